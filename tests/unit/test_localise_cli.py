"""``guard localise``: tier 2 on one input from the command line (guard/localise.py), on a
tensor model here (a seeded MLP exported to ONNX, its copy with one layer perturbed as the
primary: real ONNX Runtime sessions); the GGUF path is exercised by
tests/unit/test_activation_gguf.py and tests/e2e/test_llm_layer.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from guard.cli import main
from guard.zoo import faults


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("localise")
    clean = faults.export(faults.mlp(0), folder / "clean.onnx", faults.mlp_inputs(2, 0), ["y"])
    faults.perturb_weight(clean, folder / "broken.onnx", "/fc2/Gemm", 0.05, 0)
    np.savez(folder / "inputs.npz", **faults.mlp_inputs(8, 0))
    return folder


def _config(folder, primary: str, **model) -> str:
    doc = {"version": 1, "models": [{
        "name": "mlp", "primary": {"backend": "onnxruntime", "path": primary},
        "reference": {"backend": "onnxruntime", "path": "clean.onnx"}, **model}]}
    path = folder / f"guard-{primary}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_perturbed_layer_is_named_with_exit_1(pair, capsys):
    config = _config(pair, "broken.onnx")
    assert main(["localise", config, "--inputs", str(pair / "inputs.npz")]) == 1
    out = capsys.readouterr().out
    assert "first divergence: /fc2/Gemm (Gemm)" in out and "suspect 1: /fc2/Gemm" in out
    assert main(["localise", "--config", config, "--inputs", str(pair / "inputs.npz"),
                 "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "mlp" and report["first_divergence"]["layer"] == "/fc2/Gemm"
    assert len(report["layers"]) > 4


def test_a_clean_pair_exits_0(pair, capsys):
    assert main(["localise", _config(pair, "clean.onnx"), "--inputs",
                 str(pair / "inputs.npz")]) == 0
    assert "first divergence: none" in capsys.readouterr().out


def test_usage_errors_say_what_to_give(pair, capsys):
    config = _config(pair, "broken.onnx")
    assert main(["localise", config, "--prompt", "hello"]) == 2
    assert "takes tensors: give --inputs FILE.npz" in capsys.readouterr().err
    assert main(["localise", config, "--model", "other", "--inputs", "x.npz"]) == 2
    assert "no model 'other'" in capsys.readouterr().err
    assert main(["localise", config, "--inputs", str(pair / "missing.npz")]) == 2
    assert "missing.npz: not a readable .npz file" in capsys.readouterr().err


@pytest.mark.parametrize("arrays, says", [
    ({"input": np.zeros((2, 16), np.float32)}, "array 'input' is not an input of model 'mlp'"),
    ({"x": np.zeros((2, 16), np.float64)}, "array 'x' holds float64 (FP64), input 'x' takes FP32"),
    ({"x": np.zeros((2, 8), np.float32)}, "array 'x': samples of shape [1, 8] do not fit"),
])
def test_inputs_that_do_not_fit_the_model_are_named_before_any_capture(pair, capsys, tmp_path,
                                                                        arrays, says):
    """Checked as replay checks an .npz (it was the capture side's own error, after a report
    that said no layer diverged)."""
    path = tmp_path / "inputs.npz"
    np.savez(path, **arrays)
    assert main(["localise", _config(pair, "broken.onnx"), "--inputs", str(path)]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and captured.out == ""
