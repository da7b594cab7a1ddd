"""A model on its fallback whose fallback server is down: the primary answers (the spill).

The fallback is a real Open Inference Protocol server on a port of its own (a second guard
serving the affine model), stopped and started again on the same port while the guard under
test has the model pinned to its fallback. Without the spill every call was UNAVAILABLE for as
long as the route stayed on the fallback, and probes (which ride on answered calls) could never
have run. Both request paths: a local primary (the parsed path, ``DataPlane.infer``) and an
upstream primary (the bytes path, ``DataPlane.forward``).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from free_ports import free_port
from guard.plan.complete import load_config
from guard.serve.app import BackgroundServer
from guard.v1 import admin_pb2, admin_pb2_grpc
from support import (affine_answers, affine_backend, events, metric, model_block, running,
                     scrape, wait_for, write_config, x_input)


@contextmanager
def oip_server(folder, port: int):
    """A real OIP server on ``port``: a guard serving the affine model as ``m``."""
    folder.mkdir(exist_ok=True)
    config = load_config(write_config(folder, [{"name": "m", "primary": affine_backend()}],
                                      grpc_port=port))
    with BackgroundServer(config) as server:
        yield server


def route_of(result) -> str:
    return result.get_response().parameters["guard_route"].string_param


@pytest.mark.parametrize("primary_upstream", [False, True], ids=["local", "forwarded"])
def test_a_fallback_that_is_down_spills_to_the_primary(tmp_path, monkeypatch, caplog,
                                                       primary_upstream):
    monkeypatch.setattr("guard.serve.dataplane.SKIP_S", 0.5)  # tried again sooner
    caplog.set_level(logging.INFO, logger="guard.events")
    rows = np.arange(4, dtype=np.float32).reshape(1, 4)
    expected = affine_answers(rows)
    fallback_port, primary_port = free_port(), free_port()
    fallback_server = oip_server(tmp_path / "fallback", fallback_port)
    fallback_server.__enter__()
    primary_server = oip_server(tmp_path / "primary", primary_port) if primary_upstream \
        else None
    primary = affine_backend()
    if primary_server is not None:
        primary_server.__enter__()
        primary = {"backend": "upstream", "target": f"127.0.0.1:{primary_port}", "model": "m"}
    block = model_block(primary=primary, fallback={
        "backend": "upstream", "target": f"127.0.0.1:{fallback_port}", "model": "m"})
    try:
        with running(tmp_path, [block]) as (srv, client), \
                grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            assert route_of(client.infer("m", [x_input(rows)])) == "primary"  # sampled
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.FALLBACK))
            answered = client.infer("m", [x_input(rows)])  # (pinned: no probes, not sampled)
            assert route_of(answered) == "fallback"

            fallback_server.__exit__(None, None, None)  # the fallback goes down
            spilled = [client.infer("m", [x_input(rows)]) for _ in range(3)]
            assert [route_of(r) for r in spilled] == ["primary"] * 3
            for result in spilled:
                np.testing.assert_allclose(result.as_numpy("y"), expected, rtol=1e-6)
            (event,) = events(caplog, "fallback_unreachable")  # then skipped, not tried
            assert event["model"] == "m"
            values = scrape(srv.metrics_port)
            assert metric(values, "guard_requests_total", model="m", route="primary") == 4
            assert metric(values, "guard_requests_total", model="m", route="fallback") == 1
            assert sum(v for (name, _), v in values.items()
                       if name == "guard_request_errors_total") == 0
            # The route stays the fallback (pinned): the primary only stands in.
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="m")).models[0]
            assert status.route == "fallback"

            fallback_server = oip_server(tmp_path / "fallback", fallback_port)
            fallback_server.__enter__()  # back on the same port: it serves again
            wait_for(lambda: route_of(client.infer("m", [x_input(rows)])) == "fallback",
                     interval=0.2)

            # The primary standing in was not sampled: the verifier, which takes samples in
            # order, counts the first call's and the last one's, and none between.
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.PRIMARY))
            assert route_of(client.infer("m", [x_input(rows)])) == "primary"
            mirrored = wait_for(lambda: (n := sum(
                v for (name, _), v in scrape(srv.metrics_port).items()
                if name == "guard_mirror_total")) >= 2 and n)
            assert mirrored == 2
    finally:
        fallback_server.__exit__(None, None, None)
        if primary_server is not None:
            primary_server.__exit__(None, None, None)


def test_a_primary_that_is_down_stays_unavailable(tmp_path, caplog):
    """The spill is the fallback's only: a primary no connection can be made to answers
    UNAVAILABLE, counted, and nothing is tried in its stead."""
    caplog.set_level(logging.INFO, logger="guard.events")
    port = free_port()
    server = oip_server(tmp_path / "primary", port)
    server.__enter__()
    block = model_block(primary={"backend": "upstream", "target": f"127.0.0.1:{port}",
                                 "model": "m"}, fallback=affine_backend())
    try:
        with running(tmp_path, [block]) as (srv, client):
            server.__exit__(None, None, None)
            from tritonclient.utils import InferenceServerException

            with pytest.raises(InferenceServerException) as error:
                client.infer("m", [x_input(np.zeros((1, 4), np.float32))])
            assert error.value.status() == "StatusCode.UNAVAILABLE"
            assert metric(scrape(srv.metrics_port), "guard_request_errors_total", model="m",
                          code="UNAVAILABLE") == 1
            assert not events(caplog, "fallback_unreachable")
    finally:
        server.__exit__(None, None, None)


def test_the_route_comes_back_while_the_fallback_is_down(tmp_path):
    """The primary standing in for a fallback that is down is sampled as the fallback's calls
    are (mirrored while the route probes): its answers are the probes, and a primary that is
    clean again routes back. Without them the route stayed on a fallback that was down, no
    probe ever ran, and the primary served every call unchecked."""
    port = free_port()
    fallback_server = oip_server(tmp_path / "fallback", port)
    fallback_server.__enter__()
    block = model_block(fallback={"backend": "upstream", "target": f"127.0.0.1:{port}",
                                  "model": "m"},
                        policy={"action": "fallback_model", "detector": "window", "window": 10,
                                "min_samples": 5, "trip_ratio": 0.2, "recover_ratio": 0.0,
                                "dwell_s": 0.3})
    rows = np.arange(4, dtype=np.float32).reshape(1, 4)
    try:
        with running(tmp_path, [block]) as (srv, client), \
                grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.FALLBACK))
            assert route_of(client.infer("m", [x_input(rows)])) == "fallback"
            fallback_server.__exit__(None, None, None)
            admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.AUTO))

            def routed_back() -> bool:
                client.infer("m", [x_input(rows)])
                status = admin.GetStatus(admin_pb2.GetStatusRequest(model="m")).models[0]
                return status.route == "primary"

            wait_for(routed_back, timeout=60, interval=0.05)
            values = scrape(srv.metrics_port)
            assert metric(values, "guard_mirror_total", model="m", outcome="compared") >= 5
            assert metric(values, "guard_checks_total", model="m", tier="tensor",
                          result="fail") == 0
    finally:
        fallback_server.__exit__(None, None, None)
