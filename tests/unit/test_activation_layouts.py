"""Tier 2 on standard architectures written the usual way (guard.zoo.layouts): a pre-norm
attention encoder and a torchvision-layout ResNet, the torch eager module as reference and the
ONNX export (both exporters) of a copy with one leaf module perturbed: the report names that
leaf, or the unit the exporter folded it into, never a container or the stem.

Real torch modules, real exports, real ONNX Runtime sessions; every activation key at its
default. The full corpus, beside Polygraphy, is benchmarks/localisation.py."""

from __future__ import annotations

import onnx
import pytest

from guard.config import ActivationCheckConfig, TensorCheckConfig
from guard.verify.activation import ActivationChecker
from guard.backends.activations.onnx import OnnxSide
from guard.backends.activations.scopes import torchscript_paths, unqualified
from guard.backends.activations.torch import TorchSide
from guard.zoo import faults, layouts


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


def _case(folder, family, exporter, module, share=0.02, tensor="weight"):
    (case,) = faults.layout_cases(folder, families=(family,), exporters=(exporter,),
                                  faults={family: ((module, tensor, share),)},
                                  onnx_pairs=False, clean=False)
    return case


def _containers(report) -> set[str]:
    """Layers that are modules holding other modules (``blocks``, ``layer2.0``)."""
    return {layer.name for layer in report.layers if any(
        other.module.startswith(layer.module + ".") for other in report.layers)}


def test_torchscript_scope_segments_resolve_to_full_paths():
    """The TorchScript exporter's segments are unqualified names (torch.onnx's
    _unqualified_variable_name): rebuilt into the module's own paths."""
    assert unqualified("layer2.0.downsample.0") == "downsample.0"
    assert unqualified("layer1.0") == "layer1.0" and unqualified("0.1") == "0.1"
    assert torchscript_paths(["layer1", "layer1.0", "conv1"]) == [
        "layer1", "layer1.0", "layer1.0.conv1"]
    assert torchscript_paths(["layer2", "layer2.0", "downsample", "downsample.0"]) == [
        "layer2", "layer2.0", "layer2.0.downsample", "layer2.0.downsample.0"]
    assert torchscript_paths(["blocks.0", "attn", "q"]) == ["blocks.0", "blocks.0.attn",
                                                            "blocks.0.attn.q"]
    assert torchscript_paths(["encoder", "layer.0", "attention"]) == [
        "encoder", "encoder.layer.0", "encoder.layer.0.attention"]
    assert torchscript_paths(["0", "0.1"]) == ["0", "0.1"]  # a root Sequential of Sequentials
    # With the module's own paths, the one that exists wins.
    assert torchscript_paths(["a", "a.0"], known={"a", "a.a.0"}) == ["a", "a.a.0"]


@pytest.mark.parametrize("exporter", faults.EXPORTERS)
@pytest.mark.parametrize("family,module,expected", [
    ("encoder", "blocks.1.attn.q", "blocks.1.attn.q"),
    ("resnet", "layer2.0.conv1", "layer2.0.conv1+layer2.0.bn1"),
])
def test_torch_reference_vs_onnx_export_names_the_perturbed_leaf(folder, exporter, family,
                                                                 module, expected):
    case = _case(folder, family, exporter, module)
    report = faults.check(case)
    assert not report.error, report.error
    assert report.pair == "torch/onnx" and report.budget.tier1_failed
    first = report.first_divergence
    assert first is not None and first.name == expected, (first and first.name,
                                                          report.undetermined)
    assert faults.rank_of_true_layer(case, report) == 1
    assert first.name not in _containers(report)
    assert first.isolated.rel_error > first.allowance
    # Every leaf at every depth is a layer of the report; nothing is left unaligned.
    names = {layer.name for layer in report.layers}
    if family == "encoder":
        assert {"blocks.0.attn.k", "blocks.1.mlp.fc2", "blocks.1.ln2", "norm", "head"} <= names
    else:
        # The folded BatchNorm is compared with its Conv, on the BatchNorm's output: the stem
        # is clean, never the mismatched pair that a Conv's own output against the fused
        # Conv+BatchNorm would be.
        stem = next(layer for layer in report.layers if layer.name == "conv1+bn1")
        assert stem.isolated.rel_error < 1e-5 and not stem.divergent
        assert {"layer3.1.conv2+layer3.1.bn2", "layer2.0.downsample.0+layer2.0.downsample.1",
                "layer1.0.relu#1", "fc"} <= names
    assert report.unaligned == []


@pytest.mark.parametrize("exporter", faults.EXPORTERS)
def test_clean_exports_name_nothing(folder, exporter):
    for case in faults.layout_cases(folder, exporters=(exporter,), faults={
            "encoder": (), "resnet": ()}, onnx_pairs=False):
        report = faults.check(case)
        assert not report.error and report.first_divergence is None, case.name
        assert report.passed and not report.budget.tier1_failed and report.unaligned == []
        assert max(layer.isolated.rel_error for layer in report.layers
                   if layer.isolated is not None) < 1e-5, case.name


def test_a_module_without_scope_makes_its_neighbours_unsure_not_blamed(folder):
    """A graph whose LayerNorm lost its scope (renamed by a tool): the LayerNorm is listed as
    unaligned, and a fault in the q projection it feeds, which might hold its computation, is
    undetermined with the reason instead of named; a fault elsewhere is still named."""
    def unscoped(case):
        model = onnx.load(str(case.primary))
        for node in model.graph.node:
            if node.name == "/blocks/blocks.1/ln1/LayerNormalization":
                node.name = "LayerNormalization_renamed"
        path = case.primary.with_name(case.primary.stem + "-unscoped.onnx")
        onnx.save(model, str(path))
        case.primary = path
        return case

    report = faults.check(unscoped(_case(folder, "encoder", "torchscript", "blocks.1.attn.q")))
    assert [(u.name, u.side) for u in report.unaligned] == [("blocks.1.ln1", "reference")]
    assert "no ONNX node carries this module's scope" in report.unaligned[0].reason
    assert report.first_divergence is None and not report.passed
    assert report.undetermined.startswith("the first divergence would be blocks.1.attn.q")
    assert "blocks.1.ln1 (LayerNorm), which has no scope of its own" in report.undetermined
    assert report.summary()["undetermined"] == report.undetermined
    report = faults.check(unscoped(_case(folder, "encoder", "torchscript", "blocks.0.mlp.fc2")))
    assert report.first_divergence.name == "blocks.0.mlp.fc2"


def _checker(reference, primary) -> ActivationChecker:
    return ActivationChecker(ActivationCheckConfig(on_failure=True, top_k=50), reference,
                             primary, tensor=TensorCheckConfig())


def test_onnx_reference_vs_torch_primary_names_the_folded_unit(folder):
    """The other way round: the clean export as reference, the perturbed eager module as the
    primary; the unit is re-run in torch member by member, a container on its own code."""
    inputs = layouts.resnet_inputs(4, seed=1)
    clean = layouts.export(layouts.resnet(0), folder / "resnet-ref.onnx", inputs)
    broken = layouts.perturbed(layouts.resnet(0), "layer3.1.conv1", 0.02, seed=4)
    checker = _checker(OnnxSide(clean), TorchSide(broken, ["image"]))
    report = checker.check(inputs)
    checker.close()
    assert report.pair == "onnx/torch" and not report.error
    assert report.first_divergence.name == "layer3.1.conv1+layer3.1.bn1"
    assert [layer.name for layer in report.layers if layer.divergent] == [
        "layer3.1.conv1+layer3.1.bn1"]


def test_torch_vs_torch_names_the_leaf_not_its_containers(folder):
    """Eager vs eager: a container is isolated on its own code (its children return the
    reference's tensors), so the residual blocks around the fault add nothing of their own."""
    inputs = layouts.encoder_inputs(4, seed=1)
    broken = layouts.perturbed(layouts.encoder(0), "blocks.0.attn.v", 0.02, seed=2)
    checker = _checker(TorchSide(layouts.encoder(0), ["ids"]), TorchSide(broken, ["ids"]))
    report = checker.check(inputs)
    checker.close()
    assert report.pair == "torch/torch" and not report.error
    assert report.first_divergence.name == "blocks.0.attn.v"
    assert [layer.name for layer in report.layers if layer.divergent] == ["blocks.0.attn.v"]
    layers = {layer.name: layer for layer in report.layers}
    for container in ("blocks.0.attn", "blocks.0", "blocks"):
        assert layers[container].propagated.rel_error > layers[container].allowance
        assert layers[container].isolated.rel_error < 1e-6, container


def test_a_runtime_optimised_graph_aligns_fused_units_and_lists_what_it_lost(folder):
    """ONNX Runtime's transformer optimiser on the export: GELU and the Linear's bias become
    one unscoped BiasGelu node after the Linear's MatMul, compared as the unit
    ``...mlp.fc1+...mlp.act`` on that node's output (never the bare MatMul against torch's
    GELU output); a Linear's bias, the residual add and the LayerNorm fused into
    SkipLayerNormalization are the unit ``...attn.out+...ln2`` on the LayerNorm's output (never
    the Linear's bias-less MatMul against torch's Linear output); what is left without a
    counterpart (containers whose nodes the unscoped ones split) is listed with the reason."""
    from onnxruntime.transformers import optimizer

    case = _case(folder, "encoder", "torchscript", "blocks.1.attn.q")
    optimised = optimizer.optimize_model(str(case.primary), model_type="bert", num_heads=4,
                                         hidden_size=32, opt_level=0)
    path = case.primary.with_name(case.primary.stem + "-ort.onnx")
    optimised.save_model_to_file(str(path))
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "BiasGelu" in ops  # what this test is about; the optimiser's patterns changed if not
    case.primary = path
    report = faults.check(case)
    assert not report.error, report.error
    names = {layer.name: layer for layer in report.layers}
    unit = names["blocks.0.mlp.fc1+blocks.0.mlp.act"]
    assert unit.op == "Linear+GELU" and unit.propagated.rel_error < 1e-3
    assert "blocks.0.mlp.fc1" not in names and "blocks.0.mlp.act" not in names
    first = report.first_divergence
    if first is not None:  # named only where the alignment is sure
        assert case.names_true_layer(first.name) and not first.unsure
    else:
        assert report.undetermined.startswith("the first divergence would be ")
    # What lost its scope, or whose nodes the unscoped ones split, is listed with the reason.
    reasons = {u.name: u.reason for u in report.unaligned}
    assert reasons and all("scope" in reason for reason in reasons.values()), reasons
    assert {"blocks.0.attn.out+blocks.0.ln2", "blocks.0.mlp.fc2+blocks.1.ln1",
            "blocks.1.mlp.fc2+norm"} <= set(names)
    assert first is not None and first.name == "blocks.1.attn.q", report.undetermined
