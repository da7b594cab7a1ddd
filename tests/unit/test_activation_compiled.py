"""Tier 2 with a torch.compile side: per-module tensors of the compiled code (hooks registered
before compiling are traced into the graph), eager reference vs compiled primary aligned by
module path. Real torch.compile with inductor on CPU, the zoo's encoder."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from guard.config import ActivationCheckConfig, TensorCheckConfig
from guard.plan.complete import parse_config
from guard.errors import ConfigError
from guard.verify.activation import ActivationChecker
from guard.backends.activations.compiled import CompiledTorchSide
from guard.backends.activations.torch import TorchSide
from guard.zoo import layouts

torch = pytest.importorskip("torch")
INDUCTOR = {"backend": "inductor"}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_captured_tensors_are_the_compiled_codes():
    """The captured outputs are off eager's by summation order (the compiled kernels computed
    them; 0.7-2.8e-7 relative on every module on the machine measured), and the captured model
    output is bit-identical to the same module compiled without hooks: the hooks did not change
    what the graph computes."""
    inputs = layouts.encoder_inputs(4, seed=1)
    model = layouts.encoder(0)
    compiled = CompiledTorchSide(copy.deepcopy(model), ["ids"], INDUCTOR).capture(inputs)
    eager = TorchSide(copy.deepcopy(model), ["ids"]).capture(inputs)
    assert [c.key for c in compiled.calls] == [c.key for c in eager.calls]
    diffs = {c.key: _rel(c.outputs[0], e.outputs[0])
             for c, e in zip(compiled.calls, eager.calls) if c.kind != "Embedding"}
    assert max(diffs.values()) > 0 and all(d < 1e-5 for d in diffs.values()), diffs
    with torch.inference_mode():
        plain = torch.compile(copy.deepcopy(model), **INDUCTOR)(
            torch.from_numpy(inputs["ids"])).numpy()
    assert np.array_equal(compiled.by_key()["head#0"].outputs[0], plain)
    # Parents and leaves as the eager capture records them.
    assert [(c.parent, c.leaf) for c in compiled.calls] == [(e.parent, e.leaf)
                                                           for e in eager.calls]


def _check(primary) -> object:
    inputs = layouts.encoder_inputs(4, seed=1)
    checker = ActivationChecker(ActivationCheckConfig(on_failure=True, top_k=50),
                                TorchSide(layouts.encoder(0), ["ids"]),
                                CompiledTorchSide(primary, ["ids"], INDUCTOR),
                                tensor=TensorCheckConfig())
    try:
        return checker.check(inputs)
    finally:
        checker.close()


def test_eager_reference_vs_compiled_primary_names_the_perturbed_leaf():
    report = _check(layouts.perturbed(layouts.encoder(0), "blocks.1.attn.q", 0.02, seed=3))
    assert not report.error and report.pair == "torch/torch_compile"
    assert report.first_divergence.name == "blocks.1.attn.q"
    assert [layer.name for layer in report.layers if layer.divergent] == ["blocks.1.attn.q"]
    # Leaves are isolated on compiled kernels (a compiled LayerNorm is off eager's at
    # summation order); a container is not re-run apart from its children, and says so.
    layers = {layer.name: layer for layer in report.layers}
    assert 0 < layers["blocks.0.ln1"].isolated.rel_error < 1e-5
    assert layers["blocks.1.attn"].isolated is None
    assert "not re-run apart from its children" in layers["blocks.1.attn"].isolation_note


def test_eager_reference_vs_compiled_clean_primary_names_nothing():
    report = _check(layouts.encoder(0))
    assert not report.error and report.first_divergence is None and report.passed
    assert not report.budget.tier1_failed and report.unaligned == []
    assert max(layer.propagated.rel_error for layer in report.layers) > 0  # compiled, not eager


def test_config_takes_torch_compile_beside_a_torch_reference_only(tmp_path):
    factory = "guard.zoo.layouts:encoder"
    doc = {"version": 1, "models": [{
        "name": "m", "primary": {"backend": "torch_compile", "path": factory},
        "reference": {"backend": "torch", "path": factory},
        "checks": {"activation": {"on_failure": True}}}]}
    model = parse_config(doc, tmp_path).models[0]
    checker = ActivationChecker.for_model(model)  # builds the sides; compiles on first check
    try:
        assert isinstance(checker.primary, CompiledTorchSide)
        assert checker.primary.compile_options["backend"] == "inductor"
        assert checker.pair == "torch/torch_compile"
    finally:
        checker.close()
    doc["models"][0]["reference"] = {"backend": "onnxruntime", "path": "m.onnx"}
    (tmp_path / "m.onnx").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        parse_config(doc, tmp_path)
    problem = " ".join(err.value.problems)
    assert "primary backend 'torch_compile' beside reference backend 'onnxruntime'" in problem
