"""Sequential drift detectors on a stream of per-sample pass/fail results.

- ``BernoulliCusum``: Page's CUSUM on the log-likelihood ratio of a failure rate ``p_alt``
  against ``p_null``: ``S = max(0, S + log LR(x))``, alarm at ``S >= h``. With ``h = ln(ARL0)``
  the expected number of in-control samples between false alarms is at least ARL0 (the
  likelihood ratio is an e-value under the null, and the CUSUM is bounded by the
  Shiryaev-Roberts statistic, whose expectation grows by one per sample). That bound is loose
  by two orders of magnitude for Bernoulli data; ``exact_threshold`` computes the ARL of the
  chain itself and takes the smallest h that still keeps ARL0, which buys much faster detection
  for the same promised false-alarm rate. The same class with ``p_alt < p_null`` is the
  *recovery* detector: it alarms when the rate has come down.
- ``EDetector``: the same construction for when ``p_null`` is only an upper bound of the
  in-control rate (any rate <= p_null keeps the guarantee: each likelihood ratio has
  expectation <= 1 there) and the size of the shift is unknown: a mixture over several
  alternatives (Shin, Ramdas & Rinaldo, "E-detectors", 2022). It pays about ln(K) nats of
  threshold for K alternatives and in exchange is never badly tuned.
- ``ScoreCusum``: the same construction on a non-negative score per sample instead of a bit
  (the generation tier's mean KLD per completion): a betting e-value against "the score's mean
  is at most ``null_mean``" (one continuous figure carries far more evidence than a bit).
- ``WindowDetector``: the failing share of the last N samples against a ratio: the v0 rule,
  kept as an option (its false-alarm rate has no closed form; benchmarks/detection_delay.py
  tunes it by simulation).

Every detector exposes ``statistic`` and ``threshold`` on the same scale (log-likelihood for
the sequential ones, a share for the window) so a dashboard shows how close a model is to
tripping.

Every detector also takes ``min_samples`` (``policy.min_samples``): it is never in alarm on
fewer results than that since it started or was last reset. The statistic moves from the first
result (the gauges show it); only the decision waits. For the sequential detectors this can
only delay an alarm, never advance one, so their false-alarm guarantees still hold.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

from guard.policy.window import CountWindow


class Detector(abc.ABC):
    kind: str = ""

    def __init__(self, min_samples: int = 1) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.samples = 0  # since the last reset
        self.min_samples = min_samples

    @abc.abstractmethod
    def update(self, failed: bool) -> bool:
        """Take one result (a failure bit; a score for ``ScoreCusum``); True when the
        detector is in alarm after it."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the in-control start (after an alarm was acted on, or a new epoch)."""

    @property
    @abc.abstractmethod
    def statistic(self) -> float: ...

    @property
    @abc.abstractmethod
    def threshold(self) -> float: ...

    @property
    def alarmed(self) -> bool:
        return self.samples >= self.min_samples and self.statistic >= self.threshold

    def describe(self) -> dict:
        return {"detector": self.kind, "statistic": round(self.statistic, 4),
                "threshold": round(self.threshold, 4), "samples": self.samples}


def _llr(p_null: float, p_alt: float) -> tuple[float, float]:
    """log LR increments (on a failure, on a pass) of Bernoulli(p_alt) vs Bernoulli(p_null)."""
    return math.log(p_alt / p_null), math.log((1.0 - p_alt) / (1.0 - p_null))


def _check_rate(name: str, p: float) -> None:
    if not 0.0 < p < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {p}")


class _ClampedSum(Detector):
    """A CUSUM's bookkeeping: ``S = max(0, S + step)`` against a fixed threshold (the two
    CUSUMs below differ only in the step a sample adds)."""

    def __init__(self, threshold: float, min_samples: int):
        super().__init__(min_samples)
        if threshold <= 0:
            raise ValueError("threshold must be > 0")
        self._threshold = threshold
        self._s = 0.0

    def _add(self, step: float) -> bool:
        self.samples += 1
        self._s = max(0.0, self._s + step)
        return self.alarmed

    def reset(self) -> None:
        self._s = 0.0
        self.samples = 0

    @property
    def statistic(self) -> float:
        return self._s

    @property
    def threshold(self) -> float:
        return self._threshold


class BernoulliCusum(_ClampedSum):
    kind = "cusum"

    def __init__(self, p_null: float, p_alt: float, threshold: float, min_samples: int = 1):
        super().__init__(threshold, min_samples)
        _check_rate("p_null", p_null)
        _check_rate("p_alt", p_alt)
        if p_null == p_alt:
            raise ValueError("p_alt must differ from p_null")
        self.p_null, self.p_alt = p_null, p_alt
        self.on_fail, self.on_pass = _llr(p_null, p_alt)

    def update(self, failed: bool) -> bool:
        return self._add(self.on_fail if failed else self.on_pass)

    def describe(self) -> dict:
        return {**super().describe(), "p_null": self.p_null, "p_alt": self.p_alt}


@dataclass(frozen=True)
class ScoreSpec:
    """A tier whose detector accumulates a non-negative score per sample (``ScoreCusum``):
    ``null_mean`` the in-control mean bound, ``alarm_mean`` the level a drifting primary's
    score reaches (a sample fails above it; recovery tests against it), ``bet`` in (0, 1)."""

    null_mean: float
    alarm_mean: float
    bet: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.null_mean < self.alarm_mean:
            raise ValueError("need 0 < null_mean < alarm_mean")
        if not 0 < self.bet < 1:
            raise ValueError("bet must be in (0, 1)")

    def step(self, score: float) -> float:
        """What ``score`` adds to this tier's trip detector (``score_step``, direction up)."""
        return score_step(score, self.null_mean, self.bet)


def score_step(score: float, null_mean: float, bet: float, direction: str = "up") -> float:
    """The log e-value a score adds to a ``ScoreCusum`` (its docstring says why each is one);
    also what each replica exports as ``guard_detector_evidence_nats_total``, the evidence
    the fleet rules pool (guard/deploy/fleet.py)."""
    if not score >= 0.0:  # NaN included
        raise ValueError(f"score must be a number >= 0, got {score}")
    if direction == "up":
        return math.log1p(bet * (score / null_mean - 1.0))
    return math.log1p(bet * (1.0 - min(score, 2.0 * null_mean) / null_mean))


class ScoreCusum(_ClampedSum):
    """CUSUM of betting e-values on a non-negative score ``x`` per sample.

    ``direction='up'`` (trip): ``S = max(0, S + ln(1 + bet (x / null_mean - 1)))``. Whenever
    E[x] <= null_mean, each factor has expectation <= 1 (and is > 0, as x >= 0 and bet < 1):
    it is an e-value, so with ``threshold = ln(ARL0)`` the in-control ARL is at least ARL0 by
    the Shiryaev-Roberts argument of the module docstring, whatever the score's distribution.
    ``direction='down'`` (recovery): ``ln(1 + bet (1 - min(x, 2 null_mean) / null_mean))``, an
    e-value while E[min(x, 2 null_mean)] >= null_mean (the primary still drifts at that level;
    the clip keeps each factor >= 1 - bet > 0)."""

    kind = "score_cusum"

    def __init__(self, null_mean: float, bet: float, threshold: float, min_samples: int = 1,
                 direction: str = "up"):
        super().__init__(threshold, min_samples)
        if null_mean <= 0:
            raise ValueError("null_mean must be > 0")
        if not 0 < bet < 1:
            raise ValueError("bet must be in (0, 1)")
        if direction not in ("up", "down"):
            raise ValueError("direction must be 'up' or 'down'")
        self.null_mean, self.bet = null_mean, bet
        self.direction = direction
        self.last_score: float | None = None

    def increment(self, score: float) -> float:
        return score_step(score, self.null_mean, self.bet, self.direction)

    def update(self, score: float) -> bool:
        step = self.increment(score)
        self.last_score = score
        return self._add(step)

    def describe(self) -> dict:
        return {**super().describe(), "null_mean": self.null_mean, "bet": self.bet,
                "direction": self.direction}


def default_alternatives(p_null: float, shift: float) -> list[float]:
    """Alarm rates an e-detector mixes over: p_null + shift x {1/2, 1, 2, 4, 8, 16}, < 1."""
    rates = []
    for factor in (0.5, 1.0, 2.0, 4.0, 8.0, 16.0):
        rate = p_null + shift * factor
        if rate < 0.999:
            rates.append(rate)
    return rates or [min(0.999, (p_null + 1.0) / 2)]


class EDetector(Detector):
    kind = "e_detector"

    def __init__(self, p_null_bound: float, alternatives: list[float], threshold: float,
                 min_samples: int = 1):
        super().__init__(min_samples)
        _check_rate("p_null_bound", p_null_bound)
        if not alternatives or any(not p_null_bound < a < 1.0 for a in alternatives):
            raise ValueError("alternatives must be rates in (p_null_bound, 1)")
        if threshold <= 0:
            raise ValueError("threshold must be > 0")
        self.p_null = p_null_bound
        self.alternatives = list(alternatives)
        self._threshold = threshold
        self._log_weight = -math.log(len(alternatives))  # equal weights
        self._steps = [_llr(p_null_bound, a) for a in alternatives]
        self._s = [0.0] * len(alternatives)
        self._stat = 0.0

    def update(self, failed: bool) -> bool:
        self.samples += 1
        self._s = [max(0.0, s + (up if failed else down))
                   for s, (up, down) in zip(self._s, self._steps)]
        top = max(self._s)
        self._stat = top + math.log(sum(math.exp(s - top) for s in self._s)) + self._log_weight
        return self.alarmed

    def reset(self) -> None:
        self._s = [0.0] * len(self.alternatives)
        self._stat = 0.0
        self.samples = 0

    @property
    def statistic(self) -> float:
        return max(0.0, self._stat)

    @property
    def threshold(self) -> float:
        return self._threshold

    def describe(self) -> dict:
        return {**super().describe(), "p_null_bound": self.p_null,
                "alternatives": [round(a, 6) for a in self.alternatives]}


class WindowDetector(Detector):
    """``direction='up'``: alarm when the failing share exceeds ``ratio`` (trip).
    ``direction='down'``: alarm when it is at most ``ratio`` (recovered). Both only once
    ``min_samples`` results are in the window (the window holds the results since the last
    reset, up to its size, and ``min_samples`` is at most that size)."""

    kind = "window"

    def __init__(self, window: int, min_samples: int, ratio: float, direction: str = "up"):
        super().__init__(min_samples)
        if direction not in ("up", "down"):
            raise ValueError("direction must be 'up' or 'down'")
        if min_samples > window:
            raise ValueError("min_samples must not exceed window")
        self.window = CountWindow(window)
        self.ratio = ratio
        self.direction = direction

    def update(self, failed: bool) -> bool:
        self.samples += 1
        self.window.add(failed)
        return self.alarmed

    @property
    def alarmed(self) -> bool:
        if self.window.samples < self.min_samples:
            return False
        if self.direction == "up":
            return self.window.ratio > self.ratio
        return self.window.ratio <= self.ratio

    def reset(self) -> None:
        self.window.clear()
        self.samples = 0

    @property
    def statistic(self) -> float:
        return self.window.ratio

    @property
    def threshold(self) -> float:
        return self.ratio

    def describe(self) -> dict:
        return {**super().describe(), "window_samples": self.window.samples,
                "failures": self.window.failures}


def cusum_arl(p_fail: float, on_fail: float, on_pass: float, threshold: float) -> float:
    """Average run length (samples to alarm from S = 0) of a CUSUM that rises by ``on_fail`` on
    a failure (probability ``p_fail``) and falls by ``-on_pass`` on a pass.

    Exact Markov chain on a lattice whose unit is the pass step (Brook & Evans 1972; for the
    Bernoulli CUSUM, Reynolds & Stoumbos 1999). The failure step is rounded *up* to whole
    units, so the figure errs low: a threshold chosen from it keeps at least that ARL. Solved
    by shooting from the top state (one unknown), O(states).
    """
    import numpy as np

    if not (on_fail > 0 > on_pass and 0 < p_fail < 1):
        raise ValueError("need on_fail > 0 > on_pass and 0 < p_fail < 1")
    unit = -on_pass
    up = max(1, math.ceil(on_fail / unit - 1e-9))
    states = max(1, math.ceil(threshold / unit - 1e-9))  # S = i * unit alarms once i >= states
    a = np.zeros(states + up + 1)
    b = np.zeros(states + up + 1)
    b[states - 1] = 1.0  # L(states - 1) = x, the unknown
    q = 1.0 - p_fail
    for i in range(states - 1, 0, -1):  # L(i) = 1 + p L(i + up) + q L(i - 1)
        a[i - 1] = (a[i] - 1.0 - p_fail * a[i + up]) / q
        b[i - 1] = (b[i] - p_fail * b[i + up]) / q
    # At the floor: L(0) = 1 + p L(up) + q L(0), i.e. p (L(0) - L(up)) = 1.
    x = (1.0 / p_fail - a[0] + a[up]) / (b[0] - b[up])
    return float(a[0] + b[0] * x)


def exact_threshold(p_null: float, p_alt: float, arl0: float) -> float:
    """The smallest CUSUM threshold whose in-control ARL (at rate ``p_null``) is at least
    ``arl0``. ln(arl0) is a bound that holds for every such CUSUM and is loose by orders of
    magnitude for Bernoulli data (ln 1e5 gives an ARL near 1.5e7 at p0 = 1%, p1 = 3%)."""
    on_fail, on_pass = _llr(p_null, p_alt)
    unit = -on_pass
    low, high = 1, max(2, math.ceil(math.log(arl0) / unit) + 1)
    while low < high:  # smallest lattice threshold with ARL >= arl0 (ARL grows with it)
        mid = (low + high) // 2
        if cusum_arl(p_null, on_fail, on_pass, mid * unit) >= arl0:
            high = mid
        else:
            low = mid + 1
    return low * unit


def wilson_upper(failures: int, samples: int, z: float) -> float:
    """One-sided Wilson score upper bound of a failure rate (z = 1.2816 for 90%)."""
    if samples <= 0:
        return 1.0
    p = failures / samples
    z2 = z * z
    centre = p + z2 / (2 * samples)
    margin = z * math.sqrt(p * (1 - p) / samples + z2 / (4 * samples * samples))
    return min(1.0, (centre + margin) / (1 + z2 / samples))
