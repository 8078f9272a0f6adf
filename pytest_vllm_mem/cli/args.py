"""argparse types and output shared by the `tune` and `plan` commands (errors name the input, exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from pytest_vllm_mem.tiers import TierError, parse_tier


def print_line(line: str) -> None:
    print(line, flush=True)  # flushed: a trial takes a minute, and the output is often a pipe (CI, subprocess)


def tier_arg(text: str) -> str:
    try:
        parse_tier(text, source="--tier")
    except TierError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def env_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an environment variable: write NAME=VALUE, e.g. VLLM_CPU_KVCACHE_SPACE=1"
        )
    return key.strip(), value


def split_flag(text: str, invalid: str) -> tuple[str, Any]:
    """`max_model_len=1024` (or `max-model-len=1024`, `--max-model-len=1024`) -> value; `enforce_eager` -> True.
    A name that is not a flag name raises `invalid` (what the command accepts) after the quoted input."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"{text!r} {invalid}")
    return key, (value if sep else True)
