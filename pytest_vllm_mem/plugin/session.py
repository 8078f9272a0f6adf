"""The plugin's session object: built in one go in pytest_configure and registered as a plugin of its own, it owns
what the hooks need (the session state, the baseline gate, the report writer, the collected records) and carries
the hooks of a running session as its methods, as pytest-memray's Manager and pytest-xdist's DSession do. The hooks
that exist before it (options, configure, collection order) stay in plugin/__init__.py.

Registered at configure, after the user's conftest files, it would otherwise run before their hooks (and wrap
theirs); `trylast` keeps the order it had as a module plugin: users' wrappers see the gate's verdict and the final
report, and their session-finish hooks run before the reports are written."""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_vllm_mem.baseline.results import RECORD_PROPERTY, TestRecord
from pytest_vllm_mem.launch.ray_cluster import ClusterError
from pytest_vllm_mem.launch.server import ServerLaunchError, VLLMStartupError, stop_all_servers
from pytest_vllm_mem.load.client import LoadSpecError
from pytest_vllm_mem.plan.preflight import preflight_tier
from pytest_vllm_mem.plugin.fixtures import LoadFailed, placement, remeasure_key, startup_failure_key
from pytest_vllm_mem.plugin.gate import Gate, evaluate_record, marker_tolerances, plan_suite
from pytest_vllm_mem.plugin.report import ReportWriter, RunFacts
from pytest_vllm_mem.plugin.state import SessionState
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.tiers import Tier, device_skip_reason, parse_tier, tier_skip_reason

# Errors whose message already names the input, the root cause and the next step: a traceback through the plugin
# adds nothing. UsageError and ServerLaunchError: a corrupt baseline file, an interpreter without vLLM
# (--vllm-python) or an unwritable --vllm-log-dir found during a test; LoadSpecError: a vllm_load argument.
MESSAGE_ONLY = (VLLMStartupError, LoadFailed, UsageError, ServerLaunchError, LoadSpecError, ClusterError)


def run_facts(state: SessionState) -> RunFacts:
    """What the reports say of where this process ran (read when they are written)."""
    device = state.known_device
    tier = state.tier.name if device is not None else state.tier_text
    return RunFacts(device, tier, state.known_vllm_version, tuple(state.leaked))


def tier_marker_values(item: pytest.Item) -> tuple[str | None, str | None]:
    """The (min, max) tiers of a test's vllm_tier markers, the closest marker first."""
    minimum = maximum = None
    for mark in item.iter_markers("vllm_tier"):
        minimum = minimum or (mark.args[0] if mark.args else mark.kwargs.get("min"))
        maximum = maximum or mark.kwargs.get("max")
    return minimum, maximum


@dataclass
class PluginSession:
    """One pytest session's plugin: the state, the gate and the report writer, the records collected from test
    reports (under pytest-xdist the controller sees the workers' records this way), and the session's hooks."""

    state: SessionState
    gate: Gate
    report: ReportWriter
    records: list[TestRecord] = field(default_factory=list)

    @classmethod
    def build(cls, config: pytest.Config, state: SessionState) -> PluginSession:
        gate = Gate.from_config(config, state.settings)  # the session's one baseline store and tolerances
        report = ReportWriter(state.settings, gate, Path(config.rootpath), lambda: run_facts(state))
        return cls(state, gate, report)

    @property
    def tier(self) -> Tier:
        return self.state.tier

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The suite's tests that run loads share the gate's false-alarm budget (plugin/gate.py)."""
        plan_suite(self.gate, session.items)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Skip a test whose vllm_tier markers exclude this run's tier, before its fixtures start a server."""
        minimum, maximum = tier_marker_values(item)
        state = self.state
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

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, None, None]:
        """After a passing test body, gate its figures: tier limit and baseline regressions fail the test here,
        through the normal report (not from a summary hook)."""
        startup_failure = item.stash.get(startup_failure_key, None)
        if startup_failure is not None:
            raise startup_failure  # the server this test needs did not start: the test fails, it does not run
        result = yield
        record = self.state.records.get(item.nodeid)
        if record is not None and record.failure is None:
            remeasure = item.stash.get(remeasure_key, None)  # the gate's confirmation on fresh servers
            server = self.state.servers.get(item.nodeid)
            problems = evaluate_record(self, record, marker_tolerances(item), server, remeasure)
            if problems:
                pytest.fail(problems, pytrace=False)
        return result

    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        state = self.state
        if call.excinfo is not None and call.excinfo.errisinstance(MESSAGE_ONLY):
            report.longrepr = str(call.excinfo.value)
        record = state.records.get(item.nodeid)
        if record is not None and call.when in ("setup", "call") and (report.failed or call.when == "call"):
            record.passed = report.passed
        server = state.servers.get(item.nodeid)  # the test's server, or the stopped one of its failed startup
        if record is not None and call.when == "teardown":
            if server is not None:  # a cluster server's ranks: their peaks at the test's end
                record.nodes = placement(server, record.nodes)
            self.report.finish_record(record, server)
            state.servers.pop(item.nodeid, None)  # the test is over: its server's samples need not be held for it
            item.user_properties.append((RECORD_PROPERTY, json.dumps(record.to_dict())))
            report.user_properties = list(item.user_properties)
        if server is not None and report.failed and call.when in ("setup", "call"):
            tail = "\n".join(server.log_text().splitlines()[-40:])
            report.sections.append(("vLLM server log (last 40 lines)", tail))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == RECORD_PROPERTY and isinstance(value, str):
                self.records.append(TestRecord.from_dict(json.loads(value)))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        state, report = self.state, self.report
        state.close()
        state.leaked = stop_all_servers(grace_s=5.0)
        report.errors.extend(state.unwarned)  # a skipped flag pre-check under -W error: said in the summary
        if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist) writes the reports
            report.write_all(self.records)
            if report.failed and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a results or baseline file was not written

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if not hasattr(config, "workerinput"):
            self.report.terminal_summary(terminalreporter, self.records)


session_key = pytest.StashKey[PluginSession]()
