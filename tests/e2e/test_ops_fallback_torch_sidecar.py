"""Selective op fallback end to end on a torch_compile fp16 primary: the seeded sequence
classifier (tests/torch_drift_models.py) whose attention scores overflow fp16, served through
the sidecar; the detector trips, the repair keeps the attention module alone eager in fp32
(``eager_fp32_modules``) inside the compiled fp16 graph, traffic flows through the swap without
one failed request, agreement is restored, and a manual reset restores the compiled fp16
primary as configured."""

from __future__ import annotations

import logging

import numpy as np
import torch
import tritonclient.grpc as grpcclient

import torch_drift_models

from support import (assert_repaired_once, ops_fallback_model, reset_repaired_primary, running,
                     traffic_through_repair, x_input)

FACTORY = "torch_drift_models:build"


def test_fp16_attention_overflow_repaired_by_keeping_attn_eager_fp32(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    model = ops_fallback_model(
        "seq",
        primary={"backend": "torch_compile", "path": FACTORY, "precision": "fp16"},
        reference={"backend": "torch", "path": FACTORY},
        fallback={"backend": "torch", "path": FACTORY}, max_candidates=6)
    rows = torch_drift_models.sample_inputs(32, seed=17)
    with torch.no_grad():
        expected = torch_drift_models.build()(torch.from_numpy(rows)).numpy()
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "seq", x_input, rows)
        evidence = assert_repaired_once(values, traffic, caplog, "seq")
        assert evidence["ops_kept_fp32"] == ["attn"], evidence

        # The compiled fp16 primary answered NaN where the scores overflow; the repaired one
        # (attn eager in fp32) answers every row, within the tolerance of fp32.
        before = [y for r, _, y in traffic.answers[:served_before] if r == "primary"]
        assert any(np.isnan(y).any() for y in before)
        after = [(k, y) for r, k, y in traffic.answers[served_before:] if r == "primary"]
        assert len(after) >= 20
        for k, logits in after:
            scale = np.abs(expected[k]).max()
            assert np.abs(logits - expected[k]).max() <= 0.05 * scale
            assert logits.argmax() == expected[k].argmax()

        status = reset_repaired_primary(srv, "seq", ["attn"], "attention rescaled")
        assert "attn" in status.last_transition.reason
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("seq", [x_input(rows)]).as_numpy("logits")
        client.close()
        assert np.isnan(answers).any(axis=1).sum() >= 8  # the configured primary, overflow and all
