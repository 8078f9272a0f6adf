"""The plugin's options in pytest: registered from settings.OPTIONS, read into one Settings (command line beats ini,
ini beats the built-in default), the plugin's UsageError turned into pytest's, and the refusal of a run whose rootdir
an option's value moved."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from pytest_vllm_mem.settings import OPTIONS, Given, Option, Settings, UsageError


def settings_from_pytest(config: pytest.Config) -> Settings:
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

    return Settings.resolve(given, Path(config.rootpath))


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
