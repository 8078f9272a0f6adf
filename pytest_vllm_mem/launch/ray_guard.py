"""The lifeline watchdog for servers started inside a Ray actor, out of the reach of Ray's own worker clean-up.

When a Ray worker dies (its owner, the pytest driver, was killed; ray.kill; a node shutting down) Ray SIGKILLs the
worker's process group and its direct children (Ray 2.60: "Per-worker process group cleanup is ENABLED" and
kill_child_processes_on_worker_exit). A server in a session of its own escapes the first, its API server not the
second; the plugin's watchdog, a direct child too, is SIGKILLed with it before it can act, and vLLM 0.32's EngineCore
and workers, grandchildren of the actor with no parent-death watch, were left running (measured: 3 processes still
alive 30 s after the driver's SIGKILL, in every try).

So in an actor the watchdog runs one step further away: this script, started in a session of its own, forks; the
child runs the lifeline's loop (lifeline.run) with this process as the parent it watches, and this process waits for
it. Ray SIGKILLs this process with the actor, the child sees its parent change and stops the servers; the actor's
pipe to the child closes as well. A normal close (end of file) ends both.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from pytest_vllm_mem.launch import lifeline as lifeline_module
from pytest_vllm_mem.launch.lifeline import Lifeline


class DetachedLifeline(Lifeline):
    """A Lifeline whose watchdog is a grandchild of this process (see the module text); same protocol."""

    def _start(self) -> None:
        try:
            process = subprocess.Popen(
                [self._python, str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as error:
            self._process = None
            self.error = f"cannot start the watchdog ({error}): servers outlive a killed actor"
            return
        # Until the watchdog has forked, killing its parent would take it: wait for its word first (the import
        # takes ~0.5 s; a server started and its actor killed in that time was left running).
        ready = _read_ready(process, READY_TIMEOUT_S)
        if not ready:
            process.kill()
            with process:  # closes the pipe to it (its stdout is closed already) and waits
                pass
            self._process = None
            self.error = f"the watchdog did not start in {READY_TIMEOUT_S:.0f} s: servers outlive a killed actor"
            return
        self._process = process
        self.error = None
        for pid, created in self._watched.items():
            self._send(f"watch {pid} {created!r}\n")

    def start(self) -> None:
        """Start the watchdog now, before the first server (it is otherwise started by the first watch)."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._drop_exited()
                self._start()


READY = b"ready\n"
READY_TIMEOUT_S = 60.0


def _read_ready(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    stdout = process.stdout
    if stdout is None:
        return False
    try:
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        return bool(readable) and stdout.readline() == READY
    finally:
        stdout.close()


def install() -> Lifeline:
    """Make every server this process launches (server.launch) watched by a detached watchdog; idempotent."""
    current = lifeline_module.lifeline()
    if isinstance(current, DetachedLifeline):
        return current
    current.close()
    detached = DetachedLifeline()
    # server.launch asks lifeline() for the process-wide instance at each launch: replacing it is the seam.
    lifeline_module._LIFELINE = detached
    detached.start()
    return detached


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        os.write(1, READY)  # forked: from now on a kill of the parent is seen
        os.close(1)
        lifeline_module.run(os.getppid(), sys.stdin.buffer)
        os._exit(0)
    os.close(0)  # only the child reads the pipe
    os.close(1)
    os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
