"""The sampler: a background thread that reads a probe over a server's process tree and keeps every sample."""

from __future__ import annotations

import bisect
import math
import threading
import time
from array import array
from collections.abc import Collection
from types import TracebackType

from pytest_vllm_mem.memory.device import MemoryProbe, ProbeReadError
from pytest_vllm_mem.memory.process_tree import process_tree

__all__ = ["MemorySampler"]


def _read(probe: MemoryProbe, pids: Collection[int]) -> tuple[int, ...]:
    return tuple(probe.read(pids))


class MemorySampler:
    """Background thread: every `period_s`, `probe.read(process_tree(root_pid))`; keeps (t_monotonic, bytes).

    A sample is the memory of the server on each of its devices; `samples` and `peak_between` give their sum (the
    server's total), `device_peaks_between` the peak of each device (a tensor-parallel server's GPUs peak apart).
    `period_s` None takes the probe's `default_period_s`: 0.05 s for NVML, which sees only the moment it is asked;
    0.25 s for a probe that `tracks_peaks` (each sample is then the peak since the previous one, so a 100 ms peak is
    caught whatever the period, and placed in time to within one period). All samples are kept in flat arrays
    (8 bytes per device and 16 per sample: a 1-hour run at 50 ms is 72k samples, ~1.2 MB on one device), so peaks
    between any two markers stay exact.
    The pid set is cached: finding a tree's processes means reading every process's parent on the machine (5 ms
    right after a wake-up on a 2-core VM), while vLLM's tree only changes during startup. It is refreshed after
    `tree_refresh_s`, then at doubling intervals up to `max_tree_refresh_s` while it stays the same, and again
    after `tree_refresh_s` once it changed. A process that exits reads as 0 from then on.
    A reading that fails (ProbeReadError: an NVML error, a race with processes exiting) is a missing sample, counted
    in `missed_samples` with the reason in `missed_reason`, never a 0. `cpu_time_s` is the CPU time the sampler
    thread has used so far. The probe belongs to the caller unless `close_probe`: then stop() closes it.
    """

    def __init__(
        self,
        probe: MemoryProbe,
        root_pid: int,
        period_s: float | None = None,
        tree_refresh_s: float = 1.0,
        max_tree_refresh_s: float = 4.0,
        *,
        close_probe: bool = False,
    ) -> None:
        if period_s is None:
            period_s = float(probe.default_period_s)
        if not period_s > 0:
            raise ValueError(f"MemorySampler period_s {period_s!r} must be a positive number of seconds, e.g. 0.05.")
        self.probe = probe
        self.root_pid = root_pid
        self.period_s = period_s
        self.tree_refresh_s = tree_refresh_s
        self.max_tree_refresh_s = max(tree_refresh_s, max_tree_refresh_s)
        self.devices = tuple(probe.devices)
        # A probe shared by several servers keeps its notes: only those from this sampler's time are its server's.
        self._notes_from = len(probe.attribution_notes)
        self._close_probe = close_probe
        self._refresh_after = tree_refresh_s
        self._times = array("d")
        self._bytes = array("q")
        self._per_device = [array("q") for _ in self.devices]
        self._markers: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # one sample at a time: the thread and sample_now() share the pid cache
        self._pids: set[int] = set()
        self._pids_at = -math.inf
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.cpu_time_s = 0.0
        self.missed_samples = 0
        self.missed_reason: str | None = None  # the first failed reading's message
        self.error: BaseException | None = None  # first unexpected exception the probe raised in the thread, if any

    # -- lifecycle --

    def start(self) -> MemorySampler:
        if self._thread is not None:
            if self._stop.is_set():
                raise RuntimeError("MemorySampler was stopped; it runs once: create a new MemorySampler.")
            return self
        self._thread = threading.Thread(target=self._run, name=f"vllm-mem-sampler-{self.root_pid}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            if self._close_probe and not self._stopped:
                self.probe.close()
            self._stopped = True

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self) -> None:
        cpu_start = time.thread_time()
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception as error:  # keep sampling: one failed read must not end the measurement
                if self.error is None:
                    self.error = error
            self.cpu_time_s = time.thread_time() - cpu_start
            next_at += self.period_s
            now = time.monotonic()
            if next_at < now:  # fell behind (suspended, slow probe): skip missed ticks instead of bursting
                next_at = now
            self._stop.wait(next_at - now)
        self.cpu_time_s = time.thread_time() - cpu_start

    # -- sampling --

    def _current_pids(self, now: float) -> set[int]:
        if now - self._pids_at >= self._refresh_after or not self._pids:
            pids = process_tree(self.root_pid)
            same = pids == self._pids
            self._refresh_after = min(2 * self._refresh_after, self.max_tree_refresh_s) if same else self.tree_refresh_s
            self._pids, self._pids_at = pids, now
        return self._pids

    def sample_now(self) -> int | None:
        """Take one sample synchronously (also recorded) and return the total: call it right before and after a
        short phase. None when the reading failed (the sample is missing; see missed_samples)."""
        with self._lock:
            if self._stopped and self._close_probe:
                return None  # the probe is closed
            try:
                per_device = _read(self.probe, self._current_pids(time.monotonic()))
            except ProbeReadError as error:
                self.missed_samples += 1
                if self.missed_reason is None:
                    self.missed_reason = str(error)
                return None
            if len(per_device) != len(self._per_device):
                raise RuntimeError(f"the probe read {len(per_device)} device(s), it measures {len(self.devices)}")
            total = sum(per_device)
            self._times.append(time.monotonic())
            self._bytes.append(total)
            for column, used in zip(self._per_device, per_device):
                column.append(used)
        return total

    def mark(self, label: str) -> float:
        """Record a phase marker, e.g. "startup", "healthy", "load:1"; returns its monotonic time."""
        t = time.monotonic()
        with self._lock:
            self._markers.append((label, t))
        return t

    # -- results --

    def _window(self, t0: float, t1: float | None) -> slice:
        start = bisect.bisect_left(self._times, t0)
        end = len(self._times) if t1 is None else bisect.bisect_right(self._times, t1)
        return slice(start, end)

    def peak_between(self, t0: float, t1: float | None = None) -> int:
        """Largest total (all devices) sample taken in [t0, t1] (t1 None = now); 0 if there is none."""
        with self._lock:
            return max(self._bytes[self._window(t0, t1)], default=0)

    def device_peaks_between(self, t0: float, t1: float | None = None) -> tuple[int, ...]:
        """Each device's own largest sample in [t0, t1], in the order of `devices`; 0 where there is none."""
        with self._lock:
            window = self._window(t0, t1)
            return tuple(max(column[window], default=0) for column in self._per_device)

    @property
    def samples(self) -> list[tuple[float, int]]:
        with self._lock:
            return list(zip(self._times, self._bytes))

    @property
    def markers(self) -> list[tuple[str, float]]:
        with self._lock:
            return list(self._markers)

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return max(self._bytes, default=0)

    @property
    def device_peaks(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(max(column, default=0) for column in self._per_device)

    def attribution_note(self) -> str | None:
        """One line for the report and the record when the readings may not be the server's alone (a device delta,
        processes /proc cannot see) or may leave some of it out (a Ray worker nothing ties to the server)."""
        notes = list(self.probe.attribution_notes)[self._notes_from :]
        return "; ".join(notes) if notes else None

    def missed_note(self) -> str | None:
        """One line for the report when readings failed: how many, of how many, and the first reason."""
        with self._lock:
            if not self.missed_samples:
                return None
            taken = len(self._times)
        return (
            f"{self.missed_samples} of {self.missed_samples + taken} memory samples could not be read and are "
            f"missing (peaks use the other samples): {self.missed_reason}"
        )
