"""Speculative decoding's share of the KV cache pool, as vLLM lays it out (--speculative-config).

* State layers keep room for the draft tokens: `MambaStateShapeCalculator.gated_delta_net_state_shape` (and the
  Mamba2 one) take `num_spec` = num_speculative_tokens, so the conv state has conv_kernel - 1 + num_spec rows, and
  `MambaSpec.num_speculative_blocks` adds one page per speculative token to what a request takes
  (layers.state_blocks_per_request).
* An MTP drafter ("method": "mtp", or a model-specific *_mtp name) runs the checkpoint's own MTP layers as the draft
  model; their attention layers are registered in the same forward context, so `get_kv_cache_spec` returns one more
  full-attention layer per MTP layer, with the target's spec (same heads, head size and dtype), merged into the
  target's full-attention kind. On Qwen3.6-27B (48 Gated DeltaNet + 16 full-attention layers) the 17 full layers
  set the group size, and vLLM logs "Add 3 padding layers, may waste at most 6.25% KV cache memory" (the 48 state
  layers fill 3 groups of 17).

Not modelled: EAGLE, DFlash and draft-model drafters, whose cache layers follow the draft checkpoint's own config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_vllm_mem.plan.json_flags import json_flag

# vLLM's MTP method names: "mtp" and the per-model aliases it maps to it (config/speculative.py).
MTP_METHODS = frozenset(
    {
        "mtp",
        "deepseek_mtp",
        "qwen3_next_mtp",
        "qwen3_5_mtp",
        "mimo_mtp",
        "glm4_moe_mtp",
        "ernie_mtp",
        "longcat_flash_mtp",
    }
)


@dataclass(frozen=True)
class Speculative:
    method: str
    num_tokens: int  # num_speculative_tokens
    draft_attention_layers: int  # full-attention cache layers the drafter adds to the target's pool


def mtp_layers(config: Mapping[str, Any]) -> int:
    """The checkpoint's MTP layer count (config.json's mtp_num_hidden_layers / num_nextn_predict_layers, in the
    text config of a multimodal one); 1 where it names none."""
    text = config.get("text_config")
    for source in (text if isinstance(text, Mapping) else config, config):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 1


def speculative(flags: Mapping[str, Any], mtp_layers: int = 1) -> Speculative | None:
    """The --speculative-config of `flags` (a dict or its JSON text), or None when none is set or it names no
    speculative tokens. `mtp_layers`: the checkpoint's MTP layer count (config.json's mtp_num_hidden_layers)."""
    value = json_flag(flags, "speculative_config")
    if value is None:
        return None
    try:
        tokens = int(value.get("num_speculative_tokens") or 0)
    except (TypeError, ValueError):
        return None
    if tokens <= 0:
        return None
    method = str(value.get("method") or "").lower()
    return Speculative(method, tokens, max(1, mtp_layers) if method in MTP_METHODS else 0)


__all__ = ["MTP_METHODS", "Speculative", "mtp_layers", "speculative"]
