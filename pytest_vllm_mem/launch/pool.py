"""The core of a run, without pytest: the server pool that reuses servers across tests, and the Session that turns a
requested VLLMConfig into a launched server (model override, tiny model, tier emulation, flag pre-check, plan).

The pytest adapter (state.SessionState, plugin, fixtures) builds on it; the tune command uses it directly.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.advice import advise
from pytest_vllm_mem.diagnosis.diagnose import Diagnosis, StartupMemory
from pytest_vllm_mem.launch.devicelock import DeviceLockError, startup_lock
from pytest_vllm_mem.launch.devicelock import notes as lock_notes
from pytest_vllm_mem.launch.flagcheck import (
    FlagCheckError,
    ParserTable,
    flag_problems,
    load_parser_table,
    warn_if_skipped,
)
from pytest_vllm_mem.launch.launcher import Launcher, LaunchRequest, RunningServer
from pytest_vllm_mem.launch.server import (
    LaunchSettings,
    ServerLaunchError,
    StartupOutcome,
    VLLMServer,
    VLLMStartupError,
    launch,
    launch_lock_timeout_s,
)
from pytest_vllm_mem.launch.standins import PlannedServer, planned_or_raise
from pytest_vllm_mem.memory import (
    DeviceError,
    DeviceInfo,
    MemoryProbe,
    NvmlError,
    cpu_node_memory,
    detect_devices,
    make_probe,
    process_tree,
    server_devices,
    wait_for_free_memory,
)
from pytest_vllm_mem.plan.memory_plan import Plan
from pytest_vllm_mem.plan.preflight import PlanContext, SessionPlans, calibration_path, learn_from_startup, session_plan
from pytest_vllm_mem.settings import Settings, UsageError
from pytest_vllm_mem.tiers import BatchRule, Emulation, Tier, TierError, emulate_tier, resolve_tier
from pytest_vllm_mem.units import GIB, format_bytes
from pytest_vllm_mem.versions import default_utilization

TINY_MODEL = "tiny"
# Flags that describe a model's checkpoint, not how it is served: meaningless for the model that replaces it.
MODEL_SPECIFIC_FLAGS = (
    "quantization",
    "tokenizer",
    "revision",
    "tokenizer_revision",
    "code_revision",
    "hf_config_path",
    "served_model_name",
    "load_format",
)
# Leftover memory of a server that is still exiting clears in seconds; longer means another tenant holds it.
FREE_MEMORY_WAIT_S = 60.0


def visible_devices(visible: str | None) -> tuple[DeviceInfo, ...]:
    """The devices CUDA_VISIBLE_DEVICES=`visible` gives a server (indexes, GPU-/MIG- UUIDs), or the CPU; a name
    that matches no GPU, or NVML failing, is a usage error with the reason, not a traceback."""
    try:
        return detect_devices(visible)
    except (DeviceError, NvmlError) as error:
        raise UsageError(str(error)) from None


class LocalLauncher:
    """Servers as subprocesses of this process (the default launcher): each waits for its devices' memory to be free
    and starts under the devices' startup lock, measured through `probe` (or a probe of its own devices)."""

    def __init__(
        self, probe: MemoryProbe | None, devices_for: Callable[[VLLMConfig], tuple[DeviceInfo, ...]] | None = None
    ) -> None:
        self.probe = probe
        # The devices a launched config uses (all its GPUs); None: the probe's. Each server is waited for and
        # measured on its own devices, through a probe of its own.
        self.devices_for = devices_for

    def start(self, request: LaunchRequest, settings: LaunchSettings) -> VLLMServer:
        config, launched, advice_context = request.config, request.launched, request.advice_context
        if self.probe is None:
            raise TypeError("LocalLauncher needs the memory probe of this machine's devices")
        probe = self.probe
        ours = set().union(*(process_tree(server.pid) for server in request.running))
        devices = self.devices_for(launched) if self.devices_for is not None else None

        def _advise(diagnosis: Diagnosis, memory: StartupMemory | None, peak: int) -> list[str]:
            return advise(
                diagnosis,
                launched,
                memory,
                tier_bytes=advice_context.get("tier_bytes"),
                peak_bytes=peak,
                requested=config,
            )

        # The wait and the launch under one hold of the devices' startup lock: another startup must not take the
        # memory between the check and vLLM's own (issue 23 item 5).
        lock_on = devices or probe.devices
        try:
            with startup_lock(lock_on, launch_lock_timeout_s(settings, FREE_MEMORY_WAIT_S)) as waits:
                self._wait_for_devices(config, launched, devices, ours, advice_context)
                request.on_launch()
                server = launch(config, launched, settings, probe, advise=_advise, devices=devices, locked=True)
        except DeviceLockError as error:
            raise ServerLaunchError(str(error)) from None
        waited = lock_notes(waits)
        if waited:
            server.notes.extend(waited)
        return server

    def close(self) -> None:
        pass  # the probe is the session's

    def _wait_for_devices(
        self,
        config: VLLMConfig,
        launched: VLLMConfig,
        devices: tuple[DeviceInfo, ...] | None,
        ours: set[int],
        advice_context: dict[str, Any],
    ) -> None:
        assert self.probe is not None  # start() checked it
        waited_from = time.monotonic()
        try:
            probe = self.probe.scoped(devices) if devices is not None else self.probe
            try:
                holders = wait_for_free_memory(
                    probe,
                    exclude_pids=ours,
                    needed_bytes=advice_context.get("requested_bytes"),
                    timeout_s=FREE_MEMORY_WAIT_S,
                )
                if holders:  # vLLM would refuse to start ("Free memory on device ... is less than desired")
                    raise memory_held_error(
                        probe, config, launched, holders, advice_context, time.monotonic() - waited_from
                    )
            finally:
                if probe is not self.probe:
                    probe.close()
        except NvmlError as error:
            raise ServerLaunchError(f"{error} The server was not started.") from None


def memory_held_error(
    probe: MemoryProbe,
    config: VLLMConfig,
    launched: VLLMConfig,
    holders: list[tuple[int, int, str]],
    context: dict[str, Any],
    waited_s: float,
) -> VLLMStartupError:
    devices, frees = probe.devices, probe.free_bytes()
    # vLLM checks every GPU of the server; the fullest one is the one that refuses.
    free, device = min(zip(frees, devices), key=lambda pair: pair[0])
    where = device.name if len(devices) == 1 else f"{device.label} ({device.name}, the fullest of {len(devices)})"
    held = sum(used for _, used, _ in holders)
    diagnosis = Diagnosis(
        kind="insufficient_free_memory",
        summary=(
            f"other processes still hold {format_bytes(held)} of {where} after waiting "
            f"{waited_s:.0f} s; {format_bytes(free)} free, the server needs "
            f"{format_bytes(context.get('requested_bytes') or 0)}"
        ),
        root_cause=tuple(f"pid {pid} ({name}) holds {format_bytes(used)}" for pid, used, name in holders),
        figures={
            "free_gib": free / GIB,
            "device_total_gib": device.total_bytes / GIB,
            "requested_gib": (context.get("requested_bytes") or 0) / GIB,
        },
    )
    return VLLMStartupError(
        diagnosis,
        launched,
        None,
        StartupOutcome(False, diagnosis.kind, waited_s, 0),
        advise(diagnosis, launched, None, tier_bytes=context.get("tier_bytes"), requested=config),
        config=config,
    )


@dataclass
class ServerPool:
    """Servers by launched config: equal configs share one; at most `capacity` run at once (one device). Started
    through `launcher`: by default a LocalLauncher over `probe` and `devices_for`."""

    settings: LaunchSettings
    probe: MemoryProbe | None
    capacity: int = 1
    running: OrderedDict[VLLMConfig, RunningServer] = field(default_factory=OrderedDict)
    failed: dict[VLLMConfig, VLLMStartupError] = field(default_factory=dict)
    startups: int = 0
    devices_for: Callable[[VLLMConfig], tuple[DeviceInfo, ...]] | None = None
    launcher: Launcher | None = None

    def __post_init__(self) -> None:
        if self.launcher is None:
            self.launcher = LocalLauncher(self.probe, self.devices_for)

    def acquire(self, config: VLLMConfig, launched: VLLMConfig, advice_context: dict[str, Any]) -> RunningServer:
        server = self.running.get(launched)
        if server is not None and server.alive():
            self.running.move_to_end(launched)
            return server
        if server is not None:  # died since the last test: never hand out a dead server
            self.release(launched)
        if launched in self.failed:  # the same config failed earlier this session: same error, no second startup
            raise self.failed[launched]
        while len(self.running) >= self.capacity:
            self.release(next(iter(self.running)))
        attempted = []

        def counted() -> None:
            attempted.append(True)
            self.startups += 1

        request = LaunchRequest(config, launched, advice_context, list(self.running.values()), counted)
        assert self.launcher is not None  # __post_init__ set it
        try:
            server = self.launcher.start(request, self.settings)
        except VLLMStartupError as error:
            if attempted:  # refused before a startup (memory held by others): not remembered as the config's
                self.failed[launched] = error
            raise
        self.running[launched] = server
        return server

    def release(self, launched: VLLMConfig) -> None:
        server = self.running.pop(launched, None)
        if server is not None:
            server.stop(self.settings.stop_grace_s)

    def release_all(self) -> None:
        for launched in list(self.running):
            self.release(launched)

    def close(self) -> None:
        """Stop every server, then release the launcher (a cluster connection)."""
        try:
            self.release_all()
        finally:
            if self.launcher is not None:
                self.launcher.close()


class Session:
    """The launch path of one run (a pytest session or a `python -m pytest_vllm_mem tune`): devices, tier, probe,
    vLLM's flag table, the server pool and the plans of launched configs. Everything is created lazily, so that runs
    without servers pay nothing. No pytest here: the pytest adapter (state.SessionState) builds on it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._device: DeviceInfo | None = None
        self._devices: tuple[DeviceInfo, ...] | None = None
        self._probe: MemoryProbe | None = None
        self._pool: ServerPool | None = None
        self._parser: ParserTable | None = None
        self._batch_rule: Any = None  # plan.batch_rule.BatchRule read from vLLM's source; False: unreadable
        # Plans of launched configs (preflight.session_plan), for the report and the next plan's calibration.
        self.plans = SessionPlans()
        # A flag pre-check skipped under -W error: the warning could not be raised, the adapter shows it instead.
        self.unwarned: list[str] = []
        self.tier_text = settings.vllm_gpu
        self.cluster_address = checked_cluster(settings.vllm_cluster)  # None: servers run on this machine
        try:
            from pytest_vllm_mem.tiers import parse_tier

            parse_tier(settings.vllm_gpu)  # malformed tiers are usage errors before any test runs
        except TierError as error:
            raise UsageError(str(error)) from None

    @property
    def known_device(self) -> DeviceInfo | None:
        """The first visible device if a test has needed it (None: no device detected, e.g. an xdist controller)."""
        return self._device

    @property
    def known_vllm_version(self) -> str | None:
        """vLLM's version if its flag table was loaded this session (None: no server was prepared)."""
        return self._parser.version if self._parser is not None else None

    @property
    def devices(self) -> tuple[DeviceInfo, ...]:
        """The GPUs CUDA_VISIBLE_DEVICES gives this session's servers, in vLLM's order (or the CPU)."""
        if self._devices is None:
            self._devices = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
            self._device = self._devices[0]
        return self._devices

    @property
    def device(self) -> DeviceInfo:
        """The first visible device: the one tier auto and the report name."""
        return self.devices[0]

    def server_devices(self, config: VLLMConfig) -> tuple[DeviceInfo, ...]:
        """The devices a server for `config` uses: the first tensor x pipeline (x data) parallel size of the GPUs
        its CUDA_VISIBLE_DEVICES (the config's env, else the session's) makes visible."""
        if self.device.backend != "cuda":
            return (self.device,)
        visible = (
            visible_devices(config.env["CUDA_VISIBLE_DEVICES"])
            if "CUDA_VISIBLE_DEVICES" in config.env
            else self.devices
        )
        return server_devices(visible, config.flags)

    @property
    def tier(self) -> Tier:
        return resolve_tier(self.tier_text, self.device.total_bytes)

    @property
    def probe(self) -> MemoryProbe:
        if self._probe is None:
            try:
                self._probe = make_probe(self.devices)
            except (DeviceError, NvmlError) as error:
                raise UsageError(str(error)) from None
        return self._probe

    @property
    def pool(self) -> ServerPool:
        if self._pool is None:
            s = self.settings
            launch_settings = LaunchSettings(
                python=s.vllm_python,
                log_dir=s.vllm_log_dir,
                cache_root=s.vllm_cache_dir / "vllm",
                vllm_version=self.parser_table.version,
                startup_timeout_s=s.vllm_startup_timeout,
                sample_period_s=s.vllm_sample_period,
            )
            if self.cluster_address is None:
                self._pool = ServerPool(
                    launch_settings, self.probe, capacity=s.vllm_max_servers, devices_for=self.server_devices
                )
            else:  # the servers run on the cluster's nodes: this machine's devices are neither waited for nor probed
                from pytest_vllm_mem.launch.ray_launcher import RayLauncher

                launcher = RayLauncher(self.cluster_address)
                self._pool = ServerPool(launch_settings, None, capacity=s.vllm_max_servers, launcher=launcher)
        return self._pool

    @property
    def parser_table(self) -> ParserTable:
        if self._parser is None:
            try:
                self._parser = load_parser_table(self.settings.vllm_cache_dir, self.settings.vllm_python)
            except FlagCheckError as error:
                raise UsageError(str(error)) from None
            unwarned = warn_if_skipped(self._parser)  # once per session: the table is loaded once
            if unwarned:  # -W error: said in the summary, never a failed test
                self.unwarned.append(unwarned)
        return self._parser

    def device_total_now(self, config: VLLMConfig | None = None) -> int:
        """The device's total memory right before a launch. vLLM's CPU backend reads the NUMA node's size at startup,
        and under a VM that size can change (memory hotplug grew a node from 9 to 23 GiB within one session here).
        On GPUs, with `config`: the smallest of its server's GPUs (or MIG slices): vLLM sizes every GPU alike."""
        if self.device.backend == "cpu":
            return cpu_node_memory()[0]
        if config is not None:
            return min(device.total_bytes for device in self.server_devices(config))
        return self.device.total_bytes

    def resolve_model(self, model: str) -> str:
        if model == TINY_MODEL:
            from pytest_vllm_mem.tiny_model import build_tiny_model

            return str(build_tiny_model(self.settings.vllm_cache_dir / "models" / "tiny"))
        return model

    def default_config(self) -> VLLMConfig:
        return VLLMConfig(self.settings.vllm_model)

    def launched_config(self, config: VLLMConfig) -> tuple[VLLMConfig, Emulation | None, list[str]]:
        """What actually runs for `config`: model override, tiny-model path, tier emulation."""
        notes = []
        model, flags = config.model, dict(config.flags)
        if self.settings.vllm_model_override:
            model = self.settings.vllm_model_override
            dropped = [f"{key}={flags.pop(key)}" for key in MODEL_SPECIFIC_FLAGS if flags.get(key) is not None]
            notes.append(
                f"model {config.model} replaced by {model} (--vllm-model-override)"
                + (f", dropped its checkpoint flags {', '.join(dropped)}" if dropped else "")
            )
        launched = VLLMConfig(self.resolve_model(model), env=config.env, **flags)
        default_utilization = self.default_utilization()  # vLLM's flag table first: a broken --vllm-python stops here
        launched, emulation = emulate_tier(
            launched, self.tier, self.device_total_now(launched), default_utilization, self.batch_rule()
        )
        if emulation is not None:
            notes.append(emulation.describe())
        return launched, emulation, notes

    def batch_rule(self) -> BatchRule | None:
        """vLLM's batch defaults by device size (GPUs only): read from the server interpreter's vLLM source where it
        can be, else batch_defaults' table for its release. The smallest of a server's GPUs names the device."""
        if self.device.backend != "cuda":
            return None
        if self._batch_rule is None:
            from pytest_vllm_mem.launch.flagcheck import vllm_package_dir
            from pytest_vllm_mem.plan.batch_rule import rule_from_source

            package = vllm_package_dir(self.settings.vllm_python)
            try:
                text = (package / "engine" / "arg_utils.py").read_text() if package is not None else ""
            except OSError:
                text = ""
            self._batch_rule = (rule_from_source(text, str(package)) if text else None) or False
        rule = self._batch_rule or None
        name, version = self.device.name, self.parser_table.version

        def defaults(device_bytes: int) -> tuple[int, int]:
            from pytest_vllm_mem.plan.batch_rule import defaults_for

            # The card itself is known by name (an A100 keeps the small defaults); a tier's card is only a size.
            chosen = defaults_for(
                device_bytes, name if device_bytes >= self.device.total_bytes else "", rule, vllm_version=version
            )
            return chosen.max_num_batched_tokens, chosen.max_num_seqs

        return defaults

    def default_utilization(self) -> float:
        """The gpu_memory_utilization vLLM uses when a config sets none: its parser's default, else its release's."""
        fallback = default_utilization(self.parser_table.version)
        value = self.parser_table.default("gpu_memory_utilization", fallback)
        return float(value) if isinstance(value, (int, float, str)) else fallback

    def plan(self, config: VLLMConfig, launched: VLLMConfig) -> Plan | None:
        """The plan of `launched` (what runs for `config`) on this session's device and tier, kept in self.plans;
        None when the model cannot be planned."""
        context = PlanContext(
            device=self.device,
            tier=self.tier,
            vllm_version=self.parser_table.version,
            default_utilization=self.default_utilization(),
            device_total=self.device_total_now,
            calibration_file=calibration_path(self.settings.vllm_baseline),
            preflight=self.settings.vllm_preflight,
            model_override=self.settings.vllm_model_override,
        )
        return session_plan(self.plans, context, config, launched)

    @property
    def preflight(self) -> bool:
        """--vllm-preflight: configs are planned, no server starts."""
        return self.settings.vllm_preflight

    def start(self, config: VLLMConfig) -> RunningServer | PlannedServer:
        """Start (or reuse) the server for `config`; VLLMStartupError when it does not come up. Under
        --vllm-preflight a PlannedServer (nothing runs), or the predicted VLLMStartupError."""
        if not self.preflight:
            return self.serve(config)
        launched, _emulation, notes = self._checked_launch(config)
        return planned_or_raise(self.plans, config, launched, self.plan(config, launched), notes)

    def launch(self, config: VLLMConfig) -> VLLMServer:
        """Start (or reuse) a real server for `config` on this machine, whatever --vllm-preflight says (the tuner's
        trials, which measure this machine's devices)."""
        if self.cluster_address is not None:
            raise UsageError(
                f"--vllm-cluster={self.settings.vllm_cluster}: the tuner starts its trial servers on this machine "
                "and measures its devices; run vllm_tune / `python -m pytest_vllm_mem tune` without --vllm-cluster "
                "(on a node of the cluster)."
            )
        server = self.serve(config)
        assert isinstance(server, VLLMServer)  # the local launcher's
        return server

    def serve(self, config: VLLMConfig) -> RunningServer:
        """Start (or reuse) a real server for `config` through the session's launcher (this machine or a cluster)."""
        launched, _emulation, notes = self._checked_launch(config)
        utilization = float(launched.flag("gpu_memory_utilization", self.default_utilization()))
        context = {"tier_bytes": self.tier.bytes, "requested_bytes": int(utilization * self.device_total_now(launched))}
        self.plan(config, launched)
        server = self.pool.acquire(config, launched, context)
        peak = server.startup.peak_memory_bytes if server.startup else None
        store = calibration_path(self.settings.vllm_baseline) if self.settings.vllm_update_baseline else None
        learn_from_startup(self.plans, launched, server.memory, peak, store)
        for note in notes:
            if note not in server.notes:
                server.notes.append(note)
        return server

    def restart(self, config: VLLMConfig) -> RunningServer:
        """A fresh server for `config`: the running one stopped first, then started anew (the gate's confirmation
        on fresh servers: another session of the same config)."""
        launched, _emulation, _notes = self._checked_launch(config)
        self.pool.release(launched)
        return self.serve(config)

    def _checked_launch(self, config: VLLMConfig) -> tuple[VLLMConfig, Emulation | None, list[str]]:
        """launched_config(config), refused with a bad_flag VLLMStartupError when vLLM would reject its flags or its
        local model folder is missing."""
        launched, emulation, notes = self.launched_config(config)
        problems = flag_problems(launched, self.parser_table)
        model_problem = missing_model_folder(launched.model)
        if model_problem:
            problems.append(model_problem)
        if problems:
            diagnosis = Diagnosis(kind="bad_flag", summary="; ".join(problems), root_cause=tuple(problems), figures={})
            raise VLLMStartupError(
                diagnosis,
                launched,
                None,
                StartupOutcome(False, "bad_flag", 0.0, 0),
                advise(diagnosis, launched, None),
                config=config,
            )
        return launched, emulation, notes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._probe is not None:
            self._probe.close()


def checked_cluster(setting: str) -> str | None:
    """The Ray address `--vllm-cluster` names (None: servers run here), checked before any test runs: Ray
    installed, the address well-formed and answering; a UsageError paragraph naming the input otherwise. Ray itself
    is imported at the first server."""
    if setting.strip() in ("", "local"):
        return None
    from pytest_vllm_mem.launch.ray_cluster import ClusterError, check_cluster, cluster_address

    try:
        address = cluster_address(setting)
        if address is not None:
            check_cluster(address)
    except ClusterError as error:
        raise UsageError(str(error)) from None
    return address


def missing_model_folder(model: str) -> str | None:
    """Hub names (org/name) cannot be checked offline; a path that looks local and is missing can."""
    looks_local = model.startswith(("/", "./", "../", "~")) or (os.sep in model and Path(model).parent.exists())
    if looks_local and not Path(os.path.expanduser(model)).exists():
        return (
            f"model folder {model} does not exist: pass an existing local model folder, a model name vLLM can "
            "load, or 'tiny' for the built-in test model"
        )
    return None
