"""Where plans meet configs: the card a config is planned on, the ladder of strategies, and `--vllm-preflight`.

A preflight plans the config a test would launch, on the run's tier, without a server: a config predicted to fit
gets a PlannedServer (its loads are not run; the report says planned), one predicted not to fit raises the
VLLMStartupError a real startup would raise, with the plan's figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config import VLLMConfig
from .modelinfo import ModelInfo, ModelInfoError, load_model_info
from .plan import GIB, Calibration, Card, Plan, PlanError, plan
from .tiers import Tier

# The four rungs of the example suite's ladder (example_suite/conftest.py, `strategies`).
LADDER: tuple[tuple[str, dict[str, Any]], ...] = (
    ("A-util0.7", {"gpu_memory_utilization": 0.7}),
    ("B-len2048", {"gpu_memory_utilization": 0.8, "max_model_len": 2048}),
    ("C-eager", {"gpu_memory_utilization": 0.8, "enforce_eager": True}),
    ("D-combined", {"gpu_memory_utilization": 0.75, "max_model_len": 4096, "enforce_eager": True}),
)


def card_for(backend: str, tier: Tier, *, device_name: str = "", device_total: int | None = None,
             available: int | None = None) -> Card:
    """The memory vLLM will size from. GPU: the tier's bytes (the plugin scales the utilization to emulate a tier on
    a larger card, so utilization x tier is what vLLM reserves). CPU: the node's total, utilization scaled alike."""
    if backend == "cpu":
        total = device_total if device_total is not None else tier.bytes
        return Card("cpu", device_name or "CPU node", total, available_bytes=available)
    return Card("cuda", f"{tier.name} tier" if not tier.auto else (device_name or "GPU"), tier.bytes)


def scaled_flags(flags: Mapping[str, Any], tier: Tier, card: Card, default_utilization: float) -> dict[str, Any]:
    """The flags as the plugin launches them on a CPU node: utilization x tier / node (tiers.emulate_tier)."""
    out = dict(flags)
    if card.backend == "cpu" and not tier.auto and card.total_bytes > tier.bytes * 1.005:
        before = float(out.get("gpu_memory_utilization") or default_utilization)
        out["gpu_memory_utilization"] = round(before * tier.bytes / card.total_bytes, 4)
    return out


@dataclass(frozen=True)
class Rung:
    name: str
    flags: dict[str, Any]
    plan: Plan
    lowest_utilization: float | None  # the lowest utilization (0.01 steps) whose plan fits, None when none does
    highest_utilization: float | None


def utilization_range(fits: Callable[[float], bool]) -> tuple[float | None, float | None]:
    """The lowest and highest utilization in 0.01 steps whose plan fits (the plan is cheap: scan them all)."""
    ok = [step / 100 for step in range(5, 100) if fits(step / 100)]
    return (ok[0], ok[-1]) if ok else (None, None)


def ladder(info: ModelInfo, base_flags: Mapping[str, Any], card: Card,
           launch: Callable[[dict[str, Any]], dict[str, Any]] = dict, **plan_args: Any) -> list[Rung]:
    """The example suite's rungs A-D for `info` on `card`, each with the utilization range that fits; `launch` maps
    a rung's flags to the flags the plugin would launch (the CPU tier emulation scales the utilization)."""
    rungs = []
    for name, rung_flags in LADDER:
        flags = {**base_flags, **rung_flags}
        if info.max_position_embeddings and int(flags.get("max_model_len") or 0) > info.max_position_embeddings:
            flags["max_model_len"] = info.max_position_embeddings
        result = plan(info, launch(flags), card, **plan_args)

        def fits(utilization: float, flags: dict[str, Any] = flags) -> bool:
            return plan(info, launch({**flags, "gpu_memory_utilization": utilization}), card, **plan_args).fits

        low, high = utilization_range(fits)
        rungs.append(Rung(name, flags, result, low, high))
    return rungs


def ladder_table(rungs: list[Rung]) -> list[str]:
    rows = [["rung", "flags", "verdict", "KV cache", "KV tokens", "concurrency", "fits for utilization"]]
    for rung in rungs:
        p = rung.plan
        flags = " ".join(f"{k}={v}" if v is not True else k for k, v in rung.flags.items())
        span = f"{rung.lowest_utilization:.2f}-{rung.highest_utilization:.2f}" if rung.lowest_utilization else "none"
        rows.append([rung.name, flags, p.verdict + ("" if p.sure else "?"), f"{p.kv_bytes.value / GIB:.2f} GiB",
                     f"{p.kv_tokens.value:,}", f"{p.max_concurrency:.2f}x", span])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def plan_config(config: VLLMConfig, card: Card, *, tier: Tier, vllm_version: str | None,
                default_utilization: float, calibration: Calibration | None = None) -> Plan:
    """The plan of a launched config (model already resolved, flags as launched). Raises PlanError/ModelInfoError."""
    info = load_model_info(config.model)
    return plan(info, dict(config.flags), card, env=config.env, vllm_version=vllm_version,
                default_utilization=default_utilization, tier_bytes=None if tier.auto else tier.bytes,
                calibration=calibration)


def try_plan(config: VLLMConfig, card: Card, **kwargs: Any) -> tuple[Plan | None, str | None]:
    """(plan, None), or (None, why not): a plan is a bonus in a real run and never fails it."""
    try:
        return plan_config(config, card, **kwargs), None
    except (PlanError, ModelInfoError) as error:
        return None, str(error)


def plan_figures(result: Plan) -> dict[str, float]:
    """The figures a predicted failure carries, in the units diagnose.Diagnosis uses (GiB)."""
    return {"requested_gib": result.requested_bytes / GIB, "weights_gib": result.weights.value / GIB,
            "kv_cache_gib": result.kv_bytes.value / GIB, "kv_cache_tokens": float(result.kv_tokens.value),
            "max_model_len": float(result.max_model_len), "needed_gib":
            -(-result.max_model_len // result.block_size) * result.block_size * result.kv_bytes_per_token / GIB,
            "longest_context": float(result.longest_context)}


def compare(result: Plan, memory: Mapping[str, Any]) -> dict[str, Any]:
    """Plan vs what vLLM logged at startup (diagnose.StartupMemory.to_dict()), term by term."""
    rows: dict[str, Any] = {}
    pairs = (("weights_gib", result.weights.value / GIB), ("kv_cache_gib", result.kv_bytes.value / GIB),
             ("kv_cache_tokens", result.kv_tokens.value), ("graph_capture_gib", result.graph.value / GIB))
    if result.backend == "cpu":
        pairs += (("non_kv_gib", result.activation.value / GIB), ("requested_gib", result.requested_bytes / GIB))
    for key, planned in pairs:
        logged = memory.get(key)
        if logged is None:
            continue
        error = (planned - logged) / logged if logged else None
        rows[key] = {"planned": planned, "logged": logged, "error": error}
    return rows
