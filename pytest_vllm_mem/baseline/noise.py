"""A noise-scaled decision for the metrics that wobble from run to run (throughput, latency).

Compare medians, and let the noise the runs themselves show widen the band: a change fails when it exceeds
max(floor, k x its standard error) (k = 4), where the floor is the metric's tolerance and the standard error comes
from a robust spread (MAD) pooled over the baseline's runs and this run's repeats. Repeats within one session cannot
see a whole run landing on a fast or a slow moment of a shared machine, so where the baseline file keeps earlier
sessions' medians (`history`), the run is judged as one more session: its median against the window of recorded
session medians, with a one-sided prediction bound from their mean and spread (Student's t for the few sessions).

On the log scale: a shared machine slows a load down by a factor, so the noise of throughput and latency is a
factor too. In logs a 70% throughput drop (x 0.3) stands as far out of noise as a x 3.3 latency rise, and the spread
of a slowed run is the spread it had. The statistics are shown in percent (for small changes the two agree).

Why not a rank test: with 3 runs against 3 the smallest two-sided Mann-Whitney p is 0.1, so no test on so few runs
can be both strict and sensitive. A threshold scaled by the observed noise says what the runs can show, and
`Decision.detectable` states it: the smallest worsening that this many runs catch nearly every time (95%).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pytest_vllm_mem.baseline.compare import Comparison, Sample, Verdict, tolerance_judge
from pytest_vllm_mem.baseline.metrics import METRICS, Metric, Tolerance

# MAD x 1.4826 estimates a normal distribution's standard deviation.
_MAD_TO_SD = 1.4826
# Variance of the median of n normal draws relative to that of one draw (n = 1, 2: the mean; large n: pi/2n).
_MEDIAN_VARIANCE = {1: 1.0, 2: 1.0, 3: 1.35, 4: 1.19, 5: 1.44, 6: 1.29}
# One-sided 95% normal quantile: a true change of threshold + 1.645 standard errors is caught 95% of the time.
_Z_POWER = 1.645

# Standard errors a change must exceed. 3 would do for independent runs; a test's repeats run back to back, and a
# shared machine drifts over minutes, so they understate the noise between two sessions: on this project's 2-core
# runner k=3 failed 4 of 30 healthy 3-vs-3 comparisons, k=4 2 of 30 (benchmarks/gate_noise.py, first run). What
# no k removes is a shift between sessions: a second run's sessions had medians 624, 700 and 784 tok/s, each within
# 8-16%, and k=4 failed 4 of 30 (k=5: 4 of 30). Only earlier sessions' medians (`history`) can show that noise.
DEFAULT_K = 4.0
# With earlier sessions kept (`history`), a run is judged as a new session of the same config: its median against the
# window of recorded session medians (the earlier ones and the baseline's own), a one-sided prediction bound from their
# mean and standard deviation: mean + t(dof, 1 - alpha) x sd x sqrt(1 + 1/n) (Bencher's t-test threshold over a window
# of history is the same idea), the spread moderated by SESSION_SPREAD or pooled over the baseline file's tests.
# alpha is the suite's budget (SuiteLevel), not one comparison's: 2.5% expected false failures per healthy run. Replayed
# on this project's 2-core runner (benchmarks/gate_noise.py --targets, 2 collections): 0 of 56 record-then-rerun runs
# at the defaults failed with confirmation (3 of 56 without), 0 healthy tests failed in 20-test suites; at 5%, 2 of 56
# one-test reruns failed. The price on a runner whose sessions scatter 9-12%: in a 20-test suite a one-session 30%
# slowdown is caught 1-2 times in 30-56, a 50% one 23/56 (repeat 1, no history) to 30/30 (repeat 3 with history).
DEFAULT_ALPHA = 0.025
# The levels a user may choose (--vllm-gate-alpha): the suite's false-alarm budget, the expected number of false
# failures in a healthy run (SuiteLevel). Each comparison is judged at its share of it.
ALPHAS = (0.05, 0.025, 0.01)
# Earlier sessions needed before the window decides: with the baseline's own session, three session medians (two are
# one difference, a spread estimate too rough to lean on).
MIN_HISTORY = 2
# A failure whose judged worsening is within this factor of its limit (log scale) is re-measured before it fails: one
# slow load can move a single run this far (issue 25: -58.8% with one outlier load), a real change of this size shows
# again. Beyond it, the regression is plain and another load would only repeat it.
CONFIRM_REACH = 4.0
# Confirmation on fresh servers (issue 25). Loads on one server cannot undo a slow session: on the 2-core CI runner
# whole sessions (one server each, minutes apart) scatter by 5-12% while one server's loads agree closely, so a 30%
# slowdown of one session cannot be told from noise at a 20-test suite's level (caught 1-4 times in 30). A family
# whose first session is worse than its baseline at this one-sided level per metric (z 1.96; a family's 2 effective
# metrics flag about 5% of healthy tests), or fails within CONFIRM_REACH of its limit, is re-measured on
# CONFIRM_SESSIONS fresh servers and decided on all its sessions at the suite's level: the session noise of the
# run's side shrinks by 1/sessions. Only the last look may fail a near-limit family; an earlier look may only clear
# it (no suspect left), so the level holds.
SUSPECT_LEVEL = 0.05 / 2
CONFIRM_SESSIONS = 2


def _t_two_sided_inside(t: float, dof: int) -> float:
    """P(|T| < t) for Student's t with a whole number of degrees of freedom (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(dof))
    sin, cos = math.sin(theta), math.cos(theta)
    if dof % 2:
        if dof == 1:
            return 2 * theta / math.pi
        term = total = cos
        for j in range(3, dof - 1, 2):
            term *= cos * cos * (j - 1) / j
            total += term
        return 2 / math.pi * (theta + sin * total)
    term = total = 1.0
    for j in range(2, dof - 1, 2):
        term *= cos * cos * (j - 1) / j
        total += term
    return sin * total


def t_quantile(dof: int, alpha: float) -> float:
    """Student's t upper quantile: P(T > t) = alpha for `dof` whole degrees of freedom (0 < alpha < 0.5), found by
    bisection on the exact distribution function."""
    if not (0 < alpha < 0.5) or not isinstance(dof, int) or dof < 1:
        raise NoiseError(f"t quantile for alpha={alpha!r} (accepted: 0 < alpha < 0.5) and dof={dof!r} (a whole >= 1)")
    target = 1 - 2 * alpha
    low, high = 0.0, 1.0
    while _t_two_sided_inside(high, dof) < target:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if _t_two_sided_inside(middle, dof) < target else (low, middle)
    return (low + high) / 2


def normal_quantile(alpha: float) -> float:
    """The normal upper quantile: P(Z > z) = alpha."""
    if not 0 < alpha < 0.5:
        raise NoiseError(f"normal quantile for alpha={alpha!r} (accepted: 0 < alpha < 0.5)")
    return statistics.NormalDist().inv_cdf(1 - alpha)


# How many independent comparisons one load's five noise-judged figures amount to: Li and Ji's effective number of
# tests (Heredity 2005) from the eigenvalues of their correlation matrix over the 80 healthy loads of
# benchmarks/data/gate_noise_ci_*.json is 2.0 (Nyholt's 2.3): output and request throughput, TPOT and CPU per token
# correlate at |r| 0.95-1.0 (one figure), TTFT at 0.4-0.55 with them (the second).
EFFECTIVE_METRICS = 2.0


@dataclass(frozen=True)
class SuiteLevel:
    """The suite's false-alarm budget shared out over its comparisons (Bonferroni over families).

    A family is one test's loads: its throughput, latency and CPU figures move together (one slow load moves all of
    them), so they are one family of `metrics` comparisons, each at level / (families x metrics). By the union bound
    the expected number of false failures of a healthy run is at most `alpha`, whatever the dependence between and
    within families, and so is the chance that it fails at all. Holm's step-down gives the same verdict for the build:
    it rejects anything exactly when the smallest p-value is below alpha / m, Bonferroni's first step; it only frees
    further rejections in a run that already fails. So the level can be set when the suite is collected and each
    test decided as it ends, as pytest reports it. A false discovery rate does not fit a gate: in a healthy run every
    failure is false, and the FDR is then the family-wise rate."""

    alpha: float = DEFAULT_ALPHA
    families: int = 1  # tests that run loads (the collected tests using vllm_load; at least 1)
    metrics: float = EFFECTIVE_METRICS  # independent comparisons a family's noise-judged metrics amount to

    @property
    def per_comparison(self) -> float:
        return self.alpha / (max(1, self.families) * max(1.0, self.metrics))

    def summary(self, judged: int | None = None, families: int | None = None) -> str:
        """`48 comparisons in 12 families at 0.00104 each; expected false failures per healthy run: at most 0.05`."""
        count = judged if judged is not None else self.families * len(NOISY_GATED)
        groups = families if families is not None else self.families
        return (
            f"{count} noise-judged comparison{'' if count == 1 else 's'} in {groups} famil"
            f"{'y' if groups == 1 else 'ies'} (one per test's loads), each at level {self.per_comparison:.3g}; "
            f"expected false failures per healthy run: at most {self.alpha:g} (Bonferroni over the planned "
            f"{self.families} test{'' if self.families == 1 else 's'} x {self.metrics:g} effective comparisons)"
        )


class NoiseError(ValueError):
    """The inputs of a decision cannot be judged (no values, a value that is not positive and finite)."""


def median(values: Sequence[float]) -> float:
    items = sorted(float(v) for v in values)
    if not items:
        raise NoiseError("median of no values")
    middle = len(items) // 2
    return items[middle] if len(items) % 2 else (items[middle - 1] + items[middle]) / 2


def _logs(values: Sequence[float]) -> list[float]:
    if not all(math.isfinite(float(v)) and float(v) > 0 for v in values):
        raise NoiseError(f"a noise-scaled decision needs positive finite values, got {list(values)!r}")
    return [math.log(float(v)) for v in values]


def log_deviations(values: Sequence[float]) -> list[float]:
    """Each value's distance from the group's median on the log scale (about the relative distance: log(1.1) =
    0.095). An odd group's median is one of its values, and its own zero deviation says nothing, so one zero is
    dropped."""
    if len(values) < 2:
        return []
    logs = _logs(values)
    center = median(logs)
    deviations = [abs(v - center) for v in logs]
    if len(values) % 2:
        deviations.remove(min(deviations))
    return deviations


def pooled_spread(*groups: Sequence[float]) -> float | None:
    """A robust standard deviation of one run on the log scale (1.4826 x the median absolute deviation; about the
    relative one), each group around its own median so that a shift between groups does not count as noise. None
    when no group has two values."""
    deviations = [d for group in groups for d in log_deviations(group)]
    if not deviations:
        return None
    return _MAD_TO_SD * median(deviations)


def median_variance_factor(n: int) -> float:
    """Var(median of n) / Var(one value), for normal noise."""
    if n < 1:
        raise NoiseError(f"median of {n} values")
    return _MEDIAN_VARIANCE.get(n, math.pi / 2)


def _worse_log(fraction: float, higher_is_better: bool) -> float:
    """A worsening by `fraction` of the baseline on the log scale: a drop to 1 - f, or a rise to 1 + f."""
    if higher_is_better:
        return math.inf if fraction >= 1 else -math.log1p(-fraction)
    return math.log1p(fraction)


def _worse_fraction(log_change: float, higher_is_better: bool) -> float:
    """The inverse of _worse_log: how much worse, as a fraction of the baseline, a log-scale worsening is."""
    return -math.expm1(-log_change) if higher_is_better else math.expm1(log_change)


# The spread of session medians (log scale) assumed where a test's baseline shows none. Session medians of 3-5 loads
# scattered 0.060-0.123 per metric over 16 same-config sessions on two quiet days of this project's 2-core CI runner
# (benchmarks/gate_noise.py, benchmarks/data/gate_noise_ci_2026-12-01*.json), but a session of one load (the default
# repeat=1, what a baseline recorded once is) scattered 0.087-0.149 there (mean 0.114), and 0.12-0.37 on a busy
# runner (gate_noise_ci_2026-12-02_*.json). At 0.10 a new user's record-then-rerun failed 12 of 166 replayed pairs
# with confirmation, at 0.13 5 (0 of the 30 quiet ones); fitted on those collections, so stated as such. A GPU
# runner is quieter; its own history replaces this after MIN_HISTORY sessions.
SESSION_SPREAD = 0.13
# The weight, in sessions, of the default spread against a test's own window (moderated variance, as in Smyth 2004):
# a 3-session window alone would pay t(2) = 4.3 at 2.5%.
PRIOR_DOF = 4
# Degrees of freedom a pooled spread needs before it replaces a test's own window.
MIN_POOLED_DOF = 8


@dataclass(frozen=True)
class SessionPrior:
    """The spread between sessions of one metric on this runner (log scale), from beyond a test's own window.

    `pooled`: measured over the baseline file's tests with history (pooled_prior), `dof` their degrees of freedom,
    and used in place of a test's own window; otherwise the default SESSION_SPREAD, taken as known without a window
    (normal quantile) and weighing PRIOR_DOF sessions against one."""

    sd: float
    dof: int = PRIOR_DOF
    pooled: bool = False

    def quantile(self, alpha: float) -> float:
        return t_quantile(self.dof, alpha) if self.pooled else normal_quantile(alpha)


DEFAULT_PRIOR = SessionPrior(SESSION_SPREAD)
# TTFT's session shifts are heavy-tailed on the 2-core runner: within 0.09-0.12 over 16 sessions a day, yet a new
# server's TTFT p50 read +59.2% (50.7 vs 31.9 ms, this project's CI, 2026-12-02) and +61.6% (141 vs 87 ms, issue 25)
# right after its baseline was recorded, healthy both times. 0.16 keeps such a shift (log 0.46-0.48) inside the
# limit at a one-test suite's level (2.24 x 0.16 x sqrt(2) = 0.51); a regression that doubles TTFT is still caught.
# Fitted on those two shifts, so stated as such; a runner's own history (pooled_prior) replaces it.
TTFT_SESSION_SPREAD = 0.16
DEFAULT_PRIORS: Mapping[str, SessionPrior] = {"ttft_p50": SessionPrior(TTFT_SESSION_SPREAD)}


def pooled_prior(windows: Iterable[Sequence[float]]) -> SessionPrior | None:
    """The pooled spread of session medians over tests (each window: a test's earlier medians and its baseline's, of
    one metric), each around its own mean; None below MIN_POOLED_DOF degrees of freedom."""
    squares, dof = 0.0, 0
    for window in windows:
        if len(window) < MIN_HISTORY + 1 or not all(math.isfinite(v) and v > 0 for v in window):
            continue
        logs = [math.log(v) for v in window]
        centre = sum(logs) / len(logs)
        squares += sum((x - centre) ** 2 for x in logs)
        dof += len(logs) - 1
    if dof < MIN_POOLED_DOF:
        return None
    return SessionPrior(math.sqrt(squares / dof), dof, pooled=True)


@dataclass(frozen=True)
class Decision:
    """What the runs show about one metric. Fractions, not percent: change -0.18 is 18% lower than the baseline."""

    change: float  # (median now - median baseline) / median baseline
    worse_by: float  # the change in the metric's worse direction: positive is a worsening
    stderr: float | None  # standard error of the judged change on the log scale (about relative); None: no spread
    threshold: float  # a worsening beyond this fraction fails: max(floor, k x stderr), back from the log scale
    floor: float  # the tolerance: the smallest change that can fail, however quiet the runs
    k: float  # the multiple of stderr that set the noise limit (k, or the t quantile when a window decided)
    detectable: float  # a true worsening this large is caught 95% of the time (threshold + 1.645 x stderr)
    n_baseline: int
    n_now: int
    n_history: int  # earlier sessions in the window that decided (0: none kept, or too few)
    between: float | None  # standard deviation of the window's session medians (log scale); None: no window
    status: Literal["ok", "regressed", "improved"]
    window_change: float | None = None  # change against the window's (geometric) mean; None: no window
    margin: float = 0.0  # the judged worsening over its limit, both on the log scale (above 1: regressed)
    z: float | None = None  # the judged worsening in standard errors (log scale); None: no spread
    provisional: bool = False  # no window and an assumed session spread: a near-limit regression only warns

    @property
    def warned(self) -> bool:
        """A regression that a provisional baseline cannot tell from a slow session: within CONFIRM_REACH of its
        limit. It is reported, not failed (see NoiseJudge.provisional)."""
        return self.provisional and self.status == "regressed" and self.margin <= CONFIRM_REACH

    @property
    def suspect(self) -> bool:
        """Worth re-measuring on fresh servers before deciding: a regression within reach of its limit (a slow
        session may have made it), or a pass worse than the baseline at SUSPECT_LEVEL (a regression one session's
        noise may hide). A regression far past its limit is plain; a change within the tolerance can never fail."""
        if self.margin > CONFIRM_REACH or self.status == "improved" or self.worse_by <= self.floor:
            return False
        return self.status == "regressed" or (self.z is not None and self.z >= normal_quantile(SUSPECT_LEVEL))

    @property
    def noise_limited(self) -> bool:
        """True when the noise, not the tolerance, set the threshold."""
        return self.threshold > self.floor * (1 + 1e-9)

    def summary(self) -> str:
        """`-18.0% +- 6.1%, 4 runs vs 5` (this run's repeats vs the baseline's runs)."""
        return f"{self.change * 100:+.1f}%{self.spread_text()}"

    def spread_text(self) -> str:
        """` +- 6.1%, 4 runs vs 5`: what follows the change in a message (the standard error, then the counts)."""
        spread = f" +- {self.stderr * 100:.1f}%" if self.stderr is not None else ""
        runs = f"{self.n_now} run{'' if self.n_now == 1 else 's'} vs {self.n_baseline}"
        history = f", {self.n_history} earlier session{'' if self.n_history == 1 else 's'}" if self.n_history else ""
        return f"{spread}, {runs}{history}"

    def limit_text(self) -> str:
        """What set the limit and what the runs can show: `limit 24.4% (4 x 6.1%), catches 33% or more`; with a
        window, what was judged first: `-9.5% vs the mean of 5 sessions, limit 17.5% (t 2.78 x 6.3%), ...`."""
        if self.stderr is None:
            return f"limit {self.floor * 100:.3g}% (the tolerance; no repeats show the noise)"
        multiple = f"t {self.k:.3g}" if self.window_change is not None else f"{self.k:.3g}"
        if self.noise_limited:
            why = f"limit {self.threshold * 100:.3g}% ({multiple} x {self.stderr * 100:.1f}%, above the tolerance)"
        else:
            noise = self.k * self.stderr * 100
            why = f"limit {self.threshold * 100:.3g}% (the tolerance; {multiple} x noise is {noise:.1f}%)"
        if self.window_change is not None:
            why = f"{self.window_change * 100:+.1f}% vs the mean of {self.n_history + 1} sessions, {why}"
        return f"{why}, catches {self.detectable * 100:.3g}% or more"

    def detail(self) -> str:
        """`-18.0% +- 6.1%, 4 runs vs 5; limit 24.4% (4 x 6.1%, above the tolerance), catches 33% or more`."""
        return f"{self.summary()}; {self.limit_text()}"


@dataclass(frozen=True)
class _Judged:
    """How far this run moved (log of the median ratio) and the noise it is judged against."""

    log_change: float
    stderr: float | None
    k: float
    n_history: int = 0
    between: float | None = None
    window_change: float | None = None


def _against_window(
    history: Sequence[float],
    base_median: float,
    now: Sequence[float],
    within: float | None,
    *,
    alpha: float,
    prior: SessionPrior | None,
    now_sessions: int,
) -> _Judged:
    """This run's median as one more session of the window of session medians (history + the baseline's own)."""
    window = _logs([*history, base_median])
    n = len(window)
    centre = sum(window) / n
    between = statistics.stdev(window)
    spread2, dof = between**2, n - 1
    if prior is not None and prior.pooled:
        spread2, dof = prior.sd**2, prior.dof  # the runner's spread over the suite's tests (own window in it)
    elif prior is not None:
        spread2 = (prior.dof * prior.sd**2 + (n - 1) * between**2) / (prior.dof + n - 1)
        dof = prior.dof + n - 1
    # The run's median varies by its own repeats' noise too: the larger of the two, never their sum twice.
    now_variance = within**2 * median_variance_factor(len(now)) / len(now) if within is not None else 0.0
    variance = max(spread2 * (1 / now_sessions + 1 / n), now_variance)
    judged_log = _now_centre(now, now_sessions) - centre
    return _Judged(
        judged_log,
        math.sqrt(variance),
        t_quantile(dof, alpha),
        n_history=len(history),
        between=between,
        window_change=math.expm1(judged_log),
    )


def _against_baseline(
    baseline: Sequence[float],
    now: Sequence[float],
    within: float | None,
    *,
    k: float,
    alpha: float,
    prior: SessionPrior | None,
    now_sessions: int,
) -> _Judged:
    """This run's median against the baseline's, by the spread of both sides' runs (and the prior's session noise)."""
    stderr: float | None = None
    # A suite's share of the budget may ask for more than k standard errors (k = 4 holds to about 3e-5).
    k = max(k, normal_quantile(alpha))
    if within is not None:
        stderr = within * math.sqrt(
            median_variance_factor(len(baseline)) / len(baseline) + median_variance_factor(len(now)) / len(now)
        )
    if prior is not None:
        # One session on each side (or `now_sessions`): their shift is noise the runs cannot show. With it
        # counted, the repeats' spread needs no k beyond the level's quantile.
        stderr = math.sqrt((stderr or 0.0) ** 2 + prior.sd**2 * (1 + 1 / now_sessions))
        k = prior.quantile(alpha)
    return _Judged(_now_centre(now, now_sessions) - math.log(median(baseline)), stderr, k)


def _sessions_of(now: Sequence[float], now_sessions: int) -> list[Sequence[float]]:
    """This run's values by session (in order, the same number each; else one group): the spread within a session
    is the repeats' noise, the shift between sessions is what the session spread already counts."""
    size, rest = divmod(len(now), now_sessions)
    if now_sessions == 1 or rest or size == 0:
        return [now]
    return [now[i : i + size] for i in range(0, len(now), size)]


def _now_centre(now: Sequence[float], now_sessions: int) -> float:
    """This run's centre on the log scale: the median of one session's runs; over several sessions (fresh-start
    confirmation, the same number of runs each) the mean of all logs, the mean of the session means, whose variance
    is the 1/sessions the judged standard error counts (a median of 3 values would vary 1.35 times as much)."""
    if now_sessions == 1:
        return math.log(median(now))
    logs = _logs(now)
    return sum(logs) / len(logs)


def decide(
    baseline: Sequence[float],
    now: Sequence[float],
    *,
    higher_is_better: bool,
    floor: float,
    k: float = DEFAULT_K,
    history: Sequence[float] = (),
    alpha: float = DEFAULT_ALPHA,
    prior: SessionPrior | None = None,
    now_sessions: int = 1,
) -> Decision:
    """Judge `now` (this run's repeats) against `baseline` (the baseline's runs). `floor` is the tolerance as a
    fraction of the baseline median; `history` holds medians of earlier sessions of the same test (the baseline
    file's `history`, oldest first), if kept.

    Without a window (fewer than MIN_HISTORY earlier sessions): the change of the medians against max(floor,
    k x its standard error), from the spread of both sides' runs. With one: this run's median against the window of
    session medians (`history` and the baseline's own), against max(floor, t(n-1, 1 - alpha) x sd x sqrt(1 + 1/n));
    when this run's repeats scatter more than that, their standard error is used instead.

    `prior`: what is known of the spread between sessions beyond this test's own window (SessionPrior). Without a
    window it is the session noise both sides carry (a baseline recorded once says nothing of it; issue 25's healthy
    sessions moved -24% in throughput): the limit is at least its quantile x sqrt(within + sd^2 x (1 + 1/sessions)).
    With a window, a pooled prior replaces the window's own few-session estimate, a default one moderates it (its
    weight PRIOR_DOF sessions). `now_sessions`: servers this run's values came from (2 after a fresh-start
    confirmation)."""
    if now_sessions < 1:
        raise NoiseError(f"now_sessions must be >= 1, got {now_sessions!r}")
    if len(baseline) == 0 or len(now) == 0:
        raise NoiseError(f"a decision needs values on both sides, got {len(baseline)} baseline and {len(now)} now")
    if not (math.isfinite(floor) and floor >= 0) or not (math.isfinite(k) and k >= 0):
        raise NoiseError(f"floor and k must be finite and not negative, got floor={floor!r}, k={k!r}")
    _logs([*baseline, *now, *history])
    base_median, now_median = median(baseline), median(now)
    change = (now_median - base_median) / base_median
    within = pooled_spread(baseline, *_sessions_of(now, now_sessions))
    if len(history) >= MIN_HISTORY:
        judged = _against_window(history, base_median, now, within, alpha=alpha, prior=prior, now_sessions=now_sessions)
    else:
        judged = _against_baseline(baseline, now, within, k=k, alpha=alpha, prior=prior, now_sessions=now_sessions)
    judged_log, stderr, k = judged.log_change, judged.stderr, judged.k
    worse_log = -judged_log if higher_is_better else judged_log
    noise = k * stderr if stderr is not None else 0.0
    # A hair of slack so a change of exactly the tolerance passes despite float rounding.
    worse_limit = max(_worse_log(floor, higher_is_better), noise) * (1 + 1e-9) + 1e-12
    better_limit = max(_worse_log(floor, not higher_is_better), noise) * (1 + 1e-9) + 1e-12
    status: Literal["ok", "regressed", "improved"]
    if worse_log > worse_limit:
        status = "regressed"
    elif -worse_log > better_limit:
        status = "improved"
    else:
        status = "ok"
    threshold_log = max(_worse_log(floor, higher_is_better), noise)
    detectable_log = threshold_log + (_Z_POWER * stderr if stderr is not None else 0.0)
    return Decision(
        change=change,
        worse_by=-change if higher_is_better else change,
        stderr=stderr,
        threshold=max(floor, _worse_fraction(threshold_log, higher_is_better)),
        floor=floor,
        k=k,
        detectable=_worse_fraction(detectable_log, higher_is_better),
        n_baseline=len(baseline),
        n_now=len(now),
        n_history=judged.n_history,
        between=judged.between,
        status=status,
        window_change=judged.window_change,
        margin=worse_log / threshold_log if threshold_log > 0 else math.inf,
        z=worse_log / stderr if stderr else None,
        provisional=len(history) < MIN_HISTORY and prior is not None and not prior.pooled,
    )


def is_noisy(metric: Metric) -> bool:
    """Throughput and latency: measured per load, and not memory (a load's memory peak is near deterministic)."""
    return metric.scope == "load" and metric.unit != "bytes"


@dataclass(frozen=True)
class NoiseJudge:
    """compare.Judge for the plugin's gate: throughput and latency by `decide`, with the metric's tolerance as the
    floor; memory and KV figures by the fixed band (compare.tolerance_judge), a peak over it within reach of it
    re-measured on fresh servers first (transient_within_reach)."""

    k: float = DEFAULT_K
    alpha: float = DEFAULT_ALPHA
    priors: Mapping[str, SessionPrior] = field(default_factory=dict)  # pooled over the baseline file, by metric
    prior: SessionPrior | None = DEFAULT_PRIOR  # for metrics without a pooled one; None: none at all
    # A baseline without a window (fewer than MIN_HISTORY earlier sessions) judged with the assumed session spread
    # (none pooled over the file's other tests) is provisional for the noise-judged metrics: it cannot tell a slow
    # session from a regression (on the 2-core runner whole sessions ran 36-60% slower than the one recorded minutes
    # before, fresh servers too: benchmarks/record_rerun.py, 2 of 20 reruns failed that way with confirmation). Its
    # near-limit regression warns (Decision.warned) and is not re-measured, since more sessions of this run cannot
    # make it fail; once a window or a pooled spread exists the same figure fails. Bencher does the same with its
    # thresholds' minimum sample size. False: judged like a baseline with a window (the benchmarks' comparison).
    provisional: bool = True

    def __call__(self, metric: Metric, baseline: Sample, now: Sample, tolerance: Tolerance) -> Verdict:
        positive = baseline.median > 0 and all(v > 0 for v in (*baseline.values, *now.values))
        if not is_noisy(metric) or not positive or not baseline.values:
            verdict = tolerance_judge(metric, baseline, now, tolerance)
            return replace(verdict, confirm=transient_within_reach(metric, baseline.median, now.median, tolerance))
        floor = tolerance.limit(baseline.median) / baseline.median
        # The entry's median is what the file says (a hand-edited one too); its runs keep their spread around it.
        shift = baseline.median / median(baseline.values)
        history = [v for v in baseline.history if math.isfinite(v) and v > 0]
        decision = decide(
            [v * shift for v in baseline.values],
            now.values,
            higher_is_better=metric.higher_is_better,
            floor=floor,
            k=self.k,
            alpha=self.alpha,
            history=history,
            prior=self.priors.get(metric.name, self._default_prior(metric.name)),
            now_sessions=now.sessions,
        )
        if self.provisional and decision.provisional:
            if decision.warned:
                return Verdict("warned", f"{decision.detail()}; {provisional_text(len(history))}")
            return Verdict(decision.status, decision.detail())
        return Verdict(decision.status, decision.detail(), confirm=decision.suspect)

    def _default_prior(self, name: str) -> SessionPrior | None:
        """The session spread assumed for metric `name` without a pooled one: its own default where it has one."""
        if self.prior is DEFAULT_PRIOR:
            return DEFAULT_PRIORS.get(name, DEFAULT_PRIOR)
        return self.prior


def provisional_text(earlier_sessions: int) -> str:
    """Why a near-limit regression against a baseline without a window warns instead of failing, and what ends it."""
    more = MIN_HISTORY - earlier_sessions
    return (
        f"warned, not failed: a baseline of {earlier_sessions + 1} recorded session{'s' if earlier_sessions else ''} "
        f"cannot tell a slow session from a regression; it gates once {more} more session{'s' if more > 1 else ''} "
        "of this test are recorded (--vllm-update-baseline) or the baseline file's other tests show the runner's "
        "session spread"
    )


def transient_within_reach(metric: Metric, baseline: float, now: float, tolerance: Tolerance) -> bool:
    """A peak (Metric.transient) worse than its tolerance allows, by at most CONFIRM_REACH times that: re-measured
    on fresh servers and decided on the median over all of them, so a transient of one start does not fail the test
    and a real growth, which every start repeats, still does. Beyond the reach the growth is plain."""
    if not metric.transient or baseline <= 0 or tolerance.allows(baseline, now, metric.higher_is_better):
        return False
    worse_by = baseline - now if metric.higher_is_better else now - baseline
    return worse_by <= CONFIRM_REACH * tolerance.limit(baseline)


noise_aware_judge = NoiseJudge()
# The noise-judged metrics a family (one test's loads) is gated on by default: throughput, latency, CPU per token.
NOISY_GATED = tuple(name for name, metric in METRICS.items() if metric.gated and is_noisy(metric))


def confirm_on_fresh_sessions(
    comparisons: Sequence[Comparison],
    rerun: Callable[[int], list[Comparison] | None],
    fresh: int = CONFIRM_SESSIONS,
) -> tuple[list[Comparison], int]:
    """The confirmation rule (SUSPECT_LEVEL): while a comparison is suspect and fewer than `fresh` fresh sessions ran
    (CONFIRM_SESSIONS by default), measure one more. `rerun(n)` measures session n on a fresh server and returns
    the comparisons decided on all n sessions, or None when no fresh server could start. Returns the last comparisons
    and the number of sessions they were decided on (1: none was added)."""
    current, sessions = list(comparisons), 1
    while sessions <= fresh and any(c.confirmable for c in current):
        again = rerun(sessions + 1)
        if again is None:
            break
        current, sessions = again, sessions + 1
    return current, sessions
