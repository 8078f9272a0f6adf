"""What the plan needs to know about a model, read offline: `config.json` and the safetensors headers.

The model is found in a local folder or in the local Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub`,
`~/.cache/huggingface/hub`), never on the hub: a preflight must run on a runner without network or token. Only the
JSON header of each `.safetensors` file is read (8-byte little-endian length, then the header), so a 140 GB
checkpoint is sized in milliseconds; with `config.json` alone the weights come from the architecture.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    checkpoint: CheckpointBytes | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_layers(self) -> int:
        """Layers that keep a full K/V cache (hybrid models list others in layer_types)."""
        if not self.layer_types:
            return self.num_layers
        return sum(1 for kind in self.layer_types if kind in ("full_attention", "attention"))

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


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Llava, Gemma 3, Qwen2-VL ...) nest the language model's figures in text_config."""
    text = config.get("text_config") or config.get("llm_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        merged = {k: v for k, v in config.items() if k != "text_config"}
        merged.update(text)
        return merged
    return config


def _quantization(config: dict[str, Any]) -> tuple[str | None, int | None, int | None]:
    quant = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(quant, dict):
        return None, None, None
    method = str(quant.get("quant_method") or quant.get("format") or "unknown").lower()
    bits = _int(quant, "bits", "w_bit", "weight_bits")
    if bits is None and "fp8" in method:
        bits = 8
    if bits is None:
        groups = quant.get("config_groups")
        if isinstance(groups, dict):
            for group in groups.values():
                weights = group.get("weights") if isinstance(group, dict) else None
                if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
                    bits = int(weights["num_bits"])
                    break
    group_size = _int(quant, "group_size", "q_group_size")
    return method, bits, group_size


def model_info_from_config(
    config: dict[str, Any], *, name: str, folder: Path | None = None, checkpoint: CheckpointBytes | None = None
) -> ModelInfo:
    """ModelInfo from a parsed config.json (`name` appears in errors)."""
    text = _text_config(config)
    architectures = config.get("architectures") or [text.get("model_type", "unknown")]
    layers = _int(text, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int(text, "hidden_size", "n_embd", "d_model")
    heads = _int(text, "num_attention_heads", "n_head")
    if not layers or not hidden or not heads:
        raise ModelInfoError(
            f"model {name}: config.json lacks num_hidden_layers, hidden_size or num_attention_heads, so its memory "
            "cannot be planned. Accepted: decoder configs in the Hugging Face layout (Llama, Mistral, Qwen, Gemma, "
            "Phi, DeepSeek, Mixtral ...), with a multimodal model's language part under text_config."
        )
    kv_heads = _int(text, "num_key_value_heads", "n_head_kv", "num_kv_heads", default=heads) or heads
    head_dim = _int(text, "head_dim", default=None) or hidden // heads
    layer_types = text.get("layer_types")
    method, bits, group_size = _quantization(config)
    experts = _int(text, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    window = _int(text, "sliding_window", default=None)
    if text.get("use_sliding_window") is False:
        window = None
    return ModelInfo(
        name=name,
        folder=folder,
        architecture=str(architectures[0]),
        model_type=str(text.get("model_type", "")),
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_int(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden,
        vocab_size=_int(text, "vocab_size", default=32000) or 32000,
        torch_dtype=str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=_int(text, "max_position_embeddings", "n_positions", "max_seq_len"),
        sliding_window=window,
        layer_types=tuple(str(t) for t in layer_types) if isinstance(layer_types, list) else (),
        kv_lora_rank=_int(text, "kv_lora_rank"),
        qk_rope_head_dim=_int(text, "qk_rope_head_dim"),
        num_experts=experts,
        experts_per_token=_int(text, "num_experts_per_tok", default=0) or 0,
        moe_intermediate_size=_int(text, "moe_intermediate_size", default=None),
        shared_expert_intermediate_size=(
            _int(text, "shared_expert_intermediate_size", default=0)
            or (_int(text, "n_shared_experts", default=0) or 0) * (_int(text, "moe_intermediate_size", default=0) or 0)
        ),
        quant_method=method,
        quant_bits=bits,
        quant_group_size=group_size,
        checkpoint=checkpoint,
        raw=config,
    )


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


def architecture_weight_bytes(info: ModelInfo, dtype_bytes: float) -> int:
    """Weights from the architecture alone: embeddings, attention, MLP or experts, norms; quantized linear layers at
    their bit width plus one fp16 scale (and a packed zero point) per group."""
    h, layers = info.hidden_size, info.num_layers
    q_out = info.num_attention_heads * info.head_dim
    kv_out = info.num_kv_heads * info.head_dim
    if info.is_mla:
        rank = info.kv_lora_rank or 0
        rope = info.qk_rope_head_dim or 0
        q_lora = _int(info.raw, "q_lora_rank", default=0) or 0
        nope = _int(info.raw, "qk_nope_head_dim", default=info.head_dim) or info.head_dim
        v_dim = _int(info.raw, "v_head_dim", default=info.head_dim) or info.head_dim
        heads = info.num_attention_heads
        q_params = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
        attention = q_params + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h
    else:
        attention = h * q_out + 2 * h * kv_out + q_out * h
    if info.num_experts:
        expert_inter = info.moe_intermediate_size or info.intermediate_size
        dense_first = _int(info.raw, "first_k_dense_replace", default=0) or 0
        moe_layers = layers - dense_first
        mlp_total = (
            moe_layers
            * (
                info.num_experts * 3 * h * expert_inter
                + h * info.num_experts
                + 3 * h * info.shared_expert_intermediate_size
            )
            + dense_first * 3 * h * info.intermediate_size
        )
    else:
        mlp_total = layers * _mlp_matrices(info) * h * info.intermediate_size
    linear = layers * attention + mlp_total
    embeddings = info.vocab_size * h * (1 if info.tie_word_embeddings else 2)
    small = layers * 2 * h + h
    float_params = embeddings + small
    if info.quant_bits and info.quant_bits < 16:
        group = info.quant_group_size if info.quant_group_size and info.quant_group_size > 0 else 128
        per_weight = info.quant_bits / 8 + (2 + info.quant_bits / 8) / group
        return int(linear * per_weight + float_params * dtype_bytes)
    return int((linear + float_params) * dtype_bytes)


# Model types whose MLP is up/down only (no gate): two matrices per layer instead of three.
_UNGATED_MLP = frozenset(
    {"phi", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "starcoder2", "mpt", "gpt_bigcode"}
)


def _mlp_matrices(info: ModelInfo) -> int:
    return 2 if info.model_type in _UNGATED_MLP else 3


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
    "architecture_weight_bytes",
    "ceil_div",
    "checkpoint_bytes",
    "dtype_bytes",
    "find_model_folder",
    "load_model_info",
    "model_info_from_config",
    "read_safetensors_header",
]
