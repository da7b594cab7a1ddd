"""``guard deploy rules``: alerting rules made from a config's thresholds.

The shipped rule files must equal a fresh generation from the configs they were made from (so
they cannot go stale), pass ``promtool check rules``, and pass the rule unit tests in
deploy/prometheus/tests.yaml, which show each alert firing on the series it should and not on
healthy ones.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import promql_parser
import pytest
import yaml

from guard.cli import main
from guard.deploy.fleet import ALERTS as FLEET_ALERTS
from guard.deploy.rules import (
    ALERTS,
    RuleSettings,
    read_thresholds,
    render,
    rule_groups,
    thresholds_from_data,
)
from guard.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
BASE = "deploy/kubernetes/base"
OVERLAY = "deploy/kubernetes/overlays/example"
# (config the rules were generated from, format, committed file, more flags)
SHIPPED = [
    (f"{BASE}/guard.yaml", "prometheus", "deploy/prometheus/guard-rules.yaml", ()),
    (f"{BASE}/guard.yaml", "prometheusrule", f"{BASE}/prometheusrule.yaml", ()),
    (f"{OVERLAY}/guard.yaml", "prometheusrule", f"{OVERLAY}/prometheusrule.yaml", ()),
    ("deploy/prometheus/llm-guard.yaml", "prometheus", "deploy/prometheus/guard-rules-llm.yaml",
     ()),
    (f"{BASE}/guard.yaml", "prometheus", "deploy/prometheus/guard-rules-fleet.yaml", ("--fleet",)),
    ("deploy/prometheus/llm-guard.yaml", "prometheus",
     "deploy/prometheus/guard-rules-fleet-llm.yaml", ("--fleet",)),
    # its own name: applied in the base's namespace, it must not replace the base's rules
    ("deploy/kubernetes/llm/guard.yaml", "prometheusrule",
     "deploy/kubernetes/llm/prometheusrule.yaml", ("--name", "guard-llm-alerts", "--fleet")),
]
# The promtool unit tests of each shipped rule file: tensor models, an LLM, the fleet rules.
RULE_TESTS = ["deploy/prometheus/tests.yaml", "deploy/prometheus/tests-llm.yaml",
              "deploy/prometheus/tests-fleet.yaml", "deploy/prometheus/tests-fleet-llm.yaml"]
# only task: generation models have these
GENERATION_ALERTS = {"GuardGenerationKldHigh", "GuardGenerationNotCompared"}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: install Debian's `prometheus` package (.ci/run does)",
)


def model(name="m", **overrides) -> dict:
    block = {"name": name, "primary": {"backend": "upstream", "target": "h:1", "model": "x"},
             "reference": {"backend": "torch", "path": "ref.pt"},
             "fallback": {"backend": "onnxruntime", "path": "m.onnx"},
             "policy": {"action": "fallback_model", "trip_ratio": 0.3, "recover_ratio": 0.1}}
    block.update(overrides)
    return block


def alerts_by_name(groups: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for group in groups:
        for rule in group["rules"]:
            out.setdefault(rule["alert"], []).append(rule)
    return out


# -- shipped files ------------------------------------------------------------------------------
@pytest.mark.parametrize("config,fmt,shipped,flags", SHIPPED)
def test_shipped_rules_equal_a_fresh_generation(config, fmt, shipped, flags):
    """Regenerate with the real command, from the repository root as the docs say."""
    result = subprocess.run(
        [sys.executable, "-m", "guard", "deploy", "rules", "--config", config, "--format", fmt,
         *flags], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / shipped).read_text(), (
        f"{shipped} is stale: regenerate it with "
        f"`guard deploy rules --config {config} --format {fmt} {' '.join(flags)} -o {shipped}`"
    )


@needs_promtool
@pytest.mark.parametrize("rule_file,alerts", [
    ("deploy/prometheus/guard-rules.yaml", len(ALERTS) - len(GENERATION_ALERTS)),
    ("deploy/prometheus/guard-rules-llm.yaml", len(ALERTS)),
    # + per window 2 counts and a model's ratio, 2 rates, the fleet alert: 19 with 3 windows
    ("deploy/prometheus/guard-rules-fleet.yaml", len(ALERTS) - len(GENERATION_ALERTS) + 12),
    # an LLM's fleet: the same, and per window its pooled evidence: 22 with 3 windows
    ("deploy/prometheus/guard-rules-fleet-llm.yaml", len(ALERTS) + 15)])
def test_promtool_checks_the_rule_file(rule_file, alerts):
    result = subprocess.run([PROMTOOL, "check", "rules", rule_file],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {alerts} rules found" in result.stdout


@needs_promtool
def test_promtool_checks_the_prometheusrule_groups(tmp_path):
    """The PrometheusRule's spec.groups is a rule file too: check every shipped resource."""
    for shipped in (f"{BASE}/prometheusrule.yaml", f"{OVERLAY}/prometheusrule.yaml",
                    "deploy/kubernetes/llm/prometheusrule.yaml"):
        resource = yaml.safe_load((ROOT / shipped).read_text())
        assert resource["kind"] == "PrometheusRule"
        path = tmp_path / "groups.yaml"
        path.write_text(yaml.safe_dump({"groups": resource["spec"]["groups"]}))
        result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, f"{shipped}: {result.stdout}{result.stderr}"


@needs_promtool
@pytest.mark.parametrize("tests", RULE_TESTS)
def test_promtool_rule_unit_tests_pass(tests):
    result = subprocess.run([PROMTOOL, "test", "rules", tests],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_cover_every_alert_firing():
    cases = [case for path in RULE_TESTS
             for test in yaml.safe_load((ROOT / path).read_text())["tests"]
             for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert fired == set(ALERTS) | set(FLEET_ALERTS)
    assert quiet == set(ALERTS) | set(FLEET_ALERTS)


# -- what the rules are made of -------------------------------------------------------------------
def test_window_drift_threshold_is_each_models_trip_ratio():
    """... on as many samples as the detector itself decides from (policy.min_samples)."""
    window = {"detector": "window"}
    data = {"version": 1, "models": [
        model("a", policy={**window, "trip_ratio": 0.3, "recover_ratio": 0.1}),
        model("b", policy={**window, "trip_ratio": 0.05, "recover_ratio": 0, "min_samples": 5})]}
    drift = alerts_by_name(rule_groups(thresholds_from_data(data), RuleSettings()))[
        "GuardDriftOverThreshold"]
    exprs = sorted(rule["expr"] for rule in drift)
    assert exprs == [
        'guard_drift_ratio{model="a"} > 0.3 and guard_detector_samples{model="a"} >= 20',
        'guard_drift_ratio{model="b"} > 0.05 and guard_detector_samples{model="b"} >= 5']
    assert all(rule["labels"]["severity"] == "critical" for rule in drift)


def test_sequential_drift_alert_is_the_detectors_own_threshold():
    """cusum (the default) and e_detector: the statistic against the threshold gauge the guard
    exports (it derives h from p0, p1 and ARL0 at run time; the rule holds no copy of it). A
    trip_ratio, which these detectors do not read, does not leak into the rule."""
    data = {"version": 1, "models": [
        model("a", policy={"trip_ratio": 0.3}),
        model("b", policy={"detector": "e_detector", "false_alarms_per_day": 2,
                           "expected_rps": 50})]}
    drift = {rule["expr"]: rule for rule in alerts_by_name(
        rule_groups(thresholds_from_data(data), RuleSettings()))["GuardDriftOverThreshold"]}
    a = drift['guard_detector_statistic{model="a"} >= guard_detector_threshold{model="a"}'
              ' and guard_detector_samples{model="a"} >= 20']
    b = drift['guard_detector_statistic{model="b"} >= guard_detector_threshold{model="b"}'
              ' and guard_detector_samples{model="b"} >= 20']
    assert "cusum" in a["annotations"]["summary"] and "0.3" not in str(a)
    assert "policy.arl0=100000" in a["annotations"]["description"]
    assert "e_detector" in b["annotations"]["summary"]
    assert "policy.false_alarms_per_day=2" in b["annotations"]["description"]


def test_every_expression_parses_and_selects_its_model():
    data = {"version": 1, "models": [model("resnet-50.v2")]}
    groups = rule_groups(thresholds_from_data(data), RuleSettings(job="inference/guard"))
    for group in groups:
        for rule in group["rules"]:
            promql_parser.parse(rule["expr"])  # raises on a syntax error
            assert rule["annotations"]["runbook_url"] == (
                f"docs/runbook.md#{rule['alert'].lower()}")
            assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
            if group["name"].startswith("guard.model."):
                assert 'model="resnet-50.v2"' in rule["expr"]
    assert alerts_by_name(groups)["GuardDown"][0]["expr"] == 'up{job="inference/guard"} == 0'


def test_alerts_exist_only_for_what_a_model_has():
    data = {"version": 1, "models": [
        model("full"),
        model("no-reference", reference=None),
        model("not-sampled", mirror={"sample_rate": 0.0}),
        model("no-fallback", fallback=None, policy={"action": "alert"}),
    ]}
    groups = rule_groups(thresholds_from_data(data), RuleSettings())
    per_model = {g["name"].removeprefix("guard.model."): {r["alert"] for r in g["rules"]}
                 for g in groups if g["name"].startswith("guard.model.")}
    mirror_alerts = {"GuardDriftOverThreshold", "GuardMirrorDropping", "GuardReferenceFailing"}
    assert per_model["full"] == mirror_alerts | {"GuardFallbackActive"}
    assert per_model["no-reference"] == {"GuardFallbackActive"}
    assert per_model["not-sampled"] == {"GuardFallbackActive"}
    assert per_model["no-fallback"] == mirror_alerts
    assert groups[0]["name"] == "guard.availability"
    assert {r["alert"] for r in groups[0]["rules"]} == {"GuardDown", "GuardConfigReloadFailed",
                                                        "GuardVerifierDown"}


def test_generation_models_get_the_kld_alert_and_the_tasks_min_samples():
    llm = model("smol", task="generation",
                primary={"backend": "openai", "target": "http://h:1", "model": "q2"},
                reference={"backend": "transformers", "path": "smol.gguf"},
                fallback={"backend": "openai", "target": "http://h:2", "model": "q8"},
                checks={"generation": {"max_mean_kld": 0.08}},
                policy={"action": "fallback_model"})
    groups = rule_groups(thresholds_from_data({"version": 1, "models": [llm, model("m")]}),
                         RuleSettings())
    alerts = alerts_by_name(groups)
    (kld,) = alerts["GuardGenerationKldHigh"]
    assert kld["expr"] == ('rate(guard_generation_kld_sum{model="smol"}[10m]) / '
                           'rate(guard_generation_kld_count{model="smol"}[10m]) > 0.08')
    # The calls the edge cannot compare (never sampled: only in
    # guard_generation_not_comparable_total) over every call, with the verifier's share of the
    # sampled ones: what the tier does not see is 1 - (1 - edge) x (1 - verifier).
    (blind,) = alerts["GuardGenerationNotCompared"]
    calls = ('(sum without (route) (rate(guard_requests_total{model="smol"}[10m])) + sum '
             'without (code) (rate(guard_request_errors_total{model="smol"}[10m])) or sum '
             'without (route) (rate(guard_requests_total{model="smol"}[10m])))')
    reached = ('sum without (outcome) (rate(guard_mirror_total{model="smol",outcome!="dropped"}'
               '[10m]))')
    assert blind["expr"] == (
        '1 - (1 - (sum without (reason) (rate(guard_generation_not_comparable_total'
        f'{{model="smol"}}[10m])) / {calls} or {calls} * 0)) * (1 - (sum without (outcome) '
        '(rate(guard_mirror_total{model="smol",outcome="not_comparable"}[10m])) / '
        f'({reached} > 0) or {reached} * 0)) > 0.5') and blind["for"] == "30m"
    assert blind["labels"] == {"severity": "warning"}
    drift = {r["expr"].split("{")[1].split("}")[0]: r["expr"]
             for r in alerts["GuardDriftOverThreshold"]}
    assert drift['model="smol"'].endswith('guard_detector_samples{model="smol"} >= 5')
    assert drift['model="m"'].endswith('guard_detector_samples{model="m"} >= 20')


def test_generation_threshold_problems_are_dotted_lines():
    llm = model("smol", task="generation", checks={"generation": {"max_mean_kld": -1}})
    with pytest.raises(ConfigError) as info:
        thresholds_from_data({"version": 1, "models": [llm]})
    assert info.value.problems == ["models[0].checks.generation.max_mean_kld: must be > 0"]


def test_action_alert_says_clients_get_drifting_answers():
    data = {"version": 1, "models": [model(policy={"action": "alert"})]}
    drift = alerts_by_name(rule_groups(thresholds_from_data(data), RuleSettings()))[
        "GuardDriftOverThreshold"][0]
    assert "primary keeps answering" in drift["annotations"]["description"]


def test_prometheusrule_format_wraps_the_same_groups():
    models = thresholds_from_data({"version": 1, "models": [model()]})
    plain = yaml.safe_load(render(models, RuleSettings(), "prometheus"))
    resource = yaml.safe_load(render(models, RuleSettings(), "prometheusrule"))
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"]["groups"] == plain["groups"]


def test_settings_reject_bad_durations_and_jobs():
    with pytest.raises(ValueError, match="drift_for"):
        RuleSettings(drift_for="2 minutes")
    with pytest.raises(ValueError, match="job"):
        RuleSettings(job='gu"ard')


# -- config problems ------------------------------------------------------------------------------
def test_threshold_problems_are_dotted_lines():
    data = {"version": 2, "models": [
        model("a", policy={"trip_ratio": 1.5}, bogus=1),
        model("a", mirror={"sample_rate": -1}),
        model("b", fallback=None),
    ]}
    with pytest.raises(ConfigError) as info:
        thresholds_from_data(data)
    assert info.value.problems == [
        "version: must be 1",
        "models[0].bogus: unknown key",
        "models[0].policy.trip_ratio: must be in [0, 1]",
        "models[1].name: model name 'a' appears twice",
        "models[1].mirror.sample_rate: must be in [0, 1]",
        "models[2]: policy.action 'fallback_model' needs a 'fallback' backend",
    ]


def test_backends_and_artifacts_are_not_this_commands_business(tmp_path):
    """Rules are generated where manifests are built; the artifacts live in the Pod."""
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": [
        model(reference={"backend": "torch", "path": "/models/does-not-exist-here.pt"})]}))
    assert [m.name for m in read_thresholds(path)] == ["m"]


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "guard.yaml"
    path.write_text("version: 1\nmodels:\n  - name: m\n    primary: {}\n    policy: {window: 0}\n")
    assert main(["deploy", "rules", "--config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [f"guard: {path}: models[0].policy.window: must be >= 1"]
    assert main(["deploy", "rules", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_writes_output_file_with_runbook_base(tmp_path, capsys):
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    out = tmp_path / "rules.yaml"
    base = "https://git.example.com/ml/guard/-/blob/main/docs/runbook.md"
    assert main(["deploy", "rules", "--config", str(config), "--runbook-base", base,
                 "--job", "ml/guard", "-o", str(out)]) == 0
    assert capsys.readouterr().out == ""
    groups = yaml.safe_load(out.read_text())["groups"]
    urls = {r["annotations"]["runbook_url"] for g in groups for r in g["rules"]}
    assert f"{base}#guarddown" in urls and f"{base}#guarddriftoverthreshold" in urls
    assert alerts_by_name(groups)["GuardDown"][0]["expr"] == 'up{job="ml/guard"} == 0'


def test_runbook_has_a_section_for_every_alert():
    runbook = (ROOT / "docs/runbook.md").read_text()
    headings = {line[3:].strip() for line in runbook.splitlines() if line.startswith("## ")}
    assert set(ALERTS) | set(FLEET_ALERTS) <= headings


def test_labels_reach_the_prometheusrule_that_kube_prometheus_stack_selects(tmp_path, capsys):
    """kube-prometheus-stack's Prometheus selects PrometheusRules by `release: <its release>`:
    --label puts it on the resource (and in the header's regenerate command)."""
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rules", "--config", str(config), "--format", "prometheusrule",
                 "--label", "release=kube-prometheus-stack", "--label",
                 "example.com/team=ml"]) == 0
    text = capsys.readouterr().out
    resource = yaml.safe_load(text)
    assert resource["metadata"]["labels"] == {
        "app.kubernetes.io/name": "guard", "app.kubernetes.io/component": "alerting",
        "release": "kube-prometheus-stack", "example.com/team": "ml"}
    assert "--label release=kube-prometheus-stack --label example.com/team=ml`" in \
        text.splitlines()[0]


def test_name_gives_each_configs_prometheusrule_its_own(tmp_path, capsys):
    """Two PrometheusRules of one name in one namespace are one: the last applied replaces
    the other's alerts. --name names it (default guard-alerts), in the header's command too."""
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rules", "--config", str(config), "--format", "prometheusrule"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["name"] == "guard-alerts"
    assert main(["deploy", "rules", "--config", str(config), "--format", "prometheusrule",
                 "--name", "vision.guard-alerts"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text)["metadata"]["name"] == "vision.guard-alerts"
    assert "--format prometheusrule --name vision.guard-alerts`" in text.splitlines()[0]


def test_the_shipped_kustomizations_rules_have_distinct_names():
    """deploy/kubernetes/base and llm applied to one namespace keep both sets of alerts."""
    names = [yaml.safe_load((ROOT / path).read_text())["metadata"]["name"]
             for path in (f"{BASE}/prometheusrule.yaml", f"{OVERLAY}/prometheusrule.yaml",
                          "deploy/kubernetes/llm/prometheusrule.yaml")]
    # (the overlay's patches the base's: one name)
    assert names == ["guard-alerts", "guard-alerts", "guard-llm-alerts"]


@pytest.mark.parametrize("argv,message", [
    (["--label", "release=prom"], "--label: labels go on a PrometheusRule's metadata; a "
     "Prometheus rule file has none: add --format prometheusrule"),  # no metadata there
    (["--format", "prometheusrule", "--label", "release"], "--label: 'release' is not LABEL=VALUE"),
    (["--format", "prometheusrule", "--label", "rel ease=x"], "is not LABEL=VALUE"),
    (["--format", "prometheusrule", "--label", "release=-prom"], "the value must be"),
    (["--name", "mine"], "--name: names the PrometheusRule; a Prometheus rule file has no name"),
    (["--format", "prometheusrule", "--name", "Guard_Alerts"],
     "--name: 'Guard_Alerts' is not a Kubernetes object name"),
])
def test_bad_labels_and_names_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rules", "--config", str(config), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"guard: {argv[-2]}: ") and message in line, line


# -- fleet rules (--fleet) -------------------------------------------------------------------------
def fleet_groups_of(text: str) -> list[dict]:
    return [g for g in yaml.safe_load(text)["groups"] if g["name"] == "guard.fleet"]


def test_fleet_threshold_bounds_the_false_alarms_per_day():
    """h = ln(windows x evaluations a day / false alarms a day): Markov's bound on each
    window's likelihood ratio, summed over the evaluations of a day."""
    from guard.deploy.fleet import FleetSettings, fleet_threshold

    assert FleetSettings().threshold == pytest.approx(math.log(3 * 1440 / 0.1))
    assert fleet_threshold(1.0, 15.0, 2) == pytest.approx(math.log(2 * 5760))
    # more windows or evaluations, or fewer false alarms allowed: a higher threshold
    assert fleet_threshold(0.01, 60, 3) > fleet_threshold(0.1, 60, 3) > fleet_threshold(0.1, 60, 1)


def test_fleet_rules_pool_by_the_labels_asked_and_a_generation_models_evidence():
    from guard.deploy.fleet import FleetSettings

    data = {"version": 1, "models": [
        model("a", policy={"action": "alert", "min_samples": 7}),
        model("smol", task="generation",
              primary={"backend": "openai", "target": "http://h:1", "model": "x"},
              reference={"backend": "transformers", "path": "m.gguf"}),
        model("quiet", mirror={"sample_rate": 0.0})]}
    fleet = FleetSettings(windows=("10m",), by=("namespace", "model"))
    (group,) = fleet_groups_of(render(thresholds_from_data(data), RuleSettings(job="ml"),
                                      fleet=fleet))
    assert group["interval"] == "1m"
    rules = {r.get("record") or r["alert"]: r for r in group["rules"]}
    assert rules["model_tier:guard_fleet_checks:increase10m"]["expr"] == (
        'sum by (namespace, model, tier) (increase(guard_checks_total{job="ml",'
        'tier!="activation",result=~"pass|fail"}[10m]))')
    assert rules["model_tier:guard_fleet_p0:max"]["expr"] == (
        'max by (namespace, model, tier) (guard_detector_p0{job="ml"})')
    # The generation model's ratio is its completions' pooled evidence, "for" minus "against".
    assert rules["model_tier:guard_fleet_evidence_nats:increase10m"]["expr"] == (
        'sum by (namespace, model, tier) (increase(guard_detector_evidence_nats_total{job="ml",'
        'direction="for"}[10m])) - sum by (namespace, model, tier) (increase('
        'guard_detector_evidence_nats_total{job="ml",direction="against"}[10m]))')
    ratios = [r for r in group["rules"] if r.get("record") == "model_tier:guard_fleet_llr:10m"]
    assert [r["expr"] for r in ratios if 'model="smol"' in r["expr"]] == [
        'model_tier:guard_fleet_evidence_nats:increase10m{model="smol"}']
    alerts = {("smol" if 'model="smol"' in r["expr"] else "a"): r
              for r in group["rules"] if r.get("alert")}
    assert set(alerts) == {"a", "smol"}
    assert ">= 7)" in alerts["a"]["expr"] and "guard_detector_evidence_nats_total" in \
        alerts["smol"]["annotations"]["description"]
    assert "quiet" not in json.dumps(group)
    assert alerts["a"]["labels"] == {"severity": "critical", "scope": "fleet"}


@pytest.mark.parametrize("flags,message", [
    (["--fleet-windows", "5 minutes"], "not a Prometheus duration"),
    (["--fleet-by", "namespace"], "'model' among them"),
    (["--fleet-false-alarms-per-day", "0"], "must be > 0"),
])
def test_cli_refuses_bad_fleet_settings_in_one_line(tmp_path, capsys, flags, message):
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rules", "--config", str(config), "--fleet", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_without_fleet_no_fleet_rules(tmp_path, capsys):
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [model()]}))
    assert main(["deploy", "rules", "--config", str(config)]) == 0
    assert "guard_fleet" not in capsys.readouterr().out


def test_fleet_leaves_window_detectors_out_and_says_so(tmp_path, capsys):
    """A window detector never burns in: its replicas export guard_detector_p0 = p0_max, not
    the model's in-control rate, so pooled against it a fleet inside its own trip_ratio (10%
    failing, trip_ratio 0.2) would raise the critical GuardFleetDrift."""
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [
        model("seq", policy={"action": "alert"}),
        model("win", policy={"action": "alert", "detector": "window"})]}))
    assert main(["deploy", "rules", "--config", str(config), "--fleet"]) == 0
    out, err = capsys.readouterr()
    (group,) = fleet_groups_of(out)
    pooled = {r["expr"].split('model="')[1].split('"')[0] for r in group["rules"]
              if r.get("alert")}
    assert pooled == {"seq"}
    assert 'model="win"' not in json.dumps(group)
    # ... while its own drift alert stays, and the file and the command name what was left out
    assert 'guard_drift_ratio{model="win"} > 0.2' in out
    assert out.splitlines()[1] == ("# Not in the fleet rule: win: policy.detector is window "
                                   "(its replicas export no in-control rate to pool against; "
                                   "its own GuardDriftOverThreshold alerts on policy.trip_ratio)")
    assert err.strip() == "guard deploy rules: not in the fleet rule: " + \
        out.splitlines()[1].removeprefix("# Not in the fleet rule: ")
