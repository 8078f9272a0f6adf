"""The core (config, server, diagnose, memory, load, baseline, plan, tune, the CLI) imports and runs without pytest;
only the pytest adapter (plugin, fixtures, state, gate, report) needs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE_MODULES = (
    "pytest_vllm_mem",
    "pytest_vllm_mem.config",
    "pytest_vllm_mem.kinds",
    "pytest_vllm_mem.launch.server",
    "pytest_vllm_mem.diagnosis.diagnose",
    "pytest_vllm_mem.diagnosis.advice",
    "pytest_vllm_mem.memory",
    "pytest_vllm_mem.load.client",
    "pytest_vllm_mem.load.measure",
    "pytest_vllm_mem.baseline.metrics",
    "pytest_vllm_mem.baseline.store",
    "pytest_vllm_mem.baseline.compare",
    "pytest_vllm_mem.baseline.noise",
    "pytest_vllm_mem.baseline.results",
    "pytest_vllm_mem.plan.memory_plan",
    "pytest_vllm_mem.plan.preflight",
    "pytest_vllm_mem.settings",
    "pytest_vllm_mem.launch.pool",
    "pytest_vllm_mem.launch.flagcheck",
    "pytest_vllm_mem.tiers",
    "pytest_vllm_mem.tune.search",
    "pytest_vllm_mem.cli.args",
    "pytest_vllm_mem.cli.plan",
    "pytest_vllm_mem.cli.main",
)

# A finder first on sys.meta_path that refuses pytest: importing it anywhere raises, naming the importer.
REFUSE_PYTEST = """
import importlib.abc, sys, traceback

class RefusePytest(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest", "pluggy"):
            importer = [frame.filename for frame in traceback.extract_stack()[:-1]
                        if "pytest_vllm_mem" in frame.filename][-1:]
            raise ImportError(f"{name} imported by {importer or 'an unknown module'}")
        return None

sys.meta_path.insert(0, RefusePytest())
"""


def run_without_pytest(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", REFUSE_PYTEST + code], capture_output=True, text=True, check=False, timeout=120
    )


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_without_pytest(module: str) -> None:
    result = run_without_pytest(f"import importlib; importlib.import_module({module!r})")
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_tune_command_runs_without_pytest() -> None:
    result = run_without_pytest(
        "import sys; from pytest_vllm_mem.cli.main import main\n"
        "sys.argv = ['x', 'tune', '--help']\n"
        "try:\n    main(['tune', '--help'])\nexcept SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "assert 'pytest' not in sys.modules"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--max-startups" in result.stdout


def test_the_refusing_finder_does_refuse_pytest() -> None:
    # The check above can fail: an adapter module imported the same way is refused.
    result = run_without_pytest("import pytest_vllm_mem.plugin")
    assert result.returncode != 0 and "ImportError: pytest imported by" in result.stderr
