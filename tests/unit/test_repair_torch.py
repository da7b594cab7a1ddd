"""Selective op fallback on a torch_compile primary: the seeded sequence classifier of
tests/torch_drift_models.py whose fp16 attention scores overflow, with real torch.compile
(inductor) primaries, the real tier-2 checker on an eager fp16 copy and the model's own tier-1
checks; plus the mechanics of ``eager_fp32_modules`` and the TensorRT strategy's mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_drift_models
from guard.backends import create_backend
from guard.backends.eager_modules import EagerFp32, keep_eager_fp32, not_eager_fp32
from guard.config import BackendConfig
from guard.errors import BackendError
from guard.policy.keep_back import (
    OnnxFp16Ops,
    TensorRTLayers,
    TorchCompileModules,
    keep_back_for,
)
from guard.policy.repair import Suspect
from guard.verify.activation.errors import LayerError
from guard.verify.activation.report import LayerResult
from repair_cases import failing, make_repair, repair_case

FACTORY = "torch_drift_models:build"


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    model = {
        "name": "seq",
        "primary": {"backend": "torch_compile", "path": FACTORY, "precision": "fp16"},
        "reference": {"backend": "torch", "path": FACTORY},
        "fallback": {"backend": "torch", "path": FACTORY},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops"},
    }
    return repair_case(model, tmp_path_factory.mktemp("torchdrift"), "x",
                       torch_drift_models.sample_inputs(16, seed=21))


def layer(name: str, module: str = "") -> LayerResult:
    return LayerResult(name, "Linear", module, name, LayerError(0.5, 0.9, 1.0))


# -- the strategies ------------------------------------------------------------------------------
def test_torch_layers_map_to_module_paths_and_capture_on_an_eager_copy():
    spec = BackendConfig(backend="torch_compile", path=FACTORY, precision="bf16",
                         options={"mode": "max-autotune", "threads": 2,
                                  "eager_fp32_modules": ["head"]})
    strategy = keep_back_for(spec)
    assert isinstance(strategy, TorchCompileModules)
    assert strategy.ops_for(layer("layers.0.lin", "layers.0.lin")) == ["layers.0.lin"]
    assert strategy.ops_for(layer("pool#1")) == ["pool"]  # a second call of a shared module
    capture = strategy.capture_spec()
    assert (capture.backend, capture.precision) == ("torch", "bf16")
    assert capture.options == {"threads": 2}  # torch_compile's own options dropped
    rebuilt = strategy.rebuild_spec(["attn"])
    assert rebuilt.backend == "torch_compile"
    assert rebuilt.options["eager_fp32_modules"] == ["head", "attn"]  # the config's kept too
    assert rebuilt.options["mode"] == "max-autotune"
    assert spec.options["eager_fp32_modules"] == ["head"]  # the primary's block is untouched


def test_tensorrt_layers_are_onnx_node_names_and_rebuild_with_fp32_layers(tmp_path):
    import fp16_models
    import onnx

    onnx_path = str(fp16_models.export(tmp_path)["onnx"])
    # The nodes that read the LayerNorm's and fc1's weights, whatever the exporter named them.
    nodes = onnx.load(onnx_path).graph.node
    (norm,) = [n.name for n in nodes if "norm.weight" in n.input]
    (fc1,) = [n.name for n in nodes if "fc1.weight" in n.input]
    from guard.config import ConfigContext
    from guard.plan.serving import backend_block

    # Planned as a config's block is (TensorRT's declaration puts it on the GPU).
    spec = backend_block({"backend": "tensorrt", "path": onnx_path, "precision": "fp16",
                          "options": {"fp32_layers": [fc1], "workspace_mib": 512}},
                         ConfigContext(), "a block")
    strategy = keep_back_for(spec)
    assert isinstance(strategy, TensorRTLayers)
    capture = strategy.capture_spec()  # tier 2 captures ONNX Runtime's fp16 variant
    assert (capture.backend, capture.precision) == ("onnxruntime", "fp16")
    assert capture.options == {"nodes_to_exclude": [fc1]}
    assert isinstance(strategy.onnx, OnnxFp16Ops)
    # A segment of the fp16 variant maps to the fp32 node names, which TensorRT's parser
    # gives its layers; the converter's Casts are dropped.
    segment = layer(norm)
    segment.primary_nodes = [f"x_cast_to_{norm}", norm]
    assert strategy.ops_for(segment) == [norm]
    rebuilt = strategy.rebuild_spec([norm])
    assert rebuilt.backend == "tensorrt" and rebuilt.device == "cuda"
    assert rebuilt.options == {"fp32_layers": [fc1, norm],
                               "workspace_mib": 512}
    every = strategy.every_op(None, {})
    assert every[0] == norm and fc1 in every
    assert strategy.not_kept_back(None, [norm]) == []  # the builder checks


def test_a_fused_unit_keeps_every_member_back_not_only_its_first(tmp_path):
    """A torch primary against its ONNX export (the TorchScript exporter folds each BatchNorm
    into its Conv): tier 2 compares ``layer1.0.conv1+layer1.0.bn1`` as one unit, and a fault in
    its second member (the BatchNorm's statistics) makes it the suspect. The strategy keeps
    both members back, and the rebuilt module runs both eagerly at fp32."""
    from guard.config import ActivationCheckConfig
    from guard.verify.activation import ActivationChecker
    from guard.backends.activations.onnx import OnnxSide
    from guard.backends.activations.torch import TorchSide
    from guard.zoo import layouts

    model = layouts.resnet(seed=3, widths=(8,), blocks=1)
    inputs = layouts.resnet_inputs(2, seed=3)
    layouts.export(model, tmp_path / "ref.onnx", inputs)
    primary = layouts.perturbed(model, "layer1.0.bn1", 0.5, tensor="running_var")
    checker = ActivationChecker(ActivationCheckConfig(on_failure=True),
                                OnnxSide(tmp_path / "ref.onnx", label="reference"),
                                TorchSide(primary, ["image"], label="primary"))
    try:
        report = checker.check(inputs)
    finally:
        checker.close()
    assert not report.error, report.error
    suspect = report.suspects[0]
    assert suspect.name == "layer1.0.conv1+layer1.0.bn1"
    assert suspect.module == "layer1.0.conv1"  # the unit's first member, as reported
    spec = BackendConfig(backend="torch_compile", path=FACTORY, precision="fp16")
    strategy = keep_back_for(spec)
    ops = strategy.ops_for(suspect)
    assert ops == ["layer1.0.conv1", "layer1.0.bn1"]
    assert strategy.rebuild_spec(ops).options["eager_fp32_modules"] == ops
    kept = keep_eager_fp32(primary, ops, torch.device("cpu"), torch.float16).to(torch.float16)
    assert not_eager_fp32(kept, ops) == []
    assert kept.layer1[0].bn2.weight.dtype == torch.float16  # the rest stays at fp16


# -- eager_fp32_modules ------------------------------------------------------------------------
def test_eager_fp32_wrapper_runs_fp32_and_hands_back_the_input_dtype():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Sequential(lin))
    keep_eager_fp32(model, ["1.0", "1"], torch.device("cpu"))  # the inner one is covered
    model = model.to(torch.bfloat16)
    wrapper = model[1]
    assert isinstance(wrapper, EagerFp32) and wrapper.fp32[0].weight.dtype == torch.float32
    x = torch.randn(2, 4).to(torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, lin(x.float()).to(torch.bfloat16))  # fp32 weights, fp32 arithmetic
    assert not_eager_fp32(model, ["1", "1.0"]) == [] and not_eager_fp32(model, ["0"]) == ["0"]


def test_compiled_primary_keeps_the_named_module_eager_fp32(seq):
    spec = keep_back_for(seq["config"].primary).rebuild_spec(["attn"])
    backend = create_backend(spec, "primary")
    backend.load()
    assert isinstance(backend.module.attn, EagerFp32)
    assert backend.module.attn.fp32.wq.dtype == torch.float32
    assert backend.module.head.weight.dtype == torch.float16  # the rest stays fp16
    assert not_eager_fp32(backend.module, ["attn"]) == []
    assert not_eager_fp32(backend.module, ["head"]) == ["head"]
    assert failing(seq, backend) == 0


def test_an_unknown_module_path_is_a_backend_error_naming_it():
    spec = BackendConfig(backend="torch_compile", path=FACTORY, precision="fp16",
                         options={"eager_fp32_modules": ["attn", "blocks.9"]})
    with pytest.raises(BackendError, match="no submodule named 'blocks.9'"):
        create_backend(spec, "primary").load()


# -- the repair --------------------------------------------------------------------------------
def test_the_fp16_compiled_primary_fails_and_the_repair_keeps_only_attn_eager(seq):
    compiled = create_backend(seq["config"].primary, "primary")
    compiled.load()
    assert failing(seq, compiled) >= 8  # 10 measured (9 NaN): the product overflows fp16
    steps = []
    outcome = make_repair(seq, on_step=steps.append).run(seq["samples"])
    assert outcome.ok, outcome.reason
    assert outcome.kept == ["attn"], outcome.evidence()
    assert outcome.suspects[0].layer == "attn" and outcome.suspects[0].ops == ["attn"]
    assert "1 module(s) kept eager at fp32" in outcome.reason
    assert [s["step"] for s in steps][:2] == ["suspects", "candidate_ops"]
    assert isinstance(outcome.backend.module.attn, EagerFp32)
    assert failing(seq, outcome.backend) == 0


def test_with_no_suspect_every_leaf_module_is_tried_in_forward_order(seq):
    steps = []
    outcome = make_repair(seq, on_step=steps.append).run(seq["samples"], suspects=[])
    assert outcome.ok, outcome.reason
    (ops,) = [s for s in steps if s["step"] == "candidate_ops"]
    assert ops["ops"] == ["embed", "attn", "head"] and "tier 2 named no" in ops["note"]
    assert outcome.kept == ["attn"]


def test_an_unknown_module_ends_the_repair_in_the_whole_model_fallback(seq):
    outcome = make_repair(seq).run(seq["samples"],
                                   suspects=[Suspect("blocks.9", 1.0, ["blocks.9"])])
    assert not outcome.ok and outcome.backend is None
    assert "gives no usable variant" in outcome.reason and "'blocks.9'" in outcome.reason


def test_keeping_the_wrong_module_is_not_enough(seq):
    outcome = make_repair(seq).run(seq["samples"], suspects=[Suspect("head", 1.0, ["head"])])
    assert not outcome.ok and "still fails the checks" in outcome.reason
    assert "modules tier 2 points at" in outcome.reason
    assert np.isfinite(outcome.seconds)
