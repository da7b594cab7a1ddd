"""The verifier process: checking runs out of the serving process, and its death, a hang or a
full ring never fails or slows a client (real gRPC server, real tritonclient, real torch
backends, a real child process that is really killed)."""

from __future__ import annotations

import logging
import os
import signal

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fixture_models
from guard.v1 import admin_pb2, admin_pb2_grpc
from support import (Traffic, affine_backend, events, metric, model_block, running, scrape,
                     wait_for, x_input)


def _verifier_pid(srv) -> int:
    return srv.verifier.process.pid


def _compared(srv) -> float:
    return metric(scrape(srv.metrics_port), "guard_mirror_total", model="m",
                  outcome="compared")


def _ready(srv) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"))
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_checking_runs_in_another_process_and_both_report_on_metrics(tmp_path, rng):
    with running(tmp_path, [model_block()]) as (srv, client):
        assert _verifier_pid(srv) != os.getpid()
        for _ in range(5):
            client.infer("m", [x_input(rng.normal(size=(1, 4)))])
        wait_for(lambda: _compared(srv) == 5)
        values = scrape(srv.metrics_port)
        # The serving process's series and the verifier's, in one exposition.
        assert metric(values, "guard_requests_total", model="m", route="primary") == 5
        assert metric(values, "guard_checks_total", model="m", tier="tensor",
                      result="pass") == 5
        assert metric(values, "guard_verifier_up") == 1
        assert metric(values, "guard_build_info", version=__import__("guard").__version__) == 1


def test_sigkill_of_the_verifier_under_load_fails_no_request(tmp_path, rng, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    model = model_block(fallback=affine_backend(),
                        policy={"action": "fallback_model", "window": 10, "min_samples": 5})
    with running(tmp_path, [model], verifier={"restart_backoff_s": 0.2}) as (srv, client):
        traffic = Traffic(srv.grpc_port, "m", x_input, rng.normal(size=(64, 4)), output="y")
        traffic.start()
        try:
            wait_for(lambda: _compared(srv) >= 10)
            first = _verifier_pid(srv)
            os.kill(first, signal.SIGKILL)
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_verifier_restarts_total")
                     == 1, timeout=20)
            assert _ready(srv)  # readiness never drops for the verifier
            # Checking again: a new process compares new samples.
            wait_for(lambda: _verifier_pid(srv) != first and srv.verifier.ready.is_set(),
                     timeout=20)
            before = _compared(srv)
            wait_for(lambda: _compared(srv) > before + 5, timeout=20)
        finally:
            traffic.stop.set()
            traffic.join(30)
        assert traffic.errors == []
        assert len(traffic.answers) > 20
        (lost,) = events(caplog, "verifier_lost")
        assert "SIGKILL" in lost["how"]
        wait_for(lambda: events(caplog, "verifier_restarted"))
        # The routes survived: the restarted verifier went on from the route words.
        assert all(route == "primary" for route, _, _ in traffic.answers)


def test_pinned_fallback_survives_a_verifier_restart(tmp_path, rng):
    model = model_block(fallback=affine_backend(),
                        policy={"action": "fallback_model", "window": 10, "min_samples": 5})
    with running(tmp_path, [model], verifier={"restart_backoff_s": 0.2}) as (srv, client):
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.FALLBACK))
            first = _verifier_pid(srv)
            os.kill(first, signal.SIGKILL)
            route = client.infer("m", [x_input(rng.normal(size=(1, 4)))]).get_response() \
                .parameters["guard_route"].string_param
            assert route == "fallback"  # serving goes on on the last route
            wait_for(lambda: _verifier_pid(srv) != first and srv.verifier.ready.is_set(),
                     timeout=20)
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="m")).models[0]
            assert (status.route, status.override) == ("fallback", "fallback")  # still pinned
            # (the new verifier's gauge says so too: it read 0 after a restart)
            assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="m",
                          scope="model") == 1


def test_a_hung_verifier_is_killed_and_restarted_while_serving_goes_on(tmp_path, rng, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    with running(tmp_path, [model_block()],
                 verifier={"hang_timeout_s": 1.0, "restart_backoff_s": 0.2}) as (srv, client):
        client.infer("m", [x_input(rng.normal(size=(1, 4)))])
        wait_for(lambda: _compared(srv) == 1)
        hung = _verifier_pid(srv)
        os.kill(hung, signal.SIGSTOP)  # alive, holding its samples, answering nothing
        try:
            with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
                admin = admin_pb2_grpc.AdminStub(channel)
                for _ in range(5):  # requests keep being answered while it hangs
                    client.infer("m", [x_input(rng.normal(size=(1, 4)))])
                wait_for(lambda: events(caplog, "verifier_lost"), timeout=20)
                # While it is down, status still answers from the route word.
                status = admin.GetStatus(admin_pb2.GetStatusRequest(model="m")).models[0]
                assert status.route == "primary"
        finally:
            try:
                os.kill(hung, signal.SIGCONT)
            except ProcessLookupError:
                pass
        (lost,) = events(caplog, "verifier_lost")
        assert "hung" in lost["how"]
        wait_for(lambda: srv.verifier.ready.is_set() and _verifier_pid(srv) != hung,
                 timeout=20)
        # The samples handed off while it hung waited in the ring: the new one checks them.
        # (Its counters start at zero: a restart is a counter reset, as Prometheus expects.)
        wait_for(lambda: _compared(srv) == 5, timeout=20)


def test_a_full_ring_drops_and_counts_and_every_sample_is_accounted_for(tmp_path, rng):
    """The verifier stops reading (SIGSTOP, hang detection off): the ring fills, further
    samples are dropped and counted, clients are all answered; once it reads again every
    sample is either compared or dropped."""
    with running(tmp_path, [model_block(mirror={"sample_rate": 1.0, "queue_size": 256})],
                 verifier={"ring_bytes": 4096, "hang_timeout_s": 600}) as (srv, client):
        client.infer("m", [x_input(rng.normal(size=(1, 4)))])
        wait_for(lambda: _compared(srv) == 1)
        pid = _verifier_pid(srv)
        os.kill(pid, signal.SIGSTOP)
        try:
            sent = 100
            for _ in range(sent):
                client.infer("m", [x_input(rng.normal(size=(1, 4)))])
            dropped = metric(scrape(srv.metrics_port), "guard_mirror_total", model="m",
                             outcome="dropped")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert 0 < dropped < sent
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="m", outcome="compared") + metric(
            v, "guard_mirror_total", model="m", outcome="dropped") == sent + 1 and v)
        assert metric(values, "guard_requests_total", model="m", route="primary") == sent + 1


def test_a_reference_that_cannot_load_stops_start_up_with_its_error(tmp_path):
    model = model_block(reference={"backend": "torch", "path": "fixture_models:nope"})
    with pytest.raises(Exception) as err:
        with running(tmp_path, [model]):
            pass
    assert "reference" in str(err.value) and "nope" in str(err.value)


def test_expired_deadline_and_concurrency_cap(tmp_path, rng):
    """A request whose deadline passed is not run (DEADLINE_EXCEEDED); past
    max_concurrent_requests a request is RESOURCE_EXHAUSTED (counted), and the server keeps
    serving."""
    import asyncio
    import threading

    from tritonclient.utils import InferenceServerException

    from guard.protocol.codec import InferenceError, decode_request, encode_request

    slow = model_block(primary=affine_backend(sleep_on_trigger=1.0),
                       mirror={"sample_rate": 0.0})
    # inline_below_ms 0: the fast model must not run inline on the event loop here, where
    # one request sleeps inside it while the next one arrives.
    with running(tmp_path, [slow], max_concurrent_requests=1,
                 inline_below_ms=0) as (srv, client):
        request = decode_request(encode_request("m", {"x": np.ones((1, 4), np.float32)}))
        with pytest.raises(InferenceError) as expired:
            asyncio.run(srv.dataplane.infer(request, timeout=0.0))
        assert expired.value.status == "DEADLINE_EXCEEDED"

        sleeper = threading.Thread(target=lambda: client.infer(
            "m", [x_input(np.full((1, 4), fixture_models.SLEEP_TRIGGER))]))
        sleeper.start()
        wait_for(lambda: srv.dataplane.in_flight == 1, timeout=10)
        with pytest.raises(InferenceServerException) as err:
            client.infer("m", [x_input(rng.normal(size=(1, 4)))])
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        sleeper.join(10)
        client.infer("m", [x_input(rng.normal(size=(1, 4)))])
        assert metric(scrape(srv.metrics_port), "guard_request_errors_total", model="m",
                      code="RESOURCE_EXHAUSTED") == 1


@pytest.mark.parametrize("inline_below_ms,expected", [(1000.0, True), (0.0, False)])
def test_the_thread_hop_is_skipped_for_fast_models_and_the_choice_reported(
        tmp_path, rng, caplog, inline_below_ms, expected):
    """server.inline_below_ms: a backend measured faster than it at load runs on the event
    loop; 0 keeps every backend on the worker threads. Answers are the same either way."""
    caplog.set_level(logging.INFO, logger="guard.events")
    model = model_block(fallback=affine_backend(), mirror={"sample_rate": 0.0})
    with running(tmp_path, [model], inline_below_ms=inline_below_ms) as (srv, client):
        assert srv.models["m"].inline == {"primary": expected, "fallback": expected}
        (loaded,) = events(caplog, "model_loaded")
        assert loaded["inline"]["primary"]["inline"] is expected
        assert loaded["inline"]["primary"]["median_ms"] >= 0
        x = rng.normal(size=(2, 4)).astype(np.float32)
        answer = client.infer("m", [x_input(x)]).as_numpy("y")
        assert answer.shape == (2, 3)
