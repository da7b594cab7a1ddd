"""Outcomes -> the per-model figures of the replay report.

Outcomes are added in item order (the caller sorts them), and nothing here depends on timing or
on the engine: equal outcomes give an equal report, whichever engine produced them.

Verdict per model (a choice, documented in the README): for every tier that ran at least one
check, the failing share over the whole replay is compared with the model's
``policy.trip_ratio``, the same threshold that trips the sidecar's fallback on its window; the
model ``drift``s when any tier's share exceeds it, else it ``pass``es. A primary that raises on
a record fails that record's tensor check (a new backend that crashes on old traffic must not
pass a gate); a reference that raises leaves the record unchecked (there is no truth to compare
with) and is reported as an error, as is a generative primary that fails to generate a prompt
set's completion (an unreachable server is not drift).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from typing import Any

from guard.config import ModelConfig
from guard.replay.items import CHECKED, INPUT_ERROR, PRIMARY_ERROR, REFERENCE_ERROR, RecordOutcome
from guard.verify.generation.summary import by_cause
from guard.verify.tiers import TierFigures, sample_kind, tier_kind, tier_names

# Error histogram: a bin for exact zero, half-decade bins from 1e-12 to 1e3, one for beyond.
HIST_EDGES = tuple(10 ** (e / 2) for e in range(-24, 7))
TIMELINE_BUCKETS = 40
EXAMPLES = 5


def _bin(value: float) -> int:
    """0: exactly zero; 1..len(edges)-1: [edge[k-1], edge[k]); last: >= the top edge or not
    finite; values below the lowest edge go to bin 1."""
    if value == 0.0:
        return 0
    if not math.isfinite(value):
        return len(HIST_EDGES)
    return max(1, bisect.bisect_right(HIST_EDGES, value))


class _OutputFigures:
    def __init__(self):
        self.checks = self.passed = self.incomparable = 0
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.allowed_max = 0.0
        self.histogram = [0] * (len(HIST_EDGES) + 1)

    def add(self, check) -> None:
        self.checks += 1
        self.passed += check.passed
        if math.isfinite(check.max_abs):
            self.max_abs = max(self.max_abs, check.max_abs)
            self.sum_abs += check.max_abs
            self.allowed_max = max(self.allowed_max, check.allowed)
        else:
            self.incomparable += 1
        self.histogram[_bin(check.max_abs)] += 1

    def as_dict(self) -> dict:
        comparable = self.checks - self.incomparable
        return {
            "checks": self.checks, "passed": self.passed,
            "max_abs_error": self.max_abs,
            "mean_max_abs_error": self.sum_abs / comparable if comparable else 0.0,
            "incomparable": self.incomparable,  # shape/dtype mismatch, missing output
            "allowed_max": self.allowed_max,
            "histogram": self.histogram,
        }


class ModelAggregate:
    def __init__(self, config: ModelConfig, described: dict | None = None):
        """``described``: what the runner reports (``ModelRunner.describe``): backends, the
        tiers the verifier runs, the noise floor it measured."""
        described = described or {}
        self.config = config
        # A generative model's primary that fails to answer a prompt set's call (replay asks
        # it to generate) is an error, as a failed probe is online: not a failed check.
        self.generative = sample_kind(config.task) == "generation"
        self.backends = {k: described[k] for k in ("reference", "primary") if k in described}
        self.tiers_configured = list(described.get("tiers", []))
        self.noise_floor = described.get("noise_floor")
        self.samples = 0
        self.status: Counter[str] = Counter()
        self.tier_checks: Counter[str] = Counter()
        self.tier_passed: Counter[str] = Counter()
        self.tensor_max_abs = 0.0
        self.outputs: dict[str, _OutputFigures] = {}
        self.first_divergence: dict | None = None
        self.divergence_profile: list = []
        self.profile_record: int | None = None  # the record whose per-layer profile is kept
        self.divergent_layers: Counter[str] = Counter()
        self.task_sums: dict[str, float] = {}
        self.task_counts: Counter[str] = Counter()
        self.live: Counter[tuple[str, str]] = Counter()  # (live, replay) verdicts
        # A registered tier's own figures (its kind's ``figures``), by tier name.
        self.figures: dict[str, TierFigures] = {}
        self.timeline: list[tuple[int, int, bool]] = []  # (unix_nanos, index, passed)
        self.examples: list[dict] = []
        self.errors: list[dict] = []

    # -- adding --------------------------------------------------------------------------------
    def add(self, o: RecordOutcome) -> None:
        self.samples += 1
        self.status[o.status] += 1
        if o.status == PRIMARY_ERROR and not self.generative:
            self.tier_checks["tensor"] += 1
            self._timeline(o, False)
            self._example(o, f"primary raised: {o.error}", ["tensor"], [])
            return
        if o.status in (REFERENCE_ERROR, INPUT_ERROR, PRIMARY_ERROR):
            if len(self.errors) < EXAMPLES:
                self.errors.append(self._where(o) | {"status": o.status, "error": o.error})
            return
        passed_all = True
        for tier, result in o.tiers.items():
            self.tier_checks[tier] += 1
            self.tier_passed[tier] += result.passed
            passed_all &= result.passed
            adder = getattr(self, f"_add_{tier}", None)
            if adder is not None:
                adder(tier, result)
            else:
                self._add_other(tier, result, self._where(o))
        if self.first_divergence is not None and self.profile_record is None:
            self.profile_record = o.index  # the record the kept per-layer profile belongs to
        self._timeline(o, passed_all)
        if not passed_all:
            failing = {t: r for t, r in o.tiers.items() if not r.passed}
            outputs = [c.name for c in failing["tensor"].outputs
                       if not c.passed] if "tensor" in failing else []
            self._example(o, "; ".join(f"{t}: {r.summary}" for t, r in failing.items()),
                          list(failing), outputs)
        if o.live_passed is not None:
            self.live[("pass" if o.live_passed else "fail", "pass" if passed_all else "fail")] += 1

    def _add_tensor(self, tier: str, result) -> None:
        value = result.details.get("max_abs_error", 0.0)
        if math.isfinite(value):
            self.tensor_max_abs = max(self.tensor_max_abs, value)
        for check in result.outputs:
            self.outputs.setdefault(check.name, _OutputFigures()).add(check)

    def _add_activation(self, tier: str, result) -> None:
        first = result.details.get("first_divergence")
        if first and not first.get("within_budget"):  # a layer named inside the budget is
            self.divergent_layers[first["layer"]] += 1  # information, not a divergence
            if self.first_divergence is None and not result.passed:
                self.first_divergence = {"layer": first["layer"],
                                         "error": float(first["error"])}
                self.divergence_profile = list(result.details.get("layers", []))

    def _add_task(self, tier: str, result) -> None:
        for name, value in result.details.get("metrics", {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.task_sums[name] = self.task_sums.get(name, 0.0) + float(value)
                self.task_counts[name] += 1

    def _add_other(self, tier: str, result, where: dict) -> None:
        """A tier with figures of its own (its kind's ``figures``) adds to them, with where the
        record came from; any other is counted, nothing more."""
        if tier not in self.figures:
            factory = _figures_of(tier)
            if factory is None:
                return
            self.figures[tier] = factory()
        self.figures[tier].add(result, where)

    def _timeline(self, o: RecordOutcome, passed: bool) -> None:
        self.timeline.append((o.unix_nanos, o.index, passed))

    @staticmethod
    def _where(o: RecordOutcome) -> dict:
        return {"index": o.index, "request_id": o.request_id, "source": o.source,
                "unix_nanos": o.unix_nanos}

    def _example(self, o: RecordOutcome, why: str, tiers: list[str],
                 outputs: list[str]) -> None:
        """``tiers``/``outputs``: which tiers and which tier-1 outputs failed (the report links
        the record to those plots)."""
        if len(self.examples) < EXAMPLES:
            self.examples.append(self._where(o) | {"why": why, "failing_tiers": tiers,
                                                   "failing_outputs": outputs})

    # -- result --------------------------------------------------------------------------------
    def _tiers(self) -> dict:
        t: dict[str, dict[str, Any]] = {
            "tensor": {
                "checks": self.tier_checks["tensor"], "passed": self.tier_passed["tensor"],
                "max_abs_error": self.tensor_max_abs,
                # A tensor primary's errors fail this tier; a generative one's are in
                # ``status`` and ``error_examples`` only (this tier never ran for it).
                "primary_errors": 0 if self.generative else self.status[PRIMARY_ERROR],
                "outputs": {n: f.as_dict() for n, f in sorted(self.outputs.items())},
            },
            "activation": {
                "checks": self.tier_checks["activation"],
                "passed": self.tier_passed["activation"],
                "first_divergence": self.first_divergence,
                "first_divergence_layers": dict(self.divergent_layers.most_common()),
                "profile": self.divergence_profile,
                "profile_record": self.profile_record,
            },
            "task": {
                "checks": self.tier_checks["task"], "passed": self.tier_passed["task"],
                "metrics": {n: self.task_sums[n] / self.task_counts[n]
                            for n in sorted(self.task_sums)},
            },
        }
        # Every registered tier has a section (zero checks when it did not run), then any tier
        # a record holds that this guard has no registration for; in run order.
        for tier in [*tier_names(), *sorted(set(self.tier_checks) - set(tier_names()))]:
            section = t.setdefault(tier, {"checks": self.tier_checks[tier],
                                          "passed": self.tier_passed[tier]})
            if tier in self.figures:
                section.update(self.figures[tier].as_dict())
        t = {tier: t[tier] for tier in [*tier_names(), *t] if tier in t}
        for figures in t.values():
            checks = figures["checks"]
            figures["failing_share"] = (checks - figures["passed"]) / checks if checks else 0.0
        return t

    def _verdict(self, tiers: dict) -> tuple[str, str]:
        trip = self.config.policy.trip_ratio
        reasons = []
        for tier, figures in tiers.items():
            if figures["checks"] and figures["failing_share"] > trip:
                failed = figures["checks"] - figures["passed"]
                reasons.append(f"{tier}: {failed} of {figures['checks']} failed "
                               f"({figures['failing_share']:.1%}) > policy.trip_ratio {trip:.1%}")
        if reasons:
            return "drift", "; ".join(reasons)
        if not any(f["checks"] for f in tiers.values()):
            why = "; ".join(f"{tier}: {f['not_comparable']} not comparable "
                            f"({by_cause(f.get('not_comparable_reasons'))})"
                            for tier, f in tiers.items() if f.get("not_comparable"))
            return "pass", "no sample could be checked" + (f": {why}" if why else "")
        return "pass", f"every tier's failing share is within policy.trip_ratio {trip:.1%}"

    def _timeline_buckets(self) -> dict:
        if not self.timeline:
            return {"axis": "none", "buckets": []}
        timed = all(t for t, _, _ in self.timeline)
        keys = [t if timed else i for t, i, _ in self.timeline]
        lo, hi = min(keys), max(keys)
        width = (hi - lo) / TIMELINE_BUCKETS if hi > lo else 1
        counts = [[0, 0] for _ in range(TIMELINE_BUCKETS)]
        for key, (_, _, passed) in zip(keys, self.timeline):
            k = min(TIMELINE_BUCKETS - 1, int((key - lo) / width)) if hi > lo else 0
            counts[k][0] += 1
            counts[k][1] += passed
        buckets = [
            {"start": lo + k * width, "checks": c, "passed": p}
            for k, (c, p) in enumerate(counts) if c
        ]
        return {"axis": "unix_nanos" if timed else "index", "start": lo, "end": hi,
                "buckets": buckets}

    def result(self) -> dict:
        tiers = self._tiers()
        verdict, reason = self._verdict(tiers)
        c = self.config.checks.tensor
        thresholds = {"trip_ratio": self.config.policy.trip_ratio,
                      "tensor": {"atol": c.atol, "rtol": c.rtol,
                                 "outputs": {n: o.model_dump(exclude_none=True)
                                             for n, o in c.outputs.items()}}}
        if self.generative:
            thresholds["generation"] = self.config.checks.generation.model_dump()
        return {
            "samples": self.samples,
            "verdict": verdict,
            "verdict_reason": reason,
            "tiers": tiers,
            "thresholds": thresholds,
            "status": {s: self.status[s] for s in
                       (CHECKED, PRIMARY_ERROR, REFERENCE_ERROR, INPUT_ERROR)},
            "backends": self.backends,
            "tiers_run": self.tiers_configured,
            "noise_floor": self.noise_floor,
            "live_agreement": {
                "compared": sum(self.live.values()),
                "both_pass": self.live[("pass", "pass")],
                "both_fail": self.live[("fail", "fail")],
                "live_pass_replay_fail": self.live[("pass", "fail")],
                "live_fail_replay_pass": self.live[("fail", "pass")],
            },
            "timeline": self._timeline_buckets(),
            "failing_examples": self.examples,
            "error_examples": self.errors,
        }


def _figures_of(tier: str):
    """The registered tier's figures factory, or None (unregistered, or counts only)."""
    try:
        return tier_kind(tier).figures
    except KeyError:
        return None
