"""Selective op fallback end to end: an int8 primary that drifts (the zoo CNN's fc1 outlier),
the detector trips, the repair keeps back a small op set (fc1 and what else this CPU's int8
kernels need: see tests/repair_cases.py), traffic flows through the swap without one failed
request, agreement is restored, and a manual reset restores the primary as configured."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient

from guard.zoo.classifier import sample_inputs

from repair_cases import ZOO_CNN_FAULT, assert_minimal, repair_case
from support import (assert_repaired_once, events, image_input, ops_fallback_model,
                     reset_repaired_primary, running, traffic_through_repair)


def test_int8_drift_repaired_by_keeping_fc1_at_fp32(tmp_path, zoo_classifier, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    onnx_path = str(zoo_classifier["onnx"])
    model = ops_fallback_model(
        "cnn",
        primary={"backend": "onnxruntime", "path": onnx_path, "precision": "int8"},
        reference={"backend": "onnxruntime", "path": onnx_path},
        fallback={"backend": "onnxruntime", "path": onnx_path})
    images = sample_inputs(32, seed=17)
    expected = ort.InferenceSession(onnx_path).run(None, {"image": images})[0]
    with running(tmp_path, [model]) as (srv, _):
        values, traffic, served_before = traffic_through_repair(srv, "cnn", image_input, images)
        evidence = assert_repaired_once(values, traffic, caplog, "cnn")
        # The verifier's load event says how the int8 primary's kernels run on this CPU.
        loaded = events(caplog, "model_verifier_loaded")[0]
        assert loaded["details"]["primary"]["int8_kernels"].startswith(("exact", "saturating"))
        assert loaded["details"]["reference"]["providers"] == "CPUExecutionProvider"
        kept = evidence["ops_kept_fp32"]
        assert ZOO_CNN_FAULT in kept, evidence

        # Agreement restored: what the repaired primary answered is within the tolerance.
        after = [(k, y) for r, k, y in traffic.answers[served_before:] if r == "primary"]
        for k, logits in after:
            scale = np.abs(expected[k]).max()
            assert np.abs(logits - expected[k]).max() <= 0.05 * scale

        # A manual reset: the primary as configured (no ops kept back) answers again.
        status = reset_repaired_primary(srv, "cnn", kept, "drift fixed upstream")
        assert all(op in status.last_transition.reason for op in kept)
        (cleared,) = events(caplog, "ops_fallback_cleared")
        assert cleared["ops_kept_fp32"] == kept
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        answers = client.infer("cnn", [image_input(images)]).as_numpy("logits")
        client.close()
        beyond = (np.abs(answers - expected).max(axis=1)
                  > 0.05 * np.abs(expected).max(axis=1)).sum()
        assert beyond >= 8  # the configured int8 primary answers again, drift and all

    # The set is minimal: without any one of its ops the rebuilt primary fails the model's
    # checks on some of the traffic's rows (the repair validated on the buffered part of them).
    assert_minimal(repair_case(model, tmp_path, "image", images), kept)
