"""What the plan needs to know about a model, read offline: `config.json` and the safetensors headers.

The model is found in a local folder or in the local Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`,
`~/.cache/huggingface/hub`), never on the hub: a preflight must run on a runner without network or token. Only the
JSON header of each `.safetensors` file is read (8-byte little-endian length, then the header), so a 140 GB
checkpoint is sized in milliseconds; with `config.json` alone the weights come from the architecture.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vllm_mem.plan.errors import PlanUnsupported
from pytest_vllm_mem.plan.layers import (
    ATTENTION_FREE,
    CHUNKED,
    FULL,
    KV_SHARED,
    SLIDING,
    StateDims,
    derived_max_len,
    layer_kinds,
    pattern_layer_count,
    state_dims,
)
from pytest_vllm_mem.plan.towers import (
    QWEN3_VL_TYPES,
    gemma4_audio_params,
    gemma4_vision_params,
    qwen3_vl_vision_params,
)

# Bytes per element of the safetensors dtypes and of the torch dtype names in config.json / --dtype.
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 0.5,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
TORCH_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
}
_MAX_HEADER = 100 * 2**20  # safetensors caps its header at 100 MB; a larger length means a corrupt/pointer file


class ModelInfoError(ValueError):
    """A model that cannot be read offline: one paragraph naming it and what is accepted."""


@dataclass(frozen=True)
class CheckpointBytes:
    """Tensor bytes in the checkpoint's safetensors files, split so a served dtype can rescale the float part."""

    total: int
    float_bytes: int  # unquantized floating tensors (rescaled when --dtype differs from the checkpoint's)
    float_dtype_bytes: float  # element size of the dominant float dtype
    files: int


@dataclass(frozen=True)
class ModelInfo:
    """The architecture figures of one model (text part of multimodal configs)."""

    name: str
    folder: Path | None
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    torch_dtype: str
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    kv_lora_rank: int | None = None  # MLA (DeepSeek V2/V3): latent KV per token instead of K and V heads
    qk_rope_head_dim: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    quant_method: str | None = None
    quant_bits: int | None = None
    quant_group_size: int | None = None
    quant_experts_only: bool = False  # mxfp4 (gpt-oss) quantizes the experts, attention and router stay 16-bit
    # Bytes of scale (and zero point) stored per group of quant_group_size weights, where vLLM's own layout is known
    # (None: the generic 16-bit scale plus packed zero point per group).
    quant_scale_bytes: float | None = None
    # Modules the checkpoint leaves unquantized (modules_to_not_convert / ignore / exclude_modules, or AutoRound
    # extra_config entries of 16 bits): vLLM's is_layer_skipped keeps them in the model dtype.
    quant_skipped: tuple[str, ...] = ()
    checkpoint: CheckpointBytes | None = None
    kinds: tuple[str, ...] = ()  # one per layer: full, sliding, chunked, or a state layer's type (layers.py)
    attention_chunk_size: int | None = None
    derived_max_len: int | None = None  # vLLM's limit on max_model_len (layers.derived_max_len)
    derived_max_len_key: str | None = None
    derived_max_len_before_0_30: int | None = None  # the same under releases before 0.30 (a yarn RoPE scaled)
    vision_params: int = 0  # a multimodal model's vision tower and projector, loaded with the language model
    state: StateDims | None = None  # Gated DeltaNet / Mamba2 layers' figures (layers.py), None without them
    attn_output_gate: bool = False  # Qwen3-Next / Qwen3.5: q_proj also projects a gate (twice the query width)
    # Gemma 3n / Gemma 4: the last N layers read the KV of an earlier layer and keep none of their own.
    kv_shared_layers: int = 0
    # Gemma 4: full-attention layers use their own head size (global_head_dim) and, with attention_k_eq_v, their own
    # KV head count (num_global_key_value_heads); 0 where they are the same as the other layers'.
    full_head_dim: int = 0
    full_kv_heads: int = 0
    # Gemma 3n / Gemma 4 E-series per-layer input embeddings: a (vocab x layers x size) table and the projections
    # that feed it into every layer; the KV-shared layers' MLP is twice as wide with use_double_wide_mlp.
    per_layer_input_size: int = 0
    per_layer_vocab: int = 0
    double_wide_mlp: bool = False
    audio_params: int = 0  # Gemma 4's audio tower and projector (towers.py)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_layers(self) -> int:
        """Layers that keep a K/V cache per token (full, sliding or chunked attention; not state layers)."""
        if not self.kinds:
            return self.num_layers
        return sum(1 for kind in self.cache_kinds if kind in (FULL, SLIDING, CHUNKED))

    @property
    def mxfp4(self) -> bool:
        """gpt-oss's mxfp4 checkpoints, under either name vLLM gives the method."""
        return self.quant_method in MXFP4_METHODS

    @property
    def cache_kinds(self) -> tuple[str, ...]:
        """`kinds` with the KV-shared layers (the last kv_shared_layers, which read an earlier layer's cache and
        allocate none: vLLM's kv_sharing_target_layer_name) marked KV_SHARED."""
        if not self.kv_shared_layers:
            return self.kinds
        first_shared = self.num_layers - self.kv_shared_layers
        return tuple(KV_SHARED if index >= first_shared else kind for index, kind in enumerate(self.kinds))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "folder": str(self.folder) if self.folder else None,
            "architecture": self.architecture,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "torch_dtype": self.torch_dtype,
            "quant_method": self.quant_method,
            "quant_bits": self.quant_bits,
            "checkpoint_bytes": self.checkpoint.total if self.checkpoint else None,
        }


def hf_cache_roots() -> list[Path]:
    """Where huggingface_hub keeps downloads, in its own order of precedence."""
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    roots.append(Path(os.path.expanduser("~")) / ".cache" / "huggingface" / "hub")
    return roots


def find_model_folder(model: str) -> Path | None:
    """The local folder holding `model`'s config.json: the path itself, or its newest snapshot in the HF cache."""
    path = Path(os.path.expanduser(model))
    if (path / "config.json").is_file():
        return path
    if "/" not in model or model.startswith(("/", ".", "~")):
        return None
    repo_dir = "models--" + model.replace("/", "--")
    for root in hf_cache_roots():
        snapshots = root / repo_dir / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = root / repo_dir / "refs" / "main"
        if ref.is_file():
            candidate = snapshots / ref.read_text().strip()
            if (candidate / "config.json").is_file():
                return candidate
        found = sorted(
            (p for p in snapshots.iterdir() if (p / "config.json").is_file()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        if found:
            return found[0]
    return None


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (tensor name -> dtype, shape, data_offsets), without the data."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ModelInfoError(f"{path} is not a safetensors file: it has fewer than 8 bytes")
        (length,) = struct.unpack("<Q", head)
        if not 0 < length <= _MAX_HEADER:
            raise ModelInfoError(
                f"{path} is not a safetensors file (header length {length}); a Git LFS pointer or "
                "a partial download reads like this: fetch the file, or plan from config.json alone "
                "by removing it"
            )
        text = handle.read(length)
    try:
        header = json.loads(text)
    except ValueError:
        raise ModelInfoError(
            f"{path} has a safetensors header that is not JSON: the file is corrupt or truncated"
        ) from None
    if not isinstance(header, dict):
        raise ModelInfoError(f"{path} has a safetensors header that is not a JSON object")
    return header


def checkpoint_bytes(folder: Path) -> CheckpointBytes | None:
    """Tensor bytes of every .safetensors file in `folder` (None when there are none)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = float_bytes = 0
    by_dtype: dict[str, int] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            begin, end = entry["data_offsets"]
            size = int(end) - int(begin)
            total += size
            dtype = str(entry.get("dtype"))
            by_dtype[dtype] = by_dtype.get(dtype, 0) + size
            if dtype in FLOAT_DTYPES:
                float_bytes += size
    floats = {d: b for d, b in by_dtype.items() if d in FLOAT_DTYPES}
    dominant = max(floats, key=lambda d: floats[d]) if floats else "BF16"
    return CheckpointBytes(total, float_bytes, float(SAFETENSORS_DTYPE_BYTES[dominant]), len(files))


def _int(config: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return default


def _first_int(value: Any) -> int | None:
    """The first whole number of a list (a per-layer size given as a list), else None."""
    if isinstance(value, list) and value and isinstance(value[0], int) and not isinstance(value[0], bool):
        return value[0]
    return None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Llava, Gemma 3, Qwen2-VL ...) nest the language model's figures in text_config."""
    text = config.get("text_config") or config.get("llm_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(text)
        return merged
    return config


MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")  # the names vLLM gives gpt-oss's mxfp4 quantization
_QUANT_BITS = {"mxfp4": 4, "gpt_oss_mxfp4": 4, "modelopt_fp4": 4, "nvfp4": 4, "awq": 4}


@dataclass(frozen=True)
class _Quantization:
    method: str | None = None
    bits: int | None = None
    group_size: int | None = None
    experts_only: bool = False
    scale_bytes: float | None = None
    skipped: tuple[str, ...] = ()


def _skipped_modules(quant: dict[str, Any]) -> tuple[str, ...]:
    """The module names or patterns a quantization_config leaves unquantized: modules_to_not_convert (Qwen's FP8,
    AWQ), ignore (compressed-tensors, ModelOpt's newer export), exclude_modules (ModelOpt, also nested under
    "quantization" as hf_quant_config.json has it), and AutoRound's extra_config entries kept at 16 bits or more."""
    names: list[str] = []
    nested_value = quant.get("quantization")
    nested: dict[str, Any] = nested_value if isinstance(nested_value, dict) else {}
    for source in (quant, nested):
        for key in ("modules_to_not_convert", "ignore", "exclude_modules", "ignored_layers"):
            value = source.get(key)
            if isinstance(value, str):
                names.append(value)
            elif isinstance(value, list):
                names.extend(str(v) for v in value)
    extra = quant.get("extra_config")
    if isinstance(extra, dict):
        for name, layer in extra.items():
            if isinstance(layer, dict) and isinstance(layer.get("bits"), int) and layer["bits"] >= 16:
                names.append(f"re:{name}" if not str(name).startswith("re:") else str(name))
    return tuple(dict.fromkeys(names))


def _compressed_tensors_scales(weights: dict[str, Any], bits: int) -> tuple[int | None, float]:
    """(group size, scale bytes per group) of a compressed-tensors weight scheme as vLLM allocates it (0.24-0.33
    compressed_tensors/schemes): per channel or tensor, one float32 scale per row (negligible); per group, one
    scale in the model dtype (wNa16) or in fp8 (nvfp4, type float at 4 bits) per group, plus a packed zero point
    only when the scheme is not symmetric (symmetric is compressed-tensors' default)."""
    group = weights.get("group_size")
    strategy = str(weights.get("strategy") or ("group" if group else "channel")).lower()
    if not isinstance(group, int) or group <= 0 or strategy not in ("group", "tensor_group"):
        return None, 0.0
    if str(weights.get("type", "int")).lower() == "float" and bits == 4:
        return group, 1.0
    zero = 0.0 if weights.get("symmetric", True) else bits / 8
    return group, 2.0 + zero


def _quantization(config: dict[str, Any]) -> _Quantization:
    """Method, weight bits, group size and the per-group scale bytes of a pre-quantized checkpoint's
    quantization_config, as vLLM's linear methods allocate them (vllm 0.24-0.33, model_executor/layers/quantization):
    fp8 with weight_block_size [n, k]: one float32 scale per n x k block (fp8.py, create_fp8_scale_parameter); fp8
    per tensor or channel: one byte each (a scale per tensor or row); ModelOpt NVFP4: 4-bit weights packed two to a
    byte and one fp8 scale per 16 (modelopt.py ModelOptNvFp4LinearMethod); ModelOpt FP8: one byte each."""
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, dict):
        return _Quantization()
    method = str(quant.get("quant_method") or quant.get("format") or "unknown").lower()
    bits = _int(quant, "bits", "w_bit", "weight_bits", "num_bits")
    group_size = _int(quant, "group_size", "q_group_size")
    scale_bytes: float | None = None
    nested_value = quant.get("quantization")
    nested: dict[str, Any] = nested_value if isinstance(nested_value, dict) else {}
    algo = str(quant.get("quant_algo") or nested.get("quant_algo") or "").upper()
    if method == "modelopt" and ("NVFP4" in algo or "FP4" in algo):
        bits, scale_bytes = 4, 1.0  # uint8 pairs of e2m1, one float8_e4m3 scale per group (16 by default)
        group_size = group_size or _int(nested, "group_size") or 16
    elif method == "modelopt" and algo == "FP8":
        bits, group_size, scale_bytes = 8, None, 0.0
    if bits is None and "fp8" in method:
        bits = 8
    if method == "fp8":
        block = quant.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            group_size, scale_bytes = block[0] * block[1], 4.0  # float32 weight_scale_inv per block
        else:
            group_size, scale_bytes = None, 0.0  # per-tensor scale
    groups = quant.get("config_groups")
    if isinstance(groups, dict):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
                bits = int(weights["num_bits"]) if bits is None else bits
                if method == "compressed-tensors":
                    group_size, scale_bytes = _compressed_tensors_scales(weights, bits)
                break
    bits = bits if bits is not None else _QUANT_BITS.get(method)
    if method in MXFP4_METHODS:
        group_size = 32  # one e8m0 scale per 32 weights (OCP microscaling)
    skipped = _skipped_modules(quant)
    # Attention named in any skip list (gpt-oss's modules_to_not_convert, NVIDIA's NVFP4 exports' ignore): only the
    # experts are quantized.
    experts_only = any("self_attn" in name for name in skipped)
    return _Quantization(method, bits, group_size, experts_only, scale_bytes, skipped)


def _with_defaults_if_incomplete(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The config, completed from its transformers class when a field the plan needs is missing (config_defaults)."""
    text = _text_config(config)
    needed = ("num_hidden_layers", "hidden_size", "num_attention_heads")
    # vocab_size and intermediate_size have class defaults that differ by model (Gemma 3: 262208 tokens).
    wanted = (*needed, "vocab_size", "intermediate_size")
    if all(_int(text, key, *_ALIASES.get(key, ())) for key in wanted):
        return config
    from pytest_vllm_mem.plan.config_defaults import with_class_defaults

    full, why = with_class_defaults(config)
    text = _text_config(full)
    if all(_int(text, key, *_ALIASES.get(key, ())) for key in needed):
        return full
    if full is config and all(_int(_text_config(config), key, *_ALIASES.get(key, ())) for key in needed):
        return config  # complete enough: vocab/intermediate fall back to the plan's own defaults
    model_type = str(text.get("model_type", ""))
    if model_type in ATTENTION_FREE:
        raise PlanUnsupported(
            f"model {name} ({model_type}) is an attention-free state-space model: vLLM keeps one fixed-size "
            f"{'Mamba2' if model_type == 'mamba2' else 'Mamba'} state per request and layer instead of a KV cache, "
            "which the plan does not size (it plans attention models, Gated DeltaNet hybrids and Granite 4.0 H's "
            "Mamba2 hybrid). Measure this one with a real startup."
        )
    raise ModelInfoError(
        f"model {name}: config.json lacks num_hidden_layers, hidden_size or num_attention_heads"
        + (f" and its transformers class defaults could not fill them in ({why})" if why else "")
        + ", so its memory cannot be planned. Accepted: decoder configs in the Hugging Face layout (Llama, "
        "Mistral, Qwen, Gemma, Phi, DeepSeek, Mixtral ...), a multimodal model's language part under text_config, "
        "and configs that leave fields to the class defaults of a model type transformers knows."
    )


_ALIASES = {
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),  # n_layers, n_heads, d_model: MPT
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head", "n_heads"),
}


def _vision_params(config: dict[str, Any], text_hidden: int) -> int:
    """A vision tower's parameters from vision_config: per layer attention (4 h^2) and MLP (2 h i), the patch
    embedding, and a projector into the language model's hidden size."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return 0
    h = _int(vision, "hidden_size", "width", default=0) or 0
    inter = _int(vision, "intermediate_size", default=4 * h) or 4 * h
    layers = _int(vision, "num_hidden_layers", "depth", "layers", default=0) or 0
    patch = _int(vision, "patch_size", default=14) or 14
    channels = _int(vision, "num_channels", default=3) or 3
    return layers * (4 * h * h + 2 * h * inter) + channels * patch * patch * h + h * text_hidden + text_hidden**2


def _tower_params(config: dict[str, Any], text_hidden: int, *, gemma4: bool) -> int:
    """A multimodal model's vision tower: counted as its family builds it where the plan knows the family (towers.py),
    else by the generic estimate above."""
    if gemma4:
        return gemma4_vision_params(config, text_hidden)
    if config.get("model_type") in QWEN3_VL_TYPES:
        return qwen3_vl_vision_params(config) or _vision_params(config, text_hidden)
    return _vision_params(config, text_hidden)


def _tied_embeddings(config: dict[str, Any], text: dict[str, Any]) -> bool:
    """Whether the LM head is the input embedding (vLLM reads config.tie_word_embeddings): as config.json says, else
    the transformers class default of its text model type (Gemma 3's is true: gemma-3-1b-it's config names none),
    else false."""
    for source in (config, text):
        if "tie_word_embeddings" in source:
            return bool(source["tie_word_embeddings"])
    from pytest_vllm_mem.plan.config_defaults import with_class_defaults

    full, _ = with_class_defaults(text)
    return bool(full.get("tie_word_embeddings", False))


def _gemma4_full_kv_heads(text: dict[str, Any]) -> int:
    """KV heads of Gemma 4's full-attention layers (transformers' Gemma4TextConfig.per_layer_config, which vLLM
    reads): num_global_key_value_heads where set and attention_k_eq_v is on or not named, else the model's own."""
    heads = _int(text, "num_global_key_value_heads", default=0) or 0
    return heads if heads and text.get("attention_k_eq_v", True) else 0


def _readable(config: dict[str, Any], name: str) -> dict[str, Any]:
    """The config with its layer count where only a block pattern names it (Nemotron-H as transformers >= 5 saves
    it); DBRX's nested layout refused by name."""
    ffn = _text_config(config).get("ffn_config")
    if isinstance(ffn, dict) and "moe_num_experts" in ffn:
        raise PlanUnsupported(
            f"model {name} keeps its experts and KV heads in nested ffn_config / attn_config objects (DBRX's layout), "
            "which the plan does not read. Measure this one with a real startup."
        )
    if "num_hidden_layers" not in config and pattern_layer_count(config):
        return {**config, "num_hidden_layers": pattern_layer_count(config)}
    return config


def _experts_and_shared_mlp(text: dict[str, Any], model_type: str, *, gemma4: bool) -> tuple[int, int]:
    """Routed experts, and the width of the MLP every MoE layer runs beside them (0 for none)."""
    # Granite MoE / Granite 4.0 H name their shared MLP shared_intermediate_size (granitemoehybrid.py shared_mlp)
    shared = _int(text, "shared_expert_intermediate_size", "shared_intermediate_size", default=0) or (
        (_int(text, "n_shared_experts", default=0) or 0) * (_int(text, "moe_intermediate_size", default=0) or 0)
    )
    experts = _int(text, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    if not shared and experts and (model_type.startswith("llama4") or gemma4):
        # Llama 4: one shared expert per MoE layer; Gemma 4 (gemma4.py Gemma4DecoderLayer): the dense MLP of
        # intermediate_size beside the experts in every layer
        shared = _int(text, "intermediate_size", default=0) or 0
    return experts, shared


def model_info_from_config(
    config: dict[str, Any], *, name: str, folder: Path | None = None, checkpoint: CheckpointBytes | None = None
) -> ModelInfo:
    """ModelInfo from a parsed config.json (`name` appears in errors); missing fields from the class defaults."""
    config = _with_defaults_if_incomplete(_readable(config, name), name)
    text = _text_config(config)
    layers = _int(text, "num_hidden_layers", *_ALIASES["num_hidden_layers"]) or 0
    hidden = _int(text, "hidden_size", *_ALIASES["hidden_size"]) or 0
    heads = _int(text, "num_attention_heads", *_ALIASES["num_attention_heads"]) or 0
    quant = _quantization(config)
    window = None if text.get("use_sliding_window") is False else _int(text, "sliding_window", default=None)
    layer_types = text.get("layer_types")
    limit, limit_key = derived_max_len(text)
    model_type = str(text.get("model_type", ""))
    gemma4 = model_type.startswith("gemma4") or str(config.get("model_type", "")).startswith("gemma4")
    experts, shared = _experts_and_shared_mlp(text, model_type, gemma4=gemma4)
    kinds = layer_kinds(text, layers, window)
    return ModelInfo(
        name=name,
        folder=folder,
        architecture=str((config.get("architectures") or [text.get("model_type", "unknown")])[0]),
        model_type=str(text.get("model_type", "")),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=_int(text, "num_key_value_heads", "n_head_kv", "num_kv_heads", default=heads) or heads,
        head_dim=_int(text, "head_dim", default=None) or hidden // heads,
        # without experts Granite's shared MLP is the layer's only MLP (granitemoehybrid.py: no block_sparse_moe)
        intermediate_size=(shared if shared and not experts else None)
        or _int(text, "intermediate_size", "n_inner", "ffn_dim", default=None)
        or _first_int(text.get("intermediate_size"))  # Nemotron-H may list one per MLP layer
        or (_int(text, "expansion_ratio", default=4) or 4) * hidden  # MPT: expansion_ratio x d_model
        or 4 * hidden,
        vocab_size=_int(text, "vocab_size", default=32000) or 32000,
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        tie_word_embeddings=_tied_embeddings(config, text),
        max_position_embeddings=_int(text, "max_position_embeddings", "n_positions", "max_seq_len"),
        sliding_window=window,
        layer_types=tuple(str(t) for t in layer_types) if isinstance(layer_types, list) else (),
        kv_lora_rank=_int(text, "kv_lora_rank"),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim"),
        num_experts=experts,
        experts_per_token=_int(text, "num_experts_per_tok", "top_k_experts", default=0) or 0,  # Gemma 4: top_k
        moe_intermediate_size=_int(text, "moe_intermediate_size", default=None),
        shared_expert_intermediate_size=shared if experts else 0,
        quant_method=quant.method,
        quant_bits=quant.bits,
        quant_group_size=quant.group_size,
        quant_experts_only=quant.experts_only,
        quant_scale_bytes=quant.scale_bytes,
        quant_skipped=quant.skipped,
        checkpoint=checkpoint,
        kinds=kinds,
        attention_chunk_size=_int(text, "attention_chunk_size", default=None),
        derived_max_len=limit,
        derived_max_len_key=limit_key,
        derived_max_len_before_0_30=derived_max_len(text, before_0_30=True)[0],
        vision_params=_tower_params(config, hidden, gemma4=gemma4),
        audio_params=gemma4_audio_params(config, hidden) if gemma4 else 0,
        state=state_dims(text, kinds),
        attn_output_gate=bool(text.get("attn_output_gate", model_type.startswith(("qwen3_next", "qwen3_5")))),
        kv_shared_layers=_int(text, "num_kv_shared_layers", default=0) or 0,
        full_head_dim=(_int(text, "global_head_dim", default=512) or 0) if gemma4 else 0,
        full_kv_heads=_gemma4_full_kv_heads(text) if gemma4 else 0,
        per_layer_input_size=_int(text, "hidden_size_per_layer_input", default=0) or 0,
        per_layer_vocab=_int(text, "vocab_size_per_layer_input", "vocab_size", default=0) or 0,
        double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        raw=config,
    )


def with_hf_overrides(info: ModelInfo, overrides: Mapping[str, Any]) -> ModelInfo:
    """`info` as vLLM reads the config under `--hf-overrides` (ModelConfig.__post_init__ and _apply_dict_overrides,
    read in 0.33.0): a plain value replaces the top-level key; an object updates the nested config of that name key
    by key (recursively), or replaces a plain key (`rope_scaling`). A config stored flat (the language model's fields
    at the top, as some entries here are) takes a `text_config` object at the top."""
    config = copy.deepcopy(info.raw)
    rest = dict(overrides)
    if isinstance(rest.get("text_config"), Mapping) and not isinstance(config.get("text_config"), dict):
        _update_nested(config, rest.pop("text_config"))  # stored flat: the top level is the text config
    _update_nested(config, rest)
    return model_info_from_config(config, name=info.name, folder=info.folder, checkpoint=info.checkpoint)


def _is_config(value: dict[str, Any]) -> bool:
    """A nested sub-config (text_config, vision_config: they name a model_type or hold layers), not a dict value."""
    return "model_type" in value or "num_hidden_layers" in value or "hidden_size" in value


def _update_nested(config: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(config.get(key), dict) and _is_config(config[key]):
            _update_nested(config[key], value)
        else:
            config[key] = dict(value) if isinstance(value, Mapping) else value


def load_model_info(model: str, *, read_weights: bool = True) -> ModelInfo:
    """Read `model` (a local folder or a hub name already in the local HF cache) without touching the network."""
    folder = find_model_folder(model)
    if folder is None:
        from pytest_vllm_mem.plan.known_models import KNOWN_CONFIGS

        if model in KNOWN_CONFIGS:  # not downloaded: plan from the built-in copy of its public config.json
            return model_info_from_config(KNOWN_CONFIGS[model], name=model)
        roots = ", ".join(str(r) for r in hf_cache_roots())
        raise ModelInfoError(
            f"model {model}: no config.json found locally (looked in the folder itself and in the Hugging Face "
            f"cache: {roots}). The plan never downloads: pass a local model folder, or a hub name you have already "
            "downloaded (e.g. `huggingface-cli download NAME config.json` fetches the config alone, enough to plan "
            "from the architecture)."
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelInfoError(f"model {model}: {folder / 'config.json'} cannot be read as JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ModelInfoError(f"model {model}: {folder / 'config.json'} is not a JSON object.")
    checkpoint = checkpoint_bytes(folder) if read_weights else None
    return model_info_from_config(config, name=model, folder=folder, checkpoint=checkpoint)


def dtype_bytes(name: str) -> float:
    """Element size of a torch dtype name ("bfloat16", "torch.float16", "fp8")."""
    key = name.replace("torch.", "").lower()
    if key not in TORCH_DTYPE_BYTES:
        raise ModelInfoError(
            f"dtype {name!r} is not known to the plan. Accepted: {', '.join(sorted(TORCH_DTYPE_BYTES))}."
        )
    return float(TORCH_DTYPE_BYTES[key])


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "CheckpointBytes",
    "ModelInfo",
    "ModelInfoError",
    "ceil_div",
    "checkpoint_bytes",
    "dtype_bytes",
    "find_model_folder",
    "load_model_info",
    "model_info_from_config",
    "read_safetensors_header",
    "with_hf_overrides",
]
