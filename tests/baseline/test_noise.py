"""The noise-scaled decision: robust spread, threshold, direction, what it says, and how often it is wrong."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np
import pytest

from pytest_vllm_mem.baseline.compare import Comparison
from pytest_vllm_mem.baseline.noise import (
    ALPHAS,
    CONFIRM_SESSIONS,
    DEFAULT_PRIOR,
    SUSPECT_LEVEL,
    Decision,
    NoiseError,
    SuiteLevel,
    confirm_on_fresh_sessions,
    decide,
    log_deviations,
    median,
    median_variance_factor,
    normal_quantile,
    pooled_spread,
    t_quantile,
)


def test_median_of_odd_and_even_groups() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(NoiseError):
        median([])


def test_odd_group_drops_the_medians_own_zero_deviation() -> None:
    assert log_deviations([90.0, 100.0, 120.0]) == pytest.approx([math.log(100 / 90), math.log(1.2)])
    assert log_deviations([90.0, 160.0]) == pytest.approx([math.log(4 / 3), math.log(4 / 3)])  # median 120
    assert log_deviations([100.0]) == []
    with pytest.raises(NoiseError):
        log_deviations([100.0, 0.0])


def test_pooled_spread_ignores_a_shift_between_groups() -> None:
    quiet = pooled_spread([100.0, 101.0, 99.0], [50.0, 50.5, 49.5])  # halved, but each group is within 1%
    assert quiet == pytest.approx(1.4826 * math.log(1.01), rel=0.01)
    assert pooled_spread([100.0], [120.0]) is None


def test_one_slow_run_does_not_blow_up_the_spread() -> None:
    # Five quiet runs and one stall: the MAD barely moves, a standard deviation would triple.
    runs = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 400.0]
    spread = pooled_spread(runs)
    assert spread is not None and spread < 0.02
    assert np.std(runs) / np.median(runs) > 0.2


def test_median_variance_factor() -> None:
    assert median_variance_factor(1) == 1.0
    assert median_variance_factor(3) == pytest.approx(1.35)
    assert median_variance_factor(50) == pytest.approx(math.pi / 2)
    with pytest.raises(NoiseError):
        median_variance_factor(0)


def test_quiet_runs_fail_on_a_change_beyond_the_floor() -> None:
    d = decide([1000.0, 1005.0, 995.0], [870.0, 875.0, 865.0], higher_is_better=True, floor=0.10)
    assert d.status == "regressed"
    assert d.change == pytest.approx(-0.13)
    assert not d.noise_limited and d.threshold == 0.10


def test_noisy_runs_widen_the_threshold() -> None:
    # Runs that scatter +-15% cannot show a 20% drop.
    base, now = [1000.0, 1150.0, 850.0], [800.0, 950.0, 650.0]
    d = decide(base, now, higher_is_better=True, floor=0.10)
    assert d.status == "ok"
    assert d.noise_limited and d.threshold > 0.20
    assert d.stderr is not None and d.threshold == pytest.approx(1 - math.exp(-4 * d.stderr))
    # The same drop on quiet runs fails.
    assert (
        decide([1000.0, 1010.0, 990.0], [800.0, 810.0, 790.0], higher_is_better=True, floor=0.10).status == "regressed"
    )


def test_direction_for_latency_and_mirrored_improvement() -> None:
    slower = decide([100.0, 101.0, 99.0], [130.0, 131.0, 129.0], higher_is_better=False, floor=0.20)
    assert slower.status == "regressed" and slower.worse_by == pytest.approx(0.30)
    faster = decide([100.0, 101.0, 99.0], [70.0, 71.0, 69.0], higher_is_better=False, floor=0.20)
    assert faster.status == "improved" and faster.worse_by == pytest.approx(-0.30)
    assert decide([100.0], [85.0], higher_is_better=True, floor=0.20).status == "ok"


def test_a_change_of_exactly_the_floor_passes() -> None:
    assert decide([1000.0], [900.0], higher_is_better=True, floor=0.10).status == "ok"
    assert decide([1000.0], [899.0], higher_is_better=True, floor=0.10).status == "regressed"


def test_single_runs_fall_back_to_the_floor_and_say_so() -> None:
    d = decide([1000.0], [820.0], higher_is_better=True, floor=0.15)
    assert d.stderr is None and d.threshold == 0.15 and d.status == "regressed"
    assert d.summary() == "-18.0%, 1 run vs 1"
    assert "no repeats" in d.detail() and "catches" not in d.detail()


def test_a_window_of_earlier_sessions_judges_the_run_as_one_more_session() -> None:
    base, now = [1000.0, 1002.0, 998.0], [850.0, 852.0, 848.0]
    alone = decide(base, now, higher_is_better=True, floor=0.10)
    assert alone.status == "regressed" and alone.n_history == 0 and alone.between is None
    # Earlier sessions' medians moved +-10-20% from session to session: a 15% shift is within that.
    history = [1000.0, 1200.0, 800.0, 1100.0, 900.0]
    window = decide(base, now, higher_is_better=True, floor=0.10, history=history)
    assert window.status == "ok" and window.n_history == 5
    logs = [math.log(x) for x in [*history, 1000.0]]
    sd = statistics.stdev(logs)
    assert window.between == pytest.approx(sd) and window.stderr == pytest.approx(sd * math.sqrt(1 + 1 / 6))
    # Against the window's geometric mean, with Student's t for 6 sessions (5 degrees of freedom, one-sided 2.5%).
    assert window.window_change == pytest.approx(850.0 / math.exp(sum(logs) / 6) - 1)
    assert window.k == pytest.approx(t_quantile(5, 0.025)) == pytest.approx(2.571, abs=5e-4) and alone.k == 4.0
    assert window.summary().endswith(", 3 runs vs 3, 5 earlier sessions")
    assert "vs the mean of 6 sessions" in window.limit_text() and "(t 2.57 x " in window.limit_text()
    # A 70% drop stands out of even that session-to-session scatter.
    assert decide(base, [300.0, 301.0, 299.0], higher_is_better=True, floor=0.10, history=history).status == "regressed"


def test_a_fast_recording_session_does_not_fail_a_typical_run() -> None:
    # The baseline session happened to be 20% fast; the run is typical of the sessions before it.
    history, base, now = [800.0, 820.0, 790.0, 810.0], [1000.0, 1010.0, 990.0], [805.0, 800.0, 810.0]
    assert decide(base, now, higher_is_better=True, floor=0.10).status == "regressed"  # no window: "-19.5%"
    d = decide(base, now, higher_is_better=True, floor=0.10, history=history)
    assert d.change == pytest.approx(-0.195, abs=1e-3) and d.window_change is not None and d.window_change > -0.05
    assert d.status == "ok"


def test_t_quantiles_pay_for_few_sessions() -> None:
    assert t_quantile(2, 0.025) > t_quantile(3, 0.025) > t_quantile(5, 0.025) > t_quantile(30, 0.025) > 1.96
    assert t_quantile(5, 0.05) < t_quantile(5, 0.025) < t_quantile(5, 0.01)
    # The exact distribution, at any level a suite's share asks for (published tables to their 3 decimals).
    for dof, alpha, table in ((1, 0.025, 12.706), (2, 0.01, 6.965), (4, 0.05, 2.132), (9, 0.025, 2.262)):
        assert t_quantile(dof, alpha) == pytest.approx(table, abs=5e-4)
    assert t_quantile(5, 0.0005) == pytest.approx(6.869, abs=5e-3) and t_quantile(200, 0.025) < 1.98
    with pytest.raises(NoiseError, match="accepted"):
        t_quantile(5, 0.5)


def test_the_level_moves_the_limit_of_the_window_rule() -> None:
    # Sessions scattered by ~6%: the lower the level, the larger the drop it takes to fail.
    history, base = [1000.0, 1080.0, 930.0, 1040.0], [1000.0, 1003.0, 997.0]

    def verdicts(x: float) -> list[str]:
        now = [x, x + 2, x - 2]
        return [decide(base, now, higher_is_better=True, floor=0.10, history=history, alpha=a).status for a in ALPHAS]

    assert ALPHAS == (0.05, 0.025, 0.01)
    assert verdicts(880.0) == ["regressed", "ok", "ok"]
    assert verdicts(850.0) == ["regressed", "regressed", "ok"]
    assert verdicts(800.0) == ["regressed", "regressed", "regressed"]
    assert verdicts(900.0) == ["ok", "ok", "ok"]


def test_one_earlier_session_is_not_weighed() -> None:
    # With the baseline's own session that is one difference: too rough a spread to lean on.
    d = decide([1000.0, 1002.0, 998.0], [850.0, 852.0, 848.0], higher_is_better=True, floor=0.10, history=[700.0])
    assert d.n_history == 0 and d.between is None and d.status == "regressed" and d.window_change is None
    two = decide(
        [1000.0, 1002.0, 998.0], [850.0, 852.0, 848.0], higher_is_better=True, floor=0.10, history=[990.0, 700.0]
    )
    assert two.n_history == 2 and two.summary().endswith("2 earlier sessions")


def test_quiet_history_does_not_narrow_the_noise_of_the_runs() -> None:
    # Session medians closer together than this run's own repeats scatter: their standard error stands.
    base, now = [1000.0, 1100.0, 900.0], [1000.0, 1080.0, 920.0]
    quiet = decide(base, now, higher_is_better=True, floor=0.10, history=[1000.0, 1001.0, 999.0])
    within = pooled_spread(base, now)
    assert within is not None and quiet.n_history == 3
    assert quiet.stderr == pytest.approx(within * math.sqrt(median_variance_factor(3) / 3))


def test_history_lets_single_runs_see_the_noise() -> None:
    alone = decide([1000.0], [800.0], higher_is_better=True, floor=0.10)
    assert alone.stderr is None and alone.status == "regressed"
    seen = decide([1000.0], [800.0], higher_is_better=True, floor=0.10, history=[1150.0, 900.0, 1050.0, 850.0])
    assert seen.stderr is not None and seen.status == "ok" and "no repeats" not in seen.limit_text()
    assert seen.detail().startswith("-20.0% +- ") and ", 1 run vs 1, 4 earlier sessions; " in seen.detail()


def _session_rates(history_len: int, drop: float, trials: int = 1500) -> float:
    """Failure rate of 3-vs-3 comparisons on a runner whose sessions shift by 10% (sd) and whose loads scatter by 3%
    within a session; the baseline keeps `history_len` earlier sessions' medians."""
    rng = np.random.default_rng(16)
    failed = 0
    for _ in range(trials):
        shifts = np.exp(0.10 * rng.standard_normal(history_len + 2))
        sessions = [1000 * s * np.exp(0.03 * rng.standard_normal(3)) for s in shifts]
        history = [float(np.median(s)) for s in sessions[:-2]]
        d = decide(
            list(sessions[-2]), list(sessions[-1] * (1 - drop)), higher_is_better=True, floor=0.10, history=history
        )
        failed += d.status == "regressed"
    return failed / trials


def test_a_full_window_on_a_runner_with_5_percent_session_shifts_meets_the_targets() -> None:
    # The quieter of the two replayed collections scattered by 5.4% between sessions: with the 5 earlier sessions the
    # file keeps, healthy 3-vs-3 runs rarely fail and a 30% slowdown nearly always does (normal noise, simulated).
    rng = np.random.default_rng(17)
    outcomes = {0.0: 0, 0.30: 0}
    trials = 2000
    for drop in outcomes:
        for _ in range(trials):
            shifts = np.exp(0.05 * rng.standard_normal(7))
            sessions = [1000 * s * np.exp(0.03 * rng.standard_normal(3)) for s in shifts]
            history = [float(np.median(s)) for s in sessions[:-2]]
            now = list(sessions[-1] * (1 - drop))
            outcomes[drop] += (
                decide(list(sessions[-2]), now, higher_is_better=True, floor=0.10, history=history).status
                == "regressed"
            )
    assert outcomes[0.0] / trials < 0.03
    assert outcomes[0.30] / trials > 0.97


def test_simulated_session_shifts_fail_healthy_runs_without_history_and_rarely_with_it() -> None:
    without = _session_rates(0, 0.0)
    with_history = _session_rates(5, 0.0)
    assert without > 0.15  # repeats alone cannot see a shift of the whole machine
    assert with_history < 0.03
    assert _session_rates(5, 0.70) > 0.95  # a 70% drop is still caught


def test_summary_and_detail_carry_the_statistics() -> None:
    d = decide([1000.0, 1060.0, 940.0, 1000.0, 1030.0], [820.0, 860.0, 780.0, 800.0], higher_is_better=True, floor=0.10)
    summary = d.summary()
    assert summary.startswith("-19.0% +- ") and summary.endswith("%, 4 runs vs 5")
    assert d.detail().startswith(summary + "; limit ")
    assert "% or more" in d.detail()
    assert d.detectable > d.threshold


@pytest.mark.parametrize(
    "bad",
    [
        {"baseline": [], "now": [1.0]},
        {"baseline": [0.0], "now": [1.0]},
        {"baseline": [1.0], "now": [math.nan]},
        {"baseline": [1.0], "now": [1.0], "floor": -0.1},
        {"baseline": [1.0], "now": [1.0], "k": math.inf},
    ],
)
def test_inputs_that_cannot_be_judged(bad: dict[str, Any]) -> None:
    args = {"higher_is_better": True, "floor": 0.1, **bad}
    with pytest.raises(NoiseError):
        decide(**args)


def _rates(
    n: int, sd: float, true_change: float, floor: float, k: float = 3.0, trials: int = 2000
) -> tuple[float, float]:
    """(failure rate, median threshold) of `trials` simulated n-vs-n comparisons with normal noise `sd`."""
    rng = np.random.default_rng(15)
    failed, thresholds = 0, []
    for _ in range(trials):
        base = 1000 * (1 + sd * rng.standard_normal(n))
        now = 1000 * (1 + true_change) * (1 + sd * rng.standard_normal(n))
        d: Decision = decide(list(base), list(now), higher_is_better=True, floor=floor, k=k)
        failed += d.status == "regressed"
        thresholds.append(d.threshold)
    return failed / trials, float(np.median(thresholds))


def test_simulated_noise_false_failures_are_rare_and_large_changes_are_caught() -> None:
    # No floor at all: the noise scaling alone keeps false failures of 3 vs 3 runs under 3%.
    false_rate, threshold = _rates(3, 0.05, 0.0, floor=0.0)
    assert false_rate < 0.03
    # The threshold tracks the noise: about 3 standard errors of a difference of two medians of 3.
    assert threshold == pytest.approx(3 * 0.05 * math.sqrt(2 * 1.35 / 3), rel=0.25)
    caught, _ = _rates(3, 0.05, -0.30, floor=0.10)
    assert caught > 0.93
    # More repeats buy sensitivity: a 15% drop in 5%-noise is caught more often with 5 runs than with 3.
    assert _rates(5, 0.05, -0.15, floor=0.10)[0] > _rates(3, 0.05, -0.15, floor=0.10)[0]


# ---- the judge the gate uses ------------------------------------------------------------------------------------


def test_judge_decides_throughput_by_noise_and_memory_by_the_fixed_band() -> None:
    from pytest_vllm_mem.baseline.compare import Sample
    from pytest_vllm_mem.baseline.metrics import METRICS, Tolerance
    from pytest_vllm_mem.baseline.noise import NoiseJudge, is_noisy, noise_aware_judge

    assert is_noisy(METRICS["output_throughput"]) and is_noisy(METRICS["ttft_p50"])
    assert not is_noisy(METRICS["load_peak_memory"]) and not is_noisy(METRICS["kv_cache_tokens"])
    throughput = METRICS["output_throughput"]
    tolerance = Tolerance(relative=0.10, unit="tok/s")
    # Runs scattering +-15%: a 20% drop is within the noise for the noise judge, beyond the band for the fixed one.
    base, now = Sample.of([1000.0, 1150.0, 850.0]), Sample.of([800.0, 950.0, 650.0])
    verdict = noise_aware_judge(throughput, base, now, tolerance)
    assert verdict.status == "ok"
    assert verdict.detail.startswith("-20.0% +- ") and ", 3 runs vs 3; limit " in verdict.detail
    # k is the least multiple: a level asking for more (normal quantile of alpha) raises it, never lowers it.
    assert NoiseJudge(k=0.5, alpha=0.4, provisional=False)(throughput, base, now, tolerance).status == "regressed"
    # The plugin's default: a baseline without a window (none recorded earlier, no pooled spread) only warns.
    warned = NoiseJudge(k=0.5, alpha=0.4)(throughput, base, now, tolerance)
    assert warned.status == "warned" and "warned, not failed" in warned.detail and not warned.confirm
    # Memory keeps the fixed band and adds no statistics.
    memory = METRICS["load_peak_memory"]
    band = Tolerance(relative=0.05, unit="bytes")
    fixed = noise_aware_judge(memory, Sample.of([1000.0, 1150.0, 850.0]), Sample.of([940.0, 1090.0, 790.0]), band)
    assert fixed.status == "improved" and fixed.detail == ""


def test_judge_takes_the_floor_from_an_absolute_tolerance_and_the_files_median() -> None:
    from pytest_vllm_mem.baseline.compare import Sample
    from pytest_vllm_mem.baseline.metrics import METRICS, Tolerance
    from pytest_vllm_mem.baseline.noise import NoiseJudge, noise_aware_judge

    ttft = METRICS["ttft_p50"]
    # Twice as slow: beyond TTFT's session noise (noise.TTFT_SESSION_SPREAD), so the floor decides.
    quiet_base, slower = Sample.of([100.0, 101.0, 99.0]), Sample.of([200.0, 201.0, 199.0])
    assert noise_aware_judge(ttft, quiet_base, slower, Tolerance(absolute=150.0, unit="ms")).status == "ok"
    judge = NoiseJudge(provisional=False)
    assert judge(ttft, quiet_base, slower, Tolerance(absolute=30.0, unit="ms")).status == "regressed"
    slower = Sample.of([140.0, 141.0, 139.0])
    # A median edited in the file (runs kept): the runs are moved to it, so 140 ms is +12% of 125 ms, not +40%.
    edited = Sample(125.0, (100.0, 101.0, 99.0))
    verdict = noise_aware_judge(ttft, edited, slower, Tolerance(relative=0.20, unit="ms"))
    assert verdict.status == "ok" and verdict.detail.startswith("+12.0%")


def test_default_k_with_five_repeats_catches_a_30_percent_drop_in_5_percent_noise() -> None:
    from pytest_vllm_mem.baseline.noise import DEFAULT_K

    assert _rates(5, 0.05, 0.0, floor=0.0, k=DEFAULT_K)[0] < 0.01
    assert _rates(5, 0.05, -0.30, floor=0.10, k=DEFAULT_K)[0] > 0.97
    # With 3 repeats the same drop is missed about one time in ten.
    assert _rates(3, 0.05, -0.30, floor=0.10, k=DEFAULT_K)[0] < 0.93


def test_ttft_p99_is_reported_and_gated_only_when_a_tolerance_is_set() -> None:
    from pytest_vllm_mem.baseline.compare import compare
    from pytest_vllm_mem.baseline.metrics import GATED, parse_tolerance_spec, resolve_tolerances
    from pytest_vllm_mem.baseline.noise import noise_aware_judge
    from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey

    assert "ttft_p99" not in GATED
    entry = BaselineEntry.from_samples(
        "t", EnvKey("auto", "cpu", "0.32.0"), {"ttft_p99": [200.0, 210.0, 190.0]}, config="tiny"
    )
    slow = {"ttft_p99": [600.0, 610.0, 590.0]}
    default = compare(entry, slow, resolve_tolerances({}, {}, {}), judge=noise_aware_judge)
    assert [c.status for c in default] == ["info"]
    opted = compare(
        entry, slow, resolve_tolerances(parse_tolerance_spec("ttft_p99=50%"), {}, {}), judge=noise_aware_judge
    )
    # Against a baseline recorded once the noise judge warns (NoiseJudge.provisional); it is judged all the same.
    assert [c.status for c in opted] == ["warned"] and "3 runs vs 3" in opted[0].detail


def test_report_cell_shows_the_statistics_of_a_noise_judged_regression() -> None:
    from pytest_vllm_mem.plugin.report import _change

    judged = {
        "metric": "output_throughput",
        "change_pct": -18.04,
        "detail": "-18.0% +- 6.1%, 3 runs vs 3; limit 24.4% (4 x 6.1%, above the tolerance), catches 34% or more",
    }
    assert _change(judged) == "-18.0% +- 6.1%, 3 runs vs 3"
    assert _change({"change_pct": -18.04, "detail": ""}) == "-18.0%"


def test_failure_message_carries_the_change_with_its_statistics_once() -> None:
    from pytest_vllm_mem.baseline.compare import compare
    from pytest_vllm_mem.baseline.metrics import resolve_tolerances
    from pytest_vllm_mem.baseline.noise import NoiseJudge

    noise_aware_judge = NoiseJudge(prior=None)  # the runs' own spread only (the session prior: its own test)
    from pytest_vllm_mem.baseline.store import BaselineEntry, EnvKey
    from pytest_vllm_mem.plugin.report import _change

    entry = BaselineEntry.from_samples(
        "t",
        EnvKey("auto", "cpu", "0.32.0"),
        {"output_throughput": [1000.0, 1010.0, 990.0, 1005.0, 995.0]},
        config="tiny",
    )
    [c] = compare(
        entry, {"output_throughput": [700.0, 705.0, 695.0]}, resolve_tolerances({}, {}, {}), judge=noise_aware_judge
    )
    assert c.status == "regressed"
    message = c.message()
    assert "(-30.0% +- " in message and ", 3 runs vs 5, tolerance 10%, limit 10% (the tolerance;" in message
    assert message.count("-30.0%") == 1
    assert _change(c.to_dict()).startswith("-30.0% +- ") and _change(c.to_dict()).endswith("3 runs vs 5")


# ---- suite-level control and the session prior (issue 25) -----------------------------------------------------------


def test_the_suite_level_bounds_the_expected_false_failures_of_a_healthy_run() -> None:
    from pytest_vllm_mem.baseline.noise import EFFECTIVE_METRICS, SuiteLevel

    level = SuiteLevel(0.05, families=12)
    assert level.per_comparison == pytest.approx(0.05 / (12 * EFFECTIVE_METRICS))
    # The union bound: the per-comparison levels of all planned comparisons add up to the suite's budget.
    assert level.per_comparison * 12 * EFFECTIVE_METRICS == pytest.approx(0.05)
    text = level.summary(48, 12)
    assert text.startswith("48 noise-judged comparisons in 12 families")
    assert "expected false failures per healthy run: at most 0.05" in text and "12 tests x 2 effective" in text
    assert SuiteLevel(0.025, families=0).per_comparison == pytest.approx(0.0125)  # never divides by zero


def test_a_baseline_recorded_once_carries_the_session_noise_it_cannot_show() -> None:
    from pytest_vllm_mem.baseline.noise import DEFAULT_PRIOR, SESSION_SPREAD, SessionPrior

    # Issue 25's first rerun: one load against one, the new session 24% slower (both healthy).
    alone = decide([858.6], [649.3], higher_is_better=True, floor=0.10)
    assert alone.status == "regressed"  # the tolerance alone: no noise to see
    seen = decide([858.6], [649.3], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR, alpha=0.0125)
    assert seen.status == "ok" and seen.stderr == pytest.approx(SESSION_SPREAD * math.sqrt(2))
    # A real regression is still caught: a 60% drop.
    assert decide([858.6], [340.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR).status == "regressed"
    # A second session on the now side (a fresh start) narrows it.
    two = decide([858.6], [649.3], higher_is_better=True, floor=0.10, prior=SessionPrior(0.10), now_sessions=2)
    assert two.stderr is not None and seen.stderr is not None and two.stderr < seen.stderr


def test_a_pooled_spread_replaces_a_few_session_window_and_needs_enough_of_them() -> None:
    from pytest_vllm_mem.baseline.noise import MIN_POOLED_DOF, pooled_prior

    assert pooled_prior([[1000.0, 1100.0, 900.0]]) is None  # 2 degrees of freedom
    windows = [[1000.0, 1100.0, 900.0, 1050.0], [500.0, 550.0, 450.0, 525.0], [10.0, 11.0, 9.0, 10.5]]
    prior = pooled_prior(windows)
    assert prior is not None and prior.pooled and prior.dof == 9 >= MIN_POOLED_DOF
    # Each window around its own mean: the same relative scatter at any scale gives that scatter.
    own = statistics.stdev([math.log(v) for v in windows[0]])
    assert prior.sd == pytest.approx(own, rel=0.01)
    history, base, now = [1000.0, 1100.0], [900.0], [700.0]
    judged = decide(base, now, higher_is_better=True, floor=0.10, history=history, prior=prior, alpha=0.01)
    assert judged.k == pytest.approx(t_quantile(9, 0.01))  # the pooled degrees of freedom, not the window's 2


def test_a_failure_near_its_limit_is_suspect_a_plain_one_is_not() -> None:
    near = decide([1000.0] * 3, [850.0, 860.0, 840.0], higher_is_better=True, floor=0.10)
    far = decide([1000.0] * 3, [100.0, 110.0, 90.0], higher_is_better=True, floor=0.10)
    assert near.status == far.status == "regressed"
    assert near.suspect and 1 < near.margin < far.margin and not far.suspect
    assert not decide([1000.0] * 3, [1000.0] * 3, higher_is_better=True, floor=0.10).suspect


def test_a_pass_is_suspect_when_worse_than_its_baseline_at_the_suspect_level() -> None:
    """At a 20-test suite's share a -32% session passes against one recorded session, but it is 1.96 standard
    errors out: fresh servers decide. -5% is not; an improvement never is."""
    level = SuiteLevel(families=20).per_comparison
    prior = DEFAULT_PRIOR
    worse = decide([1000.0], [680.0], higher_is_better=True, floor=0.10, alpha=level, prior=prior)
    assert worse.provisional  # one session and the assumed spread: the plugin's judge would not re-measure it
    assert worse.status == "ok" and worse.z is not None and worse.z >= normal_quantile(SUSPECT_LEVEL)
    assert worse.suspect
    slight = decide([1000.0], [950.0], higher_is_better=True, floor=0.10, alpha=level, prior=prior)
    better = decide([1000.0], [1300.0], higher_is_better=True, floor=0.10, alpha=level, prior=prior)
    assert not slight.suspect and not better.suspect
    # Within its tolerance a change never fails, so no fresh server is spent on it, however many errors out it is.
    wide = decide([1000.0], [680.0], higher_is_better=True, floor=0.80, alpha=level, prior=prior)
    assert wide.z == worse.z and not wide.suspect


def test_sessions_are_averaged_on_the_log_scale_and_count_as_independent_draws() -> None:
    """Three fresh sessions: the mean of their logs (not the median of 3, whose variance is 1.35 times larger), judged
    with the session spread divided by the sessions."""
    one = decide([1000.0], [800.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR)
    three = decide(
        [1000.0], [800.0, 640.0, 1000.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR, now_sessions=3
    )
    centre = math.exp(sum(math.log(v) for v in (800.0, 640.0, 1000.0)) / 3)
    assert three.worse_by == pytest.approx(0.2)  # the change shown is still of the medians
    assert three.stderr is not None and one.stderr is not None and three.z is not None
    assert -math.log(centre / 1000.0) == pytest.approx(three.z * three.stderr)  # judged: the mean of the logs
    # One recorded session against three: the session spread counts 1 + 1/3 times, not 2 (x 1.155 vs 1.414).
    spread = DEFAULT_PRIOR.sd
    assert three.stderr == pytest.approx(spread * math.sqrt(1 + 1 / 3))
    assert one.stderr == pytest.approx(spread * math.sqrt(2))


def test_confirmation_stops_once_nothing_is_suspect_and_never_runs_past_its_sessions() -> None:
    suspect = Comparison("output_throughput", 1000.0, 700.0, -30.0, None, "regressed", confirmable=True)
    cleared = Comparison("output_throughput", 1000.0, 990.0, -1.0, None, "ok")
    looks: list[int] = []

    def clears(sessions: int) -> list[Comparison]:
        looks.append(sessions)
        return [cleared]

    assert confirm_on_fresh_sessions([suspect], clears) == ([cleared], 2) and looks == [2]
    looks.clear()

    def stays(sessions: int) -> list[Comparison]:
        looks.append(sessions)
        return [suspect]

    assert confirm_on_fresh_sessions([suspect], stays) == ([suspect], CONFIRM_SESSIONS + 1)
    assert looks == list(range(2, CONFIRM_SESSIONS + 2))
    assert confirm_on_fresh_sessions([suspect], lambda sessions: None) == ([suspect], 1)
    assert confirm_on_fresh_sessions([cleared], stays) == ([cleared], 1)


def test_ttft_has_its_own_session_spread_wide_enough_for_the_shifts_seen_on_healthy_runs() -> None:
    """+59.2% and +61.6% TTFT p50 on a new server right after its baseline, healthy (CI 2026-12-02, issue 25): not a
    regression at a one-test suite's level; twice as slow still is. Other metrics keep the general spread."""
    from pytest_vllm_mem.baseline.compare import Sample
    from pytest_vllm_mem.baseline.metrics import METRICS, Tolerance
    from pytest_vllm_mem.baseline.noise import NoiseJudge

    judge = NoiseJudge(alpha=0.0125, provisional=False)
    ttft, tpot = METRICS["ttft_p50"], METRICS["tpot_p50"]
    relative = Tolerance(relative=0.20, unit="ms")
    assert judge(ttft, Sample.of([31.9]), Sample.of([50.7, 49.0]), relative).status == "ok"
    assert judge(ttft, Sample.of([87.0]), Sample.of([141.0]), relative).status == "ok"
    assert judge(ttft, Sample.of([31.9]), Sample.of([64.0, 65.0]), relative).status == "regressed"
    assert judge(tpot, Sample.of([10.0]), Sample.of([16.2, 15.9]), relative).status == "regressed"


def test_a_baseline_is_provisional_until_a_window_or_a_pooled_spread_measures_the_runner() -> None:
    """Provisional: judged on the assumed session spread alone (no window of MIN_HISTORY earlier sessions, none pooled
    over the file). A near-limit regression then warns; far beyond reach it still regresses."""
    from pytest_vllm_mem.baseline.noise import CONFIRM_REACH, MIN_HISTORY, SessionPrior

    once = decide([1000.0], [600.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR)
    assert once.provisional and once.status == "regressed" and once.margin <= CONFIRM_REACH and once.warned
    plain = decide([1000.0], [50.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR)
    assert plain.provisional and plain.margin > CONFIRM_REACH and not plain.warned
    history = [1000.0 * (1 + 0.05 * i) for i in range(MIN_HISTORY)]
    windowed = decide([1000.0], [600.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR, history=history)
    assert not windowed.provisional and not windowed.warned
    short = decide([1000.0], [600.0], higher_is_better=True, floor=0.10, prior=DEFAULT_PRIOR, history=history[:-1])
    assert short.provisional
    pooled = SessionPrior(DEFAULT_PRIOR.sd, dof=20, pooled=True)
    assert not decide([1000.0], [600.0], higher_is_better=True, floor=0.10, prior=pooled).provisional
    # Without any session spread (a judge given prior=None) the repeats alone decide: nothing is assumed.
    assert not decide([1000.0] * 3, [600.0] * 3, higher_is_better=True, floor=0.10).provisional
