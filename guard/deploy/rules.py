"""Prometheus alerting rules generated from a guard config (``guard deploy rules``).

Why generate them: the drift alert must fire on the same condition on which the guard itself
acts (each model's detector), and alerts that only exist for what a model has
(a reference to mirror onto, a fallback to route to) stay quiet where they cannot mean anything.
A rule file written by hand drifts away from the config; this one is rebuilt from it, and the
repository's tests compare the shipped files with a fresh generation.

Per model, where it applies:

- ``GuardDriftOverThreshold`` (critical), for ``drift_for``, on the condition the guard acts on:
  ``guard_detector_statistic >= guard_detector_threshold`` for the sequential detectors (``cusum``,
  the default, and ``e_detector``), ``guard_drift_ratio > policy.trip_ratio`` for
  ``detector: window``, each with ``guard_detector_samples >= policy.min_samples`` (the detector
  decides from that many samples on, and so does the alert). With ``action: alert`` clients keep
  getting the drifting answers; with a fallback the guard restarts the detector when it switches,
  so the alert lasts only while the probes of the primary keep failing or the route could not
  move (an override).
- ``GuardFallbackActive`` (warning): ``guard_fallback_active == 1`` for ``fallback_for``
  (models with a fallback).
- ``GuardMirrorDropping`` (warning): dropped share of mirrored samples over
  ``mirror_drop_ratio`` (models with a reference and ``sample_rate > 0``).
- ``GuardReferenceFailing`` (warning): errors and timeouts over ``reference_error_ratio`` of
  the samples that reached the reference (same models).
- ``GuardGenerationKldHigh`` (warning), ``task: generation`` models that mirror: the mean KLD
  per token of the compared completions over ``rate_window`` above
  ``checks.generation.max_mean_kld`` (the level at which one completion fails). The detector
  (GuardDriftOverThreshold, tier ``generation``) acts on the same figure per completion; this
  one says how far the model is, also under ``action: alert`` and while the fallback serves.
- ``GuardGenerationNotCompared`` (warning), the same models: more than ``not_compared_ratio``
  of the model's calls were not compared, for ``not_compared_for``: those the HTTP edge cannot
  compare (tool calls, echo, ...: never sampled) and, of the sampled ones, those the verifier
  could not (``not_compared_share``). The tier then sees little of the traffic and its silence
  means nothing: a server relaunched with other flags (``--logprobs-mode``), sampling defaults
  left undeclared, a primary the reference cannot align with, traffic of tool calls. The
  reasons are in ``guard_generation_not_comparable_total{reason}``.

Once: ``GuardDown`` (critical): ``up{job=...} == 0`` for ``down_for``. The data plane goes through
the guard, so a guard that cannot be scraped is usually a model that cannot be reached. And
``GuardConfigReloadFailed`` (warning): a hot reload was rejected (invalid file: the old config
stays) or failed (a changed model did not load: its old version stays) within
``reload_window``; what the guard runs then differs from its config file (a ConfigMap). And
``GuardVerifierDown`` (warning): the verifier process (reference, checks, detectors, capture)
has not been up for ``verifier_for``: clients are still served on the last routes, but nothing
is checked, so drift would go unseen.

Expressions keep every label but the ones they aggregate away (``sum without (outcome)``), so an
alert names the replica (instance, pod) it fires on: drift can be specific to one node's CPU.

Reading the config: only what the rules are made of is validated here (version, model names,
``policy``, ``mirror``, ``server``; unknown keys at model level). Backends and artifact paths are
not: rules are generated where manifests are built, often by another guard version than the one
that serves, and the artifacts live in the Pod. ``guard config validate`` checks the whole file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from guard.config import (
    MODEL_NAME,
    MirrorConfig,
    ModelConfig,
    PolicyConfig,
    GenerationCheckConfig,
    ServerConfig,
    format_validation_error,
    read_yaml,
)
from guard.config.generation import TASK as GENERATION, with_task_defaults
from guard.deploy import DEFAULT_RUNBOOK_BASE, RULE_FORMATS
from guard.errors import ConfigError

FORMATS = RULE_FORMATS
# The PrometheusRule's default name. Two configs' rules in one namespace need two names (the
# second would replace the first): --name.
PROMETHEUS_RULE_NAME = "guard-alerts"
# A Kubernetes object name (a DNS-1123 subdomain), as the API server checks it.
RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")

ALERTS = (
    "GuardDriftOverThreshold",
    "GuardFallbackActive",
    "GuardMirrorDropping",
    "GuardReferenceFailing",
    "GuardGenerationKldHigh",
    "GuardGenerationNotCompared",
    "GuardDown",
    "GuardConfigReloadFailed",
    "GuardVerifierDown",
)


@dataclass(frozen=True)
class RuleSettings:
    """What the rules need beyond the config. Durations are Prometheus durations."""

    job: str = "guard"  # the scrape job's `job` label (the PodMonitor in deploy/ sets it)
    runbook_base: str = DEFAULT_RUNBOOK_BASE
    drift_for: str = "2m"  # drift over the trip ratio this long: someone must look now
    fallback_for: str = "5m"  # longer than a typical dwell + probe cycle: it did not recover
    rate_window: str = "10m"  # rate() range for the mirror ratios (>= 4 scrape intervals)
    mirror_drop_ratio: float = 0.1  # >10% of mirrored samples dropped: checks half-blind
    mirror_for: str = "15m"
    reference_error_ratio: float = 0.05  # >5% of reference calls fail or time out
    reference_for: str = "10m"
    down_for: str = "2m"
    reload_window: str = "15m"  # a rejected reload alerts this long (the guard does not retry)
    verifier_for: str = "5m"  # restarts take seconds; minutes down is a crash loop or a hang
    # Over half of an LLM's calls not compared: the tier sees too little for its
    # silence to mean anything. Long: a traffic mix can swing (a batch of tool calls); a flag
    # or an undeclared default that blinds it does not go away by itself.
    not_compared_ratio: float = 0.5
    not_compared_for: str = "30m"

    def __post_init__(self) -> None:
        for field in ("drift_for", "fallback_for", "rate_window", "mirror_for", "reference_for",
                      "down_for", "reload_window", "verifier_for", "not_compared_for"):
            if not DURATION.match(getattr(self, field)):
                raise ValueError(f"{field}: '{getattr(self, field)}' is not a Prometheus "
                                 "duration (e.g. 30s, 5m, 1h)")
        if not re.fullmatch(r"[^\"\\\n]+", self.job):
            raise ValueError(f"job: '{self.job}' must be non-empty, without quotes or backslashes")

    def runbook(self, alert: str) -> str:
        # Markdown renderers (GitHub, GitLab, mkdocs) anchor "## GuardDown" as "#guarddown".
        return f"{self.runbook_base}#{alert.lower()}"


@dataclass(frozen=True)
class ModelThresholds:
    """The parts of one model's config that its alerts are made of."""

    name: str
    policy: PolicyConfig
    mirror: MirrorConfig
    has_reference: bool
    has_fallback: bool
    generation: GenerationCheckConfig | None = None  # task: generation's tier thresholds

    @property
    def mirrors(self) -> bool:
        return self.has_reference and self.mirror.sample_rate > 0


# -- reading the config --------------------------------------------------------------------------
def read_thresholds(path: str | Path) -> list[ModelThresholds]:
    """Read a guard YAML and validate what the rules depend on (see the module docstring)."""
    _, data = read_yaml(path)
    return thresholds_from_data(data, str(path))


def _validate_block(model_class, data: Any, prefix: str, problems: list[str]):
    try:
        return model_class.model_validate({} if data is None else data)
    except ValidationError as exc:
        for line in format_validation_error(exc):
            problems.append(f"{prefix}.{line}" if not line.startswith("(") else
                            f"{prefix}: {line.split(': ', 1)[1]}")
        return None


def thresholds_from_data(data: Any, source: str | None = None) -> list[ModelThresholds]:
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping with 'version' and 'models'"], source)
    problems: list[str] = []
    if data.get("version") != 1:
        problems.append("version: must be 1")
    _validate_block(ServerConfig, data.get("server"), "server", problems)
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(problems + ["models: must be a non-empty list"], source)
    known_keys = set(ModelConfig.model_fields)
    found: list[ModelThresholds] = []
    seen: set[str] = set()
    for i, block in enumerate(models):
        where = f"models[{i}]"
        if not isinstance(block, dict):
            problems.append(f"{where}: must be a mapping")
            continue
        problems += [f"{where}.{key}: unknown key" for key in block if key not in known_keys]
        name = block.get("name")
        if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
            problems.append(f"{where}.name: must match {MODEL_NAME.pattern}")
            continue
        if name in seen:
            problems.append(f"{where}.name: model name '{name}' appears twice")
        seen.add(name)
        if "primary" not in block:
            problems.append(f"{where}.primary: required key is missing")
        policy = _validate_block(PolicyConfig, block.get("policy"), f"{where}.policy", problems)
        mirror = _validate_block(MirrorConfig, block.get("mirror"), f"{where}.mirror", problems)
        generation = None
        if block.get("task") == GENERATION:
            checks = block["checks"] if isinstance(block.get("checks"), dict) else {}
            generation = _validate_block(GenerationCheckConfig, checks.get("generation"),
                                         f"{where}.checks.generation", problems)
            if policy is not None:
                policy = with_task_defaults(policy, GENERATION)
        has_fallback = block.get("fallback") is not None
        if policy is not None and policy.uses("fallback_model") and not has_fallback:
            problems.append(f"{where}: policy.action 'fallback_model' needs a 'fallback' backend")
        if policy is not None and mirror is not None:
            found.append(ModelThresholds(name, policy, mirror,
                                         block.get("reference") is not None, has_fallback,
                                         generation))
    if problems:
        raise ConfigError(problems, source)
    return found


# -- building the rules --------------------------------------------------------------------------
def model_selector(model: str, extra: str = "") -> str:
    """The label matchers of one model's series, and any others (``extra``: a rollout gate's
    canary pods); the rules and the gate (guard/deploy/rollout.py) select series alike."""
    return f'model="{model}"' + (f",{extra}" if extra else "")


def _pct(ratio: float) -> str:
    return f"{ratio * 100:g}%"


def alert_rule(name: str, expr: str, duration: str | None, severity: str, summary: str,
           description: str, settings: RuleSettings) -> dict:
    return {
        "alert": name,
        "expr": expr,
        **({"for": duration} if duration else {}),
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": settings.runbook(name),
        },
    }


def model_rules(model: ModelThresholds, settings: RuleSettings) -> list[dict]:
    sel = model_selector(model.name)
    policy, mirror = model.policy, model.mirror
    rules = []
    if model.mirrors:
        rules.append(_drift_alert(model, settings))
    if model.has_fallback:
        rules.append(alert_rule(
            "GuardFallbackActive",
            f"guard_fallback_active{{{sel}}} == 1",
            settings.fallback_for, "warning",
            f"guard {model.name}: fallback serving for over {settings.fallback_for}",
            f"On {{{{ $labels.instance }}}} the fallback answers model {model.name} "
            f"(scope {{{{ $labels.scope }}}}). The guard probes the primary after "
            f"policy.dwell_s={policy.dwell_s:g}s and routes back once "
            + (f"a window of probes fails at most policy.recover_ratio={policy.recover_ratio!r}"
               if policy.detector == "window" else
               "its recovery detector says the probes' failure rate came down")
            + "; it has not done so yet.",
            settings,
        ))
    if model.mirrors:
        w = settings.rate_window
        rules.append(alert_rule(
            "GuardMirrorDropping",
            f'sum without (outcome) (rate(guard_mirror_total{{{sel},outcome="dropped"}}[{w}]))'
            f" / sum without (outcome) (rate(guard_mirror_total{{{sel}}}[{w}]))"
            f" > {settings.mirror_drop_ratio!r}",
            settings.mirror_for, "warning",
            f"guard {model.name}: {{{{ $value | humanizePercentage }}}} of mirrored samples "
            "dropped",
            f"On {{{{ $labels.instance }}}} the mirror queue of model {model.name} "
            f"(mirror.queue_size {mirror.queue_size}) is full for "
            f"{{{{ $value | humanizePercentage }}}} of sampled requests over {w} (alert above "
            f"{_pct(settings.mirror_drop_ratio)}): the reference cannot keep up with "
            f"mirror.sample_rate {mirror.sample_rate!r}, and drift on the dropped samples goes "
            "unseen. Clients are not affected.",
            settings,
        ))
        rules.append(alert_rule(
            "GuardReferenceFailing",
            f'sum without (outcome) (rate(guard_mirror_total{{{sel},outcome=~"error|timeout"}}'
            f"[{w}])) / sum without (outcome) (rate(guard_mirror_total"
            f'{{{sel},outcome!="dropped"}}[{w}])) > {settings.reference_error_ratio!r}',
            settings.reference_for, "warning",
            f"guard {model.name}: {{{{ $value | humanizePercentage }}}} of reference calls fail "
            "or time out",
            f"On {{{{ $labels.instance }}}}, {{{{ $value | humanizePercentage }}}} of the samples "
            f"of model {model.name} that reached the reference over {w} ended in an error or "
            f"took longer than mirror.timeout_s={mirror.timeout_s:g}s (alert above "
            f"{_pct(settings.reference_error_ratio)}). Those samples are not checked.",
            settings,
        ))
    if model.mirrors and model.generation is not None:
        rules.append(_generation_alert(model, model.generation, settings))
        rules.append(_not_compared_alert(model, settings))
    return rules


def _not_compared_alert(model: ModelThresholds, settings: RuleSettings) -> dict:
    """GuardGenerationNotCompared: the share of the model's calls the generation tier did not
    compare (``not_compared_share``)."""
    w = settings.rate_window
    return alert_rule(
        "GuardGenerationNotCompared",
        f"{not_compared_share(model_selector(model.name), w)} > {settings.not_compared_ratio!r}",
        settings.not_compared_for, "warning",
        f"guard {model.name}: {{{{ $value | humanizePercentage }}}} of calls not compared",
        f"On {{{{ $labels.instance }}}}, {{{{ $value | humanizePercentage }}}} of the calls of "
        f"model {model.name} over {w} could not be compared with the reference (alert above "
        f"{_pct(settings.not_compared_ratio)}): the ones the HTTP edge cannot compare (tool "
        "calls without token ids, echo, n > 1, other endpoints ..., never sampled) and the "
        "share of the sampled completions the verifier could not score. The generation tier "
        "sees too little of the traffic for its silence to mean the model is fine. "
        "guard_generation_not_comparable_total{reason} says why (sampling_unknown: declare the "
        "server's defaults; logprobs_mode: the server's logprobs are not raw, declare "
        "options.logprobs_mode; tools: options.sample_token_ids; unaligned, constrained, "
        "...). Clients are not affected.",
        settings,
    )


def not_compared_share(sel: str, w: str) -> str:
    """The share of a generation model's calls its tier does not see, as PromQL:
    ``1 - (1 - edge) * (1 - verifier)``. ``edge``: of the calls (answered or failed), those the
    HTTP edge cannot compare (``guard_generation_not_comparable_total``, counted on every call;
    never sampled, so never in ``guard_mirror_total``). ``verifier``: of the sampled completions
    that reached the verifier, those it could not compare
    (``guard_mirror_total{outcome="not_comparable"}``). The sample is drawn from the calls the
    edge can compare, so the product is the share the tier sees. A share with nothing to count
    is 0 (the edge's counter has no series before its first call; with every call uncomparable
    none is sampled, and 0/0 would silence the whole expression). guard declares the requests
    and mirror counters at zero, so both sides always have a series to match."""
    def rate(series: str, without: str) -> str:
        return f"sum without ({without}) (rate({series}[{w}]))"

    answered = rate(f"guard_requests_total{{{sel}}}", "route")
    calls = f"({answered} + {rate(f'guard_request_errors_total{{{sel}}}', 'code')} or {answered})"
    uncomparable = rate(f"guard_generation_not_comparable_total{{{sel}}}", "reason")
    reached = rate(f'guard_mirror_total{{{sel},outcome!="dropped"}}', "outcome")
    unscored = rate(f'guard_mirror_total{{{sel},outcome="not_comparable"}}', "outcome")
    edge = f"({uncomparable} / {calls} or {calls} * 0)"
    verifier = f"({unscored} / ({reached} > 0) or {reached} * 0)"
    return f"1 - (1 - {edge}) * (1 - {verifier})"


def _generation_alert(model: ModelThresholds, generation: GenerationCheckConfig,
                      settings: RuleSettings) -> dict:
    """GuardGenerationKldHigh: the compared completions' mean KLD per token over the window."""
    sel, w = model_selector(model.name), settings.rate_window
    limit = generation.max_mean_kld
    return alert_rule(
        "GuardGenerationKldHigh",
        f"rate(guard_generation_kld_sum{{{sel}}}[{w}]) / rate(guard_generation_kld_count"
        f"{{{sel}}}[{w}]) > {limit!r}",
        settings.drift_for, "warning",
        f"guard {model.name}: completions {{{{ printf \"%.3g\" $value }}}} nats/token from "
        "the reference",
        f"On {{{{ $labels.instance }}}} the completions of model {model.name} compared over {w} "
        f"average {{{{ printf \"%.3g\" $value }}}} nats of KL divergence per token from the "
        f"reference's distribution (a completion fails above checks.generation.max_mean_kld="
        f"{limit!r}; an 8-bit quantization sits near 0.004). The events drift_alert / "
        "route_transition name the first divergent token; the primary (its quantization, "
        "engine version or chat template) answers differently from its reference.",
        settings,
    )


def _drift_alert(model: ModelThresholds, settings: RuleSettings) -> dict:
    """GuardDriftOverThreshold on the condition the guard acts on: the model's detector.

    ``window``: the failing share over ``policy.trip_ratio``. ``cusum``/``e_detector``: the
    detector's own statistic at its own threshold (both exported as gauges with the same
    labels, so the comparison matches series one to one and the rule needs no copy of the
    threshold, which the guard derives from p0, p1 and ARL0 at run time)."""
    sel = model_selector(model.name)
    policy = model.policy
    alerting = ("the primary keeps answering clients with these results.")
    switching = ("the guard switches away from the primary when this condition is met and "
                 "restarts the detector; while the fallback serves, probes of the primary feed "
                 "it, so this alert lasts while the primary still fails its probes or the route "
                 "could not move (pinned by an override?).")
    if policy.actions:
        per_tier = ", ".join(f"{tier}: {action}" for tier, action in sorted(policy.actions.items()))
        consequence = (f"The action depends on the tier (policy.actions {per_tier}; every other "
                       f"tier: {policy.action}). A tier whose action is alert: {alerting} A "
                       f"tier that switches: {switching}")
    elif policy.action == "alert":
        consequence = f"policy.action is alert: {alerting}"
    else:
        consequence = f"policy.action is {policy.action}: {switching}"
    if policy.detector == "window":
        return alert_rule(
            "GuardDriftOverThreshold",
            drift_condition(model, sel),
            settings.drift_for, "critical",
            f"guard {model.name}: {{{{ $labels.tier }}}} drift {{{{ $value | humanizePercentage "
            f"}}}} over trip_ratio {_pct(policy.trip_ratio)}",
            f"On {{{{ $labels.instance }}}}, {{{{ $value | humanizePercentage }}}} of model "
            f"{model.name}'s last mirrored samples (window {policy.window}) fail the "
            f"{{{{ $labels.tier }}}} checks; policy.trip_ratio is {policy.trip_ratio!r}. "
            + consequence,
            settings,
        )
    if policy.false_alarms_per_day is not None:
        false_alarms = f"policy.false_alarms_per_day={policy.false_alarms_per_day:g}"
    else:  # the ARL0 the guard itself uses (its default when unset)
        false_alarms = f"policy.arl0={policy.arl0_for(model.mirror.sample_rate):g}"
    return alert_rule(
        "GuardDriftOverThreshold",
        drift_condition(model, sel),
        settings.drift_for, "critical",
        f"guard {model.name}: {{{{ $labels.tier }}}} drift detected ({policy.detector} "
        f"statistic {{{{ printf \"%.2f\" $value }}}} at its threshold)",
        f"On {{{{ $labels.instance }}}}, the {policy.detector} detector of model {model.name}'s "
        f"{{{{ $labels.tier }}}} checks has reached its threshold (guard_detector_threshold): "
        + _drift_evidence(model) + f" (false alarms: {false_alarms}). The failing share is "
        "guard_drift_ratio. " + consequence,
        settings,
    )


def _drift_evidence(model: ModelThresholds) -> str:
    if model.generation is None:
        return "the mirrored samples fail more often than the in-control rate p0 allows"
    return ("the compared completions score above the in-control level (mean KLD per token "
            "over checks.generation.max_mean_kld, or the greedy/sampled statistic over its "
            "threshold, averaging more than "
            f"in_control_ratio={model.generation.in_control_ratio!r})")


def drift_condition(model: ModelThresholds, sel: str) -> str:
    """The condition the guard trips on, as PromQL over the series ``sel`` selects: the drift
    alert's expression, and the rollout gate's detector check (guard/deploy/rollout.py)."""
    policy = model.policy
    if policy.detector == "window":
        return f"guard_drift_ratio{{{sel}}} > {policy.trip_ratio!r}" + _enough(sel, policy)
    return (f"guard_detector_statistic{{{sel}}} >= guard_detector_threshold{{{sel}}}"
            + _enough(sel, policy))


def tiers_taking(policy, alert: bool) -> str | None:
    """A PromQL matcher (``,tier=~"..."``) of the tiers whose trip alerts (``alert``) or
    switches (not ``alert``) under ``policy.action``/``policy.actions``: "" for every tier, None
    for none."""
    def takes(action: str) -> bool:
        return (action == "alert") == alert

    named = sorted(policy.actions)
    if takes(policy.action):  # every tier but the named ones that do otherwise
        others = [tier for tier in named if not takes(policy.actions[tier])]
        return f',tier!~"{"|".join(others)}"' if others else ""
    these = [tier for tier in named if takes(policy.actions[tier])]
    return f',tier=~"{"|".join(these)}"' if these else None


def _enough(sel: str, policy) -> str:
    """The detector's own evidence rule (policy.min_samples): no alert on fewer samples than
    guard itself decides on. Same labels on both sides, so ``and`` matches series by series."""
    return f" and guard_detector_samples{{{sel}}} >= {policy.min_samples}"


def availability_rules(settings: RuleSettings) -> list[dict]:
    window = settings.reload_window
    return [alert_rule(
        "GuardDown",
        f'up{{job="{settings.job}"}} == 0',
        settings.down_for, "critical",
        "guard {{ $labels.instance }} cannot be scraped",
        f"Prometheus has not scraped guard target {{{{ $labels.instance }}}} (job "
        f"{settings.job}) for {settings.down_for}. Clients reach the model through the guard: "
        "the model on this replica is probably unreachable too.",
        settings,
    ), alert_rule(
        "GuardConfigReloadFailed",
        # A reload that went wrong counts once (the file is not retried until it changes
        # again): the alert holds for the window, then resolves.
        f'increase(guard_config_reloads_total{{result=~"rejected|failed"}}[{window}]) > 0',
        None, "warning",
        "guard {{ $labels.instance }}: a config reload was {{ $labels.result }}",
        f"On {{{{ $labels.instance }}}} a config reload was {{{{ $labels.result }}}} in the "
        f"last {window}. rejected: the new file did not validate and the previous config stays "
        "in force; failed: a changed model did not load and its previous version keeps "
        "serving. Until fixed, the guard runs something other than its config file says.",
        settings,
    ), alert_rule(
        "GuardVerifierDown",
        f'guard_verifier_up{{job="{settings.job}"}} == 0',
        settings.verifier_for, "warning",
        "guard {{ $labels.instance }}: nothing is being checked (verifier process down)",
        f"On {{{{ $labels.instance }}}} guard's verifier process (reference, checks, detectors, "
        f"capture, repair) has not been up for {settings.verifier_for}. Clients are still "
        "served on the last routes, but no sample is checked, so drift would go unseen. See "
        "the verifier_lost and verifier_restart_failed events and "
        "guard_verifier_restarts_total.",
        settings,
    )]


def rule_groups(models: list[ModelThresholds], settings: RuleSettings) -> list[dict]:
    groups = [{"name": "guard.availability", "rules": availability_rules(settings)}]
    for model in models:
        rules = model_rules(model, settings)
        if rules:
            groups.append({"name": f"guard.model.{model.name}", "rules": rules})
    return groups


def render(models: list[ModelThresholds], settings: RuleSettings, fmt: str = "prometheus",
           source: str = "", labels: dict[str, str] | None = None, fleet=None,
           name: str | None = None) -> str:
    """The rule file (``prometheus``) or a PrometheusRule custom resource, as YAML text.
    ``labels``: more labels on the PrometheusRule's metadata (the Prometheus Operator picks
    the rules of a Prometheus by them: kube-prometheus-stack's ``release``); a rule file has no
    metadata, so labels with ``prometheus`` are an error rather than dropped, and so is
    ``name``, the PrometheusRule's (default ``PROMETHEUS_RULE_NAME``). ``fleet`` (a
    ``FleetSettings``): with the rules that pool each model's replicas (guard/deploy/fleet.py)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}")
    labels = labels or {}
    if labels and fmt != "prometheusrule":
        raise ValueError("--label: labels go on a PrometheusRule's metadata; a Prometheus rule "
                         "file has none: add --format prometheusrule")
    _check_name(name, fmt)
    groups = rule_groups(models, settings)
    notes = ""
    if fleet is not None:
        from guard.deploy.fleet import fleet_groups, left_out

        groups += fleet_groups(models, settings, fleet)
        notes = "".join(f"# Not in the fleet rule: {line}\n" for line in left_out(models))
    if fmt == "prometheus":
        document: dict = {"groups": groups}
    else:
        document = {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": {
                "name": name or PROMETHEUS_RULE_NAME,
                "labels": {"app.kubernetes.io/name": "guard",
                           "app.kubernetes.io/component": "alerting", **labels},
            },
            "spec": {"groups": groups},
        }
    flags = ((f" --config {source}" if source else "") + f" --format {fmt}"
             + (f" --name {name}" if name else "")
             + "".join(f" --label {key}={value}" for key, value in labels.items())
             + (fleet.flags() if fleet is not None else ""))
    header = (f"# Generated by `guard deploy rules{flags}`. Do not edit: change the guard config "
              "and regenerate.\n") + notes
    # width: one line per expression and annotation, never folded mid-expression.
    return header + yaml.safe_dump(document, sort_keys=False, width=1000, allow_unicode=True)


def _check_name(name: str | None, fmt: str) -> None:
    """``--name``: a PrometheusRule's, so a Kubernetes object name; ValueError otherwise."""
    if name is None:
        return
    if fmt != "prometheusrule":
        raise ValueError("--name: names the PrometheusRule; a Prometheus rule file has no "
                         "name: add --format prometheusrule")
    if not RESOURCE_NAME.match(name):
        raise ValueError(f"--name: '{name}' is not a Kubernetes object name (lower-case "
                         "letters, digits, '-' and '.', starting and ending with a letter or "
                         "digit, at most 253 characters)")
