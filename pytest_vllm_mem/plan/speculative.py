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

* Drafters without weights ("ngram", "ngram_gpu", "suffix") add nothing to the pool but the draft tokens' state room.

Not modelled, so planned as PlanUnsupported (check_drafter): drafters with a checkpoint of their own (EAGLE, EAGLE-3,
DFlash, DSpark, "draft_model", a custom class), whose weights and cache layers follow the draft checkpoint's own
config. Planned as if absent, a DFlash drafter on Qwen3.6-27B left 1.7-2.5 GiB of weights per card unplanned and
its KV per token 50% low (six public 2x RTX 3090/4090 startups, benchmarks/data/gpu_startups.json, sixth collection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_vllm_mem.plan.errors import PlanUnsupported
from pytest_vllm_mem.plan.json_flags import json_flag

# Drafters that bring no weights of their own (vLLM's config/speculative.py SpeculativeMethod, 0.33).
WEIGHTLESS_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def is_mtp(method: str) -> bool:
    """vLLM's MTP method names: "mtp" and the per-model aliases it maps to it (deepseek_mtp, qwen3_5_mtp, ... 28 of
    them in 0.33's MTPModelTypes, all ending in "_mtp")."""
    return method == "mtp" or method.endswith("_mtp")


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
    return Speculative(method, tokens, max(1, mtp_layers) if is_mtp(method) else 0)


def check_drafter(flags: Mapping[str, Any]) -> None:
    """PlanUnsupported for a --speculative-config whose drafter has a checkpoint of its own (the module docstring):
    any method but the MTP ones and the weightless ones, or a draft `model` with no method named."""
    value = json_flag(flags, "speculative_config")
    if value is None:
        return
    method = str(value.get("method") or "").lower()
    if is_mtp(method) or method in WEIGHTLESS_METHODS or not (method or value.get("model")):
        return
    named = f"method {method}" if method else f"draft model {value.get('model')}"
    raise PlanUnsupported(
        f"speculative_config with {named}: the drafter's weights and cache layers follow its own checkpoint's "
        "config, which the plan does not read. Planned drafters: the checkpoint's own MTP layers (method mtp or "
        f"a *_mtp alias) and the weightless {', '.join(sorted(WEIGHTLESS_METHODS))}. Measure this config with a "
        "real startup."
    )


__all__ = ["WEIGHTLESS_METHODS", "Speculative", "check_drafter", "is_mtp", "mtp_layers", "speculative"]
