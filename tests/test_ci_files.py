"""The CI templates users copy: valid YAML, expressions that use only the contexts GitHub provides where they stand,
actions pinned to commits, no persisted credentials, minimal permissions, a baseline flow that reaches the
repository (run here against a local git remote and a stand-in `gh`), and zizmor clean (ci/lint-workflows.sh)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pytest_vllm_mem.settings import OPTIONS

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / "ci"
TEMPLATES = ["github-gpu.yml", "github-cpu.yml"]

# GitHub's "Context availability" table (docs.github.com, Actions > Contexts reference), for the keys the templates
# use: the contexts an expression may name there, and the special functions it may call.
_STEP = {"github", "needs", "strategy", "matrix", "job", "runner", "env", "vars", "secrets", "steps", "inputs"}
_STATUS = {"always", "cancelled", "success", "failure"}
CONTEXTS: dict[str, tuple[set[str], set[str]]] = {
    "run-name": ({"github", "inputs", "vars"}, set()),
    "concurrency": ({"github", "inputs", "vars"}, set()),
    "env": ({"github", "secrets", "inputs", "vars"}, set()),
    "jobs.concurrency": ({"github", "needs", "strategy", "matrix", "inputs", "vars"}, set()),
    "jobs.env": ({"github", "needs", "strategy", "matrix", "vars", "secrets", "inputs"}, set()),
    "jobs.if": ({"github", "needs", "vars", "inputs"}, _STATUS),
    "jobs.name": ({"github", "needs", "strategy", "matrix", "vars", "inputs"}, set()),
    "jobs.runs-on": ({"github", "needs", "strategy", "matrix", "vars", "inputs"}, set()),
    "jobs.strategy": ({"github", "needs", "vars", "inputs"}, set()),
    "jobs.timeout-minutes": ({"github", "needs", "strategy", "matrix", "vars", "inputs"}, set()),
    "jobs.steps.if": (_STEP - {"secrets"}, _STATUS | {"hashFiles"}),
    **{
        f"jobs.steps.{key}": (_STEP, {"hashFiles"})
        for key in ("run", "env", "name", "with", "timeout-minutes", "continue-on-error", "working-directory")
    },
}
FUNCTIONS = {"contains", "startsWith", "endsWith", "format", "join", "toJSON", "fromJSON"}
LITERALS = {"true", "false", "null"}
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CI / name).read_text())
    assert isinstance(data, dict)
    data["on"] = data.pop(True)  # YAML 1.1 reads the `on` key as True
    return data


def steps(workflow: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for job_id, job in workflow["jobs"].items():
        for step in job["steps"]:
            yield job_id, step


def names_used(expression: str) -> tuple[set[str], set[str]]:
    """(contexts, functions) an expression names: identifiers that start a property chain, outside strings."""
    code = re.sub(r"'(?:[^']|'')*'", "''", expression)
    contexts, functions = set(), set()
    for match in re.finditer(r"(?<![\w.-])([A-Za-z_][\w-]*)(\s*\()?", code):
        name, call = match.group(1), match.group(2)
        if call:
            functions.add(name)
        elif name not in LITERALS:
            contexts.add(name)
    return contexts, functions


def expressions(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """(docs key, expression) for every expression under `value`; an `if` is an expression without ${{ }} too."""
    if isinstance(value, dict):
        for child in value.values():
            yield from expressions(child, key)
    elif isinstance(value, list):
        for child in value:
            yield from expressions(child, key)
    elif isinstance(value, str):
        found = re.findall(r"\$\{\{(.*?)\}\}", value, re.DOTALL)
        if not found and key in ("jobs.if", "jobs.steps.if"):
            found = [value]
        for expression in found:
            yield key, expression


def workflow_expressions(workflow: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for key in ("run-name", "concurrency", "env"):
        if key in workflow:
            yield from expressions(workflow[key], key)
    for job in workflow["jobs"].values():
        for key, value in job.items():
            if key == "steps":
                for step in value:
                    for step_key, step_value in step.items():
                        yield from expressions(step_value, f"jobs.steps.{step_key}")
            elif key not in ("permissions", "needs"):
                yield from expressions(value, f"jobs.{key}")


def misplaced(workflow: dict[str, Any]) -> list[str]:
    problems = []
    for key, expression in workflow_expressions(workflow):
        assert key in CONTEXTS, f"no context table for {key}: add it from GitHub's docs"
        allowed_contexts, allowed_functions = CONTEXTS[key]
        contexts, functions = names_used(expression)
        for name in sorted(contexts - allowed_contexts):
            problems.append(f"{key}: {name!r} is not available in ${{{{{expression}}}}}")
        for name in sorted(functions - allowed_functions - FUNCTIONS):
            problems.append(f"{key}: {name}() is not available in ${{{{{expression}}}}}")
    return problems


@pytest.mark.parametrize("name", TEMPLATES)
def test_expressions_use_only_the_contexts_available_where_they_stand(name: str) -> None:
    assert misplaced(load(name)) == []


def test_the_context_check_rejects_what_github_rejects() -> None:
    """The old GPU template's job-level `concurrency: gpu-${{ runner.name }}`: GitHub has no runner context there."""
    workflow = {
        "jobs": {
            "a": {
                "concurrency": {"group": "gpu-${{ runner.name }}"},
                "if": "success() && env.X",
                "steps": [{"run": "echo ${{ hashFiles('x') }} '${{ matrix.tier }}'"}],
            }
        }
    }
    assert misplaced(workflow) == [
        "jobs.concurrency: 'runner' is not available in ${{ runner.name }}",
        "jobs.if: 'env' is not available in ${{success() && env.X}}",
    ]
    assert names_used(" github.event_name == 'push' && '--vllm-update-baseline' || '' ") == ({"github"}, set())


@pytest.mark.parametrize("name", TEMPLATES)
def test_actions_are_pinned_to_commits_with_the_version_named(name: str) -> None:
    text = (CI / name).read_text()
    uses = [step["uses"] for _, step in steps(load(name)) if "uses" in step]
    assert uses
    for ref in uses:
        assert SHA_PIN.match(ref), f"{ref}: pin to a full commit SHA"
        assert re.search(re.escape(ref) + r" # v\d+\.\d+\.\d+\n", text), f"{ref}: name its version in a comment"


@pytest.mark.parametrize("name", TEMPLATES)
def test_checkout_does_not_persist_credentials(name: str) -> None:
    checkouts = [step for _, step in steps(load(name)) if step.get("uses", "").startswith("actions/checkout@")]
    assert checkouts
    for step in checkouts:
        assert step["with"]["persist-credentials"] is False


@pytest.mark.parametrize("name", TEMPLATES)
def test_permissions_are_empty_by_default_and_granted_per_job(name: str) -> None:
    workflow = load(name)
    assert workflow["permissions"] == {}
    for job_id, job in workflow["jobs"].items():
        assert isinstance(job["permissions"], dict), job_id
        assert set(job["permissions"].values()) <= {"read", "write"}
        writes = {scope for scope, level in job["permissions"].items() if level == "write"}
        assert writes == ({"contents", "pull-requests"} if job_id == "baseline-pr" else set()), job_id


def test_gpu_workflow_runs_the_example_suite_per_tier() -> None:
    workflow = load("github-gpu.yml")
    job = workflow["jobs"]["serving"]
    assert job["strategy"]["matrix"]["tier"] == ["8gb", "16gb", "24gb"]
    assert "self-hosted" in job["runs-on"] and "gpu" in job["runs-on"]
    assert job["env"]["TIER"] == "${{ matrix.tier }}"
    commands = " ".join(step.get("run", "") for step in job["steps"])
    assert "pytest example_suite" in commands and '"--vllm-gpu=$TIER"' in commands
    assert "--vllm-baseline=" in commands and "--vllm-results=" in commands and "--vllm-markdown=" in commands
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in job["steps"])


def test_each_tier_runs_in_shards_that_a_merge_job_combines() -> None:
    workflow = load("github-gpu.yml")
    serving, merge = workflow["jobs"]["serving"], workflow["jobs"]["merge"]
    assert serving["strategy"]["matrix"]["shard"] == list(range(1, serving["env"]["SHARDS"] + 1))
    assert serving["env"]["SHARD"] == "${{ matrix.shard }}"
    command = next(step["run"] for step in serving["steps"] if "pytest" in step.get("run", ""))
    assert '"--vllm-shard=$SHARD/$SHARDS"' in command
    upload = next(step for step in serving["steps"] if step.get("name") == "Upload the shard's files")
    assert upload["with"]["name"] == "vllm-shard-${{ matrix.tier }}-${{ matrix.shard }}"
    paths = upload["with"]["path"].splitlines()
    for path in (
        "results/",
        "example_suite/baselines/${{ matrix.tier }}.json",
        "example_suite/baselines/calibration.json",
    ):
        assert path in paths
    assert merge["needs"] == "serving" and merge["strategy"]["matrix"]["tier"] == serving["strategy"]["matrix"]["tier"]
    download = next(step for step in merge["steps"] if step.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"] == {"pattern": "vllm-shard-${{ matrix.tier }}-*", "path": "shards"}
    script = next(step["run"] for step in merge["steps"] if "run" in step)
    assert "-m pytest_vllm_mem merge . shards/vllm-shard-*" in script


def test_path_options_in_the_templates_use_the_equals_form() -> None:
    """`--vllm-baseline /abs/path` would count as a test path for pytest's rootdir (issue 17)."""
    flags = [item.flag for item in OPTIONS if item.kind != "bool"]
    for name in TEMPLATES:
        for _, step in steps(load(name)):
            for flag in flags:
                for match in re.finditer(re.escape(flag) + r"(.)", step.get("run", "")):
                    assert match.group(1) == "=", f"{name}: {flag} without '='"


def test_a_push_to_main_records_baselines_and_opens_a_pull_request() -> None:
    workflow = load("github-gpu.yml")
    assert workflow["on"]["push"]["branches"] == ["main"]
    serving = workflow["jobs"]["serving"]
    assert serving["env"]["UPDATE_BASELINE"] == "${{ github.event_name == 'push' && '--vllm-update-baseline' || '' }}"
    command = next(step["run"] for step in serving["steps"] if "pytest" in step.get("run", ""))
    assert '"--vllm-baseline=example_suite/baselines/$TIER.json"' in command and "$UPDATE_BASELINE" in command
    merge = workflow["jobs"]["merge"]  # the shards' baseline files, merged into the repository's
    upload = next(step for step in merge["steps"] if step.get("name") == "Upload the recorded baseline")
    assert "github.event_name == 'push'" in upload["if"]
    assert upload["with"]["name"] == "vllm-baseline-${{ matrix.tier }}"
    assert upload["with"]["path"] == "example_suite/baselines/${{ matrix.tier }}.json"
    pr = workflow["jobs"]["baseline-pr"]
    assert pr["needs"] == "merge" and "github.event_name == 'push'" in pr["if"]
    download = next(step for step in pr["steps"] if step.get("uses", "").startswith("actions/download-artifact@"))
    assert download["with"] == {"pattern": "vllm-baseline-*", "path": "recorded"}
    assert (
        "concurrency" in workflow
        and workflow["concurrency"]["cancel-in-progress"] == "${{ github.event_name == 'pull_request' }}"
    )  # a started run on main is never cancelled: it records


# ---- the baseline-pr script, run against a local remote and a stand-in gh -----------------------------------------

FAKE_GH = """#!/bin/sh
# Stands in for the GitHub CLI: records its arguments; `pr list` answers with $FAKE_OPEN_PR.
echo "$*" >> "$FAKE_GH_LOG"
if [ "$1 $2" = "pr list" ]; then echo "$FAKE_OPEN_PR"; fi
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A clone of a repository (its origin a local bare one) on main, as actions/checkout leaves it."""
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "--quiet", "--bare", "-b", "main", str(origin))
    work = tmp_path / "work"
    git(tmp_path, "clone", "--quiet", str(origin), str(work))
    (work / "example_suite" / "baselines").mkdir(parents=True)
    (work / "example_suite" / "baselines" / "8gb.json").write_text('{"old": 1}\n')
    git(work, "add", ".")
    git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "start")
    git(work, "push", "--quiet", "origin", "HEAD:main")
    return work


def run_baseline_pr(work: Path, tmp_path: Path, recorded: dict[str, str], open_pr: str = "") -> tuple[str, list[str]]:
    """Lay out the downloaded artifacts as download-artifact does, run the step's script; (output, gh calls)."""
    for tier, text in recorded.items():
        folder = work / "recorded" / f"vllm-baseline-{tier}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{tier}.json").write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "gh").write_text(FAKE_GH)
    (bin_dir / "gh").chmod(0o755)
    log = tmp_path / "gh.log"
    log.unlink(missing_ok=True)
    job = load("github-gpu.yml")["jobs"]["baseline-pr"]
    script = next(step["run"] for step in job["steps"] if "run" in step)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_GH_LOG": str(log),
        "FAKE_OPEN_PR": open_pr,
        "BRANCH": job["env"]["BRANCH"],
        "GITHUB_SHA": git(work, "rev-parse", "HEAD").strip(),
        "GITHUB_REF_NAME": "main",
        "GITHUB_SERVER_URL": "https://github.example",
        "GITHUB_REPOSITORY": "o/r",
        "GITHUB_RUN_ID": "42",
        "GIT_CONFIG_GLOBAL": str(tmp_path / "gitconfig"),
    }
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(work / "recorded")
    return done.stdout, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_recorded_baselines_reach_a_pull_request_branch(checkout: Path, tmp_path: Path) -> None:
    origin = tmp_path / "origin.git"
    _, calls = run_baseline_pr(checkout, tmp_path, {"8gb": '{"new": 8}\n', "24gb": '{"new": 24}\n'})
    assert git(origin, "show", "vllm-mem/baselines:example_suite/baselines/8gb.json") == '{"new": 8}\n'
    assert git(origin, "show", "vllm-mem/baselines:example_suite/baselines/24gb.json") == '{"new": 24}\n'
    assert git(origin, "show", "main:example_suite/baselines/8gb.json") == '{"old": 1}\n'  # main changes by review
    assert calls[0] == "auth setup-git"
    assert calls[1].startswith("pr list --head vllm-mem/baselines --state open")
    assert calls[2].startswith("pr create --head vllm-mem/baselines --base main --title")
    assert "https://github.example/o/r/actions/runs/42" in calls[2]

    # A later push with the pull request still open: the branch moves, the pull request gets a comment.
    _, calls = run_baseline_pr(checkout, tmp_path, {"8gb": '{"newer": 8}\n'}, open_pr="7")
    assert git(origin, "show", "vllm-mem/baselines:example_suite/baselines/8gb.json") == '{"newer": 8}\n'
    assert calls[-1].startswith("pr comment vllm-mem/baselines --body")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_unchanged_baselines_open_no_pull_request(checkout: Path, tmp_path: Path) -> None:
    output, calls = run_baseline_pr(checkout, tmp_path, {"8gb": '{"old": 1}\n'})
    assert "no pull request" in output and calls == []
    assert "vllm-mem/baselines" not in git(tmp_path / "origin.git", "branch", "--list")


# ---- zizmor ---------------------------------------------------------------------------------------------------------


def lint(*files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CI / "lint-workflows.sh"), *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_templates_are_zizmor_clean() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No findings" in done.stdout


def test_zizmor_rejects_an_unpinned_template(tmp_path: Path) -> None:
    """The check can fail: the GPU template as it was (tag-pinned actions, persisted credentials, no permissions)."""
    old = tmp_path / "old.yml"
    old.write_text(
        "name: x\non: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n      - uses: actions/checkout@v4\n"
    )
    done = lint(str(old))
    assert done.returncode != 0
    assert "unpinned-uses" in done.stdout and "artipacked" in done.stdout and "excessive-permissions" in done.stdout


def test_cpu_workflow_runs_the_readme_test_command_and_the_lint() -> None:
    workflow = load("github-cpu.yml")
    assert [step.get("run") for step in workflow["jobs"]["tests"]["steps"] if "run" in step] == ["bash ci/test.sh"]
    assert [step.get("run") for step in workflow["jobs"]["workflows"]["steps"] if "run" in step] == [
        "bash ci/lint-workflows.sh"
    ]


def test_ci_entry_point_calls_the_readme_test_command_only() -> None:
    run = (CI.parent / ".ci" / "run").read_text()
    lines = [line for line in run.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == "exec bash ci/test.sh"
