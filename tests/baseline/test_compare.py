"""compare.py: which baseline entry a test compares with across vLLM versions, the re-plan of an untiered run's KV
figures for its device memory, the judge hook, and the failure text naming both versions."""

from __future__ import annotations

import pytest

from pytest_vllm_mem.baseline.compare import (
    BaselineMatch,
    Sample,
    Verdict,
    compare,
    format_gate_failure,
    gate_failures,
    replan_for,
    select_baseline,
)
from pytest_vllm_mem.baseline.metrics import Metric, Tolerance
from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey

GIB = 2**30
DEVICE = "Intel(R) Xeon(R) Processor"
# The token line is report-only by default (derived by vLLM); these tests gate it as a user can.
TOKENS_GATED = {"kv_cache_tokens": Tolerance(relative=0.05, unit="tokens")}


def entry(version: str, tier: str = "24gb", device: str = DEVICE, **metrics: float) -> BaselineEntry:
    return BaselineEntry(
        "t.py::test_a",
        EnvKey(tier, device, version),
        metrics or {"output_throughput": 1000.0},
        runs=1,
        config="vllm serve m",
        recorded_at="2026-11-30T05:00:00Z",
        commit="abc1234",
        host="ci-1",
    )


def candidates(*entries: BaselineEntry) -> dict[EnvKey, BaselineEntry]:
    return {e.env: e for e in entries}


# ----------------------------------------------------------------------------------------------------- selection


def test_own_environment_wins() -> None:
    found = candidates(entry("0.27.1"), entry("0.32.0"), entry("0.33.0"))
    match = select_baseline(found, EnvKey("24gb", DEVICE, "0.32.0"))
    assert match is not None and match.exact and match.vllm_version == "0.32.0"


@pytest.mark.parametrize(
    ("running", "recorded", "expected"),
    [
        ("0.32.0", ["0.10.2", "0.27.1", "0.33.0"], "0.27.1"),  # the newest not newer: what the upgrade came from
        ("0.32.0", ["0.27.1", "0.27.10"], "0.27.10"),  # release order, not text order
        ("0.33.0", ["0.33.0rc1", "0.32.0"], "0.33.0rc1"),  # a release candidate is older than its release
        ("0.10.2", ["0.27.1", "0.32.0"], "0.27.1"),  # nothing older: the nearest newer one (a downgrade)
        ("0.32.0", ["unknown", "0.33.0"], "0.33.0"),  # a version that does not parse is matched only exactly
    ],
)
def test_closest_version_rule(running: str, recorded: list[str], expected: str) -> None:
    match = select_baseline(candidates(*(entry(v) for v in recorded)), EnvKey("24gb", DEVICE, running))
    assert match is not None and not match.exact and match.vllm_version == expected


def test_only_the_same_tier_and_device_cross_versions() -> None:
    found = candidates(entry("0.27.1", tier="80gb"), entry("0.27.1", device="NVIDIA L4"))
    assert select_baseline(found, EnvKey("24gb", DEVICE, "0.32.0")) is None
    assert select_baseline(candidates(entry("0.27.1")), EnvKey("24gb", DEVICE, "unknown")) is None
    assert select_baseline({}, EnvKey("24gb", DEVICE, "0.32.0")) is None


def test_match_dict_names_the_entry() -> None:
    data = BaselineMatch(entry("0.27.1"), exact=False).to_dict()
    assert data["vllm_version"] == "0.27.1" and data["exact"] is False
    assert data["env"] == f"24gb|{DEVICE}|vllm 0.27.1" and data["commit"] == "abc1234"


# ------------------------------------------------------------------------------------------------- across versions


def test_every_comparison_names_the_version_and_a_regression_across_an_upgrade_fails() -> None:
    old = entry("0.27.1", output_throughput=1000.0, weights_memory=0.5 * GIB)
    comparisons = compare(old, {"output_throughput": [215.0], "weights_memory": [0.6 * GIB]}, {})
    assert {c.baseline_version for c in comparisons} == {"0.27.1"}
    by_name = {c.metric: c for c in comparisons}
    assert by_name["weights_memory"].status == "info"  # reported, not gated
    assert "reported, not gated" in by_name["weights_memory"].message()
    failures = gate_failures(comparisons, strict=False)
    assert [c.metric for c in failures] == ["output_throughput"]
    text = format_gate_failure("t.py::test_a", failures, old, running_version="0.32.0")
    assert "compared across the vLLM upgrade 0.27.1 -> 0.32.0" in text
    assert "215.0 tok/s now vs 1,000.0 tok/s baseline on vLLM 0.27.1 (-78.5%, tolerance 10%)" in text
    assert "baseline recorded 2026-11-30T05:00:00Z on host ci-1, commit abc1234, 1 run, vLLM 0.27.1" in text


# ---------------------------------------------------------------------------------------------------------- re-plan


def untiered(
    device_gib: float, requested_gib: float, kv_gib: float, tokens: float, peak_gib: float, tier: str = "auto"
) -> BaselineEntry:
    return entry(
        "0.32.0",
        tier=tier,
        device_memory=device_gib * GIB,
        requested_memory=requested_gib * GIB,
        kv_cache_memory=kv_gib * GIB,
        kv_cache_tokens=tokens,
        startup_peak_memory=peak_gib * GIB,
        output_throughput=1000.0,
    )


def now_samples(
    device_gib: float, requested_gib: float, kv_gib: float, tokens: float, peak_gib: float
) -> dict[str, list[float]]:
    return {
        "device_memory": [device_gib * GIB],
        "requested_memory": [requested_gib * GIB],
        "kv_cache_memory": [kv_gib * GIB],
        "kv_cache_tokens": [tokens],
        "startup_peak_memory": [peak_gib * GIB],
        "output_throughput": [1000.0],
    }


def test_an_untiered_run_on_more_node_memory_is_compared_with_the_replanned_baseline() -> None:
    # Recorded on an 8.8 GiB node at utilization 0.1: 0.88 GiB requested, 0.84 GiB non-KV, 0.04 GiB KV.
    base = untiered(8.8, 0.88, 0.04, 20_000, 1.0)
    # The same config on a 14 GiB node: 1.40 GiB requested, the same 0.84 GiB non-KV, 0.56 GiB KV.
    same = now_samples(14.0, 1.40, 0.56, 280_000, 1.52)
    by_name = {c.metric: c for c in compare(base, same, TOKENS_GATED)}
    assert by_name["kv_cache_tokens"].status == "ok"
    assert by_name["kv_cache_tokens"].baseline == pytest.approx(280_000)
    assert by_name["kv_cache_tokens"].recorded == 20_000
    assert by_name["startup_peak_memory"].status == "ok"
    assert by_name["startup_peak_memory"].baseline == pytest.approx(1.52 * GIB)
    assert by_name["output_throughput"].recorded is None  # not KV-sized: compared as recorded
    assert "14.00 GiB of device memory now, 8.80 GiB when the baseline was recorded" in by_name["kv_cache_tokens"].note
    assert "(re-planned from 20,000 tokens)" in by_name["kv_cache_tokens"].message()
    # Compared as recorded, the same healthy run "improves" by 1,300%; on a smaller node it would regress.
    base.env = EnvKey("8gb", DEVICE, "0.32.0")  # a tiered entry is never re-planned
    by_name = {c.metric: c for c in compare(base, same, TOKENS_GATED)}
    assert by_name["kv_cache_tokens"].status == "improved" and by_name["kv_cache_tokens"].change_pct == 1300.0


def test_a_real_kv_regression_on_another_node_size_still_fails() -> None:
    base = untiered(14.0, 1.40, 0.56, 280_000, 1.52)
    # 10.46 GiB node; the non-KV usage grew from 0.84 to 0.94 GiB (a heavier release): KV 0.11 instead of 0.21 GiB.
    now = now_samples(10.46, 1.046, 0.106, 53_000, 1.17)  # the peak holds the same total: not a regression
    failures = gate_failures(compare(base, now, TOKENS_GATED), strict=False)
    assert [c.metric for c in failures] == ["kv_cache_memory", "kv_cache_tokens"]
    assert failures[1].baseline == pytest.approx(280_000 * (0.56 - 0.354) / 0.56)


def test_the_replan_moves_by_what_vllm_requested_not_by_the_plugins_reading_of_the_node() -> None:
    """A busy machine (benchmarks/data/gate_noise_ci_2026-12-02_busy.json, sessions same-3 and same-4): the plugin
    read the node at 10.84 GiB where it had read 9.46, but vLLM's request stayed 0.95 -> 0.96 GiB and its KV cache
    0.29 -> 0.30 GiB. Moved by utilization x the plugin's difference the baseline would be 0.43 GiB (-30%, a false
    failure); moved by vLLM's own request it is 0.30."""
    base = untiered(9.46, 0.95, 0.29, 302_848, 2.185)
    base.config = "vllm serve tiny --gpu-memory-utilization 0.1"
    now = now_samples(10.84, 0.96, 0.30, 316_032, 2.197)
    by_name = {c.metric: c for c in compare(base, now, TOKENS_GATED, now_config=base.config)}
    assert by_name["kv_cache_memory"].baseline == pytest.approx(0.30 * GIB)
    assert by_name["kv_cache_memory"].status == by_name["kv_cache_tokens"].status == "ok"
    # At another utilization the request moved by the config: moved by utilization x the node, the change shows.
    bigger = compare(
        base, now_samples(10.84, 3.25, 2.59, 2_700_000, 4.5), TOKENS_GATED, now_config=base.config.replace("0.1", "0.3")
    )
    assert {c.metric: c.status for c in bigger}["kv_cache_memory"] == "improved"
    # On the same node nothing is re-planned: a larger request is the config's, and it shows.
    assert replan_for(base, now_samples(9.46, 2.84, 2.19, 2_300_000, 4.3), base.config) is None


def test_no_replan_on_a_tiered_run_or_when_vllm_did_not_size_the_kv_cache_from_the_node() -> None:
    tiered = untiered(8.8, 0.88, 0.04, 20_000, 1.0, tier="8gb")
    assert replan_for(tiered, now_samples(14.0, 1.40, 0.56, 280_000, 1.52)) is None
    explicit = now_samples(14.0, 1.40, 1.0, 500_000, 2.0)
    del explicit["requested_memory"]  # VLLM_CPU_KVCACHE_SPACE: "Explicitly set", no requested memory
    assert replan_for(untiered(8.8, 0.88, 0.04, 20_000, 1.0), explicit) is None
    # Within rounding of the logged GiB: the same machine.
    assert replan_for(untiered(10.46, 1.05, 0.21, 108_160, 1.2), now_samples(10.47, 1.05, 0.21, 108_160, 1.2)) is None


def test_kv_tokens_cannot_be_replanned_without_the_kv_memory() -> None:
    base = untiered(8.8, 0.88, 0.04, 20_000, 1.0)
    del base.metrics["kv_cache_memory"]
    by_name = {c.metric: c for c in compare(base, now_samples(14.0, 1.40, 0.56, 280_000, 1.52), TOKENS_GATED)}
    assert by_name["kv_cache_tokens"].status == "skipped"
    assert "not compared" in by_name["kv_cache_tokens"].message()
    assert by_name["startup_peak_memory"].status == "ok"  # bytes move by the KV budget alone


# ------------------------------------------------------------------------------------------------------------ judge


def test_a_judge_sees_both_sides_samples_and_its_detail_is_shown() -> None:
    seen: list[tuple[str, Sample, Sample]] = []

    def judge(metric: Metric, baseline: Sample, now: Sample, tolerance: Tolerance) -> Verdict:
        seen.append((metric.name, baseline, now))
        return Verdict("regressed", detail=f"{len(now.values)} runs vs {len(baseline.values)}")

    base = entry("0.32.0", output_throughput=1000.0)
    base.spread = {"output_throughput": [990.0, 1000.0, 1010.0]}
    [comparison] = compare(base, {"output_throughput": [900.0, 950.0]}, {}, judge=judge)
    assert seen == [("output_throughput", Sample(1000.0, (990.0, 1000.0, 1010.0)), Sample(925.0, (900.0, 950.0)))]
    assert comparison.status == "regressed" and comparison.message().endswith("tolerance 10%, 2 runs vs 3)")
    data = comparison.to_dict()
    assert data["baseline_values"] == [990.0, 1000.0, 1010.0] and data["now_values"] == [900.0, 950.0]
    assert data["detail"] == "2 runs vs 3" and data["tolerance"] == "10%" and data["message"]


def test_the_entrys_history_reaches_the_judge_and_the_record() -> None:
    seen: list[Sample] = []

    def judge(metric: Metric, baseline: Sample, now: Sample, tolerance: Tolerance) -> Verdict:
        seen.append(baseline)
        return Verdict("ok")

    base = entry("0.32.0", output_throughput=1000.0)
    base.spread = {"output_throughput": [990.0, 1000.0, 1010.0]}
    base.history = {"output_throughput": [900.0, 1100.0, 950.0]}
    [comparison] = compare(base, {"output_throughput": [960.0]}, {}, judge=judge)
    assert seen == [Sample(1000.0, (990.0, 1000.0, 1010.0), (900.0, 1100.0, 950.0))]
    assert comparison.to_dict()["baseline_history"] == [900.0, 1100.0, 950.0]


def test_the_noise_judge_names_the_earlier_sessions_in_the_message() -> None:
    from pytest_vllm_mem.baseline.metrics import resolve_tolerances
    from pytest_vllm_mem.baseline.noise import NoiseJudge

    noise_aware_judge = NoiseJudge(prior=None)  # the window alone (a session prior moderates it: test_noise)

    base = entry("0.32.0", output_throughput=1000.0)
    base.spread = {"output_throughput": [990.0, 1000.0, 1010.0, 1005.0, 995.0]}
    now = {"output_throughput": [820.0, 830.0, 810.0, 820.0]}
    [tight] = compare(base, now, resolve_tolerances({}, {}, {}), judge=noise_aware_judge)
    assert tight.status == "regressed" and "4 runs vs 5, tolerance" in tight.message()
    # The recording session was a fast one: earlier sessions' medians scatter by about 15%.
    base.history = {"output_throughput": [850.0, 1000.0, 1150.0]}
    [widened] = compare(base, now, resolve_tolerances({}, {}, {}), judge=noise_aware_judge)
    assert widened.status == "ok"
    assert (
        "(-18.0% +- " in widened.message() and "%, 4 runs vs 5, 3 earlier sessions, tolerance 10%" in widened.message()
    )


def test_a_replanned_comparison_goes_without_history() -> None:
    seen: list[Sample] = []

    def judge(metric: Metric, baseline: Sample, now: Sample, tolerance: Tolerance) -> Verdict:
        seen.append(baseline)
        return Verdict("ok")

    base = untiered(10.0, 1.0, 0.5, 5000, 2.0)
    base.history = {"kv_cache_tokens": [5100.0, 4900.0, 5000.0]}
    compare(base, now_samples(12.0, 1.2, 0.7, 7000, 2.2), {}, judge=judge)
    assert all(not s.history for s in seen)
