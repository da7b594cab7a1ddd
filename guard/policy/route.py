"""The route state machine: a detector per tier trips the model to its fallback; a second
detector with a lower rate, fed by probes of the primary, routes it back.

States: ``primary`` (the primary answers; mirrored samples compare its answers) and ``fallback``
(the fallback answers). The trip detector of each tier (``policy.detector``: cusum, e_detector or
window; see detector.py) watches the primary's per-sample failures; when one alarms, the model
switches. On the fallback nothing is probed for the dwell time; after that the mirror runs the
primary in the background on sampled requests and the *recovery* detector (the failure rate has
come down from the alarm rate to the recovery rate; for ``window``: the failing share of a fresh
window is at most ``recover_ratio``) routes it back.

Dwell (Envoy's outlier ejection): the k-th trip in a row keeps the fallback for dwell_s x k, up
to the cap; each dwell_s spent healthy on the primary takes one trip off the count. After
routing back, ``primary_dwell_s`` must pass before the model may trip again.

Calibration: with ``p0`` unset, the first ``burn_in`` compared samples on the primary measure it
(one-sided 90% Wilson upper bound of the failing share, clipped to [p0_min, p0_max]); during the
burn-in the detector runs with p0 = p0_max, so a model broken from the start still trips.

A *scored* tier (the generation tier: ``scores``) feeds its detectors a number per sample (a
completion's mean KLD) instead of the failure bit: trip and recovery are ``ScoreCusum``s, with
no p0 to calibrate; its window still counts failures for the drift-ratio gauge.

Each transition starts a new *epoch*: results of samples taken in an earlier epoch are ignored,
so a verdict on the old route never counts toward a decision about the new one.

Each tier acts as ``policy.action_for(tier)`` says (``policy.actions``, else ``policy.action``).
A tier whose action is ``alert`` runs the same way on paper (events, gauges), but its trip never
moves the route: an alert fires once per crossing of that tier and re-arms when the tier's
recovery detector says the rate came down. So ``{tensor: alert, task: fallback_model}`` alerts
on tensor drift and switches on task drift. On the fallback, the tier whose trip sent the model
there decides the way back, and only while no other switching tier's trip detector is in alarm
on the same probes (a tier that never failed, such as tier 3 under a tier-1 drift, says nothing
about the drift; a tier that only alerts may go on drifting: that did not send the model away).
On the fallback by an operator's pin, handed back to ``auto``, any switching tier's recovery
brings it back (any tier's, when none switches). ``dry_run_percent`` of the
switching trips are reported (trigger ``dry_run``) but not enforced. A manual override (admin
API) pins the route until ``auto``.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, cast

from guard.config import PolicyConfig
from guard.observe.events import emit
from guard.policy.detector import (
    BernoulliCusum,
    Detector,
    EDetector,
    ScoreCusum,
    ScoreSpec,
    WindowDetector,
    default_alternatives,
    exact_threshold,
    wilson_upper,
)
from guard.policy.window import CountWindow

Route = Literal["primary", "fallback"]
Override = Literal["auto", "primary", "fallback"]

_BURN_IN_Z = 1.2816  # one-sided 90%: a lucky burn-in does not set p0 (and false alarms) too low


@dataclass(frozen=True)
class Transition:
    model: str
    from_route: str
    to_route: str
    trigger: str  # "policy" | "manual" | "alert" | "dry_run" | "repair"
    reason: str
    unix_time: float
    evidence: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class WindowFigures:
    tier: str
    samples: int
    failures: int
    ratio: float


@dataclass(frozen=True)
class DetectorFigures:
    """A tier's trip detector, for the statistic/threshold gauges: how close the primary is to
    tripping. On the fallback it keeps reading the probes of the primary, so a statistic over
    its threshold there says the primary still drifts (recovery is a separate detector)."""

    tier: str
    kind: str
    statistic: float
    threshold: float
    p0: float | None  # None for the window detector
    samples: int = 0  # since the detector (re)started: it decides from min_samples on
    min_samples: int = 1
    # (p0 in use, alarm rate p1) of a pass/fail tier, whatever its detector; None when scored
    rates: tuple[float, float] | None = None

    @property
    def null_rate(self) -> float:
        return self.rates[0] if self.rates else math.nan

    @property
    def alarm_rate(self) -> float:
        return self.rates[1] if self.rates else math.nan


class _TierState:
    """One tier's count window (for the drift-ratio gauge), detectors, burn-in and action."""

    def __init__(self, config: PolicyConfig, arl0: float, score: ScoreSpec | None = None,
                 action: str = "alert", has_fallback: bool = True):
        self.config = config
        self.arl0 = arl0
        self.action = action
        # A trip of this tier moves the route (else it alerts); alerting: an alert of this
        # tier fired and its recovery detector has not re-armed it yet.
        self.switches = action in ("fallback_model", "fallback_ops") and has_fallback
        self.alerting = False
        # A scored tier's sequential detectors accumulate its score (not the failure bit):
        # no p0 to measure, no burn-in. The window (drift-ratio gauge) still counts failures.
        self.score = score if config.detector != "window" else None
        self.window = CountWindow(config.window)
        self.p0 = config.p0
        self.burn_samples = 0
        self.burn_failures = 0
        self.trip: Detector
        self.recover: Detector
        self.build()

    @property
    def sequential(self) -> bool:
        return self.config.detector != "window"

    @property
    def scored(self) -> bool:
        return self.score is not None

    @property
    def p0_in_use(self) -> float:
        return self.p0 if self.p0 is not None else self.config.p0_max

    def alarm_rate(self) -> float:
        c, p0 = self.config, self.p0_in_use
        if c.detector == "cusum" and c.p1 is not None and c.p1 > p0:
            return c.p1
        return min(0.999, p0 + c.shift)

    def build(self) -> None:
        """Fresh trip and recovery detectors (at the start, and once burn-in measured p0).
        Both decide only from ``min_samples`` results on (guard/policy/detector.py)."""
        c = self.config
        if not self.sequential:
            self.trip = WindowDetector(c.window, c.min_samples, c.trip_ratio, "up")
            # Recovery reads the same window: one count, two thresholds (hysteresis).
            self.recover = _SharedWindowView(self.trip, c.recover_ratio)
            return
        h = math.log(self.arl0)
        if self.score is not None:
            spec = self.score
            self.trip = ScoreCusum(spec.null_mean, spec.bet, h, c.min_samples, "up")
            self.recover = ScoreCusum(spec.alarm_mean, spec.bet, math.log(c.recover_arl0),
                                      c.min_samples, "down")
            return
        p0, p1 = self.p0_in_use, self.alarm_rate()
        if c.detector == "cusum":
            if c.threshold == "exact":
                h = exact_threshold(p0, p1, self.arl0)
            self.trip = BernoulliCusum(p0, p1, h, c.min_samples)
        else:
            self.trip = EDetector(p0, default_alternatives(p0, c.shift), h, c.min_samples)
        rate = c.recover_rate if c.recover_rate is not None else p0
        if not rate < p1:
            rate = p1 / 2
        self.recover = BernoulliCusum(p1, max(rate, 1e-6), math.log(c.recover_arl0),
                                      c.min_samples)

    def reset(self) -> None:
        self.window.clear()
        self.trip.reset()
        self.recover.reset()

    def calibrate(self, failed: bool) -> dict | None:
        """Count one burn-in sample; returns the calibration record when p0 gets measured."""
        if self.p0 is not None or not self.sequential or self.scored:
            return None
        self.burn_samples += 1
        self.burn_failures += failed
        if self.burn_samples < self.config.burn_in:
            return None
        upper = wilson_upper(self.burn_failures, self.burn_samples, _BURN_IN_Z)
        self.p0 = min(max(upper, self.config.p0_min), self.config.p0_max)
        self.build()
        return {"p0": round(self.p0, 6), "samples": self.burn_samples,
                "failures": self.burn_failures, "upper_bound_90": round(upper, 6),
                "clipped": upper != self.p0, "p1": round(self.alarm_rate(), 6)}


class _SharedWindowView(Detector):
    """The window detector's recovery side: the same window, alarm when ratio <= recover."""

    kind = "window"

    def __init__(self, trip: WindowDetector, ratio: float):
        super().__init__(trip.min_samples)
        self._trip = trip
        self.ratio = ratio

    def update(self, failed: bool) -> bool:
        return self.alarmed  # the trip detector owns the window and is fed first

    @property
    def alarmed(self) -> bool:
        w = self._trip.window
        return w.samples >= self._trip.min_samples and w.ratio <= self.ratio

    def reset(self) -> None:
        pass  # the window belongs to the trip detector

    @property
    def statistic(self) -> float:
        return self._trip.window.ratio

    @property
    def threshold(self) -> float:
        return self.ratio


class RoutePolicy:
    def __init__(
        self,
        model: str,
        config: PolicyConfig,
        tiers: tuple[str, ...] = ("tensor",),
        has_fallback: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sample_rate: float = 1.0,
        rng: random.Random | None = None,
        scores: dict[str, ScoreSpec] | None = None,
    ):
        """``scores``: the tiers whose detectors accumulate a score per sample (``observe``'s
        ``score``) instead of the failure bit (guard/policy/detector.py ``ScoreCusum``)."""
        self.model = model
        self.config = config
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self.arl0 = config.arl0_for(sample_rate)
        self._tiers = {tier: _TierState(config, self.arl0, (scores or {}).get(tier),
                                        config.action_for(tier), has_fallback)
                       for tier in tiers}
        self.can_switch = any(state.switches for state in self._tiers.values())
        self._state: Route = "primary"
        self._override: Override = "auto"
        self._since = clock()
        self._trips = 0  # trips in a row, for the growing dwell
        self._healthy_since = clock()
        self._dwell = config.dwell_s
        self._sent_by: str | None = None  # the tier whose trip put the model on the fallback
        self.epoch = 0
        self.last_transition: Transition | None = None
        # Wall-clock time the count windows last started empty (this process's start, a route
        # change, an override): admin status says since when its "n/m failing" counts.
        self.windows_since = time.time()
        self._handed_on = False  # carry_on gave this policy's state to its successor

    # -- read on the request path: plain attribute reads, no lock ---------------------------
    @property
    def route(self) -> Route:
        return self._state

    @property
    def override(self) -> Override:
        return self._override

    @property
    def probing(self) -> bool:
        """On the fallback and past the dwell: the mirror should run the primary in background."""
        return self._state == "fallback" and self._clock() - self._since >= self._dwell

    @property
    def dwell_s(self) -> float:
        """The dwell of the current (or next) stay on the fallback."""
        return self._dwell

    # -- fed by the mirror worker --------------------------------------------------------------
    def observe(self, tier: str, failed: bool, epoch: int,
                score: float | None = None) -> Transition | None:
        """Record one check result taken in ``epoch``; returns a transition if one happened.
        ``score``: a scored tier's figure for the sample (its detectors take it; a scored
        sample without one counts in the window only)."""
        with self._lock:
            if epoch != self.epoch or self._handed_on:
                return None  # taken on a route that is no longer current, or counted on
            state = self._tiers[tier]
            state.window.add(failed)
            if state.scored:
                if score is None:
                    return None
                value = score
            else:
                value = failed
            if self._state == "primary":
                return self._observe_primary(tier, state, value)
            return self._observe_fallback(tier, state, value)

    def _observe_primary(self, tier: str, state: _TierState, failed) -> Transition | None:
        if not state.alerting:
            calibrated = state.calibrate(failed)
            if calibrated is not None:
                emit("detector_calibrated", model=self.model, tier=tier,
                     detector=self.config.detector, **calibrated)
                return None  # fresh detectors start with the next sample
        tripped = state.trip.update(failed)
        if state.alerting:
            if state.sequential:
                state.recover.update(failed)
            if state.recover.alarmed:
                state.alerting = False  # re-armed: the tier's next crossing alerts again
                if state.sequential:
                    state.trip.reset()
                    state.recover.reset()
                return None
        if not tripped:
            return None
        if self._clock() - self._since < self.config.primary_dwell_s:
            return None  # too soon after routing back; the detector keeps its alarm
        evidence = self._evidence(tier, state, state.trip)
        reason = self._trip_reason(tier, state)
        if self._override == "auto" and state.switches:
            if self._rng.random() * 100.0 < self.config.dry_run_percent:
                state.trip.reset()
                return Transition(self.model, "primary", "fallback", "dry_run",
                                  f"dry run (not enforced): {reason}", time.time(), evidence)
            return self._switch("fallback", "policy", reason, evidence)
        if not state.alerting:
            state.alerting = True
            state.recover.reset()
            return Transition(self.model, "primary", "primary", "alert", reason, time.time(),
                              evidence)
        return None

    def _observe_fallback(self, tier: str, state: _TierState, failed) -> Transition | None:
        state.trip.update(failed)  # probes keep the trip statistic (window: the shared window)
        recovered = state.recover.update(failed) if state.sequential else state.recover.alarmed
        if not recovered or self._override != "auto":
            return None
        if not self._decides_recovery(tier, state):
            return None
        if state.scored:
            scored = cast(ScoreCusum, state.recover)  # (what build() made of a scored tier)
            reason = (f"primary probes recovered: {tier} {scored.kind} statistic "
                      f"{scored.statistic:.2f} >= {scored.threshold:.2f} after "
                      f"{scored.samples} probes (mean score below {scored.null_mean:.4g})")
        elif state.sequential:
            r = cast(BernoulliCusum, state.recover)  # (what build() made of a counted tier)
            reason = (f"primary probes recovered: {tier} {r.kind} statistic {r.statistic:.2f} "
                      f">= {r.threshold:.2f} after {r.samples} probes (failure rate down from "
                      f"{r.p_null:.4g} to {r.p_alt:.4g})")
        else:
            w = state.window
            reason = (f"primary probes recovered: {tier} drift ratio {w.ratio:.2f} <= "
                      f"recover_ratio {self.config.recover_ratio} over {w.samples} samples")
        return self._switch("primary", "policy", reason,
                            self._evidence(tier, state, state.recover))

    def _decides_recovery(self, tier: str, state: _TierState) -> bool:
        """Whether ``tier``'s recovery may route back now (see the module docstring)."""
        if self.can_switch and not state.switches:
            return False  # an alerting tier did not send the model away: not its call
        if self._sent_by is not None and tier != self._sent_by:
            return False
        return not any(other.switches and other.trip.alarmed
                       for name, other in self._tiers.items() if name != tier)

    def _trip_reason(self, tier: str, state: _TierState) -> str:
        if not state.sequential:
            w = state.window
            return (f"{tier} drift ratio {w.ratio:.2f} > trip_ratio {self.config.trip_ratio} "
                    f"over {w.samples} samples")
        d = state.trip
        if state.scored:
            s = cast(ScoreCusum, d)  # (what build() made of a scored tier)
            return (f"{tier} {s.kind} statistic {s.statistic:.2f} >= threshold "
                    f"{s.threshold:.2f} (ARL0 {self.arl0:.3g} while the mean score is at most "
                    f"{s.null_mean:.4g}; last score {s.last_score:.4g}) after {s.samples} "
                    "samples")
        return (f"{tier} {d.kind} statistic {d.statistic:.2f} >= threshold {d.threshold:.2f} "
                f"(ARL0 {self.arl0:.3g}, p0 {state.p0_in_use:.4g}"
                f"{'' if state.p0 is not None else ' during burn-in'}) after {d.samples} "
                "samples")

    def _evidence(self, tier: str, state: _TierState, detector: Detector) -> dict:
        w = state.window
        evidence = {"tier": tier, "action": state.action, "samples": w.samples,
                    "failures": w.failures, "drift_ratio": round(w.ratio, 4)}
        if state.scored:
            evidence["detector"] = {**detector.describe(), "arl0": self.arl0}
        elif state.sequential:
            evidence["detector"] = {**detector.describe(), "p0": state.p0_in_use,
                                    "p0_measured": state.p0 is not None and
                                    self.config.p0 is None, "arl0": self.arl0}
        return evidence

    # -- admin -----------------------------------------------------------------------------
    def set_override(self, override: Override, reason: str) -> Transition | None:
        with self._lock:
            previous = self._override
            self._override = override
            if override == "auto":
                # Fresh evidence from here on, on whatever route is current.
                self._start_epoch()
                if previous == "auto":
                    return None
                return Transition(self.model, self._state, self._state, "manual",
                                  reason or "route handed back to the policy", time.time())
            if override == self._state:
                self._start_epoch()
                return Transition(self.model, self._state, self._state, "manual",
                                  reason or f"route pinned to {override}", time.time())
            return self._switch(override, "manual", reason or f"route pinned to {override}", {})

    def repaired(self, epoch: int, reason: str, evidence: dict) -> Transition | None:
        """Route back to the primary after a repair (ops kept back) that started in ``epoch``;
        None when the route moved meanwhile (override, recovery) and the repair is stale."""
        with self._lock:
            if (epoch != self.epoch or self._state != "fallback"
                    or self._override != "auto"):
                return None
            return self._switch("primary", "repair", reason, evidence)

    def resume(self, route: Route, epoch: int, override: Override = "auto") -> None:
        """Go on from a route, epoch and override that a previous verifier process published
        (it died): samples routed in that epoch still count, an operator's pin stays, and a stay
        on the fallback starts its dwell again. Detector statistics start afresh: they died
        with the process."""
        with self._lock:
            self._state = route
            self.epoch = epoch
            self._override = override
            self._since = self._clock()
            self._sent_by = None  # who sent it there died with the previous process
            if route == "fallback":
                self._dwell = self.config.dwell_s

    def carry_on(self, previous: RoutePolicy) -> bool:
        """Go on from ``previous``, evidence included: the same model reloaded with a config
        that changes nothing its detectors judge by (guard/serve/reload.py
        ``evidence_fingerprint``: only how many calls are mirrored, or what capture keeps).
        The route, its epoch, the dwell under way, the trip count, the pin, the count windows,
        the burn-in and the detectors' statistics go on where they were. ``previous`` counts
        nothing from now on: the two would else update the same windows and detectors under
        two locks (its mirror's last results, a few at most, are checked and captured but not
        counted). False, and nothing carried, where the two watch different tiers."""
        with previous._lock, self._lock:
            if set(previous._tiers) != set(self._tiers) or previous._handed_on:
                return False
            self._tiers = previous._tiers
            self._state, self._override = previous._state, previous._override
            self._since, self._sent_by = previous._since, previous._sent_by
            self._trips, self._dwell = previous._trips, previous._dwell
            self._healthy_since = previous._healthy_since
            self.epoch, self.last_transition = previous.epoch, previous.last_transition
            self.windows_since = previous.windows_since
            previous._handed_on = True
            return True

    def windows(self) -> list[WindowFigures]:
        with self._lock:
            return [WindowFigures(t, s.window.samples, s.window.failures, s.window.ratio)
                    for t, s in self._tiers.items()]

    def detectors(self) -> list[DetectorFigures]:
        with self._lock:
            return [DetectorFigures(tier, s.trip.kind, s.trip.statistic, s.trip.threshold,
                                    s.p0_in_use if s.sequential and not s.scored else None,
                                    s.trip.samples, s.trip.min_samples,
                                    None if s.scored else (s.p0_in_use, s.alarm_rate()))
                    for tier, s in self._tiers.items()]

    # -- internals (lock held) ---------------------------------------------------------------
    def _start_epoch(self) -> None:
        self.epoch += 1
        self._since = self._clock()
        self.windows_since = time.time()
        for state in self._tiers.values():
            state.reset()

    def _switch(self, to: Route, trigger: str, reason: str, evidence: dict) -> Transition:
        now = self._clock()
        if to == "fallback":
            if trigger == "policy":
                self._trips = self._decayed_trips(now) + 1
                self._dwell = min(self.config.dwell_s * self._trips, self.config.dwell_cap_s)
                evidence = {**evidence, "trips_in_a_row": self._trips,
                            "dwell_s": self._dwell}
            else:
                self._dwell = self.config.dwell_s
        else:
            self._healthy_since = now
        self._sent_by = evidence.get("tier") if to == "fallback" and trigger == "policy" \
            else None
        transition = Transition(self.model, self._state, to, trigger, reason, time.time(),
                                evidence)
        self._state = to
        for state in self._tiers.values():
            state.alerting = False
        self._start_epoch()
        self.last_transition = transition
        return transition

    def _decayed_trips(self, now: float) -> int:
        """Envoy: each base dwell spent healthy on the primary takes one trip off the count."""
        if self.config.dwell_s <= 0:
            return 0
        healthy = max(0.0, now - self._healthy_since)
        return max(0, self._trips - int(healthy // self.config.dwell_s))
