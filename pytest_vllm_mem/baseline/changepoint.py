"""Where a series of session medians stepped: one change point, by the energy statistic and a permutation test.

The baseline entry keeps a bounded series of session medians with the commit each came from (store.KEEP_SESSIONS).
A window of recent sessions absorbs a slow drift one session at a time; a change point over the whole series does
not. The statistic is E-divisive's (Matteson and James 2014, which Apache Otava / Hunter run over CI history) with
exponent 2, where the energy distance of two segments is twice the squared difference of their means: the split
maximising n1 x n2 / n x (mean1 - mean2)^2 on the log scale (a throughput step is a factor). Its significance is
Hunter's: the share of random reorderings of the series whose best split scores as high. Pure and seeded, so the
same series always gives the same answer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

# Sessions on each side of a step: one session is an outlier, not a step.
MIN_SEGMENT = 2
PERMUTATIONS = 999
# A step is reported at this permutation p-value or below.
STEP_ALPHA = 0.01


@dataclass(frozen=True)
class Step:
    """A step between sessions `index - 1` and `index` of a series (0-based: the first session after it)."""

    index: int
    change: float  # geometric mean after / before - 1
    p_value: float
    sessions: int
    commit: str | None = None  # the commit of the first session after the step

    def text(self, metric: str) -> str:
        """`output_throughput: step at commit abc123: -12% (p 0.002 over 9 sessions)`."""
        at = f"commit {self.commit}" if self.commit else f"session {self.index + 1} of {self.sessions}"
        return f"{metric}: step at {at}: {self.change * 100:+.0f}% (p {self.p_value:.2g} over {self.sessions} sessions)"


def _best_split(logs: Sequence[float]) -> tuple[int, float]:
    n = len(logs)
    total = sum(logs)
    best_index, best = 0, -1.0
    left = 0.0
    for index in range(1, n):
        left += logs[index - 1]
        if index < MIN_SEGMENT or n - index < MIN_SEGMENT:
            continue
        gap = left / index - (total - left) / (n - index)
        score = index * (n - index) / n * gap * gap
        if score > best:
            best_index, best = index, score
    return best_index, best


def find_step(
    values: Sequence[float],
    commits: Sequence[str | None] = (),
    *,
    alpha: float = STEP_ALPHA,
    permutations: int = PERMUTATIONS,
    seed: int = 0,
) -> Step | None:
    """The most significant single step of `values` (positive, oldest first), when its permutation p-value is at
    most `alpha`; None otherwise or with fewer than 2 x MIN_SEGMENT values. `commits`: one per value."""
    if len(values) < 2 * MIN_SEGMENT or not all(math.isfinite(v) and v > 0 for v in values):
        return None
    logs = [math.log(v) for v in values]
    index, observed = _best_split(logs)
    if observed <= 0:
        return None
    rng = random.Random(seed)
    shuffled = list(logs)
    as_high = 0
    for _ in range(permutations):
        rng.shuffle(shuffled)
        as_high += _best_split(shuffled)[1] >= observed * (1 - 1e-12)
    p_value = (as_high + 1) / (permutations + 1)
    if p_value > alpha:
        return None
    before = sum(logs[:index]) / index
    after = sum(logs[index:]) / (len(logs) - index)
    commit = commits[index] if index < len(commits) else None
    return Step(index, math.expm1(after - before), p_value, len(values), commit)
