"""GPU memory tiers: `--vllm-gpu=24gb`, the `vllm_tier` marker, and emulating a small card on a big one.

A tier is a memory size in decimal gigabytes (10^9 bytes), as vLLM's own `large_gpu_mark` counts them. Every card
sold with that label reports at least that much through NVML (an L4 "24GB" has 24.15e9 bytes, an RTX 4090 25.76e9),
so a suite that passes on the 24gb tier passes on every 24 GB card.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.units import GIB, format_bytes

# The unit is required and `g` is refused. A bare `24` or `24g` was read as GB, while torch and vLLM's logs
# count GiB: the same reason units.parse_size refuses single letters. 24gb and 24gib differ by 7%.
_TIER_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gb|gib)\s*$", re.IGNORECASE)
# Scaling utilization for a difference under 0.5% only adds noise to the command line.
_EMULATION_THRESHOLD = 1.005


class TierError(ValueError):
    """A tier value that cannot be read."""


@dataclass(frozen=True)
class Tier:
    name: str  # "24gb", or "auto (84.9 GB)"
    bytes: int
    auto: bool = False

    def __str__(self) -> str:
        return self.name


def parse_tier(text: str, *, source: str = "--vllm-gpu") -> Tier | None:
    """`24gb` -> Tier(24e9 bytes); `24gib` -> 24 * 2^30; `auto` -> None (resolved against the device later)."""
    value = str(text).strip().lower()
    if value in ("", "auto"):
        return None
    match = _TIER_RE.match(value)
    if not match or float(match.group(1)) <= 0:
        raise TierError(
            f"{source}={text!r} is not a GPU memory tier. Accepted: a size in gigabytes such as 8gb, 12gb, 16gb, 24gb, "
            "40gb, 48gb, 80gb, 141gb (1 GB = 10^9 bytes, as printed on cards), NNgib for binary gibibytes "
            "(24gib = 24 * 2^30 bytes), or auto (the total memory of the device the server runs on). The unit is "
            "required: a bare number such as 24, or 24g, is refused because tools disagree on whether it means GB "
            "or GiB."
        )
    number = float(match.group(1))
    unit = match.group(2).lower()
    size = round(number * (GIB if unit == "gib" else 10**9))
    # The label is canonical (24.0gb, 024gb and "24 GB" are all 24gb): it keys baseline entries, so spellings
    # of one tier must not split them.
    label = f"{number:f}".rstrip("0").rstrip(".") + unit
    return Tier(label, size)


def resolve_tier(text: str | None, device_total_bytes: int) -> Tier:
    tier = parse_tier(text or "auto")
    if tier is None:
        # The name keys baselines: a stable "auto", not the measured size (it drifts on some hosts).
        return Tier("auto", device_total_bytes, auto=True)
    return tier


def tier_skip_reason(selected: Tier, minimum: Tier | None, maximum: Tier | None) -> str | None:
    """Why a test marked `vllm_tier(min, max=...)` does not run on the selected tier, or None when it runs."""
    if minimum is not None and selected.bytes < minimum.bytes:
        return f"needs the {minimum} tier; this run is on the {selected} tier"
    if maximum is not None and selected.bytes > maximum.bytes:
        return f"only for tiers up to {maximum}; this run is on the {selected} tier"
    return None


def device_skip_reason(selected: Tier, device_name: str, device_total_bytes: int) -> str | None:
    """A tier larger than the device cannot be emulated: its tests are skipped, not run and failed."""
    if selected.bytes > device_total_bytes:
        return (
            f"the {selected} tier ({format_bytes(selected.bytes)}) is larger than this device "
            f"({device_name}, {format_bytes(device_total_bytes)})"
        )
    return None


@dataclass(frozen=True)
class Emulation:
    """How a server on a larger device was made to plan its memory as if the device had only the tier's memory."""

    tier: Tier
    device_total_bytes: int
    utilization_before: float
    utilization_after: float
    # max_num_batched_tokens / max_num_seqs set to what vLLM picks on a card of the tier's size (empty: the same)
    batch_flags: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        batch = ", ".join(f"{name} {value}" for name, value in self.batch_flags.items())
        return (
            f"emulating the {self.tier} tier on a {format_bytes(self.device_total_bytes)} device: "
            f"gpu_memory_utilization {self.utilization_before:g} -> {self.utilization_after:.4f} "
            f"(x {self.tier.bytes / self.device_total_bytes:.3f}), so vLLM reserves "
            f"{format_bytes(int(self.utilization_before * self.tier.bytes))}"
            + (f"; {batch}, vLLM's defaults on a card of the tier's size" if batch else "")
        )


# A device's total bytes -> (max_num_batched_tokens, max_num_seqs) vLLM's `vllm serve` picks on it when the config
# sets neither (EngineArgs.get_batch_defaults; plan.batch_rule reads it from the installed vLLM).
BatchRule = Callable[[int], tuple[int, int]]


def emulate_tier(
    config: VLLMConfig,
    tier: Tier,
    device_total_bytes: int,
    default_utilization: float,
    batch_rule: BatchRule | None = None,
) -> tuple[VLLMConfig, Emulation | None]:
    """Scale --gpu-memory-utilization by tier/device so vLLM's reservation (utilization * total) fits the tier.

    vLLM sizes everything it reserves from `utilization * total memory` (the GPU worker's `requested_memory`, the
    figure of its "Desired GPU memory utilization is (0.9, 72.0 GiB)" line); on the CPU backend the same product
    sizes the KV cache from the memory vLLM sees. Scaling the fraction is therefore the one
    mechanism that works on both, with no change to vLLM.

    vLLM also sizes its batch defaults from the device's total (`batch_rule`, GPUs only): a 24gb tier on an H200
    would profile 8192 tokens and warm up 1024 sequences where a 24 GB card does 2048 and 256, so neither its
    activation peak nor its KV cache were a 24 GB card's. Where the rule gives the tier's size other defaults than
    the device's, the launch sets them, unless the config sets them itself (performance_mode=throughput doubles
    them, as vLLM does for its own defaults).
    """
    if tier.auto or device_total_bytes <= tier.bytes * _EMULATION_THRESHOLD:
        return config, None
    before = float(config.flag("gpu_memory_utilization", default_utilization))
    after = round(before * tier.bytes / device_total_bytes, 4)
    batch: dict[str, int] = {}
    if batch_rule is not None:
        on_tier = batch_rule(tier.bytes)
        if on_tier != batch_rule(device_total_bytes):
            factor = 2 if config.flag("performance_mode") == "throughput" else 1
            for name, value in zip(("max_num_batched_tokens", "max_num_seqs"), on_tier):
                if config.flag(name) is None:
                    batch[name] = value * factor
    emulation = Emulation(tier, device_total_bytes, before, after, batch)
    return config.with_flags(gpu_memory_utilization=after, **batch), emulation
