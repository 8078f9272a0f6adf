"""Sizes, durations and quantities: parse what users write, format what reports show.

Sizes follow the usual split: `GB` = 10^9 bytes (as vLLM's own `large_gpu_mark` and GPU vendors count), `GiB` = 2^30
bytes (as vLLM's logs and torch count). Single letters (`8g`, `8G`) are refused: half the tools mean GiB by them.
"""

from __future__ import annotations

import math
import re

GIB = 2**30  # the one binary gigabyte of the package: vLLM's logs, torch and NVML-derived figures count in it

SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": GIB,
    "tib": 2**40,
}
DURATION_UNITS_MS: dict[str, float] = {"us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1000.0}

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_AMOUNT_RE = re.compile(rf"^\s*(?P<number>{_NUMBER})\s*(?P<unit>[a-zA-Zµ/]*)\s*$")
_BINARY_STEPS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class UnitError(ValueError):
    """Text that should be a size or a duration is not one."""


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is finite: what a figure read from JSON or a record must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def split_amount(text: str) -> tuple[float, str] | None:
    """`"1.5 GiB"` -> `(1.5, "gib")`; `"100"` -> `(100.0, "")`; None when the text is not number + letters."""
    match = _AMOUNT_RE.match(text)
    if not match:
        return None
    return float(match.group("number")), match.group("unit").lower()


def parse_size(text: str) -> int:
    """A size in bytes from `"24GiB"`, `"256MiB"`, `"8gb"` (10^9), `"512mb"`, `"1.5GiB"` or plain bytes `"1048576"`."""
    amount = split_amount(str(text))
    if amount is None or (amount[1] not in SIZE_UNITS and amount[1] != ""):
        raise UnitError(
            f"Size {text!r} is not understood. Accepted: a number with a unit, case-insensitive, spaces allowed: "
            "binary KiB/MiB/GiB/TiB (GiB = 2^30 bytes, e.g. '24GiB', '256MiB'), decimal KB/MB/GB/TB "
            "(GB = 10^9 bytes, e.g. '8GB', '512mb'), B, or plain bytes ('1048576'). Single letters such as "
            "'8g' are refused because tools disagree on whether they mean GB or GiB."
        )
    number, unit = amount
    return round(number * SIZE_UNITS.get(unit, 1))


def parse_duration_ms(text: str) -> float:
    """A duration in milliseconds from `"50ms"`, `"1.5s"`, `"500us"` or plain milliseconds `"50"`."""
    amount = split_amount(str(text))
    if amount is None or (amount[1] not in DURATION_UNITS_MS and amount[1] != ""):
        raise UnitError(
            f"Duration {text!r} is not understood. Accepted: a number with a unit, case-insensitive: "
            "'us' (microseconds), 'ms', 's' (e.g. '50ms', '1.5s'), or plain milliseconds ('50')."
        )
    number, unit = amount
    return number * DURATION_UNITS_MS.get(unit, 1.0)


def format_bytes(n: float, *, trim: bool = False) -> str:
    """`5.21 GiB`, `256.00 MiB`, `512 B` (binary units, two decimals; `trim` drops a `.00`: `256 MiB`)."""
    if not math.isfinite(n):
        return f"{n} B"
    sign = "-" if n < 0 else ""
    value = abs(float(n))
    step = 0
    while value >= 1024 and step < len(_BINARY_STEPS) - 1:
        value /= 1024
        step += 1
    if step == 0:
        return f"{sign}{value:,.0f} B"
    text = f"{value:,.2f}"
    if trim and text.endswith(".00"):
        text = text[:-3]
    return f"{sign}{text} {_BINARY_STEPS[step]}"


def format_number(value: float, decimals: int = 1) -> str:
    """`1,204.5`: thousands separators so large throughputs and token counts read at a glance."""
    return f"{value:,.{decimals}f}"


def format_quantity(value: float, unit: str, *, trim: bool = False) -> str:
    """A value in its metric's unit: bytes as GiB/MiB, tokens and blocks as whole numbers, ms and rates with one
    decimal."""
    if unit == "bytes":
        return format_bytes(value, trim=trim)
    if unit in ("tokens", "blocks"):
        return f"{format_number(value, 0)} {unit}"
    text = format_number(value, 1)
    if trim and text.endswith(".0"):
        text = text[:-2]
    return f"{text} {unit}" if unit else text
