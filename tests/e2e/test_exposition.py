"""guard's /metrics as Prometheus reads it: `promtool check metrics` (Debian's prometheus
package; .ci/run installs it) on a live guard's exposition, in both data planes. The merged
exposition repeated the `*_created` families (two # TYPE lines), which promtool rejects
(issue 28, item 8). Envoy mode's admin status counts requests per route as /metrics does, in
numbers (item 9)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import numpy as np
import pytest

import own_model
from envoy_support import Guard, needs_envoy, write
from support import metric, model_block, running, scrape, wait_for, x_input
from test_cli import run_guard
from test_envoy import OipServer

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed: apt-get install prometheus")
REQUESTS = 12


def exposition(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def promtool_check(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


def assert_one_family_each(text: str) -> None:
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)


@needs_promtool
def test_python_data_plane_exposition_passes_promtool(tmp_path):
    with running(tmp_path, [model_block()]) as (srv, client):
        for _ in range(REQUESTS):
            client.infer("m", [x_input(np.ones((1, 4)))])
        wait_for(lambda: metric(scrape(srv.metrics_port),
                                "guard_mirror_total", model="m", outcome="compared") == REQUESTS)
        text = exposition(srv.metrics_port)
    assert "guard_mirror_created" in text  # the verifier's families are in it
    assert_one_family_each(text)
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def envoy_guard(tmp_path_factory):
    folder = tmp_path_factory.mktemp("envoy-exposition")
    paths = own_model.export(folder)
    servers = {role: OipServer(folder, str(paths["onnx"]), role, names=("net",))
               for role in ("primary", "fallback")}
    block = {
        "name": "net", "task": "classification",
        "primary": {"backend": "upstream", "target": servers["primary"].target, "model": "net"},
        "fallback": {"backend": "upstream", "target": servers["fallback"].target,
                     "model": "net"},
        "reference": {"backend": "onnxruntime", "path": str(paths["onnx"])},
        "mirror": {"sample_rate": 1.0, "queue_size": 256},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    guard = Guard(write(folder, [block]))
    try:
        rows = np.random.default_rng(0).standard_normal((REQUESTS, own_model.FEATURES))
        for i in range(REQUESTS):
            guard.client.infer("net", [x_input(rows[i:i + 1])])
        wait_for(lambda: metric(guard.metrics(), "guard_mirror_total", model="net",
                                outcome="compared") == REQUESTS)
        yield guard
    finally:
        guard.close()
        for server in servers.values():
            server.client.close()
            server.stop()


@needs_envoy
@needs_promtool
def test_envoy_data_plane_exposition_passes_promtool(envoy_guard):
    text = exposition(envoy_guard.srv.metrics_port)
    assert 'guard_requests_total{model="net",route="primary"}' in text
    assert_one_family_each(text)
    result = promtool_check(text)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_envoy
def test_envoy_mode_admin_status_counts_requests_as_metrics_does(envoy_guard):
    values = envoy_guard.metrics()
    counted = metric(values, "guard_requests_total", model="net", route="primary")
    assert counted == REQUESTS
    result = run_guard("admin", "--admin", f"127.0.0.1:{envoy_guard.srv.admin_port}", "status",
                       "--json")
    assert result.returncode == 0, result.stderr
    (status,) = json.loads(result.stdout)["models"]
    assert status["requests"]["primary"] == REQUESTS  # a number, not "12"
    assert status["mirror"]["compared"] == REQUESTS
    text = run_guard("admin", "--admin", f"127.0.0.1:{envoy_guard.srv.admin_port}", "status")
    assert f"requests: fallback=0, primary={REQUESTS}" in text.stdout, text.stdout
