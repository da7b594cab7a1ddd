"""Tap mode end to end: a 'model server' (this test) answers its clients itself, hands each
answered request to guard's Observe over gRPC, and follows guard's WatchRoute stream."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch
from tritonclient.grpc import service_pb2 as oip

from fixture_models import DRIFT_TRIGGER, Affine
from guard.protocol.codec import encode_request, encode_response, decode_request
from guard.v1 import tap_pb2, tap_pb2_grpc
from support import affine_backend, metric, model_block, running, scrape

TAP = {"host": "127.0.0.1", "port": 0}  # server.tap: the Tap listener, loopback


def served(model: Affine, rows: np.ndarray, request_id: str) -> tap_pb2.ObserveRequest:
    """What the server does per client request: answer it, then tell guard what it answered."""
    request = encode_request("m", {"x": rows.astype(np.float32)}, request_id=request_id)
    with torch.inference_mode():
        y = model(torch.from_numpy(rows.astype(np.float32))).numpy()
    response = encode_response(decode_request(request), {"y": y}, "primary")
    return tap_pb2.ObserveRequest(request=request.SerializeToString(),
                                  response=response.SerializeToString())


def test_observe_and_watch_route(tmp_path, rng):
    block = model_block(
        primary=affine_backend(drift_on_trigger=True), fallback=affine_backend(),
        policy={"action": "fallback_model", "detector": "window", "window": 10,
                "min_samples": 5, "trip_ratio": 0.2,
                "recover_ratio": 0.0, "dwell_s": 60},
        tap=True,
    )
    server_model = Affine(drift_on_trigger=True)  # the server's own (drifting) primary
    with running(tmp_path, [block], tap=TAP) as (srv, _):
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.tap_port}")
        tap = tap_pb2_grpc.TapStub(channel)
        updates = tap.WatchRoute(tap_pb2.WatchRouteRequest(model="m"))
        first = next(updates)
        assert (first.model, first.route) == ("m", "primary")

        received = []
        reader = threading.Thread(target=lambda: received.append(next(updates)), daemon=True)
        reader.start()

        clean = rng.normal(size=(1, 4))
        reply = tap.Observe(served(server_model, clean, "c-1"))
        assert reply.sampled and reply.route == "primary"
        for i in range(5):
            tap.Observe(served(server_model, np.full((1, 4), DRIFT_TRIGGER), f"d-{i}"))
        reader.join(30)
        assert received and received[0].route == "fallback"
        assert "drift ratio" in received[0].reason
        values = scrape(srv.metrics_port)
        # The 4th drifting sample trips the window (4/5 > 0.2); whether the 5th is checked before
        # the new epoch starts is a race, so it may or may not be counted.
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="fail") >= 4
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="pass") == 1
        assert metric(values, "guard_requests_total", model="m", route="primary") == 6
        assert tap.Observe(served(server_model, clean, "c-2")).route == "fallback"
        updates.cancel()
        channel.close()


def test_observe_rejects_bad_messages(tmp_path):
    with running(tmp_path, [model_block(tap=True)], tap=TAP) as (srv, _):
        with grpc.insecure_channel(f"127.0.0.1:{srv.tap_port}") as channel:
            tap = tap_pb2_grpc.TapStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                tap.Observe(tap_pb2.ObserveRequest(request=b"\xff\xff not protobuf"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            unknown = oip.ModelInferRequest(model_name="nope").SerializeToString()
            with pytest.raises(grpc.RpcError) as err:
                tap.Observe(tap_pb2.ObserveRequest(request=unknown))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as err:
                tap.Observe(tap_pb2.ObserveRequest(served_by="elsewhere"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as err:
                next(tap.WatchRoute(tap_pb2.WatchRouteRequest(model="nope")))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
