"""Every command-line option and ini key of the plugin, read once into a typed Settings object.

The option table is the Settings dataclass itself: each field carries its help, kind and default (`option(...)`), and
`OPTIONS`, the pytest options and ini keys (plugin/options.py) and `Settings.from_values` are derived from the fields.
Adding an option is one field. No pytest here: the tune command and the core read Settings too.

CLI options default to None so that an ini value is not shadowed by a CLI default (a common complaint about pytest
plugins); the built-in default applies only when neither is given.

Relative paths resolve like pytest's own options: from the command line against the folder pytest was invoked from,
from an ini file against that file's folder, built-in defaults against the rootdir.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pytest_vllm_mem.baseline.noise import ALPHAS, CONFIRM_SESSIONS, DEFAULT_ALPHA

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
        "the suite's false-alarm budget for the throughput and latency gate: the expected number of false failures "
        "in a healthy run, shared out over the tests that run loads (Bonferroni over families); "
        f"{', '.join(map(str, ALPHAS[:-1]))} or {ALPHAS[-1]} "
        "(lower: fewer false failures, more regressions let through)",
        "float",
        DEFAULT_ALPHA,
        choices=ALPHAS,
    )
    vllm_confirm_sessions: int = option(
        "fresh servers a suspect throughput or latency verdict, or a memory peak just over its band, is re-measured on "
        "before the gate decides (the same config started anew, the test's load run again; stops early once nothing "
        "is suspect): 0 (off), 1, 2 or 3",
        "int",
        CONFIRM_SESSIONS,
        choices=(0, 1, 2, 3),
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
    vllm_shard: str | None = option(
        "run only shard K/N of the suite (e.g. 1/2 and 2/2 on two CI runners): a split that every runner computes "
        "alike, the tests of one vllm_config in one shard; combine the shards' files with `python -m "
        "pytest_vllm_mem merge`"
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
    vllm_cluster: str = option(
        "where servers run: local (subprocesses of pytest), ray (the Ray cluster $RAY_ADDRESS names, else the one "
        "`ray start` left on this machine) or ray://HOST:PORT; needs pytest-vllm-mem[ray]",
        default="local",
    )
    vllm_progress: str = option(
        "live progress of each server startup and load: auto (one updating status line on a terminal, plain lines "
        "in CI logs), line, plain or off; -q shows outcomes only, -v every phase",
        default="auto",
    )

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

        return cls.resolve(given, base)

    @classmethod
    def resolve(cls, given: Callable[[Option], Given | None], default_base: Path) -> Settings:
        """Each option from `given` (None: not given), else its built-in default (relative to `default_base`)."""
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
        # A list of accepted values says all (--vllm-confirm-sessions accepts 0: off); otherwise a number is > 0.
        if not self.choices and isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
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
