"""Weights from the architecture alone (config.json), whole or for one pipeline stage.

Per layer: attention (GQA or MLA; a Gated DeltaNet layer's projections where it replaces attention), the MLP or the
experts (with router and shared expert), two norms. Once: the input embedding (first stage), the LM head (last
stage; tied to the embedding on one GPU, its own copy on the last stage when the embedding lives on another), the
final norm, and a multimodal model's vision tower (first stage). Quantized checkpoints keep their linear layers at
the stored bit width plus the scales vLLM allocates for the method (modelinfo._quantization: block FP8 one float32
per 128x128 block, FP8 and int8 per tensor or channel none to speak of, ModelOpt NVFP4 one fp8 per 16, compressed-
tensors groups one 16-bit scale per group; otherwise one 16-bit scale and a packed zero point per group); the modules
the checkpoint's skip list names stay at the model dtype; mxfp4 (gpt-oss) quantizes only the experts, at 4 bits with
one 8-bit scale per 32 weights.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from pytest_vllm_mem.plan.layers import FULL, GDN, KV_SHARED, MAMBA2, MLP_ONLY, MOE_ONLY
from pytest_vllm_mem.plan.modelinfo import ModelInfo, _int

# Model types whose MLP is up/down only (no gate): two matrices per layer instead of three.
_UNGATED_MLP = frozenset(
    {"phi", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "starcoder2", "mpt", "gpt_bigcode"}
)


@dataclass(frozen=True)
class Parameters:
    """Parameter counts by where they live and how they are stored."""

    expert_per_layer: float  # routed experts (average over all layers, MoE or dense-first)
    other_linear_per_layer: float  # attention, dense MLP, router, shared expert
    norms_per_layer: int
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int
    vision: int
    audio: int = 0
    per_layer_embedding: int = 0  # Gemma 3n / 4 E-series: the (vocab x layers x size) per-layer input table


def _gdn_params(info: ModelInfo) -> int:
    """One Gated DeltaNet layer as vLLM builds it (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py):
    in_proj_qkvz (q, k, v and the z gate), in_proj_ba (beta and alpha per value head), the depthwise conv1d over
    q, k and v, out_proj, A_log and dt_bias per value head, and the gated norm over one value head."""
    dims, h = info.state, info.hidden_size
    if dims is None:
        return 0
    key_dim, value_dim = dims.num_k_heads * dims.head_k_dim, dims.num_v_heads * dims.head_v_dim
    conv_dim = 2 * key_dim + value_dim
    return (
        h * (conv_dim + value_dim)
        + h * 2 * dims.num_v_heads
        + conv_dim * dims.conv_kernel
        + value_dim * h
        + 2 * dims.num_v_heads
        + dims.head_v_dim
    )


def _mamba2_parts(info: ModelInfo) -> list[tuple[str, int]]:
    """One Mamba2 mixer as vLLM builds it (model_executor/layers/mamba/mamba_mixer2.py MambaMixer2), named as in a
    Granite 4.0 H checkpoint: in_proj (the z gate, x, B and C per group, dt per head), the depthwise conv1d over x, B
    and C with its bias, out_proj; under "other" A, D and dt_bias per head and the gated norm. (Under TP a single group
    is repeated on every GPU, a few rows of in_proj the count leaves out.)"""
    dims, h = info.state, info.hidden_size
    if dims is None:
        return []
    inner, heads = dims.intermediate, dims.num_v_heads
    conv_dim = inner + 2 * dims.n_groups * dims.state_size
    return [
        ("mamba.in_proj", h * (inner + conv_dim + heads)),
        ("mamba.conv1d", conv_dim * (dims.conv_kernel + 1)),
        ("mamba.out_proj", inner * h),
        ("other", 3 * heads + inner),
    ]


def _gemma_attention_params(info: ModelInfo) -> int:
    """Gemma 4's attention per layer, averaged (gemma4.py): full-attention layers with their own head size and KV
    heads, and K only (no V) with attention_k_eq_v; KV-shared layers with q_proj and o_proj only."""
    h, heads = info.hidden_size, info.num_attention_heads
    k_eq_v = bool(info.full_kv_heads)
    total = 0
    for kind, cache in zip(info.kinds, info.cache_kinds, strict=True):
        full = kind == FULL
        head_dim = info.full_head_dim if full and info.full_head_dim else info.head_dim
        kv_heads = (info.full_kv_heads or info.num_kv_heads) if full else info.num_kv_heads
        kv_matrices = 0 if cache == KV_SHARED else (1 if full and k_eq_v else 2)
        total += _qkvo(h, heads * head_dim, kv_heads * head_dim, kv_matrices=kv_matrices)
    return total // max(1, len(info.kinds))


def _qkvo(h: int, q_out: int, kv_out: int, *, kv_matrices: int = 2, gate: int = 0) -> int:
    """q (with an output gate's width where the model has one), `kv_matrices` of K and V, and o."""
    return h * (q_out + gate) + kv_matrices * h * kv_out + q_out * h


def _attention_params(info: ModelInfo) -> int:
    """Attention (or token mixer) parameters per layer, averaged over the layers when state layers replace some."""
    if info.full_head_dim or info.kv_shared_layers:
        return _gemma_attention_params(info)
    kind = info.state.kind if info.state is not None else None
    states = sum(1 for k in info.kinds if k == kind) if kind is not None else 0
    full = _full_attention_params(info)
    if not states:
        return full
    state = _gdn_params(info) if kind == GDN else sum(count for _, count in _mamba2_parts(info))
    return (states * state + (info.num_layers - states) * full) // info.num_layers


def _full_attention_params(info: ModelInfo) -> int:
    h = info.hidden_size
    if not info.is_mla:
        q_out, kv_out = info.num_attention_heads * info.head_dim, info.num_kv_heads * info.head_dim
        gate = q_out if info.attn_output_gate else 0  # Qwen3-Next / Qwen3.5: q_proj doubles for the output gate
        return _qkvo(h, q_out, kv_out, gate=gate)
    rank, rope = info.kv_lora_rank or 0, info.qk_rope_head_dim or 0
    q_lora = _int(info.raw, "q_lora_rank", default=0) or 0
    nope = _int(info.raw, "qk_nope_head_dim", default=info.head_dim) or info.head_dim
    v_dim = _int(info.raw, "v_head_dim", default=info.head_dim) or info.head_dim
    heads = info.num_attention_heads
    q_params = (h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope)
    return q_params + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h


def _padded_expert_area(info: ModelInfo, hidden: int, inter: int) -> int:
    """hidden x intermediate of one expert matrix as loaded. vLLM's mxfp4 MoE pads both for its kernels; on GPUs
    without native FP4 (Marlin backend, vllm 0.32 fused_moe/oracle/mxfp4.py) intermediate to 128, hidden to 256:
    gpt-oss's 2880 x 2880 becomes 3072 x 2944."""
    if not info.mxfp4:
        return hidden * inter
    return (-(-hidden // 256) * 256) * (-(-inter // 128) * 128)


def _block_pattern_parameters(info: ModelInfo) -> Parameters:
    """Nemotron-H (nemotron_h.py): each layer one norm and one block, by its pattern: a Mamba2 mixer, attention, an
    up/down MLP (squared ReLU, no gate), or experts (up/down each, on `moe_latent_size` where set, with its two
    projections), the router and the shared experts' MLP."""
    h, raw = info.hidden_size, info.raw
    counts = {kind: info.kinds.count(kind) for kind in (MAMBA2, FULL, MLP_ONLY, MOE_ONLY)}
    mixer = sum(count for _, count in _mamba2_parts(info))
    latent = _int(raw, "moe_latent_size", default=0) or 0
    width = latent or h
    moe_inter = info.moe_intermediate_size or info.intermediate_size
    experts = counts[MOE_ONLY] * info.num_experts * 2 * width * moe_inter
    shared = (_int(raw, "moe_shared_expert_intermediate_size", default=0) or 0) * (
        _int(raw, "n_shared_experts", default=0) or 0
    )
    per_moe = h * info.num_experts + info.num_experts + 2 * h * shared + (2 * h * latent if latent else 0)
    other = (
        counts[MAMBA2] * mixer
        + counts[FULL] * _full_attention_params(info)
        + counts[MLP_ONLY] * 2 * h * info.intermediate_size
        + counts[MOE_ONLY] * per_moe
    )
    return Parameters(
        expert_per_layer=experts / info.num_layers,
        other_linear_per_layer=other / info.num_layers,
        norms_per_layer=h,
        embedding=info.vocab_size * h,
        lm_head=0 if info.tie_word_embeddings else info.vocab_size * h,
        final_norm=h,
        vision=info.vision_params,
    )


def parameters(info: ModelInfo) -> Parameters:
    h, layers = info.hidden_size, info.num_layers
    if MLP_ONLY in info.kinds or MOE_ONLY in info.kinds:
        return _block_pattern_parameters(info)
    attention = _attention_params(info)
    if info.num_experts:
        expert_inter = info.moe_intermediate_size or info.intermediate_size
        dense_first = _int(info.raw, "first_k_dense_replace", default=0) or 0
        moe_layers = layers - dense_first
        experts = moe_layers * info.num_experts * 3 * _padded_expert_area(info, h, expert_inter)
        other = (
            moe_layers * (h * info.num_experts + 3 * h * info.shared_expert_intermediate_size)
            + dense_first * 3 * h * info.intermediate_size
        )
    else:
        matrices = 2 if info.model_type in _UNGATED_MLP else 3
        mlp_layers = layers + (info.kv_shared_layers if info.double_wide_mlp else 0)  # shared layers: 2x wide
        experts, other = 0, mlp_layers * matrices * h * info.intermediate_size
    per_layer = info.per_layer_input_size
    if per_layer:  # per layer: the input gate and projection; once: the model projection into every layer's input
        other += layers * 2 * h * per_layer + h * layers * per_layer
    return Parameters(
        expert_per_layer=experts / layers,
        other_linear_per_layer=attention + other / layers,
        norms_per_layer=2 * h,
        embedding=info.vocab_size * h,
        lm_head=0 if info.tie_word_embeddings else info.vocab_size * h,
        final_norm=h,
        vision=info.vision_params,
        audio=info.audio_params,
        per_layer_embedding=info.per_layer_vocab * layers * per_layer,
    )


def _bytes_per_quantized_weight(info: ModelInfo) -> float:
    bits = info.quant_bits or 16
    if info.mxfp4:
        return bits / 8 + 1 / 32
    if info.quant_scale_bytes is not None:  # vLLM's own layout for the method (modelinfo._quantization)
        group = info.quant_group_size
        return bits / 8 + (info.quant_scale_bytes / group if group and group > 0 else 0.0)
    group = info.quant_group_size if info.quant_group_size and info.quant_group_size > 0 else 128
    return bits / 8 + (2 + bits / 8) / group


def _matches(name: str, pattern: str) -> bool:
    """Whether a checkpoint's skip entry names the module `name`: "re:" regexes (compressed-tensors, ModelOpt,
    AutoRound), shell wildcards (ModelOpt's exclude_modules, gpt-oss), or a plain module name or prefix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None or re.search(pattern[3:], name) is not None
    if "*" in pattern or "?" in pattern:
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*{pattern}*")
    return f".{name}.".find(f".{pattern.strip('.')}.") >= 0


def _dense_layer_linears(info: ModelInfo, index: int) -> list[tuple[str, int]]:
    """(module name, parameters) of the linear layers of decoder layer `index` of a dense model, named as in the
    checkpoint (Qwen3.5's Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj; attention: q, k,
    v, o; the MLP: gate, up, down), plus its small unquantized tensors under "other"."""
    h = info.hidden_size
    prefix = f"model.language_model.layers.{index}." if info.vision_params else f"model.layers.{index}."
    kind = info.kinds[index] if index < len(info.kinds) else None
    parts: list[tuple[str, int]] = []
    if kind == GDN and info.state is not None:
        dims = info.state
        key_dim, value_dim = dims.num_k_heads * dims.head_k_dim, dims.num_v_heads * dims.head_v_dim
        conv_dim = 2 * key_dim + value_dim
        parts += [
            ("linear_attn.in_proj_qkv", h * conv_dim),
            ("linear_attn.in_proj_z", h * value_dim),
            ("linear_attn.in_proj_a", h * dims.num_v_heads),
            ("linear_attn.in_proj_b", h * dims.num_v_heads),
            ("linear_attn.conv1d", conv_dim * dims.conv_kernel),
            ("linear_attn.out_proj", value_dim * h),
            ("other", 2 * dims.num_v_heads + dims.head_v_dim),
        ]
    elif kind == MAMBA2:
        parts += _mamba2_parts(info)
    else:
        q_out, kv_out = info.num_attention_heads * info.head_dim, info.num_kv_heads * info.head_dim
        gate = q_out if info.attn_output_gate else 0
        parts += [
            ("self_attn.q_proj", h * (q_out + gate)),
            ("self_attn.k_proj", h * kv_out),
            ("self_attn.v_proj", h * kv_out),
            ("self_attn.o_proj", q_out * h),
        ]
    matrices = (
        ("gate_proj", "up_proj", "down_proj") if info.model_type not in _UNGATED_MLP else ("up_proj", "down_proj")
    )
    parts += [(f"mlp.{m}", h * info.intermediate_size) for m in matrices]
    return [(prefix + name if name != "other" else name, count) for name, count in parts]


def _skipped_linear_share(info: ModelInfo) -> float | None:
    """The share of a dense model's decoder-layer parameters its checkpoint leaves unquantized (the skip list read
    by vLLM's is_layer_skipped, e.g. Qwen's FP8 keeping in_proj_a/b in bfloat16), or None when nothing is skipped,
    the model is MoE or multi-layer attention (the per-module names differ), or it is not quantized."""
    if not info.quant_skipped or info.num_experts or info.is_mla or not info.num_layers:
        return None
    skipped = total = 0
    for index in range(info.num_layers):
        for name, count in _dense_layer_linears(info, index):
            total += count
            if name == "other" or name.endswith("conv1d") or any(_matches(name, p) for p in info.quant_skipped):
                skipped += count
    return skipped / total if total else None


def architecture_weight_bytes(
    info: ModelInfo, dtype_bytes: float, *, layers: int | None = None, first: bool = True, last: bool = True
) -> int:
    """Weight bytes of `layers` decoder layers (default all) plus what the first and last stage hold."""
    parts = parameters(info)
    count = info.num_layers if layers is None else layers
    quantized = bool(info.quant_bits and info.quant_bits < 16)
    per_quantized = _bytes_per_quantized_weight(info) if quantized else dtype_bytes
    other_bytes = dtype_bytes if info.quant_experts_only or not quantized else per_quantized
    skipped = _skipped_linear_share(info) if quantized else None
    if skipped is not None:  # a dense checkpoint with modules left unquantized: those at the model dtype
        other_bytes = skipped * dtype_bytes + (1 - skipped) * per_quantized
    layer_bytes = parts.expert_per_layer * per_quantized + parts.other_linear_per_layer * other_bytes
    total = count * (layer_bytes + parts.norms_per_layer * dtype_bytes)
    if first:
        total += (parts.embedding + parts.vision + parts.audio + parts.per_layer_embedding) * dtype_bytes
    if last:
        head = parts.lm_head or (0 if first else parts.embedding)  # a tied head is its own copy on another stage
        total += (head + parts.final_norm) * dtype_bytes
    return int(total)


__all__ = ["Parameters", "architecture_weight_bytes", "parameters"]
