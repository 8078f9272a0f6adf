"""pytest hooks of pytest-vllm-mem that exist before a session does: options, markers, configuration (which builds
and registers the session's plugin object, plugin/session.py, carrying the hooks of a running session), collection
order and shards, and the no-leftover-server sweep at unconfigure."""

from __future__ import annotations

import pytest

from pytest_vllm_mem.launch.server import stop_all_servers

# The fixtures are found on this plugin module, so they are imported here.
from pytest_vllm_mem.plugin.fixtures import (  # noqa: F401
    vllm_config,
    vllm_load,
    vllm_server,
    vllm_start,
    vllm_tune,
)
from pytest_vllm_mem.plugin.gate import marker_tolerances
from pytest_vllm_mem.plugin.interrupts import restore_sigterm, stop_servers_on_sigterm
from pytest_vllm_mem.plugin.options import add_options, settings_from_pytest, usage_errors_to_pytest
from pytest_vllm_mem.plugin.ordering import group_by_server_config
from pytest_vllm_mem.plugin.session import PluginSession, session_key, tier_marker_values
from pytest_vllm_mem.plugin.shard import parse_shard, split_items
from pytest_vllm_mem.plugin.state import SessionState, state_key
from pytest_vllm_mem.plugin.terminal import choose_mode
from pytest_vllm_mem.plugin.workers import WorkerDeviceError, assign_worker_gpus
from pytest_vllm_mem.settings import UsageError
from pytest_vllm_mem.tiers import TierError, parse_tier

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
        minimum, maximum = tier_marker_values(item)
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


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_all_servers(grace_s=5.0)
    restore_sigterm(config)
