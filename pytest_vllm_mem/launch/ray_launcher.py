"""The launcher of `--vllm-cluster=ray`: the pool's startups placed on a Ray cluster through ray_cluster.RayCluster,
connected at the first server. What the cluster refuses becomes a classified startup failure the test reports like any
other (`cluster_capacity`, `node_lost`), and a startup waiting for room on the cluster is shown as progress."""

from __future__ import annotations

import time
from collections.abc import Callable

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory
from pytest_vllm_mem.kinds import FailureKind
from pytest_vllm_mem.launch.launcher import LaunchRequest
from pytest_vllm_mem.launch.ray_cluster import (
    ClusterCapacityError,
    ClusterError,
    NodeLostError,
    RayCluster,
    RayServer,
)
from pytest_vllm_mem.launch.server import LaunchSettings, ServerLaunchError, StartupOutcome, VLLMStartupError
from pytest_vllm_mem.launch.watch import figures_of
from pytest_vllm_mem.progress import (
    Figures,
    Observer,
    PlacementWait,
    StartupBegan,
    StartupEnded,
    active_observer,
    config_label,
    send,
)

WAIT_EVENT_EVERY_S = 5.0  # RayCluster calls on_wait every second; the renderer needs far fewer


class RayLauncher:
    """Starts each server in a placement group of its own on the cluster at `address`; as many run at once as the
    cluster has room for (several pytest-xdist workers each connect and share it)."""

    def __init__(self, address: str, connect: Callable[[str], RayCluster] = RayCluster) -> None:
        self.address = address
        self._connect = connect
        self._cluster: RayCluster | None = None

    @property
    def cluster(self) -> RayCluster:
        if self._cluster is None:
            try:
                self._cluster = self._connect(self.address)
            except ClusterError as error:  # found reachable at session start, refused now: no test can run
                raise ServerLaunchError(str(error)) from None
        return self._cluster

    def start(self, request: LaunchRequest, settings: LaunchSettings) -> RayServer:
        cluster = self.cluster
        watch = PlacementWatch(active_observer(), request.config)
        request.on_launch()
        try:
            server = cluster.start(request.config, request.launched, settings, on_wait=watch.waiting)
        except VLLMStartupError as error:
            watch.finish(error.startup, error.memory)
            raise
        except (ClusterCapacityError, NodeLostError) as error:
            failure = cluster_failure(request.config, request.launched, error, watch.elapsed_s())
            watch.finish(failure.startup, None)
            raise failure from None
        except Exception:  # a launch error on the node (its message names it)
            watch.finish(StartupOutcome(False, "crash", watch.elapsed_s(), 0), None)
            raise
        except BaseException:  # Ctrl-C, a CI cancel
            watch.finish(None, None)
            raise
        watch.finish(server.startup, server.memory)
        return server

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None


def cluster_failure(config: VLLMConfig, launched: VLLMConfig, error: ClusterError, waited_s: float) -> VLLMStartupError:
    """A refusal of the cluster as the startup failure a test reports: both figures of a capacity refusal, or the
    node and rank that were lost."""
    kind: FailureKind = "node_lost" if isinstance(error, NodeLostError) else "cluster_capacity"
    if kind == "cluster_capacity":
        advice = ["a config the cluster can hold (fewer --nnodes or devices per node), or a larger cluster"]
    else:
        advice = ["check the node's raylet log (`ray logs` on the head, /tmp/ray/session_latest/logs on the node)"]
    diagnosis = Diagnosis(kind=kind, summary=str(error), root_cause=(), figures={})
    return VLLMStartupError(diagnosis, launched, None, StartupOutcome(False, kind, waited_s, 0), advice, config=config)


class PlacementWatch:
    """Progress of one cluster startup under the test's observer: began, waiting for room, ended. The startup
    phases themselves are read on the node and are not streamed back."""

    def __init__(self, observer: Observer | None, config: VLLMConfig) -> None:
        self.observer = observer
        self.config = config
        self.started = time.monotonic()
        self._next_wait_event = 0.0
        if observer is not None:
            observer.startups += 1  # a startup, not a reused server
            began = StartupBegan(observer.test_id, config_label(config), "(on its cluster node)", time.time())
            send(observer, began)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def waiting(self, waited_s: float) -> None:
        """RayCluster's on_wait: the placement group is not placed yet (other servers hold the room)."""
        if self.observer is None or waited_s < self._next_wait_event:
            return
        self._next_wait_event = waited_s + WAIT_EVENT_EVERY_S
        send(self.observer, PlacementWait(self.observer.test_id, config_label(self.config), waited_s))

    def finish(self, outcome: StartupOutcome | None, memory: StartupMemory | None) -> None:
        obs = self.observer
        if obs is None:
            return
        figures = figures_of(memory) if memory is not None else Figures()
        ok = outcome is not None and outcome.ok
        kind = outcome.kind if outcome is not None else "interrupted"
        duration = outcome.duration_s if outcome is not None else self.elapsed_s()
        peak = outcome.peak_memory_bytes if outcome is not None else 0
        phase = "serving" if ok else "starting on the cluster"
        send(obs, StartupEnded(obs.test_id, ok, kind, duration, peak, obs.tier_bytes, obs.tier_name, phase, figures))
