"""Every failure kind the plugin reports, in one place: what a record's `failure.kind`, a VLLMStartupError's `kind`,
a tuner trial's outcome and the results JSON can say.

A Literal of plain strings rather than an Enum: the kinds are written to JSON, compared with strings and shown in
messages, where a `str` Enum would print as `FailureKind.CUDA_OOM` on some Python versions.
"""

from __future__ import annotations

from typing import Literal, TypeGuard, get_args

FailureKind = Literal[
    # classified from a server's log (diagnose.py), at startup or during a load
    "cuda_oom",
    "kv_cache_insufficient",
    "insufficient_free_memory",
    "weights_too_large",
    "memory_profiling_error",
    "external_weights_over_budget",
    "host_memory",
    "bad_flag",
    "timeout",
    "crash",
    # decided by the plugin from measured figures
    "tier_exceeded",  # the fullest GPU's peak is above the tier (gate.py, tune.py)
    "load_errors",  # requests failed with the server alive and no memory error logged (tune.py)
    # decided by a cluster launcher (launch/ray_launcher.py)
    "cluster_capacity",  # the server needs more nodes or devices than the cluster has, or got no room in time
    "node_lost",  # a node the server ran on left the cluster while a test used it
]

FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)
# The kinds a log can show (diagnose.classify_failure and find_memory_error return these).
LOG_FAILURE_KINDS: tuple[FailureKind, ...] = FAILURE_KINDS[: FAILURE_KINDS.index("tier_exceeded")]


def is_failure_kind(text: str) -> TypeGuard[FailureKind]:
    """Whether `text` (a plan verdict, a kind read back from JSON) is one of the kinds."""
    return text in FAILURE_KINDS
