"""Fleet rules (``guard deploy rules --fleet``): one model's evidence pooled over its replicas.

Many replicas of one model each see a few samples, and drift caused by the image (a new
quantisation, engine or driver) reaches all of them at once. Each replica's own detector sees
only its own share of the samples; summed over the fleet, twenty replicas at 1% sampling carry
the evidence of one replica at 20%. Prometheus already holds every replica's counts
(``guard_checks_total{model, tier, result}``), so the pooling is done there:

- recording rules, per window ``w`` of ``FleetSettings.windows``: the checks and the failures
  of each (``by``, tier) over ``w``, summed over the replicas (``tier`` 2, activation, feeds no
  detector and is left out);
- the rates to test between, per (``by``, tier): the highest in-control failure rate p0 any
  replica assumes (``guard_detector_p0``: ``policy.p0``, or what its burn-in measured, an
  upper bound at 90%, or ``policy.p0_max`` until then) and the highest alarm rate p1
  (``guard_detector_p1``: p0 + ``policy.shift``, or ``policy.p1``). The highest: the test
  below keeps its promise whenever the true rate is at most the p0 it uses;
- per model, the log-likelihood ratio of its pooled counts (``f`` failures in ``n`` checks)
  between them: ``llr = f ln(p1/p0) + (n - f) ln((1 - p1)/(1 - p0))``;
- the alert ``GuardFleetDrift`` when, on any window, ``llr >= h`` with at least
  ``policy.min_samples`` pooled checks.

A ``task: generation`` model's detector weighs a score per completion, not a bit (its step is
``ln(1 + bet (score / in_control_ratio - 1))``, an e-value's log: guard/policy/detector.py
``ScoreCusum``), and each replica exports the sum of those steps, split by sign
(``guard_detector_evidence_nats_total{direction="for"|"against"}``). Its pooled ratio is that
sum over the fleet and the window, ``for`` minus ``against``: the log of the product of every
pooled completion's e-value, which is a likelihood ratio's kind of evidence and takes the same
threshold by the same argument below (each factor has expectation at most 1 while the mean
score is at most ``in_control_ratio``). Every replica must run one config (one
``in_control_ratio`` and ``bet``), as a fleet of one image does.

The threshold. A ratio over a window is not a CUSUM, and the CUSUM's ARL0 does not carry over:
the window is evaluated again every ``evaluation_interval`` over overlapping data. What holds is
this: for a fixed window, while the rate is p0, the likelihood ratio ``exp(llr)`` has expectation
1 whatever ``n`` is (each check multiplies it by a factor whose mean under p0 is
``p0 (p1/p0) + (1 - p0) (1 - p1)/(1 - p0) = 1``), so by Markov's inequality
``P(llr >= h) <= exp(-h)`` at each evaluation of each window (and at any true rate below p0:
the ratio then has expectation below 1). An alarm episode starts at an
evaluation where the condition holds, so the expected number of false alarms per day is at most
the evaluations per day times the windows times ``exp(-h)``:

    h = ln(windows x 86400 / evaluation_interval_s / false_alarms_per_day)

a bound, as ``threshold: bound`` is for the CUSUM (docs/detection.md): overlapping windows fire
in clusters and Markov's bound is loose, so the rate measured in
benchmarks/fleet_detection.py is well under it. Several windows let a large shift show within
minutes and a small one over hours (each window pays ln(windows) nats, as the e-detector's
mixture pays ln(K)). The counts come from ``increase()``, which extrapolates to the window's
edges: up to an interval of scrape more than counted, on failures and checks alike (the ratio
moves by that share; the bound's slack covers it at the default windows).

Left out: models with ``policy.detector: window``. That detector has no burn-in, so its
replicas export ``guard_detector_p0`` = ``policy.p0_max`` (a ceiling, not the model's in-control
rate) and p1 = p0 + ``policy.shift``, neither of which it decides on (``policy.trip_ratio``):
pooled, a fleet failing half its own trip ratio would raise the critical alert. The generated
file's header names them (``left_out``).

Not done: acting on the fleet's verdict. The alert says the fleet drifts; each replica still
routes on its own detector (it trips later, on its own evidence). Pinning a fleet to its
fallback is an operator's or a rollout controller's decision (``guard admin route``, or the
canary gate of ``guard deploy rollout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from guard.deploy.rules import (
    DURATION,
    ModelThresholds,
    RuleSettings,
    alert_rule,
    model_selector,
)

ALERT = "GuardFleetDrift"
ALERTS = (ALERT,)
_SECONDS = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


@dataclass(frozen=True)
class FleetSettings:
    """The pooled rule's windows, Prometheus's rule evaluation interval (the threshold counts
    evaluations) and the false alarms per day it may raise per model and tier (a bound)."""

    windows: tuple[str, ...] = ("5m", "30m", "2h")  # a large shift in minutes, a small in hours
    evaluation_interval: str = "1m"  # Prometheus's global default
    false_alarms_per_day: float = 0.1  # one in ten days per model and tier, at most
    by: tuple[str, ...] = ("model",)  # labels the replicas are pooled by (tier is added)

    def __post_init__(self) -> None:
        if not self.windows:
            raise ValueError("fleet windows: at least one")
        for duration in (*self.windows, self.evaluation_interval):
            if not DURATION.match(duration):
                raise ValueError(f"'{duration}' is not a Prometheus duration (e.g. 5m, 2h)")
        if not self.false_alarms_per_day > 0:
            raise ValueError("fleet false alarms per day must be > 0")
        if "model" not in self.by or any(not label.isidentifier() for label in self.by):
            raise ValueError("fleet pooling labels: label names, 'model' among them")

    def flags(self) -> str:
        """The command line flags that give these settings (the generated file's header)."""
        default = FleetSettings()
        out = " --fleet"
        if self.windows != default.windows:
            out += f" --fleet-windows {','.join(self.windows)}"
        if self.evaluation_interval != default.evaluation_interval:
            out += f" --fleet-evaluation-interval {self.evaluation_interval}"
        if self.false_alarms_per_day != default.false_alarms_per_day:
            out += f" --fleet-false-alarms-per-day {self.false_alarms_per_day:g}"
        if self.by != default.by:
            out += f" --fleet-by {','.join(self.by)}"
        return out

    @property
    def threshold(self) -> float:
        return fleet_threshold(self.false_alarms_per_day, seconds(self.evaluation_interval),
                               len(self.windows))


def seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``) in seconds."""
    import re

    total = sum(float(n) * _SECONDS[unit]
                for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", duration))
    if total <= 0:
        raise ValueError(f"'{duration}' is not a positive duration")
    return total


def fleet_threshold(false_alarms_per_day: float, evaluation_s: float, windows: int) -> float:
    """The log-likelihood-ratio threshold that keeps the pooled rule's false alarms at most
    ``false_alarms_per_day`` (see the module docstring)."""
    evaluations = 86400.0 / evaluation_s * windows
    return math.log(max(evaluations / false_alarms_per_day, 1.0 + 1e-9))


def applies(model: ModelThresholds) -> bool:
    """Models whose replicas check samples with a sequential detector: pass/fail tiers pool
    their counts, a generation model its completions' evidence. Not ``detector: window``
    (``left_out``)."""
    return model.mirrors and model.policy.detector != "window"


def left_out(models: list[ModelThresholds]) -> list[str]:
    """Why each sampled model the fleet rule does not pool is left out, one line each (the
    generated file's header says so). A ``window`` detector never burns in: its replicas
    export ``guard_detector_p0`` = ``policy.p0_max``, the burn-in's ceiling, not the model's
    in-control rate, and decide on ``policy.trip_ratio``, which the pooled test does not read:
    a fleet well inside its own trip ratio would raise the critical alert. Nor does it export
    a generation model's evidence."""
    return [f"{model.name}: policy.detector is window (its replicas export no in-control rate "
            "to pool against; its own GuardDriftOverThreshold alerts on policy.trip_ratio)"
            for model in models if model.mirrors and not applies(model)]


def _name(kind: str, window: str) -> str:
    return f"model_tier:guard_fleet_{kind}:increase{window}"


def recording_rules(settings: RuleSettings, fleet: FleetSettings,
                    scored: bool = False) -> list[dict]:
    """Per window, the checks and failures of each (pooling labels, tier), fleet-wide; the
    rates to test between; and with ``scored`` (a generation model is pooled), the scored
    tiers' evidence."""
    by = ", ".join((*fleet.by, "tier"))
    job = f'job="{settings.job}"'
    base = f'{job},tier!="activation"'
    rules = []
    for window in fleet.windows:
        rules += [
            {"record": _name("checks", window),
             "expr": f"sum by ({by}) (increase(guard_checks_total{{{base},"
                     f'result=~"pass|fail"}}[{window}]))'},
            {"record": _name("failures", window),
             "expr": f"sum by ({by}) (increase(guard_checks_total{{{base},"
                     f'result="fail"}}[{window}]))'},
        ]
    for rate in ("p0", "p1"):
        rules.append({"record": f"model_tier:guard_fleet_{rate}:max",
                      "expr": f"max by ({by}) (guard_detector_{rate}{{{job}}})"})
    if scored:
        evidence = "guard_detector_evidence_nats_total"
        for window in fleet.windows:
            rules.append({
                "record": _name("evidence_nats", window),
                "expr": f'sum by ({by}) (increase({evidence}{{{job},direction="for"}}'
                        f'[{window}])) - sum by ({by}) (increase({evidence}{{{job},'
                        f'direction="against"}}[{window}]))'})
    return rules


def llr_expr(model: ModelThresholds, window: str) -> str:
    """The pooled log-likelihood ratio of p1 against p0 over ``window``, as PromQL (a
    generation model: its completions' pooled log e-value)."""
    sel = model_selector(model.name)
    if model.generation is not None:
        return f"{_name('evidence_nats', window)}{{{sel}}}"
    fails, checks = f"{_name('failures', window)}{{{sel}}}", f"{_name('checks', window)}{{{sel}}}"
    p0, p1 = f"model_tier:guard_fleet_p0:max{{{sel}}}", f"model_tier:guard_fleet_p1:max{{{sel}}}"
    return (f"{fails} * ln({p1} / {p0}) + ({checks} - {fails}) * ln((1 - {p1}) / (1 - {p0}))")


def model_rules(model: ModelThresholds, settings: RuleSettings,
                fleet: FleetSettings) -> list[dict]:
    """One model's pooled log-likelihood ratio per window (recorded) and its alert."""
    sel, h = model_selector(model.name), fleet.threshold
    rules: list[dict] = [{"record": f"model_tier:guard_fleet_llr:{window}",
                          "expr": llr_expr(model, window), "labels": {"window": window}}
                         for window in fleet.windows]
    # One alert per model and tier: the largest ratio of the windows that pass.
    condition = "max without (window) (" + " or ".join(
        f"(model_tier:guard_fleet_llr:{window}{{{sel}}} >= {h!r} and ignoring(window) "
        f"{_name('checks', window)}{{{sel}}} >= {model.policy.min_samples})"
        for window in fleet.windows) + ")"
    windows = ", ".join(fleet.windows)
    if model.generation is None:
        what = (f"The replicas of model {model.name} together fail the {{{{ $labels.tier }}}} "
                "checks more often than the highest in-control rate any of them assumes "
                f"(guard_detector_p0) allows: over one of the windows {windows}, their pooled "
                "counts favour the alarm rate (guard_detector_p1) by a log-likelihood ratio of")
    else:
        what = (f"The replicas of model {model.name} together score their completions above "
                "the in-control level (checks.generation.in_control_ratio of the level where one "
                f"fails): over one of the windows {windows}, their completions' pooled "
                "evidence (guard_detector_evidence_nats_total, for minus against) is")
    rules.append(alert_rule(
        ALERT, condition, None, "critical",
        f"guard {model.name}: {{{{ $labels.tier }}}} drift across the fleet (pooled "
        f"log-likelihood ratio {{{{ printf \"%.1f\" $value }}}})",
        f"{what} "
        f"{{{{ printf \"%.1f\" $value }}}} (threshold {h:.2f}: at most "
        f"{fleet.false_alarms_per_day:g} false alarms per day with rules evaluated every "
        f"{fleet.evaluation_interval}; model_tier:guard_fleet_llr:<window> has each window's). "
        "Drift on every replica at once usually comes with the image (quantisation, engine, "
        "driver). Each replica still routes on its own detector, which trips later on its own "
        "evidence: pin the route with `guard admin route` or abort the rollout.",
        settings,
    ))
    rules[-1]["labels"]["scope"] = "fleet"
    return rules


def fleet_groups(models: list[ModelThresholds], settings: RuleSettings,
                 fleet: FleetSettings) -> list[dict]:
    """One group, evaluated every ``evaluation_interval`` (what the threshold counts on), its
    rules in order: the pooled counts, then each model's ratios and alert on them."""
    pooled = [m for m in models if applies(m)]
    if not pooled:
        return []
    rules = recording_rules(settings, fleet,
                            scored=any(m.generation is not None for m in pooled))
    for model in pooled:
        rules += model_rules(model, settings, fleet)
    return [{"name": "guard.fleet", "interval": fleet.evaluation_interval, "rules": rules}]
