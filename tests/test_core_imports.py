"""The core (every module outside plugin/: the vocabulary, diagnosis, memory, baseline, plan, launch, load, tune, the
CLI) imports and runs without pytest; only the pytest adapter (plugin/) needs it. The import-linter contracts in
pyproject.toml say the same statically; this runs the imports."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest


def _core_modules() -> tuple[str, ...]:
    """Every module of the package outside the pytest adapter (plugin/), found in the tree: a new module is covered
    without being listed."""
    import pytest_vllm_mem

    found = ["pytest_vllm_mem"]
    for info in pkgutil.walk_packages(pytest_vllm_mem.__path__, "pytest_vllm_mem."):
        if info.name != "pytest_vllm_mem.plugin" and not info.name.startswith("pytest_vllm_mem.plugin."):
            found.append(info.name)
    return tuple(found)


CORE_MODULES = _core_modules()


def test_the_core_covers_every_package_but_the_adapter() -> None:
    packages = {name.split(".")[1] for name in CORE_MODULES if name.count(".") >= 1}
    expected = {"baseline", "cli", "diagnosis", "launch", "load", "memory", "plan", "tune", "settings", "progress"}
    assert expected <= packages and "plugin" not in packages


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
