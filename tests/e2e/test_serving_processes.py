"""server.processes: several serving processes on one port (SO_REUSEPORT), sharing the verifier
and the route words (real child processes, real gRPC, real tritonclient, real ONNX Runtime and
torch backends).

Which process answered a connection is the kernel's choice; the tests open fresh connections
until every process has answered, and tell the processes apart by their own counters (the
primary's registry, and each other process's exposition over its control channel)."""

from __future__ import annotations

import logging
import os
import signal

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fixture_models
from guard.v1 import admin_pb2, admin_pb2_grpc
from support import (affine_backend, events, metric, model_block, running, scrape, wait_for,
                     x_input)

_CONNECTIONS = 64  # fresh connections tried before giving up on reaching every process


def _counts(text: str, route: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == "guard_requests_total" and s.labels == {"model": "m", "route": route})


def _per_process(srv, route: str = "primary") -> list[float]:
    """Requests each serving process answered itself: the primary first."""
    own = generate_latest(srv.metrics.registry).decode()
    return [_counts(text, route) for text in (own, *srv.serving.expositions())]


def _answer_on_fresh_connections(srv, rows, until) -> list[grpcclient.InferResult]:
    """One request per new client connection (its own subchannel, so a new TCP connection)
    until ``until()`` holds; every result."""
    results = []
    for i in range(_CONNECTIONS):
        client = grpcclient.InferenceServerClient(
            f"127.0.0.1:{srv.grpc_port}", channel_args=[("grpc.use_local_subchannel_pool", 1)])
        try:
            results.append(client.infer("m", [x_input(rows[i % len(rows)][None])]))
        finally:
            client.close()
        if until():
            return results
    raise AssertionError(f"after {_CONNECTIONS} connections: {until()}")


def _route(result) -> str:
    return result.get_response().parameters["guard_route"].string_param


def test_both_processes_answer_report_on_metrics_and_hand_samples_over(tmp_path, rng):
    with running(tmp_path, [model_block()], processes=2) as (srv, _):
        (other,) = srv.serving.others
        assert other.process.pid not in (os.getpid(), srv.verifier.process.pid)
        rows = rng.normal(size=(8, 4))
        results = _answer_on_fresh_connections(
            srv, rows, lambda: all(n >= 2 for n in _per_process(srv)))
        sent = len(results)
        primary, worker = _per_process(srv)
        assert primary + worker == sent
        values = scrape(srv.metrics_port)
        # Both processes' series in one exposition, summed; primary-only series once.
        assert metric(values, "guard_requests_total", model="m", route="primary") == sent
        assert metric(values, "guard_serving_processes") == 2
        assert metric(values, "guard_build_info",
                      version=__import__("guard").__version__) == 1
        # Every request was mirrored: the samples of both rings are compared.
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_mirror_total", model="m",
                                outcome="compared") == sent)
        assert metric(scrape(srv.metrics_port), "guard_checks_total", model="m",
                      tier="tensor", result="pass") == sent
    assert other.process.returncode == 0  # stopped gracefully with the primary


def test_a_pinned_route_is_seen_by_every_serving_process(tmp_path, rng):
    model = model_block(fallback=affine_backend(),
                        policy={"action": "fallback_model", "window": 10, "min_samples": 5})
    with running(tmp_path, [model], processes=2) as (srv, _):
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin_pb2_grpc.AdminStub(channel).SetRoute(
                admin_pb2.SetRouteRequest(model="m", route=admin_pb2.FALLBACK))
        results = _answer_on_fresh_connections(
            srv, rng.normal(size=(8, 4)),
            lambda: all(n >= 2 for n in _per_process(srv, "fallback")))
        assert {_route(r) for r in results} == {"fallback"}
        assert _per_process(srv, "primary") == [0, 0]


def test_a_reload_applies_in_every_serving_process(tmp_path, rng, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    trigger = np.array([[fixture_models.DRIFT_TRIGGER, 0.0, 0.0, 0.0]])
    model = model_block(mirror={"sample_rate": 0.0})
    with running(tmp_path, [model], processes=2, reload_interval_s=0.1) as (srv, client):
        before = client.infer("m", [x_input(trigger)]).as_numpy("y")
        path = tmp_path / "guard.yaml"
        data = yaml.safe_load(path.read_text())
        data["models"][0]["primary"] = affine_backend(drift_on_trigger=True)  # answers +1
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_config_reloads_total",
                                result="applied") == 1)
        counted = _per_process(srv)
        results = _answer_on_fresh_connections(
            srv, trigger, lambda: all(n > c for n, c in zip(_per_process(srv), counted)))
        for result in results:
            np.testing.assert_allclose(result.as_numpy("y"), before + 1.0, rtol=1e-6)
        (reloaded,) = events(caplog, "config_reloaded")
        assert reloaded["changed"] == ["m"] and reloaded["failed"] == []


def test_a_serving_process_that_dies_is_restarted_and_counted(tmp_path, rng, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    with running(tmp_path, [model_block(mirror={"sample_rate": 0.0})],
                 processes=2) as (srv, client):
        (other,) = srv.serving.others
        first = other.process.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: metric(scrape(srv.metrics_port),
                                "guard_serving_process_restarts_total") == 1)
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            ready = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"))
        assert ready.status == health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_serving_processes") == 2,
                 timeout=30)
        assert other.process.pid != first
        # The new process serves: its own counter moves.
        _answer_on_fresh_connections(srv, rng.normal(size=(8, 4)),
                                     lambda: _per_process(srv)[1] >= 1)
        (lost,) = events(caplog, "serving_process_lost")
        assert "SIGKILL" in lost["how"] and lost["index"] == 1
        wait_for(lambda: events(caplog, "serving_process_restarted"))


def test_a_repaired_primary_is_built_from_the_block_the_verifier_sends_in_every_process(
        tmp_path, rng, caplog):
    """UsePrimary carries the rebuilt backend block: every serving process builds it, the first
    one as the others, and a serving process started again later is handed it with its Init.
    (The block here is the fixture's drifting affine, so the variant is told apart by its
    answers.)"""
    from guard.config import BackendConfig
    from guard.ipc.config import backend_to_wire
    from guard.ipc.messages import UsePrimary

    caplog.set_level(logging.INFO, logger="guard.events")
    trigger = np.array([[fixture_models.DRIFT_TRIGGER, 0.0, 0.0, 0.0]])
    # the torch module: its variant is a kwarg of the same factory
    model = model_block(primary=affine_backend(torch=True), mirror={"sample_rate": 0.0})
    with running(tmp_path, [model], processes=2) as (srv, client):
        before = client.infer("m", [x_input(trigger)]).as_numpy("y")
        configured = srv.models["m"].config.primary
        variant = BackendConfig.model_validate(
            {**backend_to_wire(configured), "options": {"kwargs": {"drift_on_trigger": True}}})
        handle = srv.verifier._handlers()  # what the verifier's UsePrimary reaches
        assert handle(UsePrimary("m", ["linear"], backend_to_wire(variant))) is None
        assert srv.models["m"].kept == ["linear"]

        def every_process_answers_the_variant():
            counted = _per_process(srv)
            for result in _answer_on_fresh_connections(
                    srv, trigger, lambda: all(n > c for n, c in zip(_per_process(srv),
                                                                     counted))):
                np.testing.assert_allclose(result.as_numpy("y"), before + 1.0, rtol=1e-6)

        every_process_answers_the_variant()
        (other,) = srv.serving.others
        first = other.process.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: events(caplog, "serving_process_restarted"), timeout=60)
        assert other.process.pid != first
        every_process_answers_the_variant()  # the new process was handed the block at Init
        refused = handle(UsePrimary("m", ["linear"], None))  # the channel answers it
        assert "without the rebuilt primary" in refused.error
        # Every process said no, so every process is put back on the variant it served.
        every_process_answers_the_variant()


def test_a_repair_reaches_every_serving_process_and_outlives_their_restarts(
        tmp_path, zoo_classifier, caplog):
    """A real repair (the zoo CNN's int8 drift, tests/e2e/test_ops_fallback_sidecar.py) with two
    serving processes: its UsePrimary reaches both the same way, and the pool's record of it
    is what a killed verifier and a killed serving process resume from."""
    import onnxruntime as ort

    from guard.zoo.classifier import sample_inputs
    from support import (assert_repaired_once, image_input, ops_fallback_model,
                         traffic_through_repair)

    caplog.set_level(logging.INFO, logger="guard.events")
    onnx_path = str(zoo_classifier["onnx"])
    model = ops_fallback_model(
        "cnn",
        primary={"backend": "onnxruntime", "path": onnx_path, "precision": "int8"},
        reference={"backend": "onnxruntime", "path": onnx_path},
        fallback={"backend": "onnxruntime", "path": onnx_path})
    images = sample_inputs(32, seed=17)
    expected = ort.InferenceSession(onnx_path).run(None, {"image": images})[0]

    def every_process_answers_the_repaired_primary(srv):
        def counted():
            own = generate_latest(srv.metrics.registry).decode()
            return [sum(s.value for f in text_string_to_metric_families(text)
                        for s in f.samples if s.name == "guard_requests_total"
                        and s.labels == {"model": "cnn", "route": "primary"})
                    for text in (own, *srv.serving.expositions())]

        before = counted()
        for _ in range(_CONNECTIONS):
            client = grpcclient.InferenceServerClient(
                f"127.0.0.1:{srv.grpc_port}",
                channel_args=[("grpc.use_local_subchannel_pool", 1)])
            try:
                result = client.infer("cnn", [image_input(images)])
            finally:
                client.close()
            assert _route(result) == "primary"
            logits = result.as_numpy("logits")
            assert (np.abs(logits - expected).max(axis=1)
                    <= 0.05 * np.abs(expected).max(axis=1)).all()
            if all(n > b for n, b in zip(counted(), before)):
                return
        raise AssertionError("not every serving process answered")

    with running(tmp_path, [model], processes=2) as (srv, _):
        values, traffic, _ = traffic_through_repair(srv, "cnn", image_input, images)
        kept = assert_repaired_once(values, traffic, caplog, "cnn")["ops_kept_fp32"]
        assert srv.serving.primaries["cnn"].kept == kept
        every_process_answers_the_repaired_primary(srv)

        verifier = srv.verifier.process.pid
        os.kill(verifier, signal.SIGKILL)
        wait_for(lambda: srv.verifier.ready.is_set() and srv.verifier.process.pid != verifier,
                 timeout=120)
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            status = admin_pb2_grpc.AdminStub(channel).GetStatus(
                admin_pb2.GetStatusRequest(model="cnn")).models[0]
        assert list(status.ops_kept_back) == kept  # resumed from the pool's record

        (other,) = srv.serving.others
        first = other.process.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: other.ready and other.process.pid != first, timeout=120)
        every_process_answers_the_repaired_primary(srv)  # handed the variant at its Init
