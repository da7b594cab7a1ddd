"""Tier 2 through the sidecar: an int8 primary that drifts, a TorchScript reference, a real
server and client. The mirror worker runs tier 2 on tier-1 failures, counts it, and the route
transition carries the first divergent layer (fc1, the layer with the outlier weight)."""

from __future__ import annotations

import logging


from guard.zoo.classifier import sample_inputs

from support import events, image_input, metric, running, scrape, wait_for


def test_int8_drift_is_localised_to_fc1_in_the_route_transition(tmp_path, zoo_classifier, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    onnx = str(zoo_classifier["onnx"])
    model = {
        "name": "cnn",
        "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx, "precision": "int8"},
        "reference": {"backend": "torch", "path": str(zoo_classifier["torchscript"])},
        "fallback": {"backend": "onnxruntime", "path": onnx},
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        # An int8 deployment's tolerance: each convolution's own int8 error (~0.5%) fits in it;
        # under rtol 1e-3 the first convolution would already exceed the budget on its own.
        "checks": {"tensor": {"atol": 1e-4, "rtol": 0.02},
                   "activation": {"on_failure": True, "max_queue_fill": 1.0,
                                  "torch_factory": "guard.zoo.classifier:build"}},
        "policy": {"action": "fallback_model", "detector": "window", "window": 10,
                   "min_samples": 5, "trip_ratio": 0.2, "recover_ratio": 0.0, "dwell_s": 60},
    }
    images = sample_inputs(8, seed=11)
    with running(tmp_path, [model]) as (srv, client):
        for i in range(8):
            client.infer("cnn", [image_input(images[i:i + 1])])
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="cnn", scope="model") == 1 and v)
        assert metric(values, "guard_checks_total", model="cnn", tier="activation",
                      result="fail") >= 1
        assert metric(values, "guard_checks_total", model="cnn", tier="activation",
                      result="pass") == 0
    (transition,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "policy"]
    first = transition["evidence"]["first_divergence"]
    assert (first["layer"], first["module"]) == ("fc1", "fc1")
    suspects = transition["evidence"]["activation"]["suspects"]
    assert suspects[0]["layer"] == "fc1"
    assert "node_linear_MatMul_quant" in suspects[0]["primary_nodes"]
    divergence = events(caplog, "activation_divergence")
    assert divergence and divergence[0]["first_divergence"]["layer"] == "fc1"
