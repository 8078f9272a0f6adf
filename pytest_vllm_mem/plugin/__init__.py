"""pytest hooks of pytest-vllm-mem: options, markers, the per-test gate, reports and the no-leftover-server sweep."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest

from pytest_vllm_mem.baseline.results import RECORD_PROPERTY
from pytest_vllm_mem.launch.ray_cluster import ClusterError
from pytest_vllm_mem.launch.server import ServerLaunchError, VLLMStartupError, stop_all_servers
from pytest_vllm_mem.load.client import LoadSpecError
from pytest_vllm_mem.plan.preflight import preflight_tier

# The fixtures are found on this plugin module, so they are imported here.
from pytest_vllm_mem.plugin.fixtures import (  # noqa: F401
    LoadFailed,
    placement,
    remeasure_key,
    startup_failure_key,
    vllm_config,
    vllm_load,
    vllm_server,
    vllm_start,
    vllm_tune,
)
from pytest_vllm_mem.plugin.gate import evaluate_record, marker_tolerances, plan_suite
from pytest_vllm_mem.plugin.interrupts import restore_sigterm, stop_servers_on_sigterm
from pytest_vllm_mem.plugin.options import add_options, settings_from_pytest, usage_errors_to_pytest
from pytest_vllm_mem.plugin.ordering import group_by_server_config
from pytest_vllm_mem.plugin.session import PluginSession, session_key
from pytest_vllm_mem.plugin.shard import parse_shard, split_items
from pytest_vllm_mem.plugin.state import SessionState, state_key
from pytest_vllm_mem.plugin.terminal import choose_mode
from pytest_vllm_mem.plugin.workers import WorkerDeviceError, assign_worker_gpus
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.tiers import TierError, device_skip_reason, parse_tier, tier_skip_reason

MARKERS = [
    "vllm_tier(min=None, *, max=None): the GPU memory tier a test needs (e.g. '24gb'); skipped on smaller tiers, "
    "or on larger ones with max=",
    "vllm_tolerance(**metrics): per-test baseline tolerances, e.g. output_throughput='20%', load_peak_memory='256MiB'",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    with usage_errors_to_pytest():
        _configure(config)


def _configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    settings = settings_from_pytest(config)
    choose_mode(settings.vllm_progress, isatty=False, worker=False)  # a bad --vllm-progress: usage error now
    parse_shard(settings.vllm_shard)  # a bad --vllm-shard too
    # A pytest-xdist worker: its own GPUs before any server starts (on a cluster, placement groups share the GPUs).
    if hasattr(config, "workerinput") and settings.vllm_cluster.strip() in ("", "local"):
        try:
            assign_worker_gpus(config.workerinput["workerid"], settings.vllm_gpus_per_worker)
        except WorkerDeviceError as error:
            raise UsageError(str(error)) from None
    state = SessionState(settings)
    plugin = PluginSession.build(config, state)  # the state, the gate and the report writer, in one go
    config.stash[state_key] = state
    config.stash[session_key] = plugin
    config.pluginmanager.register(plugin, "vllm-mem-session")  # it collects the records (under xdist too)
    stop_servers_on_sigterm(config)


def _tier_marker_values(item: pytest.Item) -> tuple[str | None, str | None]:
    minimum = maximum = None
    for mark in item.iter_markers("vllm_tier"):
        minimum = minimum or (mark.args[0] if mark.args else mark.kwargs.get("min"))
        maximum = maximum or mark.kwargs.get("max")
    return minimum, maximum


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    with usage_errors_to_pytest():
        _check_markers_and_order(config, items)


# Last, after -k/-m, other plugins' deselection and the grouping above: the shards split what would run (a
# second implementation of the hook, so its own name; pytest registers only names that start with pytest_).
@pytest.hookimpl(specname="pytest_collection_modifyitems", trylast=True)
def pytest_collection_modifyitems_select_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = parse_shard(config.stash[state_key].settings.vllm_shard)
    if shard is not None:
        items[:], deselected = split_items(items, shard)
        if deselected:
            config.hook.pytest_deselected(items=deselected)


def _check_markers_and_order(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        minimum, maximum = _tier_marker_values(item)
        for value in (minimum, maximum):
            if value is None:
                continue
            try:
                parse_tier(value, source=f"@pytest.mark.vllm_tier on {item.nodeid}")
            except TierError as error:
                raise UsageError(str(error)) from None
        # A typo in a vllm_tolerance marker was found only after the test's server had started
        # and its load had run, and failed that test with a traceback; now it is a usage error before any server.
        marker_tolerances(item)
    if not config.stash[state_key].settings.vllm_keep_order:
        # Collected items are pytest.Function, which has the fixturenames ordering reads (pytest.Item does not).
        items[:] = group_by_server_config(items)  # type: ignore[type-var]


def pytest_collection_finish(session: pytest.Session) -> None:
    """The suite's tests that run loads share the gate's false-alarm budget (plugin/gate.py)."""
    plugin = session.config.stash.get(session_key, None)
    if plugin is not None:
        plan_suite(plugin.gate, session.items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    minimum, maximum = _tier_marker_values(item)
    state = item.config.stash[state_key]
    if state.settings.vllm_preflight:  # plans need no device: each test on its own tier, the whole matrix at once
        state.tier_text = preflight_tier(state.settings.vllm_gpu, minimum, maximum)
    if minimum is None and maximum is None:
        return
    selected = state.tier
    reason = tier_skip_reason(
        selected, parse_tier(minimum) if minimum else None, parse_tier(maximum) if maximum else None
    )
    if not state.settings.vllm_preflight:
        reason = reason or device_skip_reason(selected, state.device.name, state.device.card_bytes)  # label size
    if reason:
        pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """After a passing test body, gate its figures: tier limit and baseline regressions fail the test here, through
    the normal report (not from a summary hook)."""
    startup_failure = item.stash.get(startup_failure_key, None)
    if startup_failure is not None:
        raise startup_failure  # the server this test needs did not start: the test fails, it does not run
    result = yield
    state: SessionState = item.config.stash[state_key]
    record = state.records.get(item.nodeid)
    if record is not None and record.failure is None:
        remeasure = item.stash.get(remeasure_key, None)  # the gate's confirmation of a near-limit verdict
        plugin = item.config.stash[session_key]
        problems = evaluate_record(plugin, record, marker_tolerances(item), state.servers.get(item.nodeid), remeasure)
        if problems:
            pytest.fail(problems, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    state: SessionState = item.config.stash[state_key]
    # UsageError and ServerLaunchError too: a corrupt baseline file, an interpreter without vLLM
    # (--vllm-python) or an unwritable --vllm-log-dir is found during a test and failed it with a traceback through
    # the plugin; the message alone names the input. LoadSpecError: a vllm_load argument, named with what it accepts.
    if call.excinfo is not None and call.excinfo.errisinstance(
        (VLLMStartupError, LoadFailed, UsageError, ServerLaunchError, LoadSpecError, ClusterError)
    ):
        # The message already quotes the root cause and the next step; a traceback through the plugin adds nothing.
        report.longrepr = str(call.excinfo.value)
    record = state.records.get(item.nodeid)
    if record is not None and call.when in ("setup", "call") and (report.failed or call.when == "call"):
        record.passed = report.passed
    server = state.servers.get(item.nodeid)  # the test's server, or the stopped one of its failed startup
    if record is not None and call.when == "teardown":
        if server is not None:  # a cluster server's ranks: their peaks at the test's end
            record.nodes = placement(server, record.nodes)
        item.config.stash[session_key].report.finish_record(record, server)
        state.servers.pop(item.nodeid, None)  # the test is over: its server's samples need not be held for it
        item.user_properties.append((RECORD_PROPERTY, json.dumps(record.to_dict())))
        report.user_properties = list(item.user_properties)
    if server is not None and report.failed and call.when in ("setup", "call"):
        tail = "\n".join(server.log_text().splitlines()[-40:])
        report.sections.append(("vLLM server log (last 40 lines)", tail))
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    plugin: PluginSession | None = session.config.stash.get(session_key, None)
    if plugin is None:
        return
    state, report = plugin.state, plugin.report
    state.close()
    state.leaked = stop_all_servers(grace_s=5.0)
    report.errors.extend(state.unwarned)  # a skipped flag pre-check under -W error: said in the summary
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist) writes the reports
        report.write_all(plugin.records)
        if report.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a results or baseline file was not written


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    plugin: PluginSession | None = config.stash.get(session_key, None)
    if plugin is not None and not hasattr(config, "workerinput"):
        plugin.report.terminal_summary(terminalreporter, plugin.records)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_all_servers(grace_s=5.0)
    restore_sigterm(config)
