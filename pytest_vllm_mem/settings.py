"""Every command-line option and ini key of the plugin, read once into a typed Settings object.

The option table is the Settings dataclass itself: each field carries its help, kind and default (`option(...)`), and
`OPTIONS`, the pytest options, the ini keys and `Settings.from_values` are derived from the fields. Adding an option is
one field.

CLI options default to None so that an ini value is not shadowed by a CLI default (a common complaint about pytest
plugins); the built-in default applies only when neither is given.

Relative paths resolve like pytest's own options: from the command line against the folder pytest was invoked from,
from an ini file against that file's folder, built-in defaults against the rootdir.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pytest_vllm_mem.baseline.noise import ALPHAS, DEFAULT_ALPHA

if TYPE_CHECKING:  # pytest only in annotations: the tune command and the core use Settings without pytest
    import pytest

Kind = Literal["str", "bool", "float", "int", "path"]


class UsageError(Exception):
    """Bad plugin input: one paragraph naming the input and what is accepted.

    A plain exception (pytest.UsageError is final): `usage_errors_to_pytest` turns it into pytest's own at the hooks,
    so that pytest shows the one paragraph and exits 4."""


def option(
    help: str,
    kind: Kind = "str",
    default: object = None,
    fallback: Callable[[], object] | None = None,
    choices: tuple[object, ...] = (),
) -> Any:
    """A Settings field that is also a plugin option (`--vllm-x` and ini key `vllm_x`).

    `default` is the built-in value, given as a user would write it (it goes through the same conversion);
    `fallback` computes one when there is no default to write down (the running interpreter); `choices`, when
    given, are the only values accepted (after conversion)."""
    return dataclasses.field(metadata={"option": (help, kind, default, fallback, choices)})


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-vllm-mem"


def _running_python() -> str:
    return sys.executable


@dataclass(frozen=True)
class Settings:
    vllm_model: str = option(
        "model served by the default vllm_config: a model name, a local folder, or 'tiny' (the built-in "
        "random-weight model, built offline on first use)",
        default="tiny",
    )
    vllm_model_override: str | None = option(
        "serve every config with this model instead of its own (e.g. 'tiny' to run a GPU suite on the CPU); the "
        "report shows both"
    )
    vllm_gpu: str = option(
        "GPU memory tier this run represents: 8gb, 16gb, 24gb, 40gb, 80gb, NNgb (10^9 bytes), NNgib or auto (the "
        "device's total memory)",
        default="auto",
    )
    vllm_results: Path | None = option("write every measured figure to this JSON file", "path")
    vllm_markdown: Path | None = option(
        "write the summary table as markdown to this file (also appended to $GITHUB_STEP_SUMMARY when set)", "path"
    )
    vllm_plots: Path | None = option(
        "write one memory-timeline PNG per server to this folder (needs matplotlib)", "path"
    )
    vllm_baseline: Path = option(
        "baseline file compared against (and written by --vllm-update-baseline)",
        "path",
        default=".vllm-mem/baselines.json",
    )
    vllm_update_baseline: bool = option("write/refresh baseline entries for the tests that ran", "bool", False)
    vllm_tolerance: str = option(
        "per-metric tolerances, e.g. 'output_throughput=15%,load_peak_memory=256MiB'", default=""
    )
    vllm_gate_alpha: float = option(
        "one-sided level of the throughput and latency gate once the baseline file keeps 2 or more earlier sessions: "
        f"the chance that a healthy run fails one gated metric; {', '.join(map(str, ALPHAS[:-1]))} or {ALPHAS[-1]} "
        "(lower: fewer false failures, more regressions let through)",
        "float",
        DEFAULT_ALPHA,
        choices=ALPHAS,  # the levels noise.py's t table has
    )
    vllm_strict: bool = option("also fail tests that improved beyond tolerance (baseline out of date)", "bool", False)
    vllm_require_baseline: bool = option("fail tests that have no baseline entry", "bool", False)
    vllm_startup_timeout: float = option("seconds a server may take to become healthy", "float", 600.0)
    vllm_sample_period: float | None = option(
        "memory sampling period in seconds (default: 0.05 on GPUs; 0.25 on CPU, where each sample holds the peak "
        "since the previous one)",
        "float",
    )
    vllm_max_servers: int = option(
        "servers kept running at once for reuse (1: stop one before starting the next)", "int", 1
    )
    vllm_keep_order: bool = option(
        "run tests in collection order; by default tests of the same vllm_config run one after another, so each "
        "config's server starts once",
        "bool",
        False,
    )
    vllm_gpus_per_worker: int = option(
        "GPUs each pytest-xdist worker takes (CUDA_VISIBLE_DEVICES), e.g. 2 for tensor_parallel_size=2 configs",
        "int",
        1,
    )
    vllm_cache_dir: Path = option(
        "persistent folder for vLLM's compile cache, the tiny model and vLLM's flag table",
        "path",
        fallback=default_cache_dir,
    )
    vllm_log_dir: Path = option("folder for server logs", "path", default=".vllm-mem/logs")
    vllm_python: str = option("interpreter that runs vLLM (default: the one running pytest)", fallback=_running_python)
    vllm_preflight: bool = option(
        "plan every config on its tier without starting servers: configs predicted to fit pass unmeasured "
        "(reported as planned), others fail with the predicted kind and the plan's figures",
        "bool",
        False,
    )
    vllm_progress: str = option(
        "live progress of each server startup and load: auto (one updating status line on a terminal, plain lines "
        "in CI logs), line, plain or off; -q shows outcomes only, -v every phase",
        default="auto",
    )

    @classmethod
    def from_pytest(cls, config: pytest.Config) -> Settings:
        """The command line beats the ini, the ini beats the built-in default."""
        _refuse_a_misrooted_run(config)
        invocation_dir = Path(config.invocation_params.dir)
        ini_dir = config.inipath.parent if config.inipath is not None else Path(config.rootpath)

        def given(item: Option) -> Given | None:
            raw = config.getoption(item.name)
            if raw is not None:
                return Given(raw, item.flag, invocation_dir)
            raw = config.getini(item.name)
            if raw in (None, "", []):
                return None
            return Given(raw, f"ini {item.name}", ini_dir)

        return cls._resolve(given, Path(config.rootpath))

    @classmethod
    def from_values(cls, values: Mapping[str, object], base: Path) -> Settings:
        """Settings outside pytest (the tune command, benchmarks): the given values as if from the command line
        (relative paths against `base`), the built-in defaults for the rest."""
        unknown = set(values) - {item.name for item in OPTIONS}
        if unknown:
            raise TypeError(f"not plugin options: {sorted(unknown)}")

        def given(item: Option) -> Given | None:
            raw = values.get(item.name)
            return None if raw is None else Given(raw, item.flag, base)

        return cls._resolve(given, base)

    @classmethod
    def _resolve(cls, given: Callable[[Option], Given | None], default_base: Path) -> Settings:
        values: dict[str, object] = {}
        for item in OPTIONS:
            found = given(item)
            if found is None and item.default is not None:
                found = Given(item.default, f"default {item.name}", default_base)
            if found is not None:
                values[item.name] = item.convert(found)
            else:
                values[item.name] = item.fallback() if item.fallback is not None else None
        return cls(**values)  # type: ignore[arg-type]  # each value converted to its field's kind


@dataclass(frozen=True)
class Given:
    """One raw option value, where it came from (for error messages), and the folder a relative path means."""

    raw: object
    source: str
    base: Path


@dataclass(frozen=True)
class Option:
    name: str  # field, ini key and dest: vllm_gpu -> --vllm-gpu
    help: str
    kind: Kind
    default: object
    fallback: Callable[[], object] | None
    choices: tuple[object, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def convert(self, given: Given) -> object:
        raw = given.raw
        try:
            value = _CONVERTERS[self.kind](raw, given.base)
        except (TypeError, ValueError):
            expected = "a number" if self.kind in ("int", "float") else self.kind
            raise UsageError(f"{given.source}={raw!r}: expected {expected} ({self.help}).") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            raise UsageError(f"{given.source}={raw!r}: must be greater than 0 ({self.help}).")
        if self.choices and value not in self.choices:
            accepted = ", ".join(str(choice) for choice in self.choices)
            raise UsageError(f"{given.source}={raw!r}: accepted values are {accepted} ({self.help}).")
        return value


def _path(raw: object, base: Path) -> Path:
    path = Path(os.path.expanduser(str(raw)))
    return path if path.is_absolute() else base / path


def _bool(raw: object, base: Path) -> bool:
    return raw if isinstance(raw, bool) else str(raw).strip().lower() in ("1", "true", "yes", "on")


def _float(raw: object, base: Path) -> float:
    if not isinstance(raw, (str, int, float)):
        raise TypeError(raw)
    return float(raw)


def _int(raw: object, base: Path) -> int:
    if not isinstance(raw, (str, int)):
        raise TypeError(raw)
    return int(raw)


_CONVERTERS: dict[str, Callable[[object, Path], object]] = {
    "str": lambda raw, base: str(raw),
    "bool": _bool,
    "float": _float,
    "int": _int,
    "path": _path,
}

OPTIONS: tuple[Option, ...] = tuple(Option(f.name, *f.metadata["option"]) for f in dataclasses.fields(Settings))


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-mem", "vLLM memory and serving regression tests (pytest-vllm-mem)")
    for item in OPTIONS:
        # Argparse %-formats option help, so the '15%' in --vllm-tolerance's help crashed `pytest --help`.
        cli_help = item.help.replace("%", "%%")
        if item.kind == "bool":
            group.addoption(item.flag, action="store_true", default=None, dest=item.name, help=cli_help)
            parser.addini(item.name, item.help, type="bool", default=item.default)
        else:
            group.addoption(item.flag, default=None, dest=item.name, help=cli_help)
            parser.addini(item.name, item.help, type="string", default=None)


@contextmanager
def usage_errors_to_pytest() -> Iterator[None]:
    """Around a hook's body: the plugin's UsageError becomes pytest's, which pytest shows as one paragraph (exit
    code 4) instead of an internal error with a traceback."""
    import pytest

    try:
        yield
    except UsageError as error:
        raise pytest.UsageError(str(error)) from None


# ---- a rootdir chosen from an option's value ----------------------------------------------------------------------
# pytest picks its rootdir from the command line's paths before any plugin's options are known, so in
# `pytest test_x.py --vllm-python /opt/venv/bin/python` the interpreter counts as a test path: the rootdir becomes a
# common ancestor (`/`) or a project above the venv, and the test ids (the baseline's keys) change with it. The plugin
# cannot undo that choice, so it refuses the run and names the fix.

_CONFIG_FILES = (
    "pytest.ini",
    ".pytest.ini",
    "pytest.toml",
    ".pytest.toml",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
    "setup.py",
)


def _spaced_values(args: Sequence[str]) -> list[tuple[str, str]]:
    """(flag, value) for each plugin option that takes a value and was written `--flag value` in `args`."""
    flags = {item.flag for item in OPTIONS if item.kind != "bool"}
    pairs = []
    for index, arg in enumerate(args[:-1]):
        if arg == "--":
            break
        if arg in flags:
            pairs.append((arg, args[index + 1]))
    return pairs


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _honest_root(invocation_dir: Path, test_args: Sequence[str]) -> Path:
    """The common folder of the invocation folder and the test paths: where pytest starts looking for its rootdir."""
    dirs = [invocation_dir]
    for arg in test_args:
        path = Path(os.path.abspath(invocation_dir / arg.split("::")[0]))
        if path.exists():
            dirs.append(path if path.is_dir() else path.parent)
    return Path(os.path.commonpath([str(d) for d in dirs]))


def _is_first_config_above(rootpath: Path, honest: Path, inipath: Path | None) -> bool:
    """Whether `rootpath` holds a pytest config file and is the nearest folder at or above `honest` with one."""
    has_config = (inipath is not None and Path(os.path.abspath(inipath)).parent == rootpath) or (
        rootpath / "setup.py"
    ).is_file()
    if not has_config or not _within(honest, rootpath):
        return False
    between = [folder for folder in (honest, *honest.parents) if folder != rootpath and _within(folder, rootpath)]
    return not any((folder / name).exists() for folder in between for name in _CONFIG_FILES)


def misrooting_values(config: pytest.Config) -> list[tuple[str, str]]:
    """The `--flag value` pairs whose value moved pytest's rootdir: an existing path outside the folder the tests
    and the invocation share, inside the rootdir pytest chose, with no pytest config file nearer the tests."""
    if config.getoption("rootdir", None) or config.getoption("inifilename", None):
        return []  # --rootdir or -c decide the rootdir, not the paths
    args = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *config.invocation_params.args]
    # pytest compares absolute paths without resolving symlinks (a venv's bin/python is one): so does this.
    invocation_dir = Path(os.path.abspath(config.invocation_params.dir))
    rootpath = Path(os.path.abspath(config.rootpath))
    honest = _honest_root(invocation_dir, config.getoption("file_or_dir", None) or [])
    if _is_first_config_above(rootpath, honest, config.inipath):
        return []  # what pytest finds from the tests alone, whatever the values
    found = []
    for flag, value in _spaced_values(args):
        path = Path(os.path.abspath(invocation_dir / os.path.expanduser(value)))
        if not path.exists():
            continue  # pytest ignores paths that do not exist
        folder = path if path.is_dir() else path.parent
        if _within(folder, rootpath) and not _within(folder, honest):
            found.append((flag, value))
    return found


def _refuse_a_misrooted_run(config: pytest.Config) -> None:
    pairs = misrooting_values(config)
    if not pairs:
        return
    written = ", ".join(f"{flag} {value}" for flag, value in pairs)
    fixed = " ".join(f"{flag}={value}" for flag, value in pairs)
    raise UsageError(
        f"{written}: pytest read the value as a test path before the plugin's options were loaded and chose the "
        f"rootdir {config.rootpath} from it, so test ids (the keys of the baseline file) and the default paths would "
        f"be wrong. Write the option with an equals sign ({fixed}), or give --rootdir."
    )
