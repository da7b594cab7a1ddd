"""``guard replay --engine ray`` on a local Ray cluster: the records are sharded over worker actors,
each with its own backends, and the merged report equals the local engine's: counts, verdicts,
names and every other field exactly, floats within summation-order noise (a worker's backends
may run with other thread counts, and sums merge in another order: on some CPUs that moves the
last bits)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
from guard.cli import main
from guard.config import CaptureConfig
from guard.observe.metrics import GuardMetrics
from guard.replay.report import RUN_DEPENDENT

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'guard[ray]'")

# Error statistics are differences of float32 logits of magnitude up to ~10 (an ulp ~1e-6):
# a last-bit change on either side moves one by about 1e-6, i.e. 1e-5 relative at an error of
# 0.1. A record lost or counted twice would move a mean by about 1% (one of 90 samples).
FLOAT_NOISE = {"rel_tol": 1e-5, "abs_tol": 1e-6}


def assert_same_report(remote, local, where: str = "report") -> None:
    """``remote`` equals ``local`` field for field; floats within ``FLOAT_NOISE``."""
    if isinstance(local, float) or isinstance(remote, float):
        assert isinstance(remote, (int, float)) and isinstance(local, (int, float)), where
        assert not isinstance(remote, bool) and not isinstance(local, bool), where
        assert math.isclose(remote, local, **FLOAT_NOISE), f"{where}: {remote} != {local}"
    elif isinstance(local, dict) and isinstance(remote, dict):
        assert remote.keys() == local.keys(), where
        for key in local:
            assert_same_report(remote[key], local[key], f"{where}.{key}")
    elif isinstance(local, list) and isinstance(remote, list):
        assert len(remote) == len(local), where
        for k, (r, l_) in enumerate(zip(remote, local)):
            assert_same_report(r, l_, f"{where}[{k}]")
    else:
        assert remote == local, f"{where}: {remote!r} != {local!r}"


def test_ray_engine_report_equals_local_engine(tmp_path, zoo_classifier):
    from guard.zoo.classifier import sample_inputs

    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [{
        "name": "cnn", "task": "classification",
        # int8 drifts on this model (its fc1 outlier): a report with passes and failures.
        "primary": {"backend": "onnxruntime", "path": str(zoo_classifier["onnx"]),
                    "precision": "int8"},
        "reference": {"backend": "torch", "path": str(zoo_classifier["torchscript"])},
        "checks": {"tensor": {"atol": 0.6, "rtol": 0.0}},  # about half pass
    }]}))
    images = sample_inputs(90, seed=7)
    writer = CaptureWriter("cnn", CaptureConfig(dir=str(tmp_path / "cap"),
                                                max_segment_bytes=200_000),
                           GuardMetrics("test"), {})
    writer.start()
    start, i = 0, 0
    while start < 60:  # 60 images in requests of 1-3
        size = 1 + i % 3
        x = images[start:start + size]
        writer.submit(PendingRecord(CaptureTag(f"r{i}", 1_700_000_000 * 10**9 + i * 10**9,
                                               0.001, True), "primary", 0, {"image": x},
                                    {"logits": np.zeros((len(x), 10), np.float32)}))
        start, i = start + size, i + 1
    writer.close()
    np.savez(tmp_path / "set.npz", image=images[60:])
    inputs = [str(tmp_path / "cap"), str(tmp_path / "set.npz")]
    assert len(list((tmp_path / "cap" / "cnn").glob("*.gcap"))) > 1

    reports = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        code = main(["replay", "--config", str(config), *inputs, "--report-dir", str(out),
                     "--engine", engine, "--batch-size", "8", "--quiet"])
        reports[engine] = (code, json.loads((out / "report.json").read_text()))
    assert not ray.is_initialized()  # the engine shut down the cluster it started

    (local_code, local), (ray_code, remote) = reports["local"], reports["ray"]
    assert remote["engine"] == {"name": "ray", "workers": 2}
    for key in RUN_DEPENDENT:
        local.pop(key), remote.pop(key)
    assert ray_code == local_code
    assert_same_report(remote, local)
    cnn = local["models"]["cnn"]
    assert cnn["samples"] == i + 30
    tensor = cnn["tiers"]["tensor"]
    assert 0 < tensor["passed"] < tensor["checks"] == cnn["samples"]
    task = cnn["tiers"]["task"]  # tier 3 (classification) runs in replay as in the sidecar
    assert task["checks"] == cnn["samples"] and 0 < task["metrics"]["top1_agreement"] <= 1
    assert cnn["tiers_run"] == ["tensor", "task"]
