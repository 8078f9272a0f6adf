"""Where plans meet configs: the card a config is planned on, the ladder of strategies, and `--vllm-preflight`.

A preflight plans the config a test would launch, on the run's tier, without a server: a config predicted to fit
gets a launch.planned.PlannedServer (its loads are not run; the report says planned), one predicted not to fit raises
the VLLMStartupError a real startup would raise, with the plan's figures. Pure: the session's plans and calibrations
live in a SessionPlans the launch path hands in, and nothing here starts a server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vllm_mem.config import VLLMConfig
from pytest_vllm_mem.diagnosis.diagnose import StartupMemory
from pytest_vllm_mem.memory import DeviceInfo, cpu_node_memory
from pytest_vllm_mem.plan.calibration import CalibrationStore, calibration_key, from_startup
from pytest_vllm_mem.plan.memory_plan import Calibration, Card, Plan, PlanError, plan
from pytest_vllm_mem.plan.modelinfo import ModelInfo, ModelInfoError, load_model_info
from pytest_vllm_mem.tiers import Tier
from pytest_vllm_mem.units import GIB

# The four rungs of the example suite's ladder (example_suite/conftest.py, `strategies`).
LADDER: tuple[tuple[str, dict[str, Any]], ...] = (
    ("A-util0.7", {"gpu_memory_utilization": 0.7}),
    ("B-len2048", {"gpu_memory_utilization": 0.8, "max_model_len": 2048}),
    ("C-eager", {"gpu_memory_utilization": 0.8, "enforce_eager": True}),
    ("D-combined", {"gpu_memory_utilization": 0.75, "max_model_len": 4096, "enforce_eager": True}),
)


def card_for(
    backend: str, tier: Tier, *, device_name: str = "", device_total: int | None = None, available: int | None = None
) -> Card:
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


def ladder(
    info: ModelInfo,
    base_flags: Mapping[str, Any],
    card: Card,
    launch: Callable[[dict[str, Any]], dict[str, Any]] = dict,
    **plan_args: Any,
) -> list[Rung]:
    """The example suite's rungs A-D for `info` on `card`, each with the utilization range that fits; `launch` maps
    a rung's flags to the flags the plugin would launch (the CPU tier emulation scales the utilization)."""
    rungs = []
    for name, rung_flags in LADDER:
        flags = {**base_flags, **rung_flags}
        length = str(flags.get("max_model_len") or 0)  # a number, or `auto` (vLLM fits it itself)
        if info.max_position_embeddings and length.isdigit() and int(length) > info.max_position_embeddings:
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
        rows.append(
            [
                rung.name,
                flags,
                p.verdict + ("" if p.sure else "?"),
                f"{p.kv_bytes.value / GIB:.2f} GiB",
                f"{p.kv_tokens.value:,}",
                f"{p.max_concurrency:.2f}x",
                span,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def plan_config(
    config: VLLMConfig,
    card: Card,
    *,
    tier: Tier,
    vllm_version: str | None,
    default_utilization: float,
    calibration: Calibration | None = None,
) -> Plan:
    """The plan of a launched config (model already resolved, flags as launched). Raises PlanError/ModelInfoError."""
    info = load_model_info(config.model)
    return plan(
        info,
        dict(config.flags),
        card,
        env=config.env,
        vllm_version=vllm_version,
        default_utilization=default_utilization,
        tier_bytes=None if tier.auto else tier.bytes,
        calibration=calibration,
    )


def try_plan(config: VLLMConfig, card: Card, **kwargs: Any) -> tuple[Plan | None, str | None]:
    """(plan, None), or (None, why not): a plan is a bonus in a real run and never fails it."""
    try:
        return plan_config(config, card, **kwargs), None
    except (PlanError, ModelInfoError) as error:
        return None, str(error)


def plan_figures(result: Plan) -> dict[str, float]:
    """The figures a predicted failure carries, in the units diagnose.Diagnosis uses (GiB)."""
    return {
        "requested_gib": result.requested_bytes / GIB,
        "weights_gib": result.weights.value / GIB,
        "kv_cache_gib": result.kv_bytes.value / GIB,
        "kv_cache_tokens": float(result.kv_tokens.value),
        "max_model_len": float(result.max_model_len),
        "needed_gib": -(-result.max_model_len // result.block_size)
        * result.block_size
        * result.kv_bytes_per_token
        / GIB,
        "longest_context": float(result.longest_context),
    }


def compare(result: Plan, memory: Mapping[str, Any]) -> dict[str, Any]:
    """Plan vs what vLLM logged at startup (diagnose.StartupMemory.to_dict()), term by term."""
    rows: dict[str, Any] = {}
    pairs: tuple[tuple[str, float], ...] = (
        ("weights_gib", result.weights.value / GIB),
        ("kv_cache_gib", result.kv_bytes.value / GIB),
        ("kv_cache_tokens", float(result.kv_tokens.value)),
        ("kv_cache_blocks", float(result.kv_blocks)),
        ("graph_capture_gib", result.graph.value / GIB),
    )
    if result.backend == "cpu":
        pairs += (("non_kv_gib", result.activation.value / GIB), ("requested_gib", result.requested_bytes / GIB))
    for key, planned in pairs:
        logged = memory.get(key)
        if logged is None:
            continue
        error = (planned - logged) / logged if logged else None
        rows[key] = {"planned": planned, "logged": logged, "error": error}
    return rows


# --- the plugin: a plan for every launched config, and --vllm-preflight ----------------------------------------------


@dataclass(frozen=True)
class SessionPlan:
    """A launched config's plan in this session, with what re-planning and calibrating it needs."""

    plan: Plan
    calibration_key: str
    planned_config: VLLMConfig  # as planned: a CPU runner planning the GPU job plans the flags as written
    replan: Callable[[dict[str, Any]], Plan]  # the same plan with some flags changed (the advice's checks)


@dataclass
class SessionPlans:
    """The plans and calibrations of one session: launch.pool.Session holds one, the report and the tuner read it."""

    reports: dict[VLLMConfig, dict[str, Any]] = field(default_factory=dict)  # Plan.to_dict(), or {"error": why}
    plans: dict[VLLMConfig, SessionPlan] = field(default_factory=dict)
    calibrations: dict[str, Calibration] = field(default_factory=dict)  # by calibration key


@dataclass(frozen=True)
class PlanContext:
    """What a session plan reads of the session: the device and tier, vLLM's release and default utilization, the
    preflight options, where calibrations are stored, and the device's total memory right before a launch."""

    device: DeviceInfo
    tier: Tier
    vllm_version: str | None
    default_utilization: float
    device_total: Callable[[], int]
    calibration_file: Path
    preflight: bool = False
    model_override: str | None = None


class Unplannable(Exception):
    """--vllm-preflight cannot plan this config (the pytest adapter skips the test with the reason)."""


def preflight_card(backend: str, tier: Tier, model_override: str | None, requested_model: str) -> str:
    """The backend a preflight plans for. A CPU runner with a GPU tier and the suite's own (GPU) models plans the GPU
    job it stands in for; with --vllm-model-override (or the tiny model) it plans the CPU run that would happen."""
    if backend == "cpu" and not tier.auto and not model_override and requested_model != "tiny":
        return "cuda"
    return backend


def plan_advice(result: Plan, replan: Callable[[dict[str, Any]], Plan]) -> list[str]:
    """Next steps the plan itself can check: the utilization range that fits, the longest context, TP."""
    steps: list[str] = []
    if result.verdict == "weights_too_large":
        for tp in (2, 4, 8):
            if replan({"tensor_parallel_size": tp}).fits:
                steps.append(f"tensor_parallel_size={tp} (the plan fits with the weights split over {tp} GPUs)")
                break
        steps.append("a quantized checkpoint (AWQ/GPTQ 4-bit, FP8), or a larger tier")
        return steps
    low, high = utilization_range(lambda u: replan({"gpu_memory_utilization": u}).fits)
    if low is not None:
        steps.append(f"gpu_memory_utilization between {low:.2f} and {high:.2f} (the plan fits there)")
    if result.verdict == "kv_cache_insufficient" and result.longest_context >= 256:
        steps.append(
            f"max_model_len {result.max_model_len} -> {result.longest_context // 256 * 256} (the KV cache "
            f"holds {result.kv_tokens.value:,} tokens)"
        )
    if result.graph.value and replan({"enforce_eager": True}).fits:
        steps.append("enforce_eager (no CUDA graph pool: the plan fits without it)")
    return steps or ["a larger tier: no utilization, context length or eager mode makes this config fit"]


def session_plan(plans: SessionPlans, context: PlanContext, config: VLLMConfig, launched: VLLMConfig) -> Plan | None:
    """The plan of `launched` in this session, kept in `plans` for the report; None (and the reason kept) when the
    model cannot be planned. Never raises: in a real run the plan is a bonus."""
    device, tier = context.device, context.tier
    backend = device.backend
    if context.preflight:
        backend = preflight_card(device.backend, tier, context.model_override, config.model)
    if backend == device.backend:
        total = context.device_total()
        available = None
        if backend == "cpu":
            total, available = cpu_node_memory()
        card = Card(backend, device.name, total, available_bytes=available)
        planned_config = launched
    else:  # a CPU runner planning the GPU job: a card of the tier's size, the flags as written
        card = card_for("cuda", tier)
        planned_config = VLLMConfig(launched.model, env=launched.env, **config.flags)
    key = calibration_key(launched.model, context.vllm_version, card.name, dict(planned_config.flags))
    calibration = plans.calibrations.get(key)
    if calibration is None:
        calibration = CalibrationStore(context.calibration_file).get(key)

    def replan(flags: dict[str, Any]) -> Plan:
        return plan_config(
            planned_config.with_flags(**flags),
            card,
            tier=tier,
            vllm_version=context.vllm_version,
            default_utilization=context.default_utilization,
            calibration=calibration,
        )

    result, why = try_plan(
        planned_config,
        card,
        tier=tier,
        vllm_version=context.vllm_version,
        default_utilization=context.default_utilization,
        calibration=calibration,
    )
    plans.reports[launched] = result.to_dict() if result is not None else {"error": why}
    if result is not None:
        plans.plans[launched] = SessionPlan(result, key, planned_config, replan)
    if planned_config != launched:  # a predicted failure reports the config as planned: find its plan by it too
        plans.reports[planned_config] = plans.reports[launched]
        if launched in plans.plans:
            plans.plans[planned_config] = plans.plans[launched]
    return result


def calibration_path(baseline: Path) -> Path:
    """Calibrations live beside the baselines (the --vllm-baseline file): reviewed and committed with them."""
    return Path(baseline).parent / "calibration.json"


def learn_from_startup(
    plans: SessionPlans,
    launched: VLLMConfig,
    memory: StartupMemory | None,
    peak_bytes: int | None,
    store: Path | None = None,
) -> None:
    """After a real startup: the logged overheads become this session's calibration for the same model, release,
    device and flag shape, and are written to `store` (the calibration file, with --vllm-update-baseline)."""
    found = plans.plans.get(launched)
    if found is None or memory is None:
        return
    calibration = from_startup(found.plan, memory.to_dict(), peak_bytes)
    if calibration is None:
        return
    plans.calibrations[found.calibration_key] = calibration
    if store is not None:
        try:
            CalibrationStore(store).put(found.calibration_key, calibration)
        except OSError:
            pass  # the baseline write reports an unwritable folder; a calibration is not worth a second error


def kv_cell(measured: int | None, planned: Mapping[str, Any] | None) -> str:
    """The report's KV tokens cell, plan beside measurement: `108,160 (plan 103,040)`, `plan 103,040`, `-`."""
    tokens = planned.get("kv_tokens", {}).get("value") if planned and "error" not in planned else None
    if measured and tokens is not None:
        return f"{measured:,} (plan {tokens:,})"
    if measured:
        return f"{measured:,}"
    return f"plan {tokens:,}" if tokens is not None else "-"


def preflight_tier(selected: str, minimum: str | None, maximum: str | None) -> str:
    """The tier a test is planned on: the run's --vllm-gpu when one is given, else the test's own vllm_tier marker
    (its minimum, else its maximum), so that one preflight covers a suite's whole tier matrix."""
    if selected.strip().lower() not in ("", "auto"):
        return selected
    return minimum or maximum or selected


def plan_record(plans: SessionPlans, launched: VLLMConfig, memory: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a test's record keeps of the plan: the plan, and where vLLM logged figures, plan vs logged per term
    (`vs_logged`: planned, logged, relative error), so the results JSON has both side by side."""
    data: dict[str, Any] | None = plans.reports.get(launched)
    if data is None:
        return None
    found = plans.plans.get(launched)
    if found is not None and memory:
        data = {**data, "vs_logged": compare(found.plan, memory)}
    return data
