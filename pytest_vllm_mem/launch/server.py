"""Start, watch and stop one vLLM OpenAI-compatible server: its own process group, 127.0.0.1, a free port.

Startup fails fast: the loop that polls /health also polls the process, so a server that died is classified from
its log within one poll period instead of waiting for the timeout (vLLM's own RemoteOpenAIServer does the same, but
reports only "Server exited unexpectedly").
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Protocol, TypeVar

import psutil
import requests

from pytest_vllm_mem.baseline.results import NodeRecord, StartupRecord
from pytest_vllm_mem.config import VLLMConfig, is_secret_key
from pytest_vllm_mem.diagnosis.advice import render_steps
from pytest_vllm_mem.diagnosis.diagnose import (
    Diagnosis,
    StartupMemory,
    classify_failure,
    parse_startup_memory,
    phase_words,
    timeout_diagnosis,
)
from pytest_vllm_mem.diagnosis.server_metrics import kv_cache_blocks
from pytest_vllm_mem.kinds import FailureKind
from pytest_vllm_mem.launch.compile_cache import compile_cache_env, note_aot_load_failure
from pytest_vllm_mem.launch.devicelock import DeviceLockError, startup_lock
from pytest_vllm_mem.launch.devicelock import notes as lock_notes
from pytest_vllm_mem.launch.lifeline import in_session, is_alive, is_resource_tracker, kill, lifeline
from pytest_vllm_mem.launch.watch import watch_startup
from pytest_vllm_mem.memory import DeviceInfo, MemoryProbe, MemorySampler, NvmlError
from pytest_vllm_mem.versions import LAUNCHER_MODULE, launch_argv

SERVER_MODULE = LAUNCHER_MODULE  # in every server's command line: `python -c LAUNCHER serve MODEL ...` (versions.py)
T = TypeVar("T")
# (diagnosis, startup memory, peak bytes) -> next steps for a failed startup (advice.advise, bound to the config).
Advise = Callable[[Diagnosis, StartupMemory | None, int], list[str]]


@dataclass(frozen=True)
class LaunchSettings:
    python: str = sys.executable
    log_dir: Path = Path(".vllm-mem/logs")
    cache_root: Path | None = None  # VLLM_CACHE_ROOT kept across runs: warm torch.compile cache, faster startups
    vllm_version: str | None = None  # of the server interpreter's vLLM: keys what is learnt about its compile cache
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 15.0
    sample_period_s: float | None = None  # None: the probe's default_period_s
    health_poll_s: float = 0.25


@dataclass(frozen=True)
class StartupOutcome:
    ok: bool
    kind: str  # "started" or a failure kind from diagnose.FAILURE_KINDS
    duration_s: float
    peak_memory_bytes: int  # the server's total over its devices
    peak_memory_per_gpu: tuple[int, ...] = ()  # each device's own peak, in the order of VLLMServer.devices

    def to_dict(self) -> StartupRecord:
        return {
            "ok": self.ok,
            "kind": self.kind,
            "duration_s": round(self.duration_s, 3),
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_per_gpu": list(self.peak_memory_per_gpu),
        }


class Server(Protocol):
    """What the vllm_server fixture returns: a running VLLMServer, a standins.FailedServer (its startup failed:
    every member raises that VLLMStartupError) or a standins.PlannedServer (--vllm-preflight: nothing runs)."""

    @property
    def config(self) -> VLLMConfig: ...
    @property
    def launched(self) -> VLLMConfig: ...
    @property
    def url(self) -> str: ...
    @property
    def model_name(self) -> str: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def startup(self) -> StartupOutcome | None: ...
    @property
    def memory(self) -> StartupMemory | None: ...
    @property
    def notes(self) -> list[str]: ...
    @property
    def log_path(self) -> Path | None: ...
    def alive(self) -> bool: ...
    def log_text(self) -> str: ...


def served_model_name(launched: VLLMConfig) -> str:
    """The name the OpenAI API serves the model under (first --served-model-name, else the model)."""
    served = launched.flag("served_model_name")
    if isinstance(served, tuple):
        return str(served[0])
    return str(served) if served else launched.model


class VLLMStartupError(Exception):
    """A vLLM server did not become healthy. `kind` says why (see kinds.FAILURE_KINDS). As on VLLMServer, `config` is
    what the test asked for and `launched` what ran (tier emulation, overrides); `config` defaults to `launched`."""

    def __init__(
        self,
        diagnosis: Diagnosis,
        launched: VLLMConfig,
        log_path: Path | None,
        startup: StartupOutcome,
        advice: list[str] | None = None,
        *,
        config: VLLMConfig | None = None,
        server: VLLMServer | None = None,
        memory: StartupMemory | None = None,
    ) -> None:
        self.diagnosis = diagnosis
        self.kind: FailureKind = diagnosis.kind
        self.config = config if config is not None else launched
        self.launched = launched
        self.log_path = log_path
        self.startup = startup
        self.advice = list(advice or [])
        self.server = server  # the stopped server, with its memory samples and log (None when none was launched)
        self.memory = memory  # what vLLM logged before it failed
        super().__init__(self.render())

    def render(self) -> str:
        # The phase, unless the summary says it already (a device OOM's does).
        where = phase_words(self.diagnosis.phase)
        where = f" ({where})" if where and where not in self.diagnosis.summary else ""
        lines = [
            f"vLLM startup failed [{self.kind}] after {self.startup.duration_s:.1f}s{where}: {self.diagnosis.summary}"
        ]
        if self.diagnosis.root_cause:
            lines.append("root cause (from the server log):" if self.log_path else "root cause:")
            lines += [f"    {line}" for line in self.diagnosis.root_cause]
        lines.append(f"command: {self.launched}")
        lines += render_steps(self.advice)
        if self.log_path:
            lines.append(f"full log: {self.log_path}")
        return "\n".join(lines)


class ServerLaunchError(RuntimeError):
    """The server process could not be started at all (log folder not writable, interpreter not runnable).

    These were bare OSErrors, shown as a traceback through the plugin."""


# Every server process group this interpreter started and has not stopped yet: the session-end sweep and the
# SIGTERM handler stop what is left here, so no vLLM outlives pytest.
_LIVE: dict[int, VLLMServer] = {}
STARTING_STOP_GRACE_S = 5.0  # see VLLMServer.stop and _wait_for_exit
# Reentrant, because the SIGTERM handler (plugin.py) runs stop_all_servers on the main thread,
# possibly while that thread is inside `with _LIVE_LOCK` in launch() or stop(): a plain Lock deadlocked there.
_LIVE_LOCK = threading.RLock()


@dataclass
class VLLMServer:
    """A running vLLM server. `config` is what the test asked for, `launched` what ran (tier emulation, overrides)."""

    config: VLLMConfig
    launched: VLLMConfig
    device: DeviceInfo
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    sampler: MemorySampler
    started_at: float
    startup: StartupOutcome | None = None
    memory: StartupMemory | None = None
    notes: list[str] = field(default_factory=list)
    loads_run: int = 0
    # The server's engine processes (VLLM::EngineCore...) when it became healthy; see alive().
    engine_processes: list[psutil.Process] = field(default_factory=list)
    devices: tuple[DeviceInfo, ...] = ()  # every device it is measured on (all GPUs of a tensor-parallel server)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def model_name(self) -> str:
        return served_model_name(self.launched)

    def call(self, function: Callable[..., T], *args: object) -> T:
        """`function(self, *args)`: a load (load.measure.measured_load) runs here, next to the server. A cluster
        server (ray_cluster.RayServer) runs the same call on its node; callers never ask which one they have."""
        return function(self, *args)

    def per_node_peaks(self) -> list[NodeRecord]:
        """The cluster nodes it ran on, per rank with its peak: none for a server on this machine."""
        return []

    def alive(self) -> bool:
        """The API server runs, and so do the engine processes it had when it became healthy.

        VLLM's API server outlives a dead EngineCore by about a second, answering HTTP 500 to
        every request; a load that failed fast in that second saw an "alive" server, so the crash was not diagnosed,
        and a pool that checks alive() could hand the broken server to the next test.
        """
        return self.process.poll() is None and all(is_alive(proc) for proc in self.engine_processes)

    def peak_between(self, since: float) -> int:
        """The server's memory peak sampled since `since` (time.monotonic()): the running peak progress shows."""
        return self.sampler.peak_between(since)

    def log_text(self) -> str:
        """The server's log so far, with the config's secret values masked: every diagnosis, failure message and
        log tail the plugin shows is taken from here."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return mask_secrets(text, self.launched)

    def stop(self, grace_s: float = 15.0) -> None:
        """Terminate the whole process group, then kill what is left after `grace_s`. Idempotent."""
        if self.startup is None:
            # A server that never became healthy serves nothing; a stuck one should not hold
            # Ctrl-C or a CI cancel for the whole grace period (see _wait_for_exit for the usual case).
            grace_s = min(grace_s, STARTING_STOP_GRACE_S)
        # Process objects, not pids, taken before the first signal: psutil checks a process's
        # identity before signalling it, so a pid reused by an unrelated process in the meantime is never killed.
        tree = _tree_processes(self.pid)
        _signal_group(self.pid, signal.SIGTERM)
        self._wait_for_exit(tree, grace_s)
        if self.process.poll() is None:
            self.process.kill()  # the API server by its Popen: its pid cannot have been reused, it is not reaped
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        # What is left of its session, by process (children that left it with setsid are in the snapshot),
        # resource trackers last: a group SIGKILL took the tracker with the server before it unlinked the
        # semaphores the server had registered (a sem.mp-* left in /dev/shm after some stops).
        left = {proc.pid: proc for proc in tree if proc.pid != self.pid and is_alive(proc)}
        left.update(self._session_rest())
        kill(list(left.values()), grace_s=0.0, rescan=lambda: list(self._session_rest().values()))
        self.sampler.stop()
        with _LIVE_LOCK:
            _LIVE.pop(self.pid, None)
        lifeline().release(self.pid)  # stopped: the watchdog forgets it and removes the segments it left

    def _session_rest(self) -> dict[int, psutil.Process]:
        """The processes still in the server's session, but the API server."""
        return {pid: proc for pid, proc in in_session(self.pid).items() if pid != self.pid}

    def _wait_for_exit(self, tree: list[psutil.Process], grace_s: float) -> None:
        """Until the API server exits, or `grace_s`, or until the rest of its tree has exited.

        VLLM 0.32's API server does not act on SIGTERM before it is healthy: its engine and
        workers exit within ~2 s (freeing the device and their shared memory), the API server then waits for them
        forever, so every stop of a starting server (Ctrl-C, CI cancel, startup timeout) took the whole grace period
        (15 s; under xdist a worker has 5 s before the controller kills it and orphans the server). Once only the
        API server and its multiprocessing resource tracker are left, one more second, then the kill.
        """
        helpers = [proc for proc in tree if proc.pid != self.pid and not is_resource_tracker(proc)]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                self.process.wait(timeout=min(0.1, max(deadline - time.monotonic(), 0.01)))
                return
            except subprocess.TimeoutExpired:
                pass
            if helpers and not any(is_alive(proc) for proc in helpers):
                try:
                    self.process.wait(timeout=max(min(1.0, deadline - time.monotonic()), 0.01))
                except subprocess.TimeoutExpired:
                    pass
                return


def secret_values(config: VLLMConfig) -> list[str]:
    """The values of the config's secret env vars and flags (HF_TOKEN, api_key, ...), longest first."""
    values = [value for key, value in config.env.items() if is_secret_key(key)]
    for key, value in config.flags.items():
        if is_secret_key(key) and value is not None and not isinstance(value, bool):
            values += list(value) if isinstance(value, tuple) else [str(value)]
    return sorted({value for value in values if len(value) >= 4}, key=len, reverse=True)  # "1" is no secret


def mask_secrets(text: str, config: VLLMConfig) -> str:
    """VLLM prints its arguments at startup ("non-default args: {... 'hf_token': '...'}"), and a
    timeout or crash diagnosis quotes those lines: a secret flag reached the failure message and the results JSON."""
    for value in secret_values(config):
        text = text.replace(value, "***")
    return text


def _engine_processes(root: int) -> list[psutil.Process]:
    """vLLM names its engine processes with setproctitle (VLLM::EngineCore, VLLM::EngineCore_DP1, ...)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    engines = []
    for child in children:
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()[:1]):
                engines.append(child)
        except psutil.Error:
            continue
    return engines


def _tree_processes(root: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all_servers(grace_s: float = 5.0) -> list[int]:
    """Stop every server still registered; returns the pids that were still alive (a leak the caller reports)."""
    with _LIVE_LOCK:
        servers = list(_LIVE.values())
    leaked = [server.pid for server in servers if server.process.poll() is None]  # running, even if its engine died
    for server in servers:
        server.stop(grace_s)
    lifeline().close()  # waited for: nothing of the session (not even the watchdog) outlives it
    return leaked


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_env(config: VLLMConfig, settings: LaunchSettings) -> dict[str, str]:
    """The user's environment plus what the config sets; compile caches in the cache root unless the user chose."""
    env = dict(os.environ)
    # CUDA numbers GPUs fastest first unless told otherwise; the plugin resolves, measures and waits on them in
    # NVML's PCI bus order: numeric CUDA_VISIBLE_DEVICES must mean the same GPUs to both (a mixed host differs).
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.update(compile_cache_env(settings.cache_root, settings.vllm_version, {**env, **config.env}))
    env.update(config.env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


_slug_re = re.compile(r"[^A-Za-z0-9_.=-]+")
_launch_counter = 0


def _log_path(settings: LaunchSettings, config: VLLMConfig) -> Path:
    global _launch_counter
    _launch_counter += 1
    name = _slug_re.sub("_", f"{Path(config.model).name}-{config.short_id()}")[:80]
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    path = settings.log_dir / f"{os.getpid()}-{_launch_counter:02d}-{name}.log"
    path.touch()  # an unwritable folder fails here, before anything is started
    return path


# Free_port() closes its socket before vLLM binds the port (seconds later, after its imports);
# another process (a second pytest session, any outgoing connection) can take the port in between, and vLLM dies
# with this error. That is no fault of the config: start again on a fresh port, a few times.
_PORT_TAKEN = "Address already in use"
PORT_ATTEMPTS = 3


def _port_was_taken(error: VLLMStartupError) -> bool:
    return error.kind == "crash" and any(_PORT_TAKEN in line for line in error.diagnosis.root_cause)


def launch_lock_timeout_s(settings: LaunchSettings, free_wait_s: float = 60.0) -> float:
    """How long to wait for a device's startup lock: another holder's startup, stop and free-memory wait."""
    return settings.startup_timeout_s + settings.stop_grace_s + free_wait_s + 60


def launch(
    config: VLLMConfig,
    launched: VLLMConfig,
    settings: LaunchSettings,
    probe: MemoryProbe,
    advise: Advise | None = None,
    devices: Sequence[DeviceInfo] | None = None,
    *,
    locked: bool = False,
) -> VLLMServer:
    """Start `launched` and wait until /health answers 200. Raises VLLMStartupError with the classified cause.

    `locked`: the caller holds the devices' startup lock (it waited for free memory under it, launch_lock_timeout_s);
    otherwise launch takes it.

    `advise(diagnosis, startup_memory, peak_bytes) -> list[str]` turns a failure into next steps (optional).
    `devices`: the server's devices (all GPUs it uses); it is then measured through a probe of its own over them
    (`probe.scoped(devices)`, closed when the server stops). None: measured through `probe` itself.
    """
    taken: list[str] = []
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            # One startup at a time per device, machine-wide: concurrent ones mis-size each other's KV cache.
            if locked:
                server = _launch_once(config, launched, settings, probe, advise, devices)
            else:
                with startup_lock(devices or probe.devices, launch_lock_timeout_s(settings)) as waits:
                    server = _launch_once(config, launched, settings, probe, advise, devices)
                taken += lock_notes(waits)
        except DeviceLockError as error:
            raise ServerLaunchError(str(error)) from None
        except VLLMStartupError as error:
            if attempt == PORT_ATTEMPTS or not _port_was_taken(error):
                raise
            port = error.server.port if error.server is not None else "?"
            taken.append(
                f"port {port} was taken before vLLM bound it (log {error.log_path}): started again on a fresh port"
            )
            continue
        server.notes.extend(taken)
        return server
    raise AssertionError("unreachable")


def _launch_once(
    config: VLLMConfig,
    launched: VLLMConfig,
    settings: LaunchSettings,
    probe: MemoryProbe,
    advise: Advise | None = None,
    devices: Sequence[DeviceInfo] | None = None,
) -> VLLMServer:
    """One startup of `launched`: spawned, then waited for until healthy (or its failure raised, classified)."""
    return _await_startup(_spawn(config, launched, settings, probe, devices), settings, advise)


def _spawn(
    config: VLLMConfig,
    launched: VLLMConfig,
    settings: LaunchSettings,
    probe: MemoryProbe,
    devices: Sequence[DeviceInfo] | None,
) -> VLLMServer:
    """Start the server process on a free port, its log, lifeline and memory sampler with it; not yet healthy."""
    port = free_port()
    argv = [
        *launch_argv(settings.python, launched.model, launched.flag_args()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    try:
        log_path = _log_path(settings, launched)
    except OSError as error:
        raise ServerLaunchError(
            f"Cannot write the server log in {settings.log_dir}: {error.strerror or error}. "
            "Pass a writable folder for server logs (--vllm-log-dir)."
        ) from None
    # The server's own probe before its processes exist: what is on its GPUs now is never counted as the server's.
    try:
        server_probe = probe.scoped(devices) if devices is not None else probe
    except NvmlError as error:
        raise ServerLaunchError(f"{error} The server was not started.") from None
    started_at = time.monotonic()
    with open(log_path, "wb") as log:
        # No shell: flag values reach vLLM as argv items, never interpreted. Own session = own process group.
        try:
            process = spawn_server(argv, log, launched, settings)
        except OSError as error:
            if server_probe is not probe:
                server_probe.close()
            raise ServerLaunchError(
                f"Cannot run the server interpreter {settings.python}: "
                f"{error.strerror or error}. Pass an interpreter that has vLLM installed "
                "(--vllm-python)."
            ) from None
    try:
        lifeline().watch(process.pid)  # from here on, a killed pytest takes the server with it
        sampler = MemorySampler(
            server_probe, process.pid, settings.sample_period_s, close_probe=server_probe is not probe
        ).start()
        sampler.mark("launch")
        server = VLLMServer(
            config=config,
            launched=launched,
            device=server_probe.device,
            port=port,
            process=process,
            log_path=log_path,
            sampler=sampler,
            started_at=started_at,
            devices=sampler.devices,
        )
        with _LIVE_LOCK:
            _LIVE[process.pid] = server
    except BaseException:
        # Interrupted (Ctrl-C, a CI cancel) before the server was registered for cleanup, which stops what is
        # registered: stop it here. The window is short but real: the first launch also starts the watchdog.
        _signal_group(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        raise
    return server


def spawn_server(
    argv: list[str], log: IO[bytes], launched: VLLMConfig, settings: LaunchSettings
) -> subprocess.Popen[bytes]:
    """A vLLM process in a session of its own (its own process group: stopped, and told apart from other jobs' GPU
    processes, by it), its output into `log`. No shell: flag values reach vLLM as argv items, never interpreted."""
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=server_env(launched, settings),
        start_new_session=True,
    )


def _await_startup(server: VLLMServer, settings: LaunchSettings, advise: Advise | None) -> VLLMServer:
    """Wait for `server` to become healthy, shown live; its startup measured from the log and the sampler. A failed
    startup stops the server and raises the classified VLLMStartupError."""
    sampler, started_at = server.sampler, server.started_at
    watch = watch_startup(server)  # live progress from the log, when the pytest adapter observes this startup
    try:
        diagnosis = _wait_healthy(server, settings, watch.poll)
    except BaseException:
        watch.finish(None)
        server.stop(settings.stop_grace_s)  # Ctrl-C during a 40-second startup must not leave the server
        raise
    sampler.sample_now()
    duration = time.monotonic() - started_at
    startup_log = server.log_text()
    note_aot_load_failure(settings.cache_root, settings.vllm_version, startup_log)
    memory = parse_startup_memory(startup_log)
    if diagnosis is None and memory.kv_cache_blocks is None:
        memory = replace(memory, kv_cache_blocks=_served_kv_blocks(server.url))
    peak = sampler.peak_between(started_at)
    per_gpu = sampler.device_peaks_between(started_at) if server.device.backend == "cuda" else ()
    missed = sampler.missed_note()
    if missed:
        server.notes.append(f"startup: {missed}")
    attribution = sampler.attribution_note()
    if attribution:
        server.notes.append(f"startup memory attribution uncertain: {attribution}")
    if diagnosis is None:
        server.startup = StartupOutcome(True, "started", duration, peak, per_gpu)
        server.memory = memory
        server.engine_processes = _engine_processes(server.pid)
        sampler.mark("healthy")
        watch.finish(server.startup, memory)
        return server
    server.stop(settings.stop_grace_s)
    outcome = StartupOutcome(False, diagnosis.kind, duration, peak, per_gpu)
    watch.finish(outcome, memory)
    advice = advise(diagnosis, memory, peak) if advise else []
    raise VLLMStartupError(
        diagnosis, server.launched, server.log_path, outcome, advice, config=server.config, server=server, memory=memory
    )


def _served_kv_blocks(url: str) -> int | None:
    """The KV cache's blocks a healthy server reports on /metrics (V1 logs none); None when it does not answer."""
    try:
        response = requests.get(f"{url}/metrics", timeout=5)
    except requests.RequestException:
        return None
    return kv_cache_blocks(response.text) if response.status_code == 200 else None


def _wait_healthy(
    server: VLLMServer, settings: LaunchSettings, on_poll: Callable[[], None] = lambda: None
) -> Diagnosis | None:
    """None when healthy; else the diagnosis of why not (process exit or timeout). `on_poll` runs every poll."""
    deadline = server.started_at + settings.startup_timeout_s
    health = f"{server.url}/health"
    with requests.Session() as http:
        while True:
            code = server.process.poll()
            if code is not None:
                return classify_failure(server.log_text(), code)
            try:
                if http.get(health, timeout=2).status_code == 200:
                    return None
            except requests.RequestException:
                pass  # the port is bound but not listening while the engine initializes: connection refused
            if time.monotonic() > deadline:
                return timeout_diagnosis(server.log_text(), settings.startup_timeout_s)
            on_poll()
            time.sleep(settings.health_poll_s)
