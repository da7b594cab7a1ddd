"""The sidecar end to end: real gRPC server, tritonclient, torch and ONNX Runtime backends."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from fixture_models import DRIFT_TRIGGER, FAIL_TRIGGER, SLEEP_TRIGGER
from guard.v1 import admin_pb2, admin_pb2_grpc

from support import (affine_answers, affine_backend, metric, model_block, running, scrape,
                     wait_for, x_input)

CONTRACT_METRICS = {
    "guard_requests_total", "guard_request_duration_seconds_bucket", "guard_mirror_total",
    "guard_mirror_queue_depth", "guard_reference_duration_seconds_bucket", "guard_checks_total",
    "guard_tensor_max_abs_error_bucket", "guard_drift_ratio", "guard_fallback_active",
    "guard_fallback_transitions_total", "guard_build_info",
}


def route_of(result) -> str:
    return result.get_response().parameters["guard_route"].string_param


def test_outputs_equal_the_backend_called_directly(tmp_path, zoo_classifier):
    from guard.zoo.classifier import sample_inputs

    onnx = str(zoo_classifier["onnx"])
    model = {"name": "cnn", "primary": {"backend": "onnxruntime", "path": onnx},
             "mirror": {"sample_rate": 0.0}}
    images = sample_inputs(4, seed=3)
    expected = ort.InferenceSession(onnx).run(None, {"image": images})[0]
    with running(tmp_path, [model]) as (srv, client):
        tensor = grpcclient.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        result = client.infer("cnn", [tensor], request_id="r-1")
        np.testing.assert_array_equal(result.as_numpy("logits"), expected)
        assert result.get_response().id == "r-1"
        assert route_of(result) == "primary"
        meta = client.get_model_metadata("cnn")
        assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
            ("image", "FP32", [-1, 3, 32, 32])]
        assert [(o.name, o.datatype) for o in meta.outputs] == [("logits", "FP32")]
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("cnn") and not client.is_model_ready("nope")
        assert client.get_server_metadata().name == "guard"


def test_mirroring_is_counted_and_clean_samples_pass(tmp_path, rng):
    with running(tmp_path, [model_block()]) as (srv, client):
        for i in range(12):
            client.infer("m", [x_input(rng.normal(size=(2, 4)))], request_id=f"id-{i}")
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="m", outcome="compared") == 12 and v)
        assert metric(values, "guard_requests_total", model="m", route="primary") == 12
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="pass") == 12
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="fail") == 0
        assert metric(values, "guard_mirror_total", model="m", outcome="dropped") == 0
        assert metric(values, "guard_reference_duration_seconds_count", model="m") == 12
        # Agreement within float32 summation-order noise (outputs of order 1): the verifier runs
        # the reference on samples batched together, and a GEMM's kernel, so its summation
        # order, may change with the rows in the call (identical on an AMD EPYC; 2.4e-7 apart
        # for 2 rows against 64 on a Sapphire Rapids Xeon).
        assert metric(values, "guard_tensor_max_abs_error_bucket", model="m", le="1e-06") == 12
        assert CONTRACT_METRICS <= {name for name, _ in values}
        assert metric(values, "guard_build_info", version=__import__("guard").__version__) == 1


def test_drift_trips_fallback_then_routes_back_after_recovery(tmp_path, rng):
    model = model_block(
        primary=affine_backend(drift_on_trigger=True),
        fallback=affine_backend(),
        policy={"action": "fallback_model", "detector": "window", "window": 10,
                "min_samples": 5, "trip_ratio": 0.2, "recover_ratio": 0.0, "dwell_s": 0.3},
    )
    drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
    clean = rng.normal(size=(1, 4)).astype(np.float32)
    with running(tmp_path, [model]) as (srv, client):
        # Phase 1: the primary drifts on these inputs; the client gets its (drifted) answers.
        for _ in range(5):
            result = client.infer("m", [x_input(drifting)])
            assert route_of(result) == "primary"
            np.testing.assert_allclose(result.as_numpy("y"),
                                       affine_answers(drifting, drift_on_trigger=True))
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="m", scope="model") == 1 and v)
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="fail") == 5
        assert metric(values, "guard_fallback_transitions_total", model="m",
                      to="fallback_model") == 1
        assert metric(values, "guard_drift_ratio", model="m", tier="tensor") == 0.0  # new epoch

        # Phase 2: answers come from the fallback, equal to the clean model.
        result = client.infer("m", [x_input(drifting)])
        assert route_of(result) == "fallback"
        np.testing.assert_allclose(result.as_numpy("y"), affine_answers(drifting), rtol=1e-6)

        # Phase 3: past the dwell, the primary is probed in the background on clean traffic;
        # a clean window routes back.
        time.sleep(0.35)

        def back_on_primary():
            client.infer("m", [x_input(clean)])
            v = scrape(srv.metrics_port)
            return metric(v, "guard_fallback_transitions_total", model="m", to="primary") == 1

        wait_for(back_on_primary, timeout=30, interval=0.02)
        assert route_of(client.infer("m", [x_input(clean)])) == "primary"
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_fallback_active", model="m", scope="model") == 0
        assert metric(values, "guard_requests_total", model="m", route="fallback") >= 1


def test_alert_action_reports_but_never_switches(tmp_path):
    model = model_block(primary=affine_backend(drift_on_trigger=True), fallback=affine_backend())
    with running(tmp_path, [model]) as (srv, client):
        drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
        for _ in range(8):
            assert route_of(client.infer("m", [x_input(drifting)])) == "primary"
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_checks_total", model="m", tier="tensor", result="fail") == 8 and v)
        assert metric(values, "guard_drift_ratio", model="m", tier="tensor") == 1.0
        assert metric(values, "guard_fallback_active", model="m", scope="model") == 0
        assert route_of(client.infer("m", [x_input(drifting)])) == "primary"


def test_slow_reference_never_slows_or_fails_the_primary(tmp_path):
    """A reference that hangs for 2 s per sample: requests keep being answered, and every
    sample is accounted for once, as a timeout (the watchdog gives up on the hung call and the
    samples behind it while it holds the reference) or a drop (a full queue, a stale sample):
    the mirror never blocks the request path."""
    model = model_block(
        reference=affine_backend(sleep_on_trigger=2.0),
        mirror={"sample_rate": 1.0, "queue_size": 2, "timeout_s": 0.2},
    )
    slow = np.full((1, 4), SLEEP_TRIGGER, np.float32)

    def outcomes(values) -> float:
        return sum(metric(values, "guard_mirror_total", model="m", outcome=o)
                   for o in ("compared", "dropped", "timeout", "error"))

    with running(tmp_path, [model]) as (srv, client):
        for _ in range(20):
            result = client.infer("m", [x_input(slow)])
            np.testing.assert_allclose(result.as_numpy("y"), affine_answers(slow), rtol=1e-6)
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and outcomes(v) == 20 and v)
        assert metric(values, "guard_mirror_total", model="m", outcome="timeout") >= 2
        assert metric(values, "guard_mirror_total", model="m", outcome="compared") == 0
        assert metric(values, "guard_requests_total", model="m", route="primary") == 20


def test_failing_reference_counts_errors_and_serving_goes_on(tmp_path):
    model = model_block(reference=affine_backend(fail_on_trigger=True))
    bad = np.full((1, 4), FAIL_TRIGGER, np.float32)
    with running(tmp_path, [model]) as (srv, client):
        for _ in range(3):
            np.testing.assert_allclose(client.infer("m", [x_input(bad)]).as_numpy("y"),
                                       affine_answers(bad), rtol=1e-6)
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_mirror_total", model="m",
                                outcome="error") == 3)


def test_backend_exception_is_internal_and_the_server_keeps_serving(tmp_path, rng):
    model = model_block(primary=affine_backend(fail_on_trigger=True))
    with running(tmp_path, [model]) as (srv, client):
        with pytest.raises(InferenceServerException) as err:
            client.infer("m", [x_input(np.full((1, 4), FAIL_TRIGGER))])
        assert err.value.status() == "StatusCode.INTERNAL"
        assert "'m'" in err.value.message() and "fixture model failure" in err.value.message()
        ok = rng.normal(size=(1, 4)).astype(np.float32)
        np.testing.assert_allclose(client.infer("m", [x_input(ok)]).as_numpy("y"),
                                   affine_answers(ok, torch=True), rtol=1e-6)
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_request_errors_total", model="m", code="INTERNAL") == 1


def test_health_and_admin_api(tmp_path, rng):
    model = model_block(fallback=affine_backend(),
                        policy={"action": "fallback_model", "window": 10, "min_samples": 5})
    with running(tmp_path, [model]) as (srv, client):
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "readiness"):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            status = admin.GetStatus(admin_pb2.GetStatusRequest()).models[0]
            assert (status.name, status.route, status.override) == ("m", "primary", "auto")
            assert {b.role for b in status.backends} == {"primary", "reference", "fallback"}

            pinned = admin.SetRoute(admin_pb2.SetRouteRequest(
                model="m", route=admin_pb2.FALLBACK, reason="maintenance")).status
            assert (pinned.route, pinned.override) == ("fallback", "fallback")
            assert pinned.last_transition.reason == "maintenance"
            assert route_of(client.infer("m", [x_input(rng.normal(size=(1, 4)))])) == "fallback"
            assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="m",
                          scope="model") == 1

            back = admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.PRIMARY))
            assert back.status.route == "primary"
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.AUTO))
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="m"))
            assert status.models[0].override == "auto"
            with pytest.raises(grpc.RpcError) as err:
                admin.GetStatus(admin_pb2.GetStatusRequest(model="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_manual_route_without_fallback_is_refused(tmp_path):
    with running(tmp_path, [model_block()]) as (srv, _):
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.FALLBACK))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("workers", [4, 0], ids=["thread-pool", "inline"])
def test_concurrent_clients_each_get_their_own_answer(tmp_path, rng, workers):
    rows = rng.normal(size=(64, 1, 4)).astype(np.float32)
    expected = [affine_answers(r) for r in rows]
    with running(tmp_path, [model_block(mirror={"sample_rate": 0.5})],
                 workers=workers) as (srv, _):
        failures = []

        def worker(indices):
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
            for i in indices:
                got = client.infer("m", [x_input(rows[i])], request_id=str(i)).as_numpy("y")
                if not np.allclose(got, expected[i], rtol=1e-6):
                    failures.append(i)
            client.close()

        threads = [threading.Thread(target=worker, args=(range(k, 64, 8),)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert failures == []
        assert metric(scrape(srv.metrics_port), "guard_requests_total", model="m",
                      route="primary") == 64


def test_asking_for_some_outputs_still_compares_them_all(tmp_path):
    """A local primary computes every output; a client asking for one of them must not make the
    mirror see the others as missing (and must not hide drift in the ones it did not ask for)."""
    block = model_block(primary={"backend": "torch", "path": "fixture_models:nested"},
                        reference={"backend": "torch", "path": "fixture_models:nested"})
    with running(tmp_path, [block]) as (srv, client):
        x = grpcclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        result = client.infer("m", [x], outputs=[grpcclient.InferRequestedOutput("sum")])
        assert [o.name for o in result.get_response().outputs] == ["sum"]
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="m", outcome="compared") == 1 and v)
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="pass") == 1


@pytest.mark.parametrize("inline_below_ms", [None, 0.0], ids=["inline", "on_threads"])
def test_a_call_past_its_clients_deadline_is_counted(tmp_path, inline_below_ms):
    """A primary slower than the client's deadline: the client gets DEADLINE_EXCEEDED and
    guard_request_errors_total says so (a slow primary's first symptom is its clients'
    timeouts), whether the backend runs inline (the answer comes after the deadline) or on
    the inference threads (gRPC cancels the call); a call whose client waits is answered."""
    block = model_block(primary=affine_backend(sleep_on_trigger=1.0),
                        mirror={"sample_rate": 0.0})
    slow = np.full((1, 4), SLEEP_TRIGGER, np.float32)
    server = {} if inline_below_ms is None else {"inline_below_ms": inline_below_ms}
    with running(tmp_path, [block], **server) as (srv, client):
        with pytest.raises(InferenceServerException) as error:
            client.infer("m", [x_input(slow)], client_timeout=0.3)
        assert error.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        client.infer("m", [x_input(slow)], client_timeout=30)
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_request_errors_total", model="m", code="DEADLINE_EXCEEDED") == 1 and v)
        assert metric(values, "guard_requests_total", model="m", route="primary") == 1
