"""The fleet rules (`guard deploy rules --fleet`) on a real Prometheus scraping three real guard
processes (`python -m guard serve`, each its own verifier process) that serve one model: drift
that each replica sees too little of to trip its own detector trips the pooled rule.

Each replica's detector is a CUSUM from p0 = 1% to p1 = 2% at ARL0 1e5; each sees six drifting
samples (all fail), its statistic 6 ln 2 = 4.2 well under its own threshold. Pooled, the fleet
has 18 failures: 18 ln 2 = 12.5 nats, over the fleet threshold ln(86400 evaluations a day / 1
false alarm a day) = 11.4 with rules evaluated every second. Only time is shortened (scrapes and
rule evaluation every second, a 30 s window); tritonclient drives the real data plane.

The same for an LLM (the rule pools the generation detector's evidence,
``guard_detector_evidence_nats_total``): three replicas in front of one llama.cpp server
serving SmolLM2's Q2_K rung, each scoring with the F16 rung; each sees three greedy completions,
whose evidence (7.5 nats here) stays under its own threshold, ln(1e5) = 11.5; pooled, 22.6 nats,
over the fleet's ln(86400) = 11.4.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from fixture_models import DRIFT_TRIGGER
from prometheus_support import PROMETHEUS, PrometheusServer
from support import affine_backend, metric, model_block, scrape, wait_for, x_input

from guard.deploy.fleet import FleetSettings
from guard.deploy.rules import RuleSettings, render, thresholds_from_data
from free_ports import free_port

TESTS_DIR = Path(__file__).resolve().parents[1]
REPLICAS = 3
DRIFTING = 6  # drifting requests per replica
WINDOW = "2m"  # the fleet rule's one window

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None, reason="Prometheus server binary not found: install "
                       "Debian's `prometheus` package (.ci/run does)"),
    pytest.mark.timeout(240),
]


class Replica:
    """One `guard serve` child process on free ports."""

    def __init__(self, folder: Path, config: dict):
        folder.mkdir()
        self.grpc_port, self.metrics_port = free_port(), free_port()
        self.http_port = free_port() if "http_port" in config["server"] else None
        ports = {"grpc_port": self.grpc_port, "metrics_port": self.metrics_port,
                 "admin_port": free_port()}
        if self.http_port is not None:  # the OpenAI-compatible edge of an LLM
            ports["http_port"] = self.http_port
        config = {**config, "server": {**config["server"], **ports}}
        path = folder / "guard.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
        self.log = (folder / "guard.log").open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config",
                                         str(path)], stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env)
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"guard exited with {self.process.returncode}")
        try:
            return self.client.is_server_ready()
        except Exception:  # noqa: BLE001  (not listening yet)
            return False

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


@contextlib.contextmanager
def fleet_of(folder: Path, config: dict, fleet: FleetSettings):
    """REPLICAS `guard serve` processes on ``config`` and a Prometheus scraping them with
    ``config``'s rules and ``fleet``'s, every target up and GuardFleetDrift evaluated and
    inactive; all stopped on the way out."""
    rules = render(thresholds_from_data(config), RuleSettings(job="guard"), fleet=fleet)
    replicas = [Replica(folder / f"guard{k}", config) for k in range(REPLICAS)]
    prometheus = None
    try:
        for replica in replicas:
            wait_for(replica.ready, timeout=120, interval=0.2)
        prom_dir = folder / "prometheus"
        prom_dir.mkdir()
        prometheus = PrometheusServer(prom_dir, [r.metrics_port for r in replicas], rules)
        prometheus.start()

        def scraped_everywhere():
            up = prometheus.api("query", query='up{job="guard"}')["result"]
            rule = prometheus.rule("GuardFleetDrift")
            return len(up) == REPLICAS and all(u["value"][1] == "1" for u in up) and \
                rule["health"] == "ok" and rule
        assert wait_for(scraped_everywhere, timeout=30, interval=0.2)["state"] == "inactive"
        yield replicas, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        for replica in replicas:
            replica.stop()


def fleet_alert(prometheus, timeout: float) -> dict:
    """The one firing GuardFleetDrift alert, waited for."""
    def firing():
        return [a for a in prometheus.alerts("GuardFleetDrift") if a["state"] == "firing"]
    (alert,) = wait_for(firing, timeout=timeout, interval=0.2)
    return alert


def test_pooled_evidence_of_three_replicas_fires_the_fleet_alert(tmp_path):
    policy = {"action": "alert", "detector": "cusum", "p0": 0.01, "shift": 0.01, "arl0": 1e5,
              "window": 20, "min_samples": 5}
    config = {"version": 1, "server": {"host": "127.0.0.1"}, "models": [model_block(
        primary=affine_backend(drift_on_trigger=True),
        checks={"tensor": {"atol": 1e-3, "rtol": 0.0}}, policy=policy)]}
    # The window holds the whole drifting phase, however slowly a loaded machine checks the
    # samples (each replica's wait below may take up to 30 s): with 30 s, a replica's failures
    # that came in over more than the window were pooled in part (17.6 of 18 once).
    fleet = FleetSettings(windows=(WINDOW,), evaluation_interval="1s", false_alarms_per_day=1.0)
    assert fleet.threshold == pytest.approx(np.log(86400))
    with fleet_of(tmp_path, config, fleet) as (replicas, prometheus):
        rng = np.random.default_rng(0)
        for replica in replicas:  # healthy traffic first: a few passes on each replica
            for _ in range(3):
                replica.client.infer("m", [x_input(rng.normal(size=(1, 4)).astype(np.float32))])

        drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
        for replica in replicas:
            for _ in range(DRIFTING):
                replica.client.infer("m", [x_input(drifting)])
        for replica in replicas:  # every replica checked its samples ...
            wait_for(lambda r=replica: metric(scrape(r.metrics_port), "guard_checks_total",
                                              model="m", tier="tensor", result="fail")
                     == DRIFTING, timeout=30)
        for replica in replicas:  # ... and none has seen enough to trip its own detector
            page = scrape(replica.metrics_port)
            assert metric(page, "guard_detector_statistic", model="m", tier="tensor") < \
                metric(page, "guard_detector_threshold", model="m", tier="tensor")
            assert metric(page, "guard_detector_p0", model="m", tier="tensor") == 0.01
            assert metric(page, "guard_detector_p1", model="m", tier="tensor") == \
                pytest.approx(0.02)

        alert = fleet_alert(prometheus, timeout=30)
        assert alert["labels"] == {"alertname": "GuardFleetDrift", "severity": "critical",
                                   "scope": "fleet", "model": "m", "tier": "tensor"}
        assert float(alert["value"]) >= fleet.threshold
        # The pooled counts are the replicas' counts summed: the recorded series is, at its
        # evaluation time, the sum over the three targets of their increase. Compared at each
        # evaluation of the last minute with the sum evaluated at that time now. A scrape still
        # in flight at an evaluation lands later with an earlier timestamp, so that evaluation
        # saw one sample less per such target, which moves increase()'s extrapolation by a few
        # per cent; Prometheus keeps the phase of scrapes and evaluations fixed, so on a loaded
        # machine every evaluation may see one in flight (no exact match in 30 s once). Hence
        # 5%: summing tells 18 from pooling one replica (6) or the largest (6) by 3x.
        # The alert may fire at the series' first evaluation, so later ones are waited for.
        name = f"model_tier:guard_fleet_failures:increase{WINDOW}"
        (series,) = prometheus.api("query", query=name)["result"]
        assert series["metric"] == {"__name__": name, "model": "m", "tier": "tensor"}

        def an_evaluation_equal_to_the_sum():
            (history,) = prometheus.api("query", query=f"{name}[1m]")["result"]
            for stamp, value in history["values"]:
                summed = prometheus.api(
                    "query", time=stamp,
                    query='sum by (model, tier) (increase(guard_checks_total{job="guard",'
                          f'tier!="activation",result="fail"}}[{WINDOW}]))')["result"]
                assert len(summed) == 1 and len({s["metric"].get("instance") for s in summed}) == 1
                if float(value) == pytest.approx(float(summed[0]["value"][1]), rel=0.05):
                    return stamp
            return None
        wait_for(an_evaluation_equal_to_the_sum, timeout=30, interval=1.0)
        # Every failure pooled: each replica had counted its six when scraped directly above,
        # but Prometheus's last scrape of it (and the rule's next evaluation) may come up to a
        # scrape interval later (17.7 of 18 when read at once, on a loaded machine).

        def most_pooled() -> float:
            (most,) = prometheus.api("query", query=f"max_over_time({name}[5m])")["result"]
            return float(most["value"][1])
        wait_for(lambda: most_pooled() >= REPLICAS * DRIFTING - 1e-9, timeout=30, interval=0.5)
        # Nothing per replica fires: the evidence exists only pooled.
        assert prometheus.alerts("GuardDriftOverThreshold") == []


def _complete(port: int, prompt: str) -> None:
    body = json.dumps({"model": "smol", "prompt": prompt, "max_tokens": 24,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200 and json.loads(answer.read())["choices"][0]["text"]


def test_pooled_evidence_of_three_llm_replicas_fires_the_fleet_alert(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from llm_support import start_llama_cpp_upstream, stop_llama_server

    from guard.zoo.llm import quant_ladder

    completions = 3  # per replica
    ladder = quant_ladder(("F16", "Q2_K"))
    upstream = start_llama_cpp_upstream(tmp_path, ladder["Q2_K"], "smol-q2k")
    config = {"version": 1, "server": {"host": "127.0.0.1", "http_port": 0}, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "openai", "target": upstream.url, "model": upstream.model,
                    "options": {"engine": "llama.cpp", "sample_logprobs": 5}},
        "reference": {"backend": "llama_cpp", "path": str(ladder["F16"])},
        "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}}]}
    fleet = FleetSettings(windows=(WINDOW,), evaluation_interval="1s", false_alarms_per_day=1.0)
    try:
        with fleet_of(tmp_path, config, fleet) as (replicas, prometheus):
            _pool_llm_evidence(replicas, prometheus, fleet, completions)
    finally:
        stop_llama_server(upstream)


def _pool_llm_evidence(replicas, prometheus, fleet: FleetSettings, completions: int) -> None:
    """``completions`` drifting completions through each replica: each one's evidence under
    its own threshold, the pooled over the fleet's, and GuardFleetDrift alone fires."""
    from guard.zoo.llm import PROMPTS

    for replica in replicas:
        for prompt in PROMPTS[:completions]:
            _complete(replica.http_port, prompt)
    for replica in replicas:  # every replica scored its completions, all failing ...
        wait_for(lambda r=replica: metric(scrape(r.metrics_port), "guard_checks_total",
                                          model="smol", tier="generation", result="fail")
                 == completions, timeout=120, interval=0.2)
    evidence = []
    for replica in replicas:  # ... and none has seen enough to trip its own detector
        page = scrape(replica.metrics_port)
        evidence.append(metric(page, "guard_detector_evidence_nats_total", model="smol",
                               tier="generation", direction="for"))
        assert metric(page, "guard_detector_statistic", model="smol", tier="generation") < \
            metric(page, "guard_detector_threshold", model="smol", tier="generation")
    assert sum(evidence) >= fleet.threshold > max(evidence), evidence

    alert = fleet_alert(prometheus, timeout=60)
    assert alert["labels"] == {"alertname": "GuardFleetDrift", "severity": "critical",
                               "scope": "fleet", "model": "smol", "tier": "generation"}
    assert float(alert["value"]) >= fleet.threshold
    assert prometheus.alerts("GuardDriftOverThreshold") == []
