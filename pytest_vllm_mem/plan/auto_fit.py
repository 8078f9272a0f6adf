"""`--max-model-len auto` (or -1): vLLM profiles with the model's own limit, then shortens max_model_len to the
longest context one request of which fits the KV pool (vllm#29431, `kv_cache_utils._auto_fit_max_model_len`: a
binary search over the length, read in the 0.14.0, 0.27.1 and 0.33.0 wheels), and fails only when not even one token
fits. 0.13.0's `--max-model-len` takes a number only (its parser is `int`; read in the 0.12.0 and 0.13.0 wheels).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vllm_mem.plan.errors import PlanRefused
from pytest_vllm_mem.versions import release_or_latest

AUTO_FIT_SINCE = (0, 14)
AUTO_VALUES = ("auto", "-1")
# vLLM's own words when nothing fits (the ValueError of _auto_fit_max_model_len).
CANNOT_AUTO_FIT = (
    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. Try increasing "
    "`gpu_memory_utilization`."
)


def auto_fit_requested(flags: Mapping[str, Any], vllm_version: str | None) -> bool:
    """Whether the config asks vLLM to fit max_model_len; PlanRefused on a release whose parser refuses `auto`."""
    value = flags.get("max_model_len")
    if value is None or str(value).strip().lower() not in AUTO_VALUES:
        return False
    if release_or_latest(vllm_version) < AUTO_FIT_SINCE:
        raise PlanRefused(
            f"argument --max-model-len: invalid int value: {str(value)!r} (vLLM {vllm_version} takes a number; "
            "`auto` came in 0.14).",
            "Give max_model_len as a number of tokens.",
        )
    return True


def fitted_max_model_len(model_limit: int, longest_that_fits: int) -> int:
    """The max_model_len vLLM runs with: the model's limit, or the longest context that fits when that is shorter
    (0: nothing fits, vLLM refuses to start)."""
    return max(0, min(model_limit, longest_that_fits))


__all__ = ["AUTO_FIT_SINCE", "CANNOT_AUTO_FIT", "auto_fit_requested", "fitted_max_model_len"]
