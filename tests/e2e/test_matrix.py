"""``guard matrix`` end to end: real backends, JSONL records, summary, heat map, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from guard.cli import main

TESTS = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]


def test_structured_outputs_are_compared_never_passed_unseen(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(TESTS))
    torch_with = lambda name, **kw: {"name": name, "backend": "torch",  # noqa: E731
                                     "options": {"kwargs": kw}}
    doc = {
        "version": 1, "name": "structured", "output_dir": "out",
        "models": [{"name": "nested", "factory": "matrix_fixtures:structured",
                    "inputs": {"samples": 3, "batch": 2}}],
        "backends": [torch_with("same"), torch_with("bumped", bump=0.5),
                     torch_with("reshaped", shape_change=True), torch_with("flattened", flat=True)],
        "tolerances": {"atol": [1e-3], "rtol": [0.0]},
    }
    assert main(["matrix", str(write(tmp_path, doc)), "--quiet"]) == 1
    out = {r["backend"]: r for r in records(tmp_path / "out")}
    assert set(out) == {"same", "bumped", "reshaped", "flattened"}
    assert all(r["tier"] == "tensor" for r in out.values())  # generic: tier 1 only
    assert out["same"]["status"] == "pass" and out["same"]["stats"]["outputs"] == 3
    bumped = out["bumped"]
    assert bumped["failure_type"] == "numeric" and "parts.1: max abs error 0.5" in bumped["reason"]
    assert "parts.0" not in bumped["reason"] and "sum" not in bumped["reason"]
    assert out["reshaped"]["failure_type"] == "shape" and "parts.0: shape" in out["reshaped"]["reason"]
    flat = out["flattened"]
    assert flat["failure_type"] == "shape"
    assert "parts: reference lacks this output" in flat["reason"]
    assert "parts.0: primary lacks this output" in flat["reason"]
    assert "1/4 checks pass" in capsys.readouterr().out


def test_zoo_sweep_writes_records_summary_and_heat_map(tmp_path):
    doc = {
        "version": 1, "name": "small", "output_dir": "res",
        "models": [{"name": "resnet", "zoo": "resnet", "inputs": {"samples": 4, "batch": 4}}],
        "backends": [{"name": "ort_fp32", "backend": "onnxruntime"},
                     {"name": "ort_int8", "backend": "onnxruntime", "precision": "int8"}],
        "tolerances": {"atol": [1e-6, 1e-3], "rtol": [1e-5]},
    }
    assert main(["matrix", str(write(tmp_path, doc)), "--quiet"]) == 1
    folder = tmp_path / "res"
    recs = records(folder)
    assert len(recs) == 1 * 2 * 2 * 2  # models x backends x tolerances x tiers
    first = recs[0]
    for key in ("model", "backend", "backend_kind", "precision", "atol", "rtol", "tier",
                "status", "failure_type", "stats", "latency", "environment", "samples"):
        assert key in first, key
    assert {"torch", "onnxruntime", "cpu", "cores"} <= set(first["environment"])
    by = {(r["backend"], r["atol"], r["tier"]): r for r in recs}
    assert by[("ort_fp32", 1e-3, "tensor")]["status"] == "pass"
    assert by[("ort_fp32", 1e-3, "task")]["status"] == "pass"
    int8 = by[("ort_int8", 1e-3, "tensor")]
    assert int8["status"] == "fail" and int8["failure_type"] == "numeric"
    assert int8["stats"]["max_abs"] > 1e-2
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["checks"] == 8 and 0 < summary["passed"] < 8
    assert summary["cells"]["resnet|ort_int8"]["checks"] == 4
    assert "## Pass rate by tolerance" in (folder / "summary.md").read_text()
    assert (folder / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_matrix_config_exits_2_with_dotted_paths(tmp_path, capsys):
    doc = {"version": 1, "models": [{"name": "m", "zoo": "nope"}],
           "backends": [{"name": "b", "backend": "onnxruntime", "precisionn": "int8"}],
           "tolerances": {"atol": [1e-3], "rtol": [0.0]}}
    assert main(["matrix", str(write(tmp_path, doc))]) == 2
    err = capsys.readouterr().err
    assert "backends[0].precisionn: unknown key" in err
    doc["backends"][0].pop("precisionn")
    assert main(["matrix", str(write(tmp_path, doc))]) == 2
    assert "models[0].zoo: unknown zoo model 'nope'" in capsys.readouterr().err
    assert main(["matrix", str(tmp_path / "missing.yaml")]) == 2


def test_a_column_in_a_process_of_its_own_answers_as_in_the_sweep(tmp_path):
    """``process: own`` (Keras on another Keras backend, any process-wide setting): the child
    process runs the same block on the same samples; the answers come back unchanged."""
    import numpy as np

    from guard.config import BackendConfig, ConfigContext
    from guard.matrix.apart import run_apart
    from guard.matrix.runner import run_backend

    spec = BackendConfig.model_validate({"backend": "torch", "path": "fixture_models:affine"})
    spec.context = ConfigContext(base_dir=TESTS)
    rng = np.random.default_rng(0)
    samples = [{"x": rng.normal(size=(2, 4)).astype(np.float32)} for _ in range(3)]
    here = run_backend(spec, "primary", 1, samples)
    apart = run_apart(spec, "primary", 1, samples)
    assert apart.error == "" and len(apart.outputs) == 3
    for a, b in zip(here.outputs, apart.outputs):
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    broken = BackendConfig.model_validate({"backend": "torch", "path": "fixture_models:nope"})
    broken.context = ConfigContext(base_dir=TESTS)
    assert run_apart(broken, "primary", 1, samples).error.startswith("load failed")
