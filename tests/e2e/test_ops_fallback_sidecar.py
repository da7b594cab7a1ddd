"""Selective op fallback end to end: an int8 primary that drifts (the zoo CNN's fc1 outlier),
the detector trips, the repair keeps back a small op set, traffic flows through the swap
without one failed request, agreement is restored, and a manual reset restores the primary as
configured."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient

from guard.v1 import admin_pb2, admin_pb2_grpc
from guard.zoo.classifier import sample_inputs

from support import (event_story, events, image_input, metric, running, scrape,
                     traffic_through_repair)


def test_int8_drift_repaired_by_keeping_fc1_at_fp32(tmp_path, zoo_classifier, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    onnx_path = str(zoo_classifier["onnx"])
    model = {
        "name": "cnn",
        "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx_path, "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": onnx_path},
        "fallback": {"backend": "onnxruntime", "path": onnx_path},
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops", "p0": 0.01, "arl0": 1000, "dwell_s": 600,
                   "repair": {"buffer": 16}},
    }
    images = sample_inputs(32, seed=17)
    expected = ort.InferenceSession(onnx_path).run(None, {"image": images})[0]
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "cnn", image_input, images)
        assert traffic.errors == []
        story = event_story(caplog)
        assert metric(values, "guard_fallback_transitions_total", model="cnn",
                      to="fallback_model") == 1, story
        assert metric(values, "guard_fallback_transitions_total", model="cnn",
                      to="fallback_ops") == 1
        assert metric(values, "guard_fallback_active", model="cnn", scope="model") == 0

        (done,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "repair"]
        kept = done["evidence"]["ops_kept_fp32"]
        assert kept == ["node_linear_MatMul"], done["evidence"]
        assert events(caplog, "repair_started") and not events(caplog, "repair_failed")

        # Agreement restored: what the repaired primary answered is within the tolerance.
        after = [(k, y) for r, k, y in traffic.answers[served_before:] if r == "primary"]
        for k, logits in after:
            scale = np.abs(expected[k]).max()
            assert np.abs(logits - expected[k]).max() <= 0.05 * scale

        # A manual reset: the primary as configured (no ops kept back) answers again.
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="cnn")).models[0]
            assert status.route == "primary", story
            assert "node_linear_MatMul" in status.last_transition.reason
            assert list(status.ops_kept_back) == ["node_linear_MatMul"]
            assert not status.repairing
            reset = admin.SetRoute(admin_pb2.SetRouteRequest(
                model="cnn", route=admin_pb2.PRIMARY, reason="drift fixed upstream")).status
            assert list(reset.ops_kept_back) == []
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_fallback_active", model="cnn", scope="ops") == 0
        (cleared,) = events(caplog, "ops_fallback_cleared")
        assert cleared["ops_kept_fp32"] == ["node_linear_MatMul"]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("cnn", [image_input(images)]).as_numpy("logits")
        client.close()
        beyond = (np.abs(answers - expected).max(axis=1)
                  > 0.05 * np.abs(expected).max(axis=1)).sum()
        assert beyond >= 8  # the configured int8 primary answers again, drift and all
