"""vLLM flags the plan reads beyond a plain value: a JSON object (--compilation-config, --speculative-config) and a
switch (--enable-lora, --language-model-only) given as True or as its command-line text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_flag(flags: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    """The object flag `name` holds (a dict, or its JSON text as given on the command line); None when it is unset
    or is not a JSON object (vLLM's own argparse refuses that text before the plan's verdict matters)."""
    value = flags.get(name)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, Mapping) else None


def switch_on(flags: Mapping[str, Any], name: str) -> bool:
    """Whether the switch `name` is set (True, or "true"/"True"/1 as a suite or the command line gives it)."""
    return flags.get(name) in (True, "true", "True", 1)


__all__ = ["json_flag", "switch_on"]
