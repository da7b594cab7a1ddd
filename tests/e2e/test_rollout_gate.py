"""The rollout gate's queries against a real Prometheus scraping a real guard.

`guard deploy rollout` turns a config into an Argo Rollouts AnalysisTemplate and Flagger
MetricTemplates. Here one guard serves four canaries, two clean and two that drift on trigger
inputs: per detector kind one pair, ``window`` canaries with a fallback (the gate reads their
route) and ``cusum`` ones that only alert (the gate reads their detector); Prometheus
(Debian's binary, as in test_prometheus_alerts.py) scrapes it every second with the labels a
Kubernetes scrape would give a Flagger canary pod. Every query of both manifests, with the
controller's variables filled in as the controller would, is run through Prometheus' HTTP API
and judged by the manifest's own condition (Argo's successCondition/failureCondition, Flagger's
thresholdRange): the clean canaries pass every check, the drifting ones fail the drift and
route or detector checks while their evidence check passes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import yaml
from fixture_models import DRIFT_TRIGGER
from support import affine_backend, model_block, running, wait_for, x_input
from test_prometheus_alerts import PROMETHEUS, PrometheusServer

from guard.deploy.rollout import RolloutSettings, render
from guard.deploy.rules import thresholds_from_data

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus server binary not found: install "
                       "Debian's `prometheus` package (.ci/run does)"),
    pytest.mark.timeout(180),
]

POLICIES = {
    "window": {"detector": "window", "window": 10, "min_samples": 5, "trip_ratio": 0.2,
               "recover_ratio": 0.05},
    "cusum": {"detector": "cusum", "p0": 0.01, "shift": 0.5, "arl0": 1000, "window": 10,
              "min_samples": 5},
}
# What a Kubernetes scrape of a Flagger canary pod of target `shop` in namespace `prod` labels.
POD_LABELS = {"namespace": "prod", "pod": "shop-5d8f7c9b4-q7x2z"}
FLAGGER_VARS = {"{{ namespace }}": "prod", "{{ target }}": "shop", "{{ interval }}": "1m"}


def canary(name: str, detector: str, drifts: bool) -> dict:
    """window canaries switch to a fallback (gated on their route), cusum ones only alert
    (gated on their detector)."""
    if detector == "window":
        return model_block(
            name, primary=affine_backend(drift_on_trigger=drifts), fallback=affine_backend(),
            policy={"action": "fallback_model", "dwell_s": 600, **POLICIES[detector]})
    return model_block(name, primary=affine_backend(drift_on_trigger=drifts),
                       policy={"action": "alert", **POLICIES[detector]})


def argo_measurements(text: str, canary_hash: str = "5d8f7c9b4") -> dict[str, tuple]:
    """metric name -> (query with the args' defaults, successCondition, failureCondition)."""
    template = yaml.safe_load(text)
    args = {a["name"]: a["value"] for a in template["spec"]["args"]}
    args["window"] = "1m"
    args["canary-hash"] = canary_hash  # what valueFrom.podTemplateHashValue gives the Rollout
    out = {}
    for metric in template["spec"]["metrics"]:
        query = metric["provider"]["prometheus"]["query"]
        for name, value in args.items():
            query = query.replace(f"{{{{args.{name}}}}}", value)
        out[metric["name"]] = (query, metric["successCondition"], metric["failureCondition"])
    return out


def argo_verdict(value: float, success: str, failure: str) -> str:
    def holds(condition: str) -> bool:
        if condition == "false":
            return False
        op, number = re.fullmatch(r"result\[0\] (<=|>=|<|>) (\S+)", condition).groups()
        return {"<=": value <= float(number), ">=": value >= float(number),
                "<": value < float(number), ">": value > float(number)}[op]

    return "success" if holds(success) else "failure" if holds(failure) else "inconclusive"


def flagger_measurements(text: str) -> dict[str, tuple[str, dict]]:
    """template name -> (query with Flagger's variables filled in, thresholdRange)."""
    documents = list(yaml.safe_load_all(text))
    snippet = yaml.safe_load("\n".join(
        line[2:] for line in text.splitlines()
        if line.startswith("# ") and not line.startswith("# Generated")
        and not line.startswith("# The Canary") and not line.startswith("# Not gated")))
    ranges = {m["templateRef"]["name"]: m["thresholdRange"]
              for m in snippet["analysis"]["metrics"]}
    out = {}
    for document in documents:
        query = document["spec"]["query"]
        for variable, value in FLAGGER_VARS.items():
            query = query.replace(variable, value)
        out[document["metadata"]["name"]] = (query, ranges[document["metadata"]["name"]])
    return out


def flagger_passes(value: float, bounds: dict) -> bool:
    return bounds.get("min", -np.inf) <= value <= bounds.get("max", np.inf)


def test_the_gate_passes_clean_canaries_and_fails_drifting_ones(tmp_path):
    models = [canary("ok_window", "window", False), canary("ok_cusum", "cusum", False),
              canary("bad_window", "window", True), canary("bad_cusum", "cusum", True)]
    guard_dir, prom_dir = tmp_path / "guard", tmp_path / "prometheus"
    guard_dir.mkdir()
    prom_dir.mkdir()
    with running(guard_dir, models) as (srv, client):
        config = thresholds_from_data(yaml.safe_load((guard_dir / "guard.yaml").read_text()))
        settings = RolloutSettings(window="1m", interval="10s")
        argo = argo_measurements(render(config, "argo", settings))
        # Another ReplicaSet's hash: the stable pods, say, which this scrape does not have.
        elsewhere = argo_measurements(render(config, "argo", settings), canary_hash="6b7c8d9f0")
        flagger = flagger_measurements(render(config, "flagger", settings))
        # drift-ratio, evidence, and route (fallback_model) or detector (alert)
        assert len(argo) == len(flagger) == 4 * 3
        assert {n for n in argo if n.startswith("ok-window")} == \
            {f"ok-window-{c}" for c in ("drift-ratio", "evidence", "route")}
        assert {n for n in argo if n.startswith("ok-cusum")} == \
            {f"ok-cusum-{c}" for c in ("drift-ratio", "evidence", "detector")}

        prometheus = PrometheusServer(prom_dir, srv.metrics_port, "groups: []\n")
        scrape = yaml.safe_load((prom_dir / "prometheus.yml").read_text())
        scrape["scrape_configs"][0]["static_configs"][0]["labels"] = POD_LABELS
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(scrape))
        try:
            prometheus.start()

            def value(query: str) -> float:
                result = prometheus.api("query", query=query)["result"]
                assert len(result) == 1, (query, result)
                return float(result[0]["value"][1])

            def verdicts() -> dict[str, tuple[str, bool]]:
                got = {}
                for name, (query, success, failure) in argo.items():
                    got[name] = (argo_verdict(value(query), success, failure),)
                for name, (query, bounds) in flagger.items():
                    got[name.removeprefix("guard-")] += (flagger_passes(value(query), bounds),)
                return got

            # One request per canary, scraped, then the rest: increase() counts what changed
            # after a target's first scrape, and this guard took traffic before Prometheus
            # had started.
            rng = np.random.default_rng(0)
            names = ("ok_window", "ok_cusum", "bad_window", "bad_cusum")
            for model in names:
                client.infer(model, [x_input(rng.normal(size=(1, 4)))])
            wait_for(lambda: len(prometheus.api("query", query='guard_mirror_total{outcome='
                                                '"compared"}')["result"]) == 4, timeout=30,
                     interval=0.5)
            for model in names:
                for _ in range(8):
                    client.infer(model, [x_input(rng.normal(size=(1, 4)))])
            # Clean traffic seen: every canary passes, evidence included.
            evidence = [n for n in argo if n.endswith("-evidence")]
            wait_for(lambda: all(argo_verdict(value(argo[n][0]), *argo[n][1:]) == "success"
                                 for n in evidence), timeout=30, interval=0.5)
            clean = verdicts()
            assert all(v == ("success", True) for v in clean.values()), clean
            # Series of other pods are not the canary's evidence: too little is inconclusive.
            for name in evidence:
                assert value(elsewhere[name][0]) == 0
                assert argo_verdict(0.0, *elsewhere[name][1:]) == "inconclusive"

            drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
            for model in ("bad_window", "bad_cusum"):
                for _ in range(10):
                    client.infer(model, [x_input(drifting)])
            tripped = ["bad-window-route", "bad-cusum-detector"]
            wait_for(lambda: all(value(argo[n][0]) == 1.0 for n in tripped), timeout=30,
                     interval=0.5)
            after = verdicts()
            for name, verdict in after.items():
                if name.startswith("ok-") or name.endswith("-evidence"):
                    assert verdict == ("success", True), (name, verdict)
                else:  # drift-ratio, and route or detector, of the drifting canaries
                    assert verdict == ("failure", False), (name, verdict, after)
        finally:
            prometheus.stop()
