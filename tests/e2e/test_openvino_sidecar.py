"""The sidecar with an OpenVINO primary beside an ONNX Runtime reference: real gRPC server,
real tritonclient, OpenVINO's CPU plugin, the verifier process comparing every request."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

pytest.importorskip("openvino")

from support import metric, running, scrape, wait_for  # noqa: E402


def test_openvino_primary_checked_against_onnxruntime(tmp_path, zoo_classifier):
    from guard.zoo.classifier import sample_inputs

    onnx = str(zoo_classifier["onnx"])
    model = {
        "name": "cnn",
        "primary": {"backend": "openvino", "path": onnx},
        "reference": {"backend": "onnxruntime", "path": onnx},
        "mirror": {"sample_rate": 1.0, "queue_size": 64, "timeout_s": 10.0},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-4}},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    images = sample_inputs(8, seed=5)
    expected = ort.InferenceSession(onnx).run(None, {"image": images})[0]
    with running(tmp_path, [model]) as (srv, client):
        for i in range(6):
            tensor = grpcclient.InferInput("image", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images)
            result = client.infer("cnn", [tensor], request_id=f"r-{i}")
            # Pinned f32: OpenVINO's answer is ONNX Runtime's up to summation order.
            np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-4, atol=1e-4)
            assert result.get_response().parameters["guard_route"].string_param == "primary"
        meta = client.get_model_metadata("cnn")
        assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == [
            ("image", "FP32", [-1, 3, 32, 32])]
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="cnn", outcome="compared") == 6 and v, timeout=60)
        assert metric(values, "guard_checks_total", model="cnn", tier="tensor",
                      result="pass") == 6
        assert metric(values, "guard_fallback_active", model="cnn", scope="model") == 0
