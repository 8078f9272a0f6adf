"""Which CUDA graphs vLLM captures for a config (config/vllm.py, config/compilation.py), as the plan needs them.

* Capture sizes (`_set_cudagraph_sizes`): unless the config lists them, up to min(2 x max_num_seqs, 512,
  max_num_batched_tokens): [1, 2, 4], then every 8 below 256, then every 16 up to the largest.
* Full graphs (`CUDAGraphMode.has_full_cudagraphs`): the default mode captures FULL decode graphs beside the
  PIECEWISE ones; --compilation-config '{"cudagraph_mode": "PIECEWISE"}' (or "NONE") captures none. vLLM's check that
  every decoding sequence of a state-layer model has a Mamba cache block (`resolve_cudagraph_mode_and_sizes`:
  `cudagraph_mode.has_full_cudagraphs() and ... max_num_reqs > kv_cache_config.num_blocks`) runs only with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vllm_mem.plan.json_flags import json_flag

FULL_MODES = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})


def capture_sizes(max_num_seqs: int, batched_tokens: int) -> list[int]:
    """vLLM's default capture sizes for `max_num_seqs` and `max_num_batched_tokens`."""
    largest = min(2 * max_num_seqs, 512, batched_tokens)
    sizes = [n for n in (1, 2, 4) if n <= largest]
    if largest >= 8:
        sizes += list(range(8, min(largest + 1, 256), 8))
    if largest >= 256:
        sizes += list(range(256, largest + 1, 16))
    return sizes


FULL_CAPTURE_SIZES = len(capture_sizes(256, 8192))  # 51, the list of the default configs on large cards


def full_cudagraphs(flags: Mapping[str, Any]) -> bool:
    """Whether the config captures FULL graphs: --enforce-eager captures none; a compilation_config (a dict or its
    JSON text) whose cudagraph_mode is not a FULL mode captures only piecewise ones (or none)."""
    if flags.get("enforce_eager") in (True, "true", "1"):
        return False
    config = json_flag(flags, "compilation_config")
    mode = config.get("cudagraph_mode") if config is not None else None
    if mode is None:
        return True
    return str(mode).upper().split(".")[-1] in FULL_MODES


__all__ = ["FULL_CAPTURE_SIZES", "FULL_MODES", "capture_sizes", "full_cudagraphs"]
