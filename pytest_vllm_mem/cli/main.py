"""`python -m pytest_vllm_mem tune ...`: the tuner on the command line, without pytest.

Bad input is an argparse error naming the input (exit 2), never a traceback; Ctrl-C or SIGTERM stops the running
server and exits 130; exit 0 when a utilization was recommended, 1 when none in the range worked.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_vllm_mem.cli.args import env_arg, print_line, split_flag, tier_arg
from pytest_vllm_mem.cli.merge import add_merge_parser
from pytest_vllm_mem.cli.plan import add_plan_parser
from pytest_vllm_mem.settings import Settings, UsageError
from pytest_vllm_mem.tune.search import (
    DEFAULT_MAX_STARTUPS,
    DEFAULT_RESOLUTION,
    GOALS,
    TUNE_LOAD,
    UTILIZATION_FLAG,
    TuneError,
    TuneResult,
    tune,
)

EXIT_FOUND, EXIT_NONE_WORKED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _number(convert: Callable[[str], float], accept: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    """An argparse type: `convert`, then `accept`, else an error naming the input and what is expected."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            value = float("nan")
        if not accept(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
        return value

    return parse


_fraction = _number(float, lambda v: 0 < v <= 1, "a gpu_memory_utilization: give a fraction in (0, 1], e.g. 0.9")
_step = _number(float, lambda v: 0 < v < 1, "a search step: give a fraction in (0, 1), e.g. 0.05")
_positive_int = _number(int, lambda v: v >= 1, "a positive whole number")
_positive_float = _number(float, lambda v: v > 0, "a positive number of seconds")


def _flag(text: str) -> tuple[str, Any]:
    key, value = split_flag(
        text,
        "is not a vLLM flag: write NAME=VALUE (max_model_len=1024) or a bare NAME for an on/off flag (enforce_eager)",
    )
    if key == UTILIZATION_FLAG:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {UTILIZATION_FLAG} is what the tuner searches; give its range with --low and --high"
        )
    if key in ("model", "host", "port"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: --{key} is set by the tuner itself (--model names the model; "
            "servers bind 127.0.0.1 on a free port)"
        )
    return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_vllm_mem", description="pytest-vllm-mem tools that run outside pytest."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    tune_parser = commands.add_parser(
        "tune",
        help="find the highest gpu_memory_utilization that starts and survives a load on a tier",
        description="Bisect gpu_memory_utilization: each trial starts a fresh vLLM server, runs a short concurrent "
        "load and checks the peak against the tier. Prints each trial, then the recommended command "
        "and its headroom. Exit 0 with a recommendation, 1 when no value in the range worked.",
    )
    _add_search_arguments(tune_parser.add_argument)
    _add_run_arguments(tune_parser.add_argument)
    tune_parser.set_defaults(run=run_tune, command_parser=tune_parser)  # errors show the subcommand's usage
    add_plan_parser(commands)
    add_merge_parser(commands)
    return parser


def _add_search_arguments(add: Callable[..., object]) -> None:
    """What the tuner searches: the model and tier, the utilization range, its step and budget, the trials' flags."""
    add("--model", required=True, help="model name, local folder, or 'tiny' (the built-in random-weight model)")
    add(
        "--tier",
        type=tier_arg,
        default="auto",
        help="GPU memory tier: 8gb, 16gb, 24gb, 40gb, 80gb, NNgb, NNgib or auto (the device's memory); the "
        "utilization is a fraction of the tier (default: auto)",
    )
    add(
        "--low",
        type=_fraction,
        default=None,
        help="lowest utilization tried (default 0.5 on a GPU, 0.05 on the CPU backend)",
    )
    add(
        "--high",
        type=_fraction,
        default=None,
        help="highest utilization tried (default 0.95 on a GPU, 0.5 on the CPU backend)",
    )
    add(
        "--resolution",
        type=_step,
        default=DEFAULT_RESOLUTION,
        help=f"search step: the boundary is found to within this (default {DEFAULT_RESOLUTION})",
    )
    add(
        "--max-startups",
        type=_positive_int,
        default=DEFAULT_MAX_STARTUPS,
        help=f"most server startups (trials) to spend (default {DEFAULT_MAX_STARTUPS})",
    )
    add(
        "--find",
        choices=GOALS,
        default="auto",
        help="highest: the largest working value (out-of-memory above it); lowest: the smallest (too little KV "
        "cache below it); auto: highest on a GPU, lowest on the CPU backend (default)",
    )
    add(
        "--flag",
        type=_flag,
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="a vLLM flag for every trial, e.g. --flag max_model_len=4096 --flag enforce_eager (repeatable)",
    )
    add(
        "--env",
        type=env_arg,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the server (repeatable)",
    )


def _add_run_arguments(add: Callable[..., object]) -> None:
    """How each trial runs: its load, the startup timeout, and where the results, caches and logs go."""
    for name, what in (
        ("num_prompts", "requests in each trial's load"),
        ("concurrency", "requests in flight at once"),
        ("max_tokens", "output tokens per request"),
        ("prompt_len", "prompt tokens per request"),
    ):  # the defaults are the tuner's load
        flag, default = "--" + name.replace("_", "-"), getattr(TUNE_LOAD, name)
        add(flag, type=_positive_int, default=default, help=f"{what} (default %(default)s)")
    add(
        "--startup-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds a server may take to become healthy (default 600)",
    )
    add("--json", type=Path, default=None, metavar="PATH", help="also write every trial and the result to this file")
    add(
        "--cache-dir",
        type=Path,
        default=None,
        help="vLLM compile cache, tiny model and flag table (default ~/.cache/pytest-vllm-mem)",
    )
    add("--log-dir", type=Path, default=Path(".vllm-mem/logs"), help="server logs (default .vllm-mem/logs)")
    add("--python", default=None, help="interpreter that runs vLLM (default: this one)")


def build_settings(args: argparse.Namespace) -> Settings:
    """The plugin's Settings for a CLI run: every option's default, with what the command line sets."""
    return Settings.from_values(
        {
            "vllm_model": args.model,
            "vllm_gpu": args.tier,
            "vllm_max_servers": 1,
            "vllm_startup_timeout": args.startup_timeout,
            "vllm_log_dir": args.log_dir,
            "vllm_cache_dir": args.cache_dir,
            "vllm_python": args.python,
        },
        Path.cwd(),
    )


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_tune(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.launch.pool import Session, missing_model_folder
    from pytest_vllm_mem.launch.server import stop_all_servers

    missing = missing_model_folder(args.model)
    if missing:
        parser.error(f"argument --model: {missing}")
    config = VLLMConfig(args.model, env=dict(args.env), **dict(args.flag))
    load = replace(
        TUNE_LOAD,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
    )
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # CI cancelling the job: stop the server first
    state = None
    try:
        state = Session(build_settings(args))
        result: TuneResult = tune(
            state,
            config,
            low=args.low,
            high=args.high,
            resolution=args.resolution,
            max_startups=args.max_startups,
            goal=args.find,
            load=load,
            out=print_line,
        )
    except (TuneError, UsageError) as error:
        parser.error(str(error))  # before any startup: bad input, exit 2
    except KeyboardInterrupt:
        print("\ninterrupted: the running server was stopped; no recommendation.", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        if state is not None:
            state.close()
        stop_all_servers()
        signal.signal(signal.SIGTERM, previous)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return EXIT_FOUND if result.ok else EXIT_NONE_WORKED


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    code: int = args.run(args, args.command_parser)
    return code


if __name__ == "__main__":
    sys.exit(main())
