"""Tier 2 on Keras sides (guard/backends/activations/keras.py, keras_align.py), on the
CrossedWires port cases of the zoo (guard/zoo/keras_port.py): a torch CNN and its Keras ports
with the same seeded weights. Each port bug is named at its own layer, against the torch
reference and against the faithful port; clean pairs name none. One process: torch and Keras
on TensorFlow; the exports are built once per module."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from guard.config import ModelConfig  # noqa: E402
from guard.plan.complete import parse_config  # noqa: E402
from guard.errors import ConfigError  # noqa: E402
from guard.verify.activation import ActivationChecker  # noqa: E402
from guard.zoo import zoo_entry  # noqa: E402
from guard.zoo.keras_port import BUGS  # noqa: E402

VARIANTS = ("keras_port", *(f"keras_port_{bug}" for bug in BUGS))
TORCH = {"backend": "torch", "path": "guard.zoo.keras_port:build"}  # the eager reference
# Where each bug is: the layer whose own computation differs from torch's.
BUG_LAYER = {"padding": "conv2", "bn_epsilon": "bn1", "flatten": "fc"}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ports")
    return {name: zoo_entry(name).export(folder, 0) for name in VARIANTS}


def keras(paths: dict, **options) -> dict:
    return {"backend": "keras", "path": str(paths["keras"]),
            **({"options": options} if options else {})}


def check(reference: dict, primary: dict, rows: int = 4):
    config = ModelConfig.model_validate({
        "name": "port", "task": "classification", "primary": primary, "reference": reference,
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5},
                   "activation": {"on_failure": True}}})
    checker = ActivationChecker.for_model(config)
    try:
        return checker.check(zoo_entry("keras_port").sample_inputs(rows, 7))
    finally:
        checker.close()


def test_the_faithful_port_is_blamed_nowhere(exports):
    paths = exports["keras_port"]
    for reference, primary in ((TORCH, keras(paths)), (keras(paths), TORCH),
                               (keras(paths), keras(paths))):
        report = check(reference, primary)
        assert report.passed and report.first_divergence is None, report.summary()
        assert not report.error
        assert len(report.layers) >= 4  # conv1, bn1, conv2, fc at least
        assert all(layer.isolated is not None and layer.isolated.rel_error < 1e-5
                   for layer in report.layers), report.as_dict()["layers"]


@pytest.mark.parametrize("bug", BUGS)
def test_a_torch_reference_names_each_port_bug_at_its_layer(exports, bug):
    report = check(TORCH, keras(exports[f"keras_port_{bug}"]))
    assert report.pair == "torch/keras"
    assert not report.passed, report.summary()
    assert report.first_divergence.name == BUG_LAYER[bug]
    assert report.suspects[0].name == BUG_LAYER[bug]
    assert all(not s.divergent for s in report.suspects[1:])
    # The port's own layers without a torch module (Permutes, the ReLUs torch computes in
    # forward, the padding) are primary-only, never unaligned or blamed.
    assert "to_nhwc" in report.primary_only and not report.unaligned


def test_the_padding_bug_is_isolated_on_what_torch_feeds_the_convolution(exports):
    """The faulty port has no ZeroPadding2D: its conv2 reads relu1 (16x16) where the faithful
    port's reads pad2 (18x18). Each is fed torch's bn1 output through its own layers in front:
    the faithful one pads and matches torch, the faulty one pads 0 before, 1 after."""
    faithful = check(TORCH, keras(exports["keras_port"]))
    faulty = check(TORCH, keras(exports["keras_port_padding"]))
    conv = {r: next(layer for layer in report.layers if layer.name == "conv2")
            for r, report in (("faithful", faithful), ("faulty", faulty))}
    assert conv["faithful"].primary_nodes == ["relu1", "pad2", "conv2"]
    assert conv["faulty"].primary_nodes == ["relu1", "conv2"]
    assert conv["faithful"].isolated.rel_error < 1e-5
    assert conv["faulty"].isolated.rel_error > 0.1
    assert conv["faulty"].op == "Conv2d" and conv["faulty"].module == "conv2"


def test_a_keras_reference_names_the_padding_bug_of_a_torch_primary_and_a_keras_one(exports):
    """Reversed: the faithful port as the reference. A torch primary's conv2 is fed the
    tensor in front of the reference's ZeroPadding2D (the shape torch's module reads); the
    faulty Keras port, aligned by layer name, lacks pad2 (listed as unaligned)."""
    padding = keras(exports["keras_port_padding"])
    report = check(keras(exports["keras_port"]), padding)
    assert report.pair == "keras/keras" and not report.passed
    assert report.first_divergence.name == "conv2"
    assert [u.name for u in report.unaligned] == ["pad2"]
    report = check(padding, TORCH)
    assert report.pair == "keras/torch" and not report.passed
    assert report.first_divergence.name == "conv2"


def test_layer_map_aligns_names_that_differ(exports):
    """options.layer_map (Keras layer -> torch module) pairs layers whose names do not match;
    a map entry naming a module torch does not have is reported, not fatal."""
    paths = exports["keras_port_bn_epsilon"]
    report = check(TORCH, keras(paths, layer_map={"relu1": "bn1", "bn1": "nonexistent"}))
    reasons = {u.name: u.reason for u in report.unaligned}
    assert "nonexistent" in reasons["bn1"]
    relu = next(layer for layer in report.layers if layer.name == "bn1")
    assert relu.op == "BatchNorm2d" and relu.primary_nodes[-1] == "relu1"
    # bn1 of torch compared with Keras's relu1: the ReLU's output is not the BatchNorm's.
    assert relu.propagated.rel_error > 0.1


def test_config_refuses_litert_and_tensorflow_with_the_reason(exports, tmp_path):
    paths = exports["keras_port"]

    def problems(primary: dict) -> list[str]:
        doc = {"version": 1, "models": [{"name": "m", "primary": primary,
                                         "reference": keras(paths),
                                         "checks": {"activation": {"on_failure": True}}}]}
        with pytest.raises(ConfigError) as err:
            parse_config(doc, tmp_path)
        return err.value.problems

    litert = problems({"backend": "litert", "path": str(paths["saved_model"])})
    assert "primary backend 'litert': LiteRT's interpreter runs fused kernels" in litert[0]
    tf = problems({"backend": "tensorflow", "path": str(paths["saved_model"])})
    assert "primary backend 'tensorflow': a SavedModel's signature is one" in tf[0]


def test_keras_against_its_tf2onnx_conversion_aligns_by_scope(exports):
    """The faithful port against tf2onnx's conversion of it (ONNX Runtime): layers align by
    the scopes in the node names and none is blamed; the padding tf2onnx folded into the
    Conv's pads leaves pad2 and conv2 unaligned, and the Conv it named itself runs in relu2's
    segment. With that conversion as the reference, the faulty Keras port is named at relu2,
    the first layer the two graphs share after the fault, whose segment is the port's conv2."""
    paths = exports["keras_port"]
    onnx = {"backend": "onnxruntime", "path": str(paths["keras"])}  # tf2onnx, cached
    report = check(keras(paths), onnx)
    assert report.pair == "keras/onnx" and report.passed, report.summary()
    assert {"conv1", "bn1", "relu1", "relu2", "fc"} <= {layer.name for layer in report.layers}
    assert {"pad2", "conv2"} <= {u.name for u in report.unaligned}
    relu2 = next(layer for layer in report.layers if layer.name == "relu2")
    assert relu2.primary_nodes[0].startswith("Conv__")  # tf2onnx's own node, unscoped
    assert all(layer.isolated.rel_error < 1e-5 for layer in report.layers)
    report = check(onnx, keras(exports["keras_port_padding"]))
    assert report.pair == "onnx/keras" and not report.passed
    assert report.first_divergence.name == "relu2"
    assert report.first_divergence.primary_nodes == ["conv2", "relu2"]


def test_guard_replay_names_the_keras_layer_of_the_padding_bug(exports, tmp_path):
    """End to end: ``guard replay`` with tier 2 on failures, the torch TorchScript reference
    (its eager factory for the hooks) against the faulty Keras port: report.json's first
    divergence is the Keras port's conv2."""
    import yaml

    from guard.cli import main

    paths = exports["keras_port_padding"]
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [{
        "name": "port", "task": "classification",
        "primary": keras(paths),
        "reference": {"backend": "torch", "path": str(paths["torchscript"])},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5},
                   "activation": {"on_failure": True,
                                  "torch_factory": "guard.zoo.keras_port:build"}}}]}))
    np.savez(tmp_path / "set.npz", **zoo_entry("keras_port").sample_inputs(6, 3))
    code = main(["replay", "--config", str(config), str(tmp_path / "set.npz"),
                 "--report-dir", str(tmp_path / "report"), "--batch-size", "2", "--quiet"])
    report = json.loads((tmp_path / "report" / "report.json").read_text())["models"]["port"]
    assert code == 1 and report["verdict"] == "drift"
    activation = report["tiers"]["activation"]
    assert activation["checks"] == 6 and activation["passed"] == 0
    assert activation["first_divergence"]["layer"] == "conv2"


_ON_JAX = """
import json, sys
from guard.config import ModelConfig
from guard.verify.activation import ActivationChecker
from guard.zoo import zoo_entry

out = {}
for variant, path in json.loads(sys.argv[1]).items():
    config = ModelConfig.model_validate({
        "name": "port", "task": "classification",
        "primary": {"backend": "keras", "path": path, "options": {"keras_backend": "jax"}},
        "reference": {"backend": "torch", "path": "guard.zoo.keras_port:build"},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-5}, "activation": {"on_failure": True}}})
    checker = ActivationChecker.for_model(config)
    report = checker.check(zoo_entry("keras_port").sample_inputs(4, 7))
    first = report.first_divergence
    out[variant] = {"passed": report.passed, "first": first.name if first else None,
                    "error": report.error}
out["tensorflow_imported"] = "tensorflow" in sys.modules
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                    reason="jax is not installed (pip install 'jax[cpu]')")
def test_keras_on_jax_names_the_padding_bug_in_a_process_of_its_own(exports):
    """``keras_backend: jax`` (Keras picks its backend once per process: a child process).
    Skipped where jax is not installed: it is not part of guard[tensorflow], because with jax
    installed ``import tensorflow`` imports it too (+140 MB in every TensorFlow process)."""
    import os
    import subprocess
    import sys

    paths = {v: str(exports[v]["keras"]) for v in ("keras_port", "keras_port_padding")}
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", _ON_JAX, json.dumps(paths)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["keras_port"] == {"passed": True, "first": None, "error": ""}
    assert result["keras_port_padding"] == {"passed": False, "first": "conv2", "error": ""}
    assert not result["tensorflow_imported"]  # Keras on jax needs no TensorFlow


def test_guard_matrix_names_the_port_bugs_with_tier2(tmp_path):
    """``tiers: [..., activation]`` in a matrix: tier 2 runs on each cell's first tier-1 failure
    and the record, and the summary's table, name the layer; LiteRT is skipped with the reason
    and a faithful port has nothing to localise."""
    import yaml

    from guard.cli import main

    config = tmp_path / "ports.yaml"
    config.write_text(yaml.safe_dump({
        "version": 1, "name": "ports", "output_dir": "res",
        "models": [{"name": "faithful", "zoo": "keras_port", "inputs": {"samples": 2, "batch": 4}},
                   {"name": "padding", "zoo": "keras_port_padding",
                    "inputs": {"samples": 2, "batch": 4}}],
        "backends": [{"name": "keras_tf", "backend": "keras"},
                     {"name": "tf2onnx_ort", "backend": "onnxruntime", "artifact": "keras"},
                     {"name": "litert_fp32", "backend": "litert"}],
        "tolerances": {"atol": [1e-3], "rtol": [1e-5]},
        "tiers": ["tensor", "activation"]}))
    assert main(["matrix", str(config), "--quiet"]) == 1
    records = [json.loads(line) for line in (tmp_path / "res" / "records.jsonl").open()]
    tier2 = {(r["model"], r["backend"]): r for r in records if r["tier"] == "activation"}
    padding = tier2[("padding", "keras_tf")]
    assert padding["status"] == "fail"
    assert padding["stats"]["first_divergence"]["layer"] == "conv2"
    assert tier2[("faithful", "keras_tf")]["status"] == "pass"
    # tf2onnx's conversion of the port carries its Keras layer scopes: aligned with torch's
    # modules by name, the bug is named there too.
    assert tier2[("padding", "tf2onnx_ort")]["stats"]["first_divergence"]["layer"] == "conv2"
    litert = tier2[("padding", "litert_fp32")]
    assert litert["status"] == "skip" and "LiteRT's interpreter" in litert["reason"]
    summary = (tmp_path / "res" / "summary.md").read_text()
    assert "| padding | conv2 | conv2 | skip |" in summary
