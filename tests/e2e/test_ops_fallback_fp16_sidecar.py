"""Selective op fallback end to end on an fp16 primary: the seeded pressure model
(tests/fp16_models.py) whose input LayerNorm overflows fp16, served through the sidecar; the
detector trips, the repair keeps back the LayerNorm alone (the fp16 converter's block list),
traffic flows through the swap without one failed request, agreement is restored, and a manual
reset restores the fp16 primary as configured."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient

import fp16_models

from support import (assert_repaired_once, ops_fallback_model, reset_repaired_primary, running,
                     traffic_through_repair, x_input)


def test_fp16_overflow_repaired_by_keeping_the_layer_norm_at_fp32(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    onnx_path = str(fp16_models.export(tmp_path / "zoo")["onnx"])
    model = ops_fallback_model(
        "pressure",
        primary={"backend": "onnxruntime", "path": onnx_path, "precision": "fp16"},
        reference={"backend": "onnxruntime", "path": onnx_path},
        fallback={"backend": "onnxruntime", "path": onnx_path})
    rows = fp16_models.sample_inputs(32, seed=17)
    expected = ort.InferenceSession(onnx_path).run(None, {"x": rows})[0]
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "pressure", x_input, rows)
        evidence = assert_repaired_once(values, traffic, caplog, "pressure")
        assert evidence["ops_kept_fp32"] == ["node_layer_norm"], evidence

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

        reset_repaired_primary(srv, "pressure", ["node_layer_norm"], "sensor units fixed")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("pressure", [x_input(rows)]).as_numpy("logits")
        client.close()
        # The configured fp16 primary answers again, overflow and all.
        assert np.isnan(answers).all()
