"""Every command-line option and ini key of the plugin, read once into a typed Settings object.

CLI options default to None so that an ini value is not shadowed by a CLI default (a common complaint about pytest
plugins); the built-in default applies only when neither is given.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest


@dataclass(frozen=True)
class Option:
    name: str  # ini key and dest: vllm_gpu -> --vllm-gpu
    help: str
    default: Any = None
    kind: str = "str"  # str, bool, float, int, path

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS = [
    Option("vllm_model", "model served by the default vllm_config: a model name, a local folder, or 'tiny' "
           "(the built-in random-weight model, built offline on first use)", "tiny"),
    Option("vllm_model_override", "serve every config with this model instead of its own (e.g. 'tiny' to run a GPU "
           "suite on the CPU); the report shows both"),
    Option("vllm_gpu", "GPU memory tier this run represents: 8gb, 16gb, 24gb, 40gb, 80gb, NNgb (10^9 bytes), NNgib "
           "or auto (the device's total memory)", "auto"),
    Option("vllm_results", "write every measured figure to this JSON file", kind="path"),
    Option("vllm_markdown", "write the summary table as markdown to this file (also appended to "
           "$GITHUB_STEP_SUMMARY when set)", kind="path"),
    Option("vllm_plots", "write one memory-timeline PNG per server to this folder (needs matplotlib)", kind="path"),
    Option("vllm_baseline", "baseline file compared against (and written by --vllm-update-baseline)",
           ".vllm-mem/baselines.json", kind="path"),
    Option("vllm_update_baseline", "write/refresh baseline entries for the tests that ran", False, kind="bool"),
    Option("vllm_tolerance", "per-metric tolerances, e.g. 'output_throughput=15%,load_peak_memory=256MiB'", ""),
    Option("vllm_strict", "also fail tests that improved beyond tolerance (baseline out of date)", False, kind="bool"),
    Option("vllm_require_baseline", "fail tests that have no baseline entry", False, kind="bool"),
    Option("vllm_startup_timeout", "seconds a server may take to become healthy", 600.0, kind="float"),
    Option("vllm_sample_period", "memory sampling period in seconds (default: 0.05 on GPUs; 0.25 on CPU, where each "
           "sample holds the peak since the previous one)", kind="float"),
    Option("vllm_max_servers", "servers kept running at once for reuse (1: stop one before starting the next)", 1,
           kind="int"),
    Option("vllm_keep_order", "run tests in collection order; by default tests of the same vllm_config run one "
           "after another, so each config's server starts once", False, kind="bool"),
    Option("vllm_gpus_per_worker", "GPUs each pytest-xdist worker takes (CUDA_VISIBLE_DEVICES), e.g. 2 for "
           "tensor_parallel_size=2 configs", 1, kind="int"),
    Option("vllm_cache_dir", "persistent folder for vLLM's compile cache, the tiny model and vLLM's flag table",
           None, kind="path"),
    Option("vllm_log_dir", "folder for server logs", ".vllm-mem/logs", kind="path"),
    Option("vllm_python", "interpreter that runs vLLM (default: the one running pytest)", None),
]


class UsageError(pytest.UsageError):
    """Bad plugin input: one paragraph naming the input and what is accepted."""


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-mem", "vLLM memory and serving regression tests (pytest-vllm-mem)")
    for option in OPTIONS:
        # Argparse %-formats option help, so the '15%' in --vllm-tolerance's help crashed `pytest --help`.
        cli_help = option.help.replace("%", "%%")
        if option.kind == "bool":
            group.addoption(option.flag, action="store_true", default=None, dest=option.name, help=cli_help)
        else:
            group.addoption(option.flag, default=None, dest=option.name, help=cli_help)
        parser.addini(option.name, option.help, type="bool" if option.kind == "bool" else "string",
                      default=option.default if option.kind == "bool" else None)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pytest-vllm-mem"


def _convert(option: Option, raw: Any, rootdir: Path, source: str) -> Any:
    converters: dict[str, Callable[[Any], Any]] = {
        "str": str,
        "bool": lambda v: v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on"),
        "float": float,
        "int": int,
        "path": lambda v: (rootdir / Path(os.path.expanduser(str(v)))) if not Path(str(v)).is_absolute()
        else Path(str(v)),
    }
    try:
        value = converters[option.kind](raw)
    except (TypeError, ValueError):
        raise UsageError(f"{source}={raw!r}: expected {'a number' if option.kind in ('int', 'float') else option.kind}"
                         f" ({option.help}).") from None
    if option.kind in ("int", "float") and value <= 0:
        raise UsageError(f"{source}={raw!r}: must be greater than 0 ({option.help}).")
    return value


@dataclass(frozen=True)
class Settings:
    vllm_model: str
    vllm_model_override: str | None
    vllm_gpu: str
    vllm_results: Path | None
    vllm_markdown: Path | None
    vllm_plots: Path | None
    vllm_baseline: Path
    vllm_update_baseline: bool
    vllm_tolerance: str
    vllm_strict: bool
    vllm_require_baseline: bool
    vllm_startup_timeout: float
    vllm_sample_period: float | None
    vllm_max_servers: int
    vllm_keep_order: bool
    vllm_gpus_per_worker: int
    vllm_cache_dir: Path
    vllm_log_dir: Path
    vllm_python: str

    @classmethod
    def from_pytest(cls, config: pytest.Config) -> "Settings":
        rootdir = Path(str(config.rootpath))
        values: dict[str, Any] = {}
        for option in OPTIONS:
            raw, source = config.getoption(option.name), option.flag
            if raw is None:
                raw, source = config.getini(option.name), f"ini {option.name}"
                if raw in (None, "", []) and option.kind != "bool":
                    raw = option.default
            values[option.name] = None if raw is None else _convert(option, raw, rootdir, source)
        values["vllm_cache_dir"] = values["vllm_cache_dir"] or default_cache_dir()
        values["vllm_python"] = values["vllm_python"] or sys.executable
        values["vllm_tolerance"] = values["vllm_tolerance"] or ""
        return cls(**values)
