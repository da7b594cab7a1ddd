"""``guard deploy rollout``: the canary gate's manifests, checked offline.

The CRD schemas of Argo Rollouts and Flagger cannot be downloaded here (no network, and
neither is on PyPI), so the manifests are checked against the fields the controllers document:
Argo Rollouts' AnalysisTemplate (argoproj.io/v1alpha1: spec.args[name, value, valueFrom],
spec.metrics[name, interval, initialDelay, count, successCondition, failureCondition,
failureLimit, inconclusiveLimit, consecutiveErrorLimit, provider.prometheus[address, query,
timeout, insecure, headers]], spec.dryRun, spec.measurementRetention) and Flagger's
MetricTemplate (flagger.app/v1beta1: spec.provider[type, address, secretRef, region,
insecureSkipVerify], spec.query) with the Canary's analysis.metrics[name, templateRef[name,
namespace], thresholdRange[min, max], interval, templateVariables]. What the queries measure is
shown against a real Prometheus in tests/e2e/test_rollout_gate.py.
"""

from __future__ import annotations

import re

import promql_parser
import pytest
import yaml

from guard.cli import main
from guard.deploy.rollout import RolloutSettings, gate_checks, render
from guard.deploy.rules import RuleSettings, thresholds_from_data
from guard.deploy.rules import render as render_rules

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
ARGO_SPEC = {"args", "metrics", "dryRun", "measurementRetention"}
ARGO_ARG = {"name", "value", "valueFrom"}
ARGO_METRIC = {"name", "interval", "initialDelay", "count", "successCondition",
               "failureCondition", "failureLimit", "inconclusiveLimit", "consecutiveErrorLimit",
               "provider"}
ARGO_PROMETHEUS = {"address", "query", "timeout", "insecure", "headers"}
FLAGGER_SPEC = {"provider", "query"}
FLAGGER_PROVIDER = {"type", "address", "secretRef", "region", "insecureSkipVerify"}
FLAGGER_PROVIDER_TYPES = {"prometheus", "influxdb", "datadog", "stackdriver", "cloudwatch",
                          "newrelic", "graphite", "dynatrace"}
CANARY_METRIC = {"name", "templateRef", "thresholdRange", "interval", "templateVariables"}
CONDITION = re.compile(r"result\[0\] (<=|>=|<|>) -?[0-9.]+(e-?[0-9]+)?|false")
DURATION = re.compile(r"([0-9]+(ms|s|m|h))+")


def model(name="cnn", **overrides) -> dict:
    block = {"name": name, "primary": {"backend": "upstream", "target": "h:1", "model": "x"},
             "reference": {"backend": "torch", "path": "ref.pt"},
             "fallback": {"backend": "onnxruntime", "path": "m.onnx"},
             "mirror": {"sample_rate": 0.1},
             "policy": {"action": "fallback_model", "trip_ratio": 0.15, "min_samples": 40}}
    block.update(overrides)
    return block


def config(*models) -> list:
    return thresholds_from_data({"version": 1, "models": list(models)})


def flagger_documents(text: str) -> tuple[list[dict], list[dict]]:
    templates = [d for d in yaml.safe_load_all(text) if d]
    snippet = "\n".join(line[2:] for line in text.splitlines()
                        if line.startswith("# ") and not line.startswith(
                            ("# Generated", "# Not gated", "# The Canary")))
    return templates, yaml.safe_load(snippet)["analysis"]["metrics"]


def filled(query: str) -> str:
    for placeholder, value in {"{{args.selector}}": 'job="guard"', "{{args.window}}": "5m",
                               "{{args.canary-hash}}": "5d8f7c9b4",
                               "{{ namespace }}": "prod", "{{ target }}": "shop",
                               "{{ interval }}": "5m"}.items():
        query = query.replace(placeholder, value)
    return query


MODELS = [model(), model("sequential", policy={"action": "alert", "detector": "cusum",
                                                "min_samples": 10}),
          model("no-reference", reference=None)]


def test_argo_analysis_template_has_only_documented_fields():
    document = yaml.safe_load(render(config(*MODELS), "argo", RolloutSettings()))
    assert (document["apiVersion"], document["kind"]) == ("argoproj.io/v1alpha1",
                                                          "AnalysisTemplate")
    assert DNS_SUBDOMAIN.fullmatch(document["metadata"]["name"])
    spec = document["spec"]
    assert set(spec) <= ARGO_SPEC
    assert all(set(arg) <= ARGO_ARG and isinstance(arg["value"], str) for arg in spec["args"])
    args = {arg["name"] for arg in spec["args"]}
    names = [m["name"] for m in spec["metrics"]]
    assert len(names) == len(set(names))
    for metric in spec["metrics"]:
        assert set(metric) <= ARGO_METRIC, metric
        assert DURATION.fullmatch(metric["interval"]) and isinstance(metric["count"], int)
        assert CONDITION.fullmatch(metric["successCondition"])
        assert CONDITION.fullmatch(metric["failureCondition"])
        (provider,) = metric["provider"].values()
        assert list(metric["provider"]) == ["prometheus"] and set(provider) <= ARGO_PROMETHEUS
        used = set(re.findall(r"\{\{args\.([a-z-]+)\}\}", provider["query"] +
                              provider["address"]))
        assert used <= args  # every {{args.x}} is declared, or Argo refuses the run
        promql_parser.parse(filled(provider["query"]))


def test_flagger_metric_templates_and_canary_analysis_have_only_documented_fields():
    templates, analysis = flagger_documents(render(config(*MODELS), "flagger",
                                                   RolloutSettings()))
    assert len(templates) == len(analysis) == 6  # cnn: 3 checks, sequential: 3, none for the last
    by_name = {}
    for template in templates:
        assert (template["apiVersion"], template["kind"]) == ("flagger.app/v1beta1",
                                                              "MetricTemplate")
        assert DNS_SUBDOMAIN.fullmatch(template["metadata"]["name"])
        assert set(template["spec"]) == FLAGGER_SPEC
        provider = template["spec"]["provider"]
        assert set(provider) <= FLAGGER_PROVIDER and provider["type"] in FLAGGER_PROVIDER_TYPES
        promql_parser.parse(filled(template["spec"]["query"]))
        by_name[template["metadata"]["name"]] = template
    for metric in analysis:
        assert set(metric) <= CANARY_METRIC
        assert metric["templateRef"]["name"] in by_name
        assert set(metric["thresholdRange"]) in ({"min"}, {"max"})


def test_thresholds_come_from_the_config():
    checks = {c.name: c for m in config(*MODELS) for c in gate_checks(m)}
    assert (checks["cnn-drift-ratio"].op, checks["cnn-drift-ratio"].threshold) == ("<=", 0.15)
    assert (checks["cnn-evidence"].op, checks["cnn-evidence"].threshold) == (">=", 40)
    assert "cnn-route" in checks and "cnn-detector" not in checks  # the switch is the verdict
    assert "sequential-detector" in checks and "sequential-route" not in checks
    # The detector check is the drift alert's own condition, on the canary's series.
    rules = render_rules(config(*MODELS), RuleSettings())
    alert = next(r for g in yaml.safe_load(rules)["groups"] for r in g["rules"]
                 if r["alert"] == "GuardDriftOverThreshold" and 'model="sequential"' in r["expr"])
    assert "guard_detector_statistic" in alert["expr"]
    assert alert["expr"].replace('model="sequential"', 'model="sequential",$SELECTOR') in \
        checks["sequential-detector"].query
    assert not any(name.startswith("no-reference") for name in checks)
    document = yaml.safe_load(render(config(*MODELS), "argo", RolloutSettings()))
    metrics = {m["name"]: m for m in document["spec"]["metrics"]}
    assert metrics["cnn-drift-ratio"]["successCondition"] == "result[0] <= 0.15"
    assert metrics["cnn-drift-ratio"]["failureCondition"] == "result[0] > 0.15"
    # Too little evidence pauses an Argo rollout (inconclusive), it does not abort it.
    assert metrics["cnn-evidence"]["successCondition"] == "result[0] >= 40"
    assert metrics["cnn-evidence"]["failureCondition"] == "false"
    # Inconclusive in every one of the run's measurements (count 5) is an inconclusive run.
    assert (metrics["cnn-evidence"]["count"], metrics["cnn-evidence"]["inconclusiveLimit"]) == \
        (5, 4)
    _, analysis = flagger_documents(render(config(*MODELS), "flagger", RolloutSettings()))
    ranges = {m["name"]: m["thresholdRange"] for m in analysis}
    assert ranges["guard-cnn-drift-ratio"] == {"max": 0.15}
    assert ranges["guard-cnn-evidence"] == {"min": 40}


def test_every_query_selects_its_model_and_the_canary():
    for check in (c for m in config(*MODELS) for c in gate_checks(m)):
        query = check.render_query('pod=~"shop-.*"', "2m")
        for selector in re.findall(r"guard_[a-z_]+\{([^}]*)\}", query):
            assert f'model="{check.model}"' in selector and 'pod=~"shop-.*"' in selector
        assert "[2m" in query and query.endswith(" or vector(0)")


def test_nothing_to_gate_and_clashing_names_are_errors():
    with pytest.raises(ValueError, match="nothing for a rollout gate to read"):
        render(config(model(reference=None)), "argo", RolloutSettings())
    with pytest.raises(ValueError, match="same object name 'a-b'"):
        render(config(model("a_b"), model("a.b")), "argo", RolloutSettings())
    with pytest.raises(ValueError, match="window: '5 minutes' is not a Prometheus duration"):
        RolloutSettings(window="5 minutes")
    with pytest.raises(ValueError, match="must be a DNS label"):
        RolloutSettings(name="Guard")


def test_cli_prints_and_writes(tmp_path, capsys):
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rollout", str(path), "--kind", "argo", "--window", "10m",
                 "--selector", 'namespace="prod"']) == 0
    document = yaml.safe_load(capsys.readouterr().out)
    assert {a["name"]: a["value"] for a in document["spec"]["args"]}["window"] == "10m"
    out = tmp_path / "gate.yaml"
    assert main(["deploy", "rollout", str(path), "--kind", "flagger", "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    assert flagger_documents(out.read_text())[0][0]["kind"] == "MetricTemplate"
    assert main(["deploy", "rollout", str(path), "--kind", "argo", "--interval", "soon"]) == 2
    assert "interval: 'soon' is not a Prometheus duration" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"version": 1, "models": [model(reference=None)]}))
    assert main(["deploy", "rollout", str(path), "--kind", "flagger"]) == 2
    assert "nothing for a rollout gate to read" in capsys.readouterr().err


def test_an_action_per_tier_gates_alerting_tiers_by_the_detector_and_the_rest_by_the_route():
    """policy.actions {tensor: alert} with action fallback_model: the detector check reads the
    tensor tier only (task trips switch: the route check gates those)."""
    tiered = model("tiered", policy={"action": "fallback_model", "min_samples": 10,
                                     "actions": {"tensor": "alert"}})
    inverse = model("inverse", policy={"action": "alert", "min_samples": 10,
                                       "actions": {"task": "fallback_model"}})
    checks = {c.name: c for m in config(tiered, inverse) for c in gate_checks(m)}
    assert {"tiered-detector", "tiered-route", "inverse-detector", "inverse-route"} <= set(checks)
    assert 'tier=~"tensor"' in checks["tiered-detector"].query
    assert 'tier!~"task"' in checks["inverse-detector"].query
    for name in ("tiered-detector", "inverse-detector"):
        promql_parser.parse(filled(checks[name].render_query('job="guard"', "5m")))
    rules = yaml.safe_load(render_rules(config(tiered), RuleSettings()))
    drift = next(r for g in rules["groups"] for r in g["rules"]
                 if r["alert"] == "GuardDriftOverThreshold")
    assert "policy.actions tensor: alert; every other tier: fallback_model" in \
        drift["annotations"]["description"]
