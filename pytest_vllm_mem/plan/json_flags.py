"""vLLM flags whose value is a JSON object (--compilation-config, --speculative-config), as the plan reads them."""

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


__all__ = ["json_flag"]
