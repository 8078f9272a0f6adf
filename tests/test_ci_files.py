"""The CI templates users copy are valid YAML with the jobs and commands the README describes."""

from __future__ import annotations

from pathlib import Path

import yaml

CI = Path(__file__).resolve().parent.parent / "ci"


def load(name: str) -> dict:
    return yaml.safe_load((CI / name).read_text())


def test_gpu_workflow_runs_the_example_suite_per_tier() -> None:
    workflow = load("github-gpu.yml")
    job = workflow["jobs"]["serving"]
    assert job["strategy"]["matrix"]["tier"] == ["8gb", "16gb", "24gb"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    commands = " ".join(step.get("run", "") for step in job["steps"])
    assert "pytest example_suite" in commands and "--vllm-gpu=${{ matrix.tier }}" in commands
    assert "--vllm-baseline=" in commands and "--vllm-results=" in commands and "--vllm-markdown=" in commands
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in job["steps"])


def test_cpu_workflow_runs_the_readme_test_command() -> None:
    workflow = load("github-cpu.yml")
    commands = [step.get("run", "") for step in workflow["jobs"]["tests"]["steps"]]
    assert "bash ci/test.sh" in commands


def test_ci_entry_point_calls_the_readme_test_command_only() -> None:
    run = (CI.parent / ".ci" / "run").read_text()
    lines = [line for line in run.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == "exec bash ci/test.sh"
