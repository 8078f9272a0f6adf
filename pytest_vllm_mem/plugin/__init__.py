"""pytest hooks of pytest-vllm-mem: options, markers, the per-test gate, reports and the no-leftover-server sweep."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest

from pytest_vllm_mem.baseline.results import RECORD_PROPERTY, TestRecord
from pytest_vllm_mem.launch.server import ServerLaunchError, VLLMStartupError, stop_all_servers
from pytest_vllm_mem.load.client import LoadSpecError
from pytest_vllm_mem.plan.preflight import preflight_tier

# The fixtures are found on this plugin module, so they are imported here.
from pytest_vllm_mem.plugin.fixtures import (  # noqa: F401
    LoadFailed,
    startup_failure_key,
    vllm_config,
    vllm_load,
    vllm_server,
    vllm_start,
    vllm_tune,
)
from pytest_vllm_mem.plugin.gate import Gate, evaluate_record, marker_tolerances
from pytest_vllm_mem.plugin.interrupts import restore_sigterm, stop_servers_on_sigterm
from pytest_vllm_mem.plugin.ordering import group_by_server_config
from pytest_vllm_mem.plugin.report import ReportWriter
from pytest_vllm_mem.plugin.state import SessionState, state_key
from pytest_vllm_mem.plugin.workers import WorkerDeviceError, assign_worker_gpus
from pytest_vllm_mem.progress import choose_mode
from pytest_vllm_mem.settings import Settings, UsageError, add_options, usage_errors_to_pytest
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
    settings = Settings.from_pytest(config)
    choose_mode(settings.vllm_progress, isatty=False, worker=False)  # a bad --vllm-progress: usage error now
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its own GPUs before any server starts
        try:
            assign_worker_gpus(config.workerinput["workerid"], settings.vllm_gpus_per_worker)
        except WorkerDeviceError as error:
            raise UsageError(str(error)) from None
    state = SessionState(settings)
    state.gate = Gate.from_config(config, settings)  # the session's one baseline store and tolerances
    config.stash[state_key] = state
    state.report = ReportWriter(state, config)
    state.collector = RecordCollector()
    config.pluginmanager.register(state.collector, "vllm-mem-collector")
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
        items[:] = group_by_server_config(items)  # type: ignore[arg-type,assignment]


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
        reason = reason or device_skip_reason(selected, state.device.name, state.device.total_bytes)
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
        problems = evaluate_record(state, record, marker_tolerances(item), state.servers.get(item.nodeid))
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
        (VLLMStartupError, LoadFailed, UsageError, ServerLaunchError, LoadSpecError)
    ):
        # The message already quotes the root cause and the next step; a traceback through the plugin adds nothing.
        report.longrepr = str(call.excinfo.value)
    record = state.records.get(item.nodeid)
    if record is not None and call.when in ("setup", "call") and (report.failed or call.when == "call"):
        record.passed = report.passed
    server = state.servers.get(item.nodeid)  # the test's server, or the stopped one of its failed startup
    if record is not None and call.when == "teardown":
        state.report.finish_record(record, server)
        state.servers.pop(item.nodeid, None)  # the test is over: its server's samples need not be held for it
        item.user_properties.append((RECORD_PROPERTY, json.dumps(record.to_dict())))
        report.user_properties = list(item.user_properties)
    if server is not None and report.failed and call.when in ("setup", "call"):
        tail = "\n".join(server.log_text().splitlines()[-40:])
        report.sections.append(("vLLM server log (last 40 lines)", tail))
    return report


class RecordCollector:
    """Collects records from test reports, so that under pytest-xdist the controller sees the workers' records."""

    def __init__(self) -> None:
        self.records: list[TestRecord] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == RECORD_PROPERTY and isinstance(value, str):
                self.records.append(TestRecord.from_dict(json.loads(value)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state: SessionState | None = session.config.stash.get(state_key, None)
    if state is None:
        return
    state.close()
    state.leaked = stop_all_servers(grace_s=5.0)
    state.report.errors.extend(state.unwarned)  # a skipped flag pre-check under -W error: said in the summary
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist) writes the reports
        state.report.write_all(state.collector.records)
        if state.report.failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a results or baseline file was not written


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state: SessionState | None = config.stash.get(state_key, None)
    if state is not None and not hasattr(config, "workerinput"):
        state.report.terminal_summary(terminalreporter, state.collector.records)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_all_servers(grace_s=5.0)
    restore_sigterm(config)
