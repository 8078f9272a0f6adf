"""The change-point search over a baseline entry's series of session medians (baseline/changepoint.py)."""

from __future__ import annotations

import random

from pytest_vllm_mem.baseline.changepoint import MIN_SEGMENT, find_step


def test_a_step_is_found_at_its_commit_with_its_size() -> None:
    values = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 880.0, 875.0, 885.0, 870.0, 880.0]
    commits = [f"c{i}" for i in range(len(values))]
    step = find_step(values, commits)
    assert step is not None and step.index == 5 and step.commit == "c5"
    assert -0.13 < step.change < -0.11 and step.p_value <= 0.01
    assert step.text("output_throughput") == (
        f"output_throughput: step at commit c5: -12% (p {step.p_value:.2g} over 10 sessions)"
    )


def test_a_slow_drift_that_a_window_absorbs_shows_as_a_step() -> None:
    # -2% a session: each within a 5-session window's noise, 16% over the series.
    values = [1000.0 * 0.98**i for i in range(10)]
    step = find_step(values)
    assert step is not None and step.change < -0.08


def test_noise_alone_reports_no_step_and_the_answer_is_repeatable() -> None:
    rng = random.Random(7)
    found = 0
    for _ in range(40):
        values = [1000.0 * (1 + rng.gauss(0, 0.08)) for _ in range(12)]
        found += find_step(values) is not None
        assert find_step(values) == find_step(values)  # seeded: the same series, the same answer
    assert found <= 3  # at p <= 0.01, about 0.4 of 40 expected


def test_too_short_or_unusable_series_are_not_searched() -> None:
    assert find_step([1000.0] * (2 * MIN_SEGMENT - 1)) is None
    assert find_step([1000.0, 1000.0, 0.0, 500.0, 500.0]) is None
    assert find_step([1000.0] * 8) is None  # flat: nothing to split
