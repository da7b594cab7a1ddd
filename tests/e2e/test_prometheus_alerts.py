"""A real Prometheus server scrapes a running guard, evaluates the rules `guard deploy rules`
generates for its config, and fires the drift alert once drift is injected through the guard.

Everything is real: the guard (gRPC + /metrics on free ports), tritonclient, the fixture model
that drifts on trigger inputs (its ONNX form: tests/affine_onnx.py), Debian's Prometheus binary
(installed by .ci/run) with its own TSDB in a temp folder, and its HTTP API. The only thing the
test shortens is time: scrape and rule evaluation every second, and the drift alert's `for` set
to 2 s.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from fixture_models import DRIFT_TRIGGER
from prometheus_support import PROMETHEUS, PrometheusServer
from support import (
    affine_backend,
    metric,
    model_block,
    running,
    scrape,
    wait_for,
    x_input,
)

from guard.deploy.rules import RuleSettings, render, thresholds_from_data

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus server binary not found: install "
                       "Debian's `prometheus` package (.ci/run does)"),
    pytest.mark.timeout(120),
]


def dashboard_queries() -> list[str]:
    """The dashboard's panel queries with Grafana's macros and variables filled in."""
    dashboard = json.loads((ROOT / "deploy/grafana/guard-dashboard.json").read_text())
    values = {"$__rate_interval": "5s", "$__interval": "5s", "$__range": "1m",
              '"$job"': '"guard"', '"$instance"': '".*"', '"$model"': '".*"'}
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            query = target["expr"]
            for variable, value in values.items():
                query = query.replace(variable, value)
            queries.append(query)
    return queries


# The two kinds of drift rule `guard deploy rules` writes: the window detector's failing share
# over trip_ratio, and a sequential detector's statistic at its own threshold gauge. The cusum
# case pins p0 and a large shift so that two failing samples would trip it (threshold exact, ARL0
# 1e3); both decide, and alert, from policy.min_samples (5) on.
DETECTORS = {
    "window": {
        "policy": {"detector": "window", "window": 10, "min_samples": 5, "trip_ratio": 0.2,
                   "recover_ratio": 0.05},
        "query": 'guard_drift_ratio{model="m"} > 0.2 and guard_detector_samples{model="m"} >= 5',
        "summary": lambda value: "guard m: tensor drift 100% over trip_ratio 20%",
    },
    "cusum": {
        "policy": {"detector": "cusum", "p0": 0.01, "shift": 0.5, "arl0": 1000, "window": 10,
                   "min_samples": 5},
        "query": ('guard_detector_statistic{model="m"} >= guard_detector_threshold{model="m"}'
                  ' and guard_detector_samples{model="m"} >= 5'),
        "summary": lambda value: (f"guard m: tensor drift detected (cusum statistic "
                                  f"{value:.2f} at its threshold)"),
    },
}


@pytest.mark.parametrize("detector", list(DETECTORS))
def test_drift_alert_goes_from_inactive_to_firing(tmp_path, detector):
    case = DETECTORS[detector]
    model = model_block(
        primary=affine_backend(drift_on_trigger=True),
        policy={"action": "alert", **case["policy"]},
    )
    guard_dir, prom_dir = tmp_path / "guard", tmp_path / "prometheus"
    guard_dir.mkdir()
    prom_dir.mkdir()
    with running(guard_dir, [model]) as (srv, client):
        # The rules for exactly this config, as `guard deploy rules` makes them; only the
        # durations are shortened so that the test runs in seconds.
        config = yaml.safe_load((guard_dir / "guard.yaml").read_text())
        settings = RuleSettings(job="guard", drift_for="2s", fallback_for="2s",
                                rate_window="10s", mirror_for="2s", reference_for="2s",
                                down_for="2s")
        prometheus = PrometheusServer(prom_dir, srv.metrics_port,
                                      render(thresholds_from_data(config), settings))
        try:
            prometheus.start()
            rng = np.random.default_rng(0)
            for _ in range(6):
                client.infer("m", [x_input(rng.normal(size=(1, 4)))])

            # Healthy: the target is up, the rules evaluate, the drift alert is inactive.
            def healthy_and_evaluated():
                up = prometheus.api("query", query='up{job="guard"}')["result"]
                ratio = prometheus.api("query", query='guard_drift_ratio{model="m"}')["result"]
                rule = prometheus.rule("GuardDriftOverThreshold")
                return (up and up[0]["value"][1] == "1" and ratio
                        and rule["health"] == "ok" and rule["lastEvaluation"] > "2" and rule)

            rule = wait_for(healthy_and_evaluated, timeout=20, interval=0.2)
            assert rule["state"] == "inactive"
            assert rule["query"] == case["query"]
            assert prometheus.alerts("GuardDriftOverThreshold") == []
            assert prometheus.alerts("GuardDown") == []
            # Every dashboard query is PromQL this Prometheus accepts, over real guard series.
            for query in dashboard_queries():
                prometheus.api("query", query=query)

            # Drift: the primary adds 1.0 to its answer for inputs >= 1000; the reference
            # does not. Every mirrored sample fails the tensor tier; ten fill the window and
            # take the cusum statistic far past its threshold.
            drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
            for _ in range(10):
                client.infer("m", [x_input(drifting)])
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_drift_ratio", model="m",
                                    tier="tensor") == 1.0, timeout=20)
            page = scrape(srv.metrics_port)
            statistic = metric(page, "guard_detector_statistic", model="m", tier="tensor")
            assert statistic >= metric(page, "guard_detector_threshold", model="m", tier="tensor")

            states = []

            def firing():
                alerts = prometheus.alerts("GuardDriftOverThreshold")
                states.extend(a["state"] for a in alerts)
                return [a for a in alerts if a["state"] == "firing"]

            (alert,) = wait_for(firing, timeout=30, interval=0.2)
            assert "pending" in states or states[0] == "firing"
            assert alert["labels"] == {
                "alertname": "GuardDriftOverThreshold", "severity": "critical",
                "job": "guard", "instance": f"127.0.0.1:{srv.metrics_port}",
                "model": "m", "tier": "tensor",
            }
            value = float(alert["value"])
            assert value == (1.0 if detector == "window" else statistic)
            assert alert["annotations"]["runbook_url"] == "docs/runbook.md#guarddriftoverthreshold"
            assert alert["annotations"]["summary"] == case["summary"](value)
            assert prometheus.rule("GuardDriftOverThreshold")["state"] == "firing"
            # Nothing else is wrong: no drops, no reference failures, the guard is up.
            for other in ("GuardMirrorDropping", "GuardReferenceFailing", "GuardDown",
                          "GuardConfigReloadFailed", "GuardVerifierDown"):
                assert prometheus.alerts(other) == [], other
        finally:
            prometheus.stop()
