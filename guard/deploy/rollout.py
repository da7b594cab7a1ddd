"""A progressive-delivery gate from a guard config (``guard deploy rollout FILE --kind ...``).

A canary of an optimised model (Argo Rollouts, Flagger, or KServe's ``canaryTrafficPercent``
driven by either) runs guard as its sidecar; the gate asks Prometheus, over the analysis
window, whether guard saw that canary drift. Per model of the config:

- ``drift-ratio``: the largest failing share of any tier's checks over the window
  (``guard_checks_total``; the tiers the policy acts on, not tier 2's localisation), at most
  ``policy.trip_ratio``: the share at which the guard itself trips.
- ``detector`` (the tiers whose action is ``alert``: ``policy.action``, or per tier
  ``policy.actions``): those of them that met the guard's trip condition at any point of the
  window, which must be none. The condition is the drift alert's
  (``guard deploy rules``, guard/deploy/rules.py: the drift-ratio gauge over ``trip_ratio``
  for ``detector: window``, the statistic at its threshold gauge for ``cusum`` and
  ``e_detector``, each from ``policy.min_samples`` samples on), read over the window instead
  of for a ``for`` duration.
- ``evidence``: compared samples in the window (``guard_mirror_total{outcome="compared"}``), at
  least ``policy.min_samples``: a canary that saw no traffic, or whose reference failed, has
  not passed anything. Argo marks too little evidence *inconclusive* (the rollout pauses), not
  failed.
- ``route`` (a tier's action is ``fallback_model`` or ``fallback_ops``): the fallback never
  served in the window
  (``guard_fallback_active``): a canary whose guard had to route away from it has failed.
  With these actions the switch *is* the detector's verdict, and the detector gauges are no
  use to a gate: the guard restarts the detector when it switches, within one scrape
  interval, so a scrape rarely sees their peak (the failing share of the checks, a counter,
  keeps the record).

Models without a reference mirror nothing: the gate has nothing to read for them and says so
(they are left out, with a comment in the output).

Every query ends in ``or vector(0)``, so that an absent series is a value (0) and not an empty
result (an error in both controllers), and a tier with no checks in the window drops out of
the ratio instead of making it NaN (which fails every comparison); the evidence check is what
stops "no data" from passing.

The canary's series are picked by label matchers: for Argo, the args ``selector`` (default
``job="guard"``, e.g. the namespace) and ``canary-hash`` (the canary ReplicaSet's
pod-template-hash, which the Rollout passes; default ``.*``) matched against the pod name; for
Flagger, the canary pods of ``{{ target }}`` in ``{{ namespace }}`` as Flagger's own built-in
checks select them.

The manifests follow the fields the controllers document (Argo Rollouts' AnalysisTemplate
``spec.args``/``spec.metrics[].provider.prometheus``; Flagger's MetricTemplate ``spec.provider``
/``spec.query`` and the Canary's ``analysis.metrics[].templateRef``/``thresholdRange``); their
CRD schemas are not shipped with guard and are not checked here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from guard.deploy.rules import (
    DURATION,
    ModelThresholds,
    drift_condition,
    model_selector,
    read_thresholds,
    tiers_taking,
)

KINDS = ("argo", "flagger")
# A Rollout's pods are named <rollout>-<pod-template-hash>-<suffix>: the Rollout passes the
# canary's hash (valueFrom.podTemplateHashValue: Latest); `pod` is a label every Kubernetes
# scrape (PodMonitor, pod service discovery) gives.
ARGO_SELECTOR = '{{args.selector}},pod=~".+-{{args.canary-hash}}-.+"'
ARGO_WINDOW = "{{args.window}}"
# Flagger's canary pods of a Deployment target `podinfo` are podinfo-<hash>-<id>; the primary's
# are podinfo-primary-<hash>-<id> (the pattern Flagger's built-in request-success-rate uses).
FLAGGER_SELECTOR = 'namespace="{{ namespace }}",pod=~"{{ target }}-[0-9a-zA-Z]+(-[0-9a-zA-Z]+)"'
FLAGGER_WINDOW = "{{ interval }}"


@dataclass(frozen=True)
class RolloutSettings:
    """What the gate needs beyond the config."""

    prometheus: str = "http://prometheus.monitoring.svc:9090"
    window: str = "5m"  # Argo: the analysis window (an arg); Flagger uses the metric interval
    interval: str = "1m"  # how often a controller measures
    count: int = 5  # Argo: measurements per analysis run
    selector: str = 'job="guard"'  # Argo: the default of the selector arg
    name: str = "guard"  # prefix of the generated objects' names

    def __post_init__(self) -> None:
        for field in ("window", "interval"):
            if not DURATION.match(getattr(self, field)):
                raise ValueError(f"{field}: '{getattr(self, field)}' is not a Prometheus "
                                 "duration (e.g. 30s, 5m, 1h)")
        if self.count < 1:
            raise ValueError("count: must be at least 1")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.name):
            raise ValueError(f"name: '{self.name}' must be a DNS label (a-z, 0-9, '-')")
        if not re.fullmatch(r"https?://\S+", self.prometheus):
            raise ValueError(f"prometheus: '{self.prometheus}' must be an http(s) URL")


@dataclass(frozen=True)
class GateCheck:
    """One measurement of the gate: a PromQL query whose value must satisfy ``op threshold``
    (``<=`` or ``>=``). ``query`` holds the placeholders ``$SELECTOR`` and ``$WINDOW``, filled
    per controller by :meth:`render_query`."""

    model: str
    check: str
    query: str
    op: str
    threshold: float
    inconclusive_when_unmet: bool = False  # too little evidence is not a failure

    @property
    def name(self) -> str:
        return f"{_dns(self.model)}-{self.check}"

    def render_query(self, selector: str, window: str) -> str:
        return self.query.replace("$SELECTOR", selector).replace("$WINDOW", window)

    def passes(self, value: float) -> bool:
        return value <= self.threshold if self.op == "<=" else value >= self.threshold


def _dns(name: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "model"


def _evidence_tiers() -> list[str]:
    """The registered tiers that feed no detector (guard/verify/tiers.py)."""
    from guard.verify.tiers import tier_kinds

    return [kind.name for kind in tier_kinds() if not kind.detector]


def gate_checks(model: ModelThresholds) -> list[GateCheck]:
    """The checks for one model (none when it mirrors nothing: see the module docstring)."""
    if not model.mirrors:
        return []
    sel = model_selector(model.name, "$SELECTOR")
    # The tiers the policy acts on: those whose kind feeds a detector (tier 2, activation,
    # localises: it does not trip the guard).
    tiers = sel + "".join(f',tier!="{name}"' for name in _evidence_tiers())
    policy = model.policy
    checks = [GateCheck(
        model.name, "drift-ratio",
        f'max(sum by (tier) (increase(guard_checks_total{{{tiers},result="fail"}}[$WINDOW]))'
        f" / (sum by (tier) (increase(guard_checks_total{{{tiers}}}[$WINDOW])) > 0))"
        " or vector(0)",
        "<=", policy.trip_ratio)]
    alerting = tiers_taking(policy, alert=True)
    if alerting is not None:
        # How many alerting tiers met the trip condition at some point of the window: 0 passes
        # (a tier that switches is gated by the route check below).
        checks.append(GateCheck(
            model.name, "detector",
            f"count(max_over_time(({drift_condition(model, sel + alerting)})[$WINDOW:])) "
            "or vector(0)", "<=", 0.0))
    checks.append(GateCheck(
        model.name, "evidence",
        f'sum(increase(guard_mirror_total{{{sel},outcome="compared"}}[$WINDOW])) or vector(0)',
        ">=", float(max(policy.min_samples, 1)), inconclusive_when_unmet=True))
    if tiers_taking(policy, alert=False) is not None:
        checks.append(GateCheck(
            model.name, "route",
            f"max(max_over_time(guard_fallback_active{{{sel}}}[$WINDOW])) or vector(0)",
            "<=", 0.0))
    return checks


def _number(value: float) -> str:
    return f"{value:g}"


def _argo(models: list[ModelThresholds], settings: RolloutSettings) -> dict:
    metrics = []
    for model in models:
        for check in gate_checks(model):
            bad = ">" if check.op == "<=" else "<"
            metric = {
                "name": check.name,
                "interval": settings.interval,
                "count": settings.count,
                "successCondition": f"result[0] {check.op} {_number(check.threshold)}",
                # Argo: a measurement meeting neither condition is inconclusive.
                "failureCondition": ("false" if check.inconclusive_when_unmet else
                                     f"result[0] {bad} {_number(check.threshold)}"),
                "failureLimit": 0,
                "provider": {"prometheus": {
                    "address": "{{args.prometheus}}",
                    "query": check.render_query(ARGO_SELECTOR, ARGO_WINDOW),
                }},
            }
            if check.inconclusive_when_unmet:
                # Argo ends a metric Inconclusive once its inconclusive measurements exceed
                # this, and Successful after `count` otherwise: evidence reached in at least one
                # of the run's measurements passes, evidence never reached pauses the rollout.
                metric["inconclusiveLimit"] = settings.count - 1
            metrics.append(metric)
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "AnalysisTemplate",
        "metadata": {"name": settings.name, "labels": {"app.kubernetes.io/name": "guard"}},
        "spec": {
            "args": [
                {"name": "selector", "value": settings.selector},
                {"name": "canary-hash", "value": ".*"},
                {"name": "window", "value": settings.window},
                {"name": "prometheus", "value": settings.prometheus},
            ],
            "metrics": metrics,
        },
    }


def _flagger(models: list[ModelThresholds], settings: RolloutSettings) -> tuple[list, list]:
    templates, analysis = [], []
    for model in models:
        for check in gate_checks(model):
            name = f"{settings.name}-{check.name}"
            templates.append({
                "apiVersion": "flagger.app/v1beta1",
                "kind": "MetricTemplate",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "guard"}},
                "spec": {
                    "provider": {"type": "prometheus", "address": settings.prometheus},
                    "query": check.render_query(FLAGGER_SELECTOR, FLAGGER_WINDOW),
                },
            })
            bound = "min" if check.op == ">=" else "max"
            analysis.append({"name": name, "templateRef": {"name": name},
                             "thresholdRange": {bound: check.threshold},
                             "interval": settings.interval})
    return templates, analysis


def render(models: list[ModelThresholds], kind: str, settings: RolloutSettings,
           source: str = "") -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}")
    header = ("# Generated by `guard deploy rollout" + (f" {source}" if source else "")
              + f" --kind {kind}`. Do not edit: change the guard config and regenerate.\n")
    skipped = [m.name for m in models if not gate_checks(m)]
    if skipped:
        header += ("# Not gated (no reference, or mirror.sample_rate 0: guard compares nothing "
                   f"for them): {', '.join(skipped)}\n")
    if not any(gate_checks(m) for m in models):
        raise ValueError("no model of the config mirrors to a reference: there is nothing for "
                         "a rollout gate to read")
    names: dict[str, str] = {}
    for model in models:
        if gate_checks(model) and names.setdefault(_dns(model.name), model.name) != model.name:
            raise ValueError(f"models '{names[_dns(model.name)]}' and '{model.name}' give the "
                             f"same object name '{_dns(model.name)}' (lower case, '-' for "
                             "other characters): rename one")
    dump = lambda doc: yaml.safe_dump(doc, sort_keys=False, width=1000)  # noqa: E731
    if kind == "argo":
        return header + dump(_argo(models, settings))
    templates, analysis = _flagger(models, settings)
    snippet = dump({"analysis": {"metrics": analysis}})
    return (header + "---\n".join(dump(t) for t in templates)
            + "# The Canary's analysis (thresholds from the config): merge into its spec.\n"
            + "".join(f"# {line}\n" for line in snippet.splitlines()))


def render_file(path: str | Path, kind: str, settings: RolloutSettings) -> str:
    return render(read_thresholds(path), kind, settings, source=str(path))
