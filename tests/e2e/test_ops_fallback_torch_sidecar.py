"""Selective op fallback end to end on a torch_compile fp16 primary: the seeded sequence
classifier (tests/torch_drift_models.py) whose attention scores overflow fp16, served through
the sidecar; the detector trips, the repair keeps the attention module alone eager in fp32
(``eager_fp32_modules``) inside the compiled fp16 graph, traffic flows through the swap without
one failed request, agreement is restored, and a manual reset restores the compiled fp16
primary as configured."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import torch
import tritonclient.grpc as grpcclient

import torch_drift_models
from guard.v1 import admin_pb2, admin_pb2_grpc

from support import (event_story, events, metric, running, scrape, traffic_through_repair,
                     x_input)

FACTORY = "torch_drift_models:build"


def test_fp16_attention_overflow_repaired_by_keeping_attn_eager_fp32(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    model = {
        "name": "seq",
        "task": "classification",
        "primary": {"backend": "torch_compile", "path": FACTORY, "precision": "fp16"},
        "reference": {"backend": "torch", "path": FACTORY},
        "fallback": {"backend": "torch", "path": FACTORY},
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops", "p0": 0.01, "arl0": 1000, "dwell_s": 600,
                   "repair": {"buffer": 16, "max_candidates": 6}},
    }
    rows = torch_drift_models.sample_inputs(32, seed=17)
    with torch.no_grad():
        expected = torch_drift_models.build()(torch.from_numpy(rows)).numpy()
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "seq", x_input, rows)
        assert traffic.errors == []
        story = event_story(caplog)
        assert metric(values, "guard_fallback_transitions_total", model="seq",
                      to="fallback_model") == 1, story
        assert metric(values, "guard_fallback_transitions_total", model="seq",
                      to="fallback_ops") == 1
        assert metric(values, "guard_fallback_active", model="seq", scope="model") == 0

        (done,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "repair"]
        assert done["evidence"]["ops_kept_fp32"] == ["attn"], done["evidence"]
        assert events(caplog, "repair_started") and not events(caplog, "repair_failed")

        # The compiled fp16 primary answered NaN where the scores overflow; the repaired one
        # (attn eager in fp32) answers every row, within the tolerance of fp32.
        before = [y for r, _, y in traffic.answers[:served_before] if r == "primary"]
        assert any(np.isnan(y).any() for y in before), story
        after = [(k, y) for r, k, y in traffic.answers[served_before:] if r == "primary"]
        assert len(after) >= 20
        for k, logits in after:
            scale = np.abs(expected[k]).max()
            assert np.abs(logits - expected[k]).max() <= 0.05 * scale
            assert logits.argmax() == expected[k].argmax()

        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            status = admin.GetStatus(admin_pb2.GetStatusRequest(model="seq")).models[0]
            assert status.route == "primary", story
            assert list(status.ops_kept_back) == ["attn"]
            assert "attn" in status.last_transition.reason
            assert not status.repairing
            reset = admin.SetRoute(admin_pb2.SetRouteRequest(
                model="seq", route=admin_pb2.PRIMARY, reason="attention rescaled")).status
            assert list(reset.ops_kept_back) == []
        assert metric(scrape(srv.metrics_port), "guard_fallback_active", model="seq",
                      scope="ops") == 0
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("seq", [x_input(rows)]).as_numpy("logits")
        client.close()
        assert np.isnan(answers).any(axis=1).sum() >= 8  # the configured primary, overflow and all
