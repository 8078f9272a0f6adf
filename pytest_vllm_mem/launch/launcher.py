"""The launch seam: how the server pool gets a server for a (config, launched) pair. `pool.LocalLauncher` starts it
as a subprocess of this process (the default); `ray_launcher.RayLauncher` places it on a Ray cluster. Another
launcher (Slurm, a Kubernetes LeaderWorkerSet) implements the same two methods."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, TypeVar

from pytest_vllm_mem.baseline.results import NodeRecord
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.launch.server import LaunchSettings, Server

T = TypeVar("T")


class RunningServer(Server, Protocol):
    """A server that runs (server.VLLMServer here, ray_cluster.RayServer on a cluster): what the pool keeps, the
    fixtures hand out and a load runs against."""

    @property
    def pid(self) -> int: ...
    @property
    def started_at(self) -> float: ...  # time.monotonic() of this process when the server was asked for
    @property
    def loads_run(self) -> int: ...
    def peak_between(self, since: float) -> int: ...
    def per_node_peaks(self) -> list[NodeRecord]: ...
    def call(self, function: Callable[..., T], *args: Any) -> T: ...
    def stop(self, grace_s: float = ...) -> None: ...


def is_running(server: Server) -> TypeGuard[RunningServer]:
    """Whether the fixture's server is one that runs (not a standins.FailedServer or PlannedServer)."""
    return callable(getattr(type(server), "call", None)) and callable(getattr(type(server), "stop", None))


@dataclass
class LaunchRequest:
    """One startup the pool asks of its launcher."""

    config: VLLMConfig  # what the test asked for
    launched: VLLMConfig  # what runs (tier emulation, overrides)
    advice_context: dict[str, Any]  # tier_bytes, requested_bytes: for the advice of a failed startup
    running: Sequence[RunningServer] = ()  # the pool's other servers (their memory is not someone else's)
    # Called once the launcher commits to a startup (after its waits): the pool counts it, and only a startup that
    # was attempted is remembered as failed for the session.
    on_launch: Callable[[], None] = field(default=lambda: None)


class Launcher(Protocol):
    def start(self, request: LaunchRequest, settings: LaunchSettings) -> RunningServer:
        """A healthy server for `request`; VLLMStartupError (classified) when it does not come up."""
        ...

    def close(self) -> None:
        """Release what the launcher holds (a cluster connection); the servers are the pool's to stop."""
        ...
