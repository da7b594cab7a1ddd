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
    assert (out["reshaped"]["failure_type"] == "shape"
            and "parts.0: shape" in out["reshaped"]["reason"])
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
    # What the backend said at load rides in the record: how the int8 kernels run here.
    assert int8["backend_details"]["providers"] == "CPUExecutionProvider"
    assert int8["backend_details"]["int8_kernels"].startswith(("exact", "saturating"))
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
    assert apart.details == here.details  # what the backend said at load comes back too
    for a, b in zip(here.outputs, apart.outputs):
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    broken = BackendConfig.model_validate({"backend": "torch", "path": "fixture_models:nope"})
    broken.context = ConfigContext(base_dir=TESTS)
    assert run_apart(broken, "primary", 1, samples).error.startswith("load failed")


def own_matrix(tmp_path: Path, reference: dict) -> Path:
    """The matrix of a user's own export (tests/own_model.py: a TorchScript without guard.json,
    whose output is output0, and its ONNX export naming it scores), written to a folder the
    user names on the command line."""
    import own_model

    paths = own_model.export(tmp_path / "models")
    return write(tmp_path, {
        "version": 1, "name": "mine", "reference": reference,
        "models": [{"name": "net", "task": "classification",
                    "torchscript": str(paths["torchscript"]), "onnx": str(paths["onnx"]),
                    "inputs": {"samples": 4, "batch": 2}}],
        "backends": [{"name": "torch_fp32", "backend": "torch"},
                     {"name": "torch_compile", "backend": "torch_compile"},
                     {"name": "ort_fp32", "backend": "onnxruntime"}],
        "tolerances": {"atol": [1e-4], "rtol": [1e-4]},
    })


def test_your_own_torchscript_and_onnx_need_no_signature_file(tmp_path, capsys):
    """No guard.json: the inputs come from the ONNX column's signature and output0 is matched
    to scores by position, as guard serve matches them; every fp32 column passes."""
    path = own_matrix(tmp_path, {"backend": "torch"})
    out = tmp_path / "my-results"
    assert main(["matrix", str(path), "--output-dir", str(out), "--quiet"]) == 0
    recs = {(r["backend"], r["tier"]): r for r in records(out)}
    # torch.compile takes a .pt2 or a factory, never TorchScript: a skip that says so.
    compiled = recs.pop(("torch_compile", "tensor"))
    assert compiled["status"] == "skip" and "torch.export program (.pt2)" in compiled["reason"]
    recs.pop(("torch_compile", "task"))
    assert {r["status"] for r in recs.values()} == {"pass"}, recs
    assert recs[("ort_fp32", "tensor")]["outputs_matched"] == {"output0": "scores"}
    assert "outputs_matched" not in recs[("torch_fp32", "tensor")]
    assert recs[("ort_fp32", "tensor")]["stats"]["outputs"] == 1
    assert not (tmp_path / "out").exists()  # only where --output-dir says


def test_options_set_on_the_reference_reach_the_torch_columns(tmp_path):
    """The reference names the TorchScript's output scores (options.output_names): the torch
    columns read the same file and get the same names (they compared output0 against scores)."""
    path = own_matrix(tmp_path, {"backend": "torch", "options": {"output_names": ["scores"]}})
    out = tmp_path / "named"
    assert main(["matrix", str(path), "--output-dir", str(out), "--quiet",
                 "--backends", "torch_fp32,ort_fp32"]) == 0
    recs = {(r["backend"], r["tier"]): r for r in records(out)}
    torch_fp32 = recs[("torch_fp32", "tensor")]
    assert torch_fp32["status"] == "pass", torch_fp32["reason"]
    assert torch_fp32["options"] == {"output_names": ["scores"]}  # what the column ran with
    assert "outputs_matched" not in recs[("ort_fp32", "tensor")]  # same names: nothing to match


def test_a_reference_naming_its_inputs_otherwise_says_how_to_name_them(tmp_path, capsys):
    """nn.Sequential's forward(input) against an ONNX export whose input is x: the sweep says
    which option names them alike; with it, the reference and the torch columns take x."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    example = torch.randn(2, 8)
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(model, example), str(tmp_path / "seq.pt"))
        torch.onnx.export(model, (example,), str(tmp_path / "seq.onnx"), dynamo=False,
                          input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    doc = {"version": 1, "reference": {"backend": "torch"},
           "models": [{"name": "seq", "torchscript": "seq.pt", "onnx": "seq.onnx",
                       "inputs": {"samples": 2}}],
           "backends": [{"name": "torch_bf16", "backend": "torch", "precision": "bf16"},
                        {"name": "ort", "backend": "onnxruntime"}],
           "tolerances": {"atol": [1e-4], "rtol": [1e-4]}}
    assert main(["matrix", str(write(tmp_path, doc)), "--output-dir", str(tmp_path / "a")]) == 1
    assert ("the reference declares no datatypes or shapes for its inputs [input], and ort's "
            "signature, which could give them, names them [x]: name the reference's inputs "
            "alike (reference.options.input_names: [x]") in capsys.readouterr().out
    doc["reference"]["options"] = {"input_names": ["x"]}
    main(["matrix", str(write(tmp_path, doc)), "--output-dir", str(tmp_path / "b"), "--quiet"])
    recs = {r["backend"]: r for r in records(tmp_path / "b")}
    assert recs["ort"]["status"] == "pass"
    assert recs["torch_bf16"]["options"] == {"input_names": ["x"]}
    assert recs["torch_bf16"]["failure_type"] in (None, "numeric")  # it ran: bf16 may drift
