"""The wait for a quiet runner before a confirmation session (load/measure.py wait_for_quiet_host)."""

from __future__ import annotations

from collections.abc import Callable

from pytest_vllm_mem.baseline.metrics import BUSY_SHARE
from pytest_vllm_mem.load.measure import wait_for_quiet_host


def looks(*shares: float | None) -> Callable[[], float | None]:
    queue = list(shares)
    return lambda: queue.pop(0)


def test_a_quiet_host_is_not_waited_for() -> None:
    assert wait_for_quiet_host(1, look=looks(0.02)) is None
    assert wait_for_quiet_host(1, look=looks(None)) is None


def test_a_busy_host_is_waited_for_until_quiet() -> None:
    note = wait_for_quiet_host(1, timeout_s=60, look=looks(0.5, 0.4, BUSY_SHARE))
    assert note is not None and note.startswith("busy runner: waited")


def test_a_host_that_stays_busy_is_measured_anyway_and_said_so() -> None:
    note = wait_for_quiet_host(1, timeout_s=0, look=looks(0.45))
    assert note is not None and "45%" in note and "measured anyway" in note
