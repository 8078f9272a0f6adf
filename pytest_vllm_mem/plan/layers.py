"""What each decoder layer keeps in the KV cache, and the longest context the config allows, as vLLM derives them.

Layer kinds (one per layer): "full" (a K/V entry per token of the context), "sliding" (the last `sliding_window`
tokens), "chunked" (Llama 4's local attention: the current `attention_chunk_size` chunk), or the raw layer type of
a state layer (Mamba, linear attention) the plan does not model. Where config.json names no `layer_types`, the
pattern is the one the transformers config class builds: Gemma 2 alternates sliding and full (even layers slide),
Gemma 3 / Cohere 2 put one full layer after every `sliding_window_pattern - 1` sliding ones, Llama 4 uses chunked
attention on three of every four layers (the fourth has no RoPE and attends globally), and a model with a
`sliding_window` alone (Mistral 7B v0.1) slides on every layer.

The derived maximum length follows vLLM's `_get_and_verify_max_len` (vllm 0.32 config/model.py): the smallest of
the length keys, times the RoPE scaling factor unless the RoPE type already scales max_position_embeddings (llama3,
yarn, longrope, su, deepseek_yarn) or the model is Gemma 3.
"""

from __future__ import annotations

from typing import Any

FULL, SLIDING, CHUNKED = "full", "sliding", "chunked"
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


def layer_kinds(text: dict[str, Any], num_layers: int, window: int | None) -> tuple[str, ...]:
    """One kind per layer (see the module docstring)."""
    declared = text.get("layer_types")
    if isinstance(declared, list) and len(declared) == num_layers:
        return tuple(_LAYER_TYPE_KINDS.get(str(kind), str(kind)) for kind in declared)
    model_type = str(text.get("model_type", ""))
    if window and model_type.startswith("gemma2"):
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
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


def _rope_parameters(text: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = text.get(key)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested if nested and all("rope_type" in v or "type" in v for v in nested) else [value]
    return found


def derived_max_len(text: dict[str, Any]) -> tuple[int | None, str | None]:
    """vLLM's derived maximum model length and the key it came from; (None, None) when config.json names none."""
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
        for rope in _rope_parameters(text):
            kind = str(rope.get("rope_type") or rope.get("type") or "default")
            if kind not in _ROPE_TYPES_ALREADY_SCALED and isinstance(rope.get("factor"), (int, float)):
                factor = float(rope["factor"])
        best *= factor
    return int(best), key_used


__all__ = ["CHUNKED", "FULL", "LENGTH_KEYS", "SLIDING", "derived_max_len", "layer_kinds"]
