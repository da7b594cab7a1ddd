"""Tiers 1 and 3 through the real sidecar: the zoo CNN served by ONNX Runtime, checked against
its TorchScript reference; task-tier checks in /metrics, the noise floor, fp64 arbitration."""

from __future__ import annotations

import json
import logging

import tritonclient.grpc as grpcclient

from guard.zoo.classifier import sample_inputs

from support import metric, running, scrape, wait_for


def cnn_model(paths, precision="fp32", **checks) -> dict:
    return {
        "name": "cnn",
        "task": "classification",
        "primary": {"backend": "onnxruntime", "path": str(paths["onnx"]), "precision": precision},
        "reference": {"backend": "torch", "path": str(paths["torchscript"])},
        "mirror": {"sample_rate": 1.0, "queue_size": 64, "timeout_s": 10.0},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-4, **checks}},
        "policy": {"action": "alert", "detector": "window", "window": 20, "min_samples": 5},
    }


def send(client, count: int, rows: int = 8) -> None:
    for i in range(count):
        images = sample_inputs(rows, seed=100 + i)
        tensor = grpcclient.InferInput("image", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        client.infer("cnn", [tensor], request_id=f"r{i}")


def compared(srv, count):
    return wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
        v, "guard_mirror_total", model="cnn", outcome="compared") >= count and v, timeout=60)


def test_classification_task_tier_is_counted_in_metrics(tmp_path, zoo_classifier, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    with running(tmp_path, [cnn_model(zoo_classifier)]) as (srv, client):
        send(client, 6)
        values = compared(srv, 6)
        for tier in ("tensor", "task"):
            assert metric(values, "guard_checks_total", model="cnn", tier=tier,
                          result="pass") == 6, tier
            assert metric(values, "guard_checks_total", model="cnn", tier=tier,
                          result="fail") == 0, tier
        assert ("guard_drift_ratio", (("model", "cnn"), ("tier", "task"))) in values
        # Measured in the verifier process at load, reported through the serving process.
        (floor,) = [json.loads(r.getMessage()) for r in caplog.records
                    if r.name == "guard.events" and '"noise_floor"' in r.getMessage()]
        assert not floor["skipped"] and floor["model"] == "cnn"
        assert floor["comparisons"] == ["batch 1 vs batch 4", "threads 1 vs 2"]
        assert set(floor["per_output"]) == {"logits"} and floor["per_output"]["logits"] < 1e-4


def test_int8_primary_fails_the_task_tier_and_the_arbiter_blames_it(tmp_path, zoo_classifier,
                                                                    caplog):
    model = cnn_model(zoo_classifier, precision="int8",
                      arbitration={"enabled": True, "multiplier": 2.0})
    with caplog.at_level(logging.INFO, logger="guard.events"):
        with running(tmp_path, [model]) as (srv, client):
            send(client, 6, rows=16)
            values = compared(srv, 6)
    assert metric(values, "guard_checks_total", model="cnn", tier="tensor", result="fail") == 6
    task_fail = metric(values, "guard_checks_total", model="cnn", tier="task", result="fail")
    task_pass = metric(values, "guard_checks_total", model="cnn", tier="task", result="pass")
    assert task_fail + task_pass == 6 and task_fail >= 1  # int8 flips real top-1 classes
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "guard.events"]
    verdicts = [e["verdict"] for e in events if e["event"] == "arbitration"]
    assert len(verdicts) == 6
    assert all(v["wrong"] == "primary" for v in verdicts), verdicts
    assert all(v["primary_error"] > 10 * v["reference_error"] for v in verdicts)
    floors = [e for e in events if e["event"] == "noise_floor"]
    assert floors and floors[0]["model"] == "cnn" and "logits" in floors[0]["per_output"]
