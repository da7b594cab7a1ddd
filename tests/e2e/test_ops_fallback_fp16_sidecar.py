"""Selective op fallback end to end on an fp16 primary: the seeded pressure model
(tests/fp16_models.py) whose input LayerNorm overflows fp16, served through the sidecar; the
detector trips, the repair keeps back the LayerNorm alone (the fp16 converter's block list),
traffic flows through the swap without one failed request, agreement is restored, and a manual
reset restores the fp16 primary as configured."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient

import fp16_models
from guard.v1 import admin_pb2, admin_pb2_grpc

from support import (event_story, events, metric, running, scrape, traffic_through_repair,
                     x_input)


def test_fp16_overflow_repaired_by_keeping_the_layer_norm_at_fp32(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    onnx_path = str(fp16_models.export(tmp_path / "zoo")["onnx"])
    model = {
        "name": "pressure",
        "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx_path, "precision": "fp16"},
        "reference": {"backend": "onnxruntime", "path": onnx_path},
        "fallback": {"backend": "onnxruntime", "path": onnx_path},
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops", "p0": 0.01, "arl0": 1000, "dwell_s": 600,
                   "repair": {"buffer": 16}},
    }
    rows = fp16_models.sample_inputs(32, seed=17)
    expected = ort.InferenceSession(onnx_path).run(None, {"x": rows})[0]
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "pressure", x_input, rows)
        assert traffic.errors == []
        story = event_story(caplog)
        assert metric(values, "guard_fallback_transitions_total", model="pressure",
                      to="fallback_model") == 1, story
        assert metric(values, "guard_fallback_transitions_total", model="pressure",
                      to="fallback_ops") == 1
        assert metric(values, "guard_fallback_active", model="pressure", scope="model") == 0

        (done,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "repair"]
        assert done["evidence"]["ops_kept_fp32"] == ["node_layer_norm"], done["evidence"]
        assert events(caplog, "repair_started") and not events(caplog, "repair_failed")

        # Every primary answer is either the configured fp16 session's (NaN: the overflow) or
        # the repaired one's (agrees with fp32), and the NaN ones all come first: the swap is
        # one step, with no request answered badly after it.
        primary = [(k, y) for r, k, y in traffic.answers if r == "primary"]
        broken = [np.isnan(y).all() for _, y in primary]
        swap = broken.index(False)
        assert swap >= 1 and not any(broken[swap:]), broken
        for k, logits in primary[swap:]:
            scale = np.abs(expected[k]).max()
            assert np.abs(logits - expected[k]).max() <= 0.05 * scale
            assert logits.argmax() == expected[k].argmax()
        assert len(primary) - swap >= 20

        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="pressure")).models[0]
            assert status.route == "primary", story
            assert list(status.ops_kept_back) == ["node_layer_norm"]
            assert not status.repairing
            reset = admin.SetRoute(admin_pb2.SetRouteRequest(
                model="pressure", route=admin_pb2.PRIMARY, reason="sensor units fixed")).status
            assert list(reset.ops_kept_back) == []
        assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="pressure",
                      scope="ops") == 0
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("pressure", [x_input(rows)]).as_numpy("logits")
        client.close()
        assert np.isnan(answers).all()  # the configured fp16 primary answers again, overflow and all
