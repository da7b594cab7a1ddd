"""Tier 2 on a runtime-optimised primary: ONNX Runtime's transformer optimiser packed the second
block's q, k and v projections (and the attention's own code) into one Attention node, and
folded each Linear's bias, the residual add and the next LayerNorm into SkipLayerNormalization.
The packed node is one unit, ``blocks.1.attn.{q,k,v}``, matched to the torch modules by its
packed weight; a fault in any member is localised to it, and clean pairs name nothing.

Real torch modules, real exports through the real optimiser, real ONNX Runtime sessions; the
full set of cases, beside Polygraphy, is in benchmarks/localisation.py (``encoder_ort``)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from guard.verify.activation.packed import brace, members, pack_order
from guard.zoo import faults


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("packed")


def _cases(folder, exporter, fault=None, clean=False):
    return faults.packed_attention_cases(folder / exporter, exporters=(exporter,),
                                         faults=(fault,) if fault else (), clean=clean)


def test_names_list_their_members_and_read_back():
    assert brace(["blocks.1.attn.q", "blocks.1.attn.k", "blocks.1.attn.v"]) == \
        "blocks.1.attn.{q,k,v}"
    assert members("blocks.1.attn.{q,k,v}") == ["blocks.1.attn.q", "blocks.1.attn.k",
                                                "blocks.1.attn.v"]
    assert members("layer1.0.conv1+layer1.0.bn1") == ["layer1.0.conv1", "layer1.0.bn1"]
    assert members("a.{q,k}+b") == ["a.q", "a.k", "b"]
    names = ["/blocks/blocks.1/attn/q/MatMul", "/blocks/blocks.1/attn/k/MatMul"]
    assert members(brace(names, "/")) == names
    # Names without a common scope (an exporter's flat node names) are joined with "+".
    assert brace(["MatMul_1", "MatMul_2"], "/") == "MatMul_1+MatMul_2"


def test_pack_order_finds_the_members_within_a_fault_and_nothing_else():
    rng = np.random.default_rng(0)
    q, k, v, other = (rng.standard_normal((8, 8)) for _ in range(4))
    packed = np.concatenate([q, k * (1 + 0.1 * rng.standard_normal(k.shape)), v], axis=1)
    candidates = [("other", other), ("v", v), ("k", k), ("q", q)]
    assert pack_order(packed, candidates) == ["q", "k", "v"]
    assert pack_order(np.concatenate([q, other], axis=1), [("q", q), ("k", k)]) is None
    assert pack_order(q, [("q", q)]) is None  # one weight is no packing


def test_the_optimiser_packs_qkv_as_these_cases_assume(folder):
    case, _ = _cases(folder, "torchscript", ("blocks.1.attn.q", "weight", 0.02))
    ops = [node.op_type for node in onnx.load(str(case.primary)).graph.node]
    # What the cases are about; the optimiser's patterns changed if not.
    assert ops.count("Attention") == 1 and "SkipLayerNormalization" in ops


@pytest.mark.parametrize("exporter", faults.EXPORTERS)
def test_a_fault_in_a_packed_projection_names_the_packed_unit(folder, exporter):
    torch_case, onnx_case = _cases(folder, exporter, ("blocks.1.attn.q", "weight", 0.02))
    report = faults.check(torch_case)
    assert not report.error and report.pair == "torch/onnx"
    first = report.first_divergence
    assert first is not None, report.undetermined
    assert first.name == "blocks.1.attn.{q,k,v}" and first.op == "Linear+Linear+Linear"
    assert torch_case.names_true_layer(first.name) and not first.unsure
    assert first.isolated.rel_error > first.allowance
    # The packed members are one unit, not three modules without a counterpart.
    unaligned = {u.name for u in report.unaligned}
    assert not unaligned & {"blocks.1.attn.q", "blocks.1.attn.k", "blocks.1.attn.v",
                            "blocks.1.ln1", "blocks.0.ln2"}, unaligned
    assert "blocks.0.attn.out+blocks.0.ln2" in {layer.name for layer in report.layers}
    report = faults.check(onnx_case)
    first = report.first_divergence
    assert first is not None and onnx_case.names_true_layer(first.name), (
        first and first.name, onnx_case.true_layer)
    assert len(members(first.name)) == 6  # q, k, v: their weights' and biases' nodes


def test_a_fault_in_a_packed_bias_and_clean_pairs(folder):
    cases = _cases(folder, "torchscript", ("blocks.1.attn.v", "bias", 0.1), clean=True)
    for case in cases:
        report = faults.check(case)
        assert not report.error, (case.name, report.error)
        if case.true_layer is None:
            assert report.first_divergence is None and report.passed, case.name
            assert not report.budget.tier1_failed and not report.undetermined
        else:
            first = report.first_divergence
            assert first is not None and case.names_true_layer(first.name), (
                case.name, first and first.name, report.undetermined)


def test_a_post_norm_bert_optimised_by_onnx_runtime_names_the_broken_leaf(folder):
    """transformers' BERT (post-norm: each Linear's bias, the residual add and the LayerNorm
    after it fused into SkipLayerNormalization, GELU with its bias into BiasGelu) through the
    optimiser's own ``bert`` patterns: a fault in a query projection is named; the clean file
    names nothing. The fused units' outputs are the boundaries the isolated segments start
    from, never a container's tensor compared against a bias-less MatMul."""
    pytest.importorskip("transformers")
    from guard.zoo import families, layouts

    inputs = families.inputs("bert")
    module = "model.bert.encoder.layer.1.attention.self.query"
    model = families.bert()
    out = []
    for name, source in (("clean", model), ("broken", layouts.perturbed(model, module, 0.02))):
        path = layouts.export(source, folder / f"bert-{name}.onnx", inputs)
        out.append(faults.ort_optimised(path, model_type="bert"))
    ops = {node.op_type for node in onnx.load(str(out[1])).graph.node}
    assert {"SkipLayerNormalization", "BiasGelu"} <= ops
    for path, true_layer in zip(out, (None, module)):
        case = faults.FaultCase("bert-ort", "weight", "bert", families.bert, path, inputs,
                                true_layer, tensor=faults.FP32, input_names=list(inputs))
        report = faults.check(case)
        assert not report.error, report.error
        first = report.first_divergence
        if true_layer is None:
            assert first is None and report.passed and not report.undetermined
        else:
            assert first is not None and first.name == module, report.undetermined
        names = {layer.name for layer in report.layers}
        assert ("model.bert.encoder.layer.0.attention.output.dense"
                "+model.bert.encoder.layer.0.attention.output.LayerNorm") in names
