"""Policy v0: a count window per tier and a two-state route with hysteresis and dwell.

States: ``primary`` (the primary answers; mirrored samples compare its answers) and ``fallback``
(the fallback answers). The model trips to the fallback when, after ``min_samples``, the failing
share of a tier's window exceeds ``trip_ratio``. On the fallback nothing is probed for
``dwell_s``; after that the mirror keeps running the primary in the background on sampled
requests, and the model routes back when a fresh window of those probes fails at most
``recover_ratio`` (lower than the trip ratio, so it does not flap).

Each transition starts a new *epoch*: results of samples taken in an earlier epoch are ignored,
so a verdict on the old route never counts toward a decision about the new one.

With ``action: alert`` the state machine runs the same way on paper (events, gauges), but the
route never leaves the primary. A manual override (admin API) pins the route until ``auto``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

from guard.config import PolicyConfig
from guard.policy.window import CountWindow

Route = Literal["primary", "fallback"]
Override = Literal["auto", "primary", "fallback"]


@dataclass(frozen=True)
class Transition:
    model: str
    from_route: str
    to_route: str
    trigger: str  # "policy" | "manual"
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


class RoutePolicy:
    def __init__(
        self,
        model: str,
        config: PolicyConfig,
        tiers: tuple[str, ...] = ("tensor",),
        has_fallback: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.model = model
        self.config = config
        self.can_switch = config.action == "fallback_model" and has_fallback
        self._clock = clock
        self._lock = threading.Lock()
        self._windows = {tier: CountWindow(config.window) for tier in tiers}
        self._state: Route = "primary"
        self._override: Override = "auto"
        self._since = clock()
        self._alerting = False
        self.epoch = 0
        self.last_transition: Transition | None = None

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
        return self._state == "fallback" and self._clock() - self._since >= self.config.dwell_s

    # -- fed by the mirror worker --------------------------------------------------------------
    def observe(self, tier: str, failed: bool, epoch: int) -> Transition | None:
        """Record one check result taken in ``epoch``; returns a transition if one happened."""
        with self._lock:
            if epoch != self.epoch:
                return None  # taken on a route that is no longer current
            window = self._windows[tier]
            window.add(failed)
            if window.samples < self.config.min_samples:
                return None
            evidence = {"tier": tier, "samples": window.samples, "failures": window.failures,
                        "drift_ratio": round(window.ratio, 4)}
            if self._state == "primary" and window.ratio > self.config.trip_ratio:
                reason = (f"{tier} drift ratio {window.ratio:.2f} > trip_ratio "
                          f"{self.config.trip_ratio} over {window.samples} samples")
                if self._override == "auto" and self.can_switch:
                    return self._switch("fallback", "policy", reason, evidence)
                if not self._alerting:
                    self._alerting = True
                    return Transition(self.model, "primary", "primary", "alert", reason,
                                      time.time(), evidence)
            elif self._state == "primary" and window.ratio <= self.config.recover_ratio:
                self._alerting = False
            elif (self._state == "fallback" and self._override == "auto"
                  and window.ratio <= self.config.recover_ratio):
                reason = (f"primary probes recovered: {tier} drift ratio {window.ratio:.2f} <= "
                          f"recover_ratio {self.config.recover_ratio} over {window.samples} samples")
                return self._switch("primary", "policy", reason, evidence)
            return None

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

    def windows(self) -> list[WindowFigures]:
        with self._lock:
            return [WindowFigures(t, w.samples, w.failures, w.ratio)
                    for t, w in self._windows.items()]

    # -- internals (lock held) ---------------------------------------------------------------
    def _start_epoch(self) -> None:
        self.epoch += 1
        self._since = self._clock()
        for window in self._windows.values():
            window.clear()

    def _switch(self, to: Route, trigger: str, reason: str, evidence: dict) -> Transition:
        transition = Transition(self.model, self._state, to, trigger, reason, time.time(),
                                evidence)
        self._state = to
        self._alerting = False
        self._start_epoch()
        self.last_transition = transition
        return transition
