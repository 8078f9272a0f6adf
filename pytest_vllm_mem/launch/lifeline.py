"""Servers die with the pytest process that started them, however it dies: a watchdog process per pytest process.

Servers run in sessions of their own (start_new_session), so that a Ctrl-C in the terminal reaches pytest only
and pytest stops them in order. The price: when pytest itself is killed (SIGKILL from a runner's hard cancel or the
OOM killer) nothing stops them, and on a GPU runner the next job fails with insufficient free memory. The SIGTERM
handler and the session-end sweep cannot help there; nothing that runs in pytest can.

So the first launch also starts this file as a script, a watchdog in a session of its own. pytest holds the write
end of a pipe to its stdin and tells it the servers it starts and stops. When the pipe reports end-of-file, or the
watchdog's parent changes (pytest died while a forked child still holds the pipe), the watchdog kills every process
of the servers still registered and removes the shared memory segments (/dev/shm) they had mapped or open, if no
live process has them mapped or open any more. While servers run it notes those processes and segments every
`PERIOD_S`, so that what a server had is known even after it is gone; a server that pytest stopped (or that
crashed) gets the same segment clean-up when pytest says so.

Why not PR_SET_PDEATHSIG in the server: it fires when the *thread* that forked exits, needs preexec_fn (unsafe with
threads), covers the API server only (vLLM 0.32's EngineCore has no parent-death watch of its own: no prctl, no
parent check in v1/engine/core.py), and leaves the segments. Linux first: the segment clean-up reads /proc;
without it (macOS) processes are still stopped; where sessions do not exist (Windows) the lifeline is off.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

PERIOD_S = 0.5  # how often the watchdog notes the servers' processes and the segments they hold open
# ... and how often it also reads their memory maps and trees: a vLLM process's /proc/PID/maps takes ~10 ms to
# read, every 0.5 s it would cost a tenth of a core next to the server it measures.
DEEP_PERIOD_S = 5.0
# SIGTERM lets a healthy vLLM remove its own files (a serving one exits in 0.3-0.4 s here); then SIGKILL. A starting
# vLLM 0.32's API server ignores SIGTERM: the grace is lost there, so it is short.
TERM_GRACE_S = 1.0
LATE_ROUNDS = 3  # kills, each after a look for what a starting server spawned in the meantime
TRACKER_GRACE_S = 3.0  # a resource tracker's clean-up after its processes died (it took 0.1-0.3 s here)
SHM_DIR = "/dev/shm"
# Where the watchdog writes what it did and when (appended), for a slow or failed clean-up; unset: nowhere.
TRACE_VAR = "PYTEST_VLLM_MEM_LIFELINE_LOG"


def supported() -> bool:
    return os.name == "posix" and hasattr(os, "getsid")


# ---------------------------------------------------------------- pytest's side


class Lifeline:
    """pytest's end of the pipe. Thread-safe; every method is a no-op where the lifeline is not supported."""

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        # Reentrant: the SIGTERM handler stops every server (and closes this) on the main thread, which may be
        # inside watch() at that moment.
        self._lock = threading.RLock()
        self._process: subprocess.Popen[bytes] | None = None
        self._watched: dict[int, float] = {}  # pid -> create time, re-sent to a restarted watchdog
        self.error: str | None = None  # why there is no watchdog, for a note

    def watch(self, pid: int) -> None:
        """From now on, pytest's death kills the session of `pid` (a server started with start_new_session)."""
        if not supported():
            return
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # already gone: nothing to stop
        with self._lock:
            self._watched[pid] = created
            if self._process is None or self._process.poll() is not None:
                self._drop_exited()
                self._start()  # sends every watched pid
            else:
                self._send(f"watch {pid} {created!r}\n")

    def release(self, pid: int) -> None:
        """pytest has stopped the server: forget it, and remove the segments it left."""
        with self._lock:
            if self._watched.pop(pid, None) is not None:
                self._send(f"release {pid}\n")

    def close(self, timeout_s: float = 10.0) -> None:
        """pytest's orderly end: the watchdog stops what is still registered, cleans up, and exits; waited for, so
        that nothing of the session runs after it."""
        with self._lock:
            process, self._process = self._process, None
            self._watched.clear()
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _drop_exited(self) -> None:
        """Close the pipe to a watchdog that exited (poll() has reaped it) before another is started: an open pipe
        left to the garbage collector is a ResourceWarning, a leaked file descriptor until then."""
        process, self._process = self._process, None
        if process is not None and process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:  # BrokenPipeError: a line not flushed before the watchdog died
                pass

    def pid(self) -> int | None:
        with self._lock:
            return self._process.pid if self._process is not None and self._process.poll() is None else None

    def _start(self) -> None:
        try:
            self._process = subprocess.Popen(
                [self._python, str(Path(__file__).resolve()), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as error:
            self._process = None
            self.error = f"cannot start the watchdog ({error}): servers outlive a killed pytest"
            return
        self.error = None
        for pid, created in self._watched.items():
            self._send(f"watch {pid} {created!r}\n")

    def _send(self, line: str) -> None:
        stdin = self._process.stdin if self._process is not None else None
        if stdin is None:
            return
        try:
            stdin.write(line.encode())
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.error = "the watchdog exited: the next launch starts another"


_LIFELINE = Lifeline()


def lifeline() -> Lifeline:
    return _LIFELINE


# ---------------------------------------------------------------- the watchdog


@dataclass
class Watched:
    """One server: its session leader, every process seen in its session or tree, every segment they had."""

    leader: psutil.Process
    members: dict[int, psutil.Process] = field(default_factory=dict)
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (st_dev, st_ino) when seen


def session_members(watched: Watched, deep: bool = True) -> list[psutil.Process]:
    """The processes of the leader's session, and (`deep`) the descendants that left it (setsid).

    A session id is the leader's pid, which the kernel does not hand out again while a process is in that session:
    while the leader, or a process seen in the session before, is alive in it, every process in it is ours, a late
    one too (started after the last look: a startup goes on while its processes are being stopped). A session found
    through neither (the pid was reused) is not ours."""
    sid = watched.leader.pid
    found: dict[int, psutil.Process] = {}
    if is_alive(watched.leader):
        found[sid] = watched.leader
    for pid, proc in watched.members.items():  # seen before: still ours while psutil says it is the same process
        if pid not in found and is_alive(proc):
            found[pid] = proc
    anchors = list(found.values())
    if any(_session_of(proc) == sid for proc in anchors):
        found.update((pid, proc) for pid, proc in in_session(sid).items() if pid not in found)
    if deep:
        for proc in anchors:
            try:
                found.update((child.pid, child) for child in proc.children(recursive=True) if child.pid not in found)
            except psutil.Error:
                continue
    return list(found.values())


def _session_of(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except OSError:
        return None


def in_session(sid: int) -> dict[int, psutil.Process]:
    """The live processes (zombies are not) whose session id is `sid`, by pid."""
    found: dict[int, psutil.Process] = {}
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and is_alive(proc := psutil.Process(pid)):
                found[pid] = proc
        except (OSError, psutil.Error):
            continue
    return found


def is_alive(proc: psutil.Process) -> bool:
    """Still this very process (is_running() checks the create time against pid reuse), and not a zombie: a zombie
    holds nothing but a process-table entry."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Until none of `procs` is alive, or `timeout_s`; returns those still alive.

    Not psutil.wait_procs: for a process that is not our child it waits until the pid is gone, that is until
    whoever adopted the orphan reaps it, and a container's init may take seconds (here it reaps every ~2 s) or
    never do it. A dead server's processes are orphans (their parent, pytest or the API server, died first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [proc for proc in procs if is_alive(proc)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def shm_paths(pid: int, maps: bool = True) -> set[str]:
    """The /dev/shm files a process has open (/proc/PID/fd) and, with `maps`, mapped (/proc/PID/maps: named
    semaphores, segments whose fd was closed); empty where /proc is not."""
    found: set[str] = set()
    prefix = SHM_DIR + "/"
    if maps:
        try:
            with open(f"/proc/{pid}/maps", "rb") as file:
                text = file.read().decode(errors="replace")
        except OSError:
            text = ""
        at = text.find(prefix)
        while at >= 0:
            end = text.find("\n", at)
            found.add(text[at : end if end >= 0 else None].removesuffix(" (deleted)"))
            at = text.find(prefix, end) if end >= 0 else -1
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.add(target.removesuffix(" (deleted)"))
    return found


def note(watched: Watched, deep: bool = True) -> list[psutil.Process]:
    """Remember the server's processes and the segments they have now; returns the processes."""
    members = session_members(watched, deep)
    for proc in members:
        watched.members[proc.pid] = proc
        for path in shm_paths(proc.pid, maps=deep):
            if path not in watched.segments:
                identity = _identity(path)
                if identity is not None:
                    watched.segments[path] = identity
    return members


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def is_resource_tracker(proc: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _term_then_kill(
    members: list[psutil.Process],
    grace_s: float,
    trace: Callable[[str], None],
    rescan: Callable[[], list[psutil.Process]] | None = None,
) -> list[psutil.Process]:
    """SIGTERM, `grace_s`, SIGKILL to what is alive then, with what `rescan` finds then that was not in `members`."""
    if not members:
        return []
    for proc in members:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    alive = wait_gone(members, grace_s)
    if rescan is not None:  # while some of them still run, what they started during the grace is still found
        known = {proc.pid for proc in members}
        late = [proc for proc in rescan() if proc.pid not in known]
        if late:
            trace(f"started during the grace: {describe(late)}")
        alive += late
    trace(f"SIGTERM to {len(members)}; after {grace_s:.1f} s, SIGKILL to {describe(alive)}")
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    alive = wait_gone(alive, 5.0)
    trace(f"after SIGKILL, still alive: {describe(alive)}")
    return alive


def kill(
    members: list[psutil.Process],
    grace_s: float = TERM_GRACE_S,
    trace: Callable[[str], None] | None = None,
    rescan: Callable[[], list[psutil.Process]] | None = None,
) -> list[psutil.Process]:
    """SIGTERM, `grace_s`, SIGKILL (psutil checks each process's identity first), multiprocessing resource trackers
    last. With `rescan` (the server's processes now), what a starting server spawned while it was being stopped is
    killed too, before the trackers wait for it. A tracker ignores SIGTERM and, once every process it serves is
    gone, unlinks the named semaphores and segments they registered and exits; killed together with them it leaves
    those in /dev/shm (a `sem.mp-*` per server, seen after killed vLLM servers). Returns the processes still
    alive."""
    trace = trace or (lambda message: None)
    trackers = {proc.pid: proc for proc in members if is_resource_tracker(proc)}

    def not_trackers() -> list[psutil.Process]:
        found = rescan() if rescan is not None else []
        trackers.update((proc.pid, proc) for proc in found if proc.pid not in trackers and is_resource_tracker(proc))
        return [proc for proc in found if proc.pid not in trackers]

    batch = [proc for proc in members if proc.pid not in trackers]
    alive: dict[int, psutil.Process] = {}
    for _ in range(LATE_ROUNDS):
        left = _term_then_kill(batch, grace_s, trace, not_trackers)
        alive.update((proc.pid, proc) for proc in left)
        batch = [proc for proc in not_trackers() if proc.pid not in alive]
        if not batch:
            break
        trace(f"found after the kill: {describe(batch)}")
        grace_s = 0.0  # the grace was spent: a late one is killed at once
    trace(f"servers stopped; waiting for resource trackers {describe(list(trackers.values()))}")
    lingering = wait_gone(list(trackers.values()), TRACKER_GRACE_S)
    trace(f"{len(lingering)} resource trackers still running")
    return list(alive.values()) + _term_then_kill(lingering, 0.0, trace)


def describe(procs: list[psutil.Process]) -> str:
    """'PID name, ...' for a trace line."""
    names = []
    for proc in sorted(procs, key=lambda proc: proc.pid):
        try:
            names.append(f"{proc.pid} {proc.name()}")
        except psutil.Error:
            names.append(f"{proc.pid} (gone)")
    return ", ".join(names) or "none"


def segments_in_use(paths: set[str]) -> set[str]:
    """Which of these segments some live process (any, ours or not) has mapped or open."""
    used: set[str] = set()
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        used |= shm_paths(pid) & paths
        if used == paths:
            break
    return used


def remove_segments(watched: Watched) -> list[str]:
    """Unlink the server's segments that still exist as the same file and no live process uses; returns them."""
    candidates = {path for path, identity in watched.segments.items() if _identity(path) == identity}
    if not candidates:
        return []
    removed = []
    uid = os.getuid()
    for path in sorted(candidates - segments_in_use(candidates)):
        try:
            if os.stat(path).st_uid == uid:  # another user's file is never ours to remove
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def parse(line: str, watched: dict[int, Watched]) -> Watched | None:
    """Apply one line from pytest; returns the server it released (to clean up after), else None."""
    parts = line.split()
    if len(parts) == 3 and parts[0] == "watch":
        try:
            proc = psutil.Process(int(parts[1]))
            if abs(proc.create_time() - float(parts[2])) < 0.01:  # the very process pytest started
                watched[proc.pid] = Watched(proc)
        except (ValueError, psutil.Error):
            pass
        return None
    if len(parts) == 2 and parts[0] == "release":
        try:
            return watched.pop(int(parts[1]), None)
        except ValueError:
            return None
    return None


class Trace:
    """The watchdog's record of its clean-up, to the file $PYTEST_VLLM_MEM_LIFELINE_LOG names (else nowhere):
    seconds since pytest was found gone, and what was done."""

    def __init__(self, path: str | None) -> None:
        self._path = path
        self._since = time.monotonic()

    def start(self) -> None:
        self._since = time.monotonic()

    def __call__(self, message: str) -> None:
        if not self._path:
            return
        try:
            with open(self._path, "a") as file:
                file.write(f"lifeline {os.getpid()} +{time.monotonic() - self._since:.2f} s: {message}\n")
        except OSError:
            pass


def run(parent: int, stdin: IO[bytes], period_s: float = PERIOD_S) -> None:
    """The watchdog's loop: until pytest is gone, then stop what is left of its servers."""
    trace = Trace(os.environ.get(TRACE_VAR))
    watched: dict[int, Watched] = {}
    buffer = b""
    fd = stdin.fileno()
    deep_at = 0.0
    while True:
        readable, _, _ = select.select([fd], [], [], period_s)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # end of file: pytest is gone
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                released = parse(line.decode(errors="replace"), watched)
                if released is not None:
                    remove_segments(released)
        if os.getppid() != parent:
            break
        deep = time.monotonic() >= deep_at
        if deep:
            deep_at = time.monotonic() + DEEP_PERIOD_S
        for server in watched.values():
            note(server, deep)
    trace.start()
    trace(f"pytest {parent} gone; {len(watched)} servers to stop")

    def look() -> list[psutil.Process]:
        return [proc for server in watched.values() for proc in note(server)]

    members = look()
    trace(f"{len(members)} processes found: {describe(members)}")
    alive = kill(members, trace=trace, rescan=look)
    trace(f"killed; alive: {describe(alive)}")
    removed = [path for server in watched.values() for path in remove_segments(server)]
    trace(f"{len(removed)} segments removed: {removed}")


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is pytest's to handle; we outlive it to check
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal kills pytest: that is when we are needed
    try:
        parent = int(argv[1])
    except (IndexError, ValueError):
        print("usage: lifeline.py PYTEST_PID (started by pytest-vllm-mem, not by hand)", file=sys.stderr)
        return 2
    run(parent, sys.stdin.buffer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
