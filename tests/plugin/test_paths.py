"""Where relative paths land (issue 17): from the command line against the folder pytest was invoked from, from an ini
file against that file's folder, built-in defaults against the rootdir; and a `--opt /abs/path` that would move
pytest's rootdir is refused before anything is written.

The layout used: `proj/` holds the ini file, `proj/tests/` the tests and is where pytest is invoked from, and
`--rootdir` points elsewhere where a test needs the three folders apart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from stubs.helpers import STUB_ENV, stub_args

from pytest_vllm_mem.plugin.options import settings_from_pytest
from pytest_vllm_mem.settings import OPTIONS, Settings

PATH_OPTIONS = [item for item in OPTIONS if item.kind == "path"]


def layout(pytester: pytest.Pytester, ini: str = "") -> tuple[Path, Path]:
    """(project folder with the ini, tests folder), and chdir into the tests folder."""
    project = pytester.path / "proj"
    tests = project / "tests"
    tests.mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\n" + ini)
    (tests / "test_x.py").write_text("def test_a():\n    pass\n")
    os.chdir(tests)  # pytester restores the working directory after the test
    return project, tests


def settings(pytester: pytest.Pytester, *args: str) -> Settings:
    return settings_from_pytest(pytester.parseconfig(*args))


@pytest.mark.parametrize("form", ["space", "equals"])
@pytest.mark.parametrize("name", [item.name for item in PATH_OPTIONS])
def test_a_relative_command_line_path_resolves_against_the_invocation_folder(
    pytester: pytest.Pytester, name: str, form: str
) -> None:
    project, tests = layout(pytester)
    flag = "--" + name.replace("_", "-")
    given = [flag, "out/x"] if form == "space" else [f"{flag}=out/x"]
    resolved = getattr(settings(pytester, "test_x.py", *given), name)
    assert resolved == tests / "out" / "x"
    assert resolved != project / "out" / "x"  # the rootdir (proj, where the ini is) is not the base


@pytest.mark.parametrize("form", ["space", "equals"])
@pytest.mark.parametrize("name", [item.name for item in PATH_OPTIONS])
def test_an_absolute_path_outside_the_project_is_kept_in_the_equals_form(
    pytester: pytest.Pytester, name: str, form: str
) -> None:
    layout(pytester)
    outside = pytester.path / "elsewhere"  # not created: pytest ignores paths that do not exist
    flag = "--" + name.replace("_", "-")
    given = [flag, str(outside)] if form == "space" else [f"{flag}={outside}"]
    assert getattr(settings(pytester, "test_x.py", *given), name) == outside


@pytest.mark.parametrize("name", [item.name for item in PATH_OPTIONS])
def test_an_ini_path_resolves_against_the_ini_folder(pytester: pytest.Pytester, name: str) -> None:
    project, _ = layout(pytester, f"{name} = from-ini/x\n")
    elsewhere = pytester.path / "root"
    elsewhere.mkdir()
    resolved = getattr(settings(pytester, "test_x.py", f"--rootdir={elsewhere}"), name)
    assert resolved == project / "from-ini" / "x"


def test_defaults_resolve_against_the_rootdir(pytester: pytest.Pytester) -> None:
    project, _ = layout(pytester)
    resolved = settings(pytester, "test_x.py")
    assert resolved.vllm_baseline == project / ".vllm-mem" / "baselines.json"
    assert resolved.vllm_log_dir == project / ".vllm-mem" / "logs"


def test_home_is_expanded(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    layout(pytester)
    monkeypatch.setenv("HOME", str(pytester.path / "home"))
    assert settings(pytester, "test_x.py", "--vllm-results=~/r.json").vllm_results == pytester.path / "home/r.json"


# ---- a value that moves pytest's rootdir ----------------------------------------------------------------------------


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def outside_interpreter(pytester: pytest.Pytester) -> Path:
    """An existing file in a folder of its own next to the project, as /opt/venv/bin/python is."""
    python = pytester.path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    return python


@pytest.mark.parametrize("case", ["venv-in-another-project", "no-ini", "value-before-the-tests"])
def test_a_spaced_value_that_would_move_the_rootdir_is_a_usage_error(pytester: pytest.Pytester, case: str) -> None:
    project, tests = layout(pytester)
    python = outside_interpreter(pytester)
    args = ["test_x.py", "--vllm-python", str(python), "--vllm-results", "r.json"]
    if case == "no-ini":  # the rootdir becomes the common ancestor of the tests and the interpreter
        (project / "pytest.ini").unlink()
    else:  # the venv lives in another project: pytest finds that project's ini first and roots the run there
        (python.parent.parent / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
        if case == "venv-in-another-project":
            (project / "pytest.ini").unlink()
        else:
            args = args[1:] + args[:1]
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    output = result.stderr.str()
    assert f"--vllm-python {python}: pytest read the value as a test path" in output
    assert f"--vllm-python={python}" in output and "Traceback" not in output
    assert not (tests / "r.json").exists()


def test_the_equals_form_of_the_same_value_runs(pytester: pytest.Pytester) -> None:
    layout(pytester)
    python = outside_interpreter(pytester)
    result = run(pytester, "test_x.py", f"--vllm-python={python}", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["test_x.py::test_a PASSED*"])  # the test id is the one without the option


def test_a_spaced_value_pytest_does_not_root_on_is_accepted(pytester: pytest.Pytester) -> None:
    """With the project's ini nearer the tests than the value, pytest keeps the right rootdir: nothing to refuse."""
    layout(pytester)
    cache = pytester.path / "cache"
    cache.mkdir()
    result = run(
        pytester, "test_x.py", "--vllm-cache-dir", str(cache), "--vllm-log-dir", "logs", "-v", "--vllm-gpu=24gb"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["test_x.py::test_a PASSED*"])


# ---- end to end: the baseline and results files of a run on the stub server ----------------------------------------

STUB_TEST = """
import pytest
from pytest_vllm_mem import VLLMConfig

OK = VLLMConfig("stub-model", env={"VLLM_STUB": "fake_server.py"}, max_model_len=1024)

@pytest.mark.parametrize("vllm_config", [OK], ids=["ok"])
def test_serves(vllm_server, vllm_load):
    assert vllm_load(num_prompts=4, concurrency=2, max_tokens=4).ok
"""


@pytest.mark.parametrize("form", ["space", "equals"])
def test_baseline_and_results_land_in_the_invocation_folder(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    project, tests = layout(pytester)
    (tests / "test_x.py").write_text(STUB_TEST)
    for key, value in STUB_ENV.items():
        monkeypatch.setenv(key, value)

    common = [*stub_args(pytester.path / "cache"), "--vllm-log-dir=logs", "-p", "no:cacheprovider", "test_x.py"]
    first = pytester.runpytest_subprocess(
        *common, *written(form, results="r.json", baseline="b.json"), "--vllm-update-baseline", timeout=120
    )
    first.assert_outcomes(passed=1)
    written_line = [line for line in first.stdout.lines if line.startswith("baseline: wrote 1 entries")]
    assert written_line and written_line[0].endswith(f" to {tests / 'b.json'}")
    results = json.loads((tests / "r.json").read_text())
    assert [t["test_id"] for t in results["tests"]] == ["tests/test_x.py::test_serves[ok]"]
    assert "tests/test_x.py::test_serves[ok]" in (tests / "b.json").read_text()
    assert not (project / "r.json").exists() and not (project / "b.json").exists()

    # The next run, in the other form, compares with that entry: the same file and the same test id.
    other = "equals" if form == "space" else "space"
    second = pytester.runpytest_subprocess(
        *common, *written(other, results="r2.json", baseline="b.json"), "--vllm-require-baseline", timeout=120
    )
    # It found the entry (--vllm-require-baseline fails a test without one); it may still fail on the stub's
    # throughput noise, a comparison all the same.
    assert "no baseline" not in second.stdout.str(), second.stdout.str()
    assert json.loads((tests / "r2.json").read_text())["tests"][0]["test_id"] == "tests/test_x.py::test_serves[ok]"


def written(form: str, **paths: str) -> list[str]:
    """`--vllm-NAME value` or `--vllm-NAME=value` for each path."""
    args: list[str] = []
    for name, value in paths.items():
        args += [f"--vllm-{name}", value] if form == "space" else [f"--vllm-{name}={value}"]
    return args
