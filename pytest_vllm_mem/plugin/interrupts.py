"""SIGTERM: pytest has none of its own handling, so a CI job cancelled mid-run would orphan servers holding the GPU."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

import psutil
import pytest

from pytest_vllm_mem.launch.server import stop_all_servers

# (our handler, the one it replaced), for restore_sigterm
_sigterm_key = pytest.StashKey[tuple[Callable[[int, FrameType | None], NoReturn], Any]]()


def stop_servers_on_sigterm(config: pytest.Config) -> None:
    """Stop every server (and, under xdist, tell the workers to) before pytest unwinds on SIGTERM."""
    previous = signal.getsignal(signal.SIGTERM)

    # Exercised by the reliability tests in a subprocess, which coverage does not see.
    def handler(signum: int, frame: FrameType | None) -> NoReturn:  # pragma: no cover
        _forward_to_xdist_workers(config, signum)
        stop_all_servers(grace_s=5.0)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return  # not the main thread (embedded pytest): nothing to install
    config.stash[_sigterm_key] = (handler, previous)


def _forward_to_xdist_workers(config: pytest.Config, signum: int) -> None:
    """Under xdist a SIGTERM reaches the controller only; execnet interrupts the workers 5 s
    later and kills them 5 s after that, which cut short a worker's stop of its (starting) servers and could orphan
    them (measured: 9.6 s of the 10 s). The workers, our handler installed in each, stop their servers at once."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    try:
        workers = psutil.Process().children()  # the controller runs no tests: its children are its workers
    except psutil.Error:
        return
    for worker in workers:
        try:
            worker.send_signal(signum)
        except psutil.Error:
            pass


def restore_sigterm(config: pytest.Config) -> None:
    """In-process runs (pytester) stacked one handler per session on the host process."""
    handler, previous = config.stash.get(_sigterm_key, (None, None))
    if handler is not None and signal.getsignal(signal.SIGTERM) is handler:
        try:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        except ValueError:
            pass
