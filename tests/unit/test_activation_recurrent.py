"""Tier 2 on recurrent modules: an ``nn.GRU`` or ``nn.LSTM`` that the exporter turns into one
ONNX GRU/LSTM op is aligned as one unit (its output sequence, the value that leaves the op's
scope; its final states, which nothing reads, have no counterpart), so that a fault inside it is
named there and not on the Linear head after it (issue 30: a 3% change in a GRU's weights named
the head). Where the graph gives no counterpart, tier 2 says undetermined, never a wrong name.

Real torch modules, real exports (both exporters), real ONNX Runtime sessions; every activation
key at its default. The full corpus is benchmarks/localisation.py."""

from __future__ import annotations

import pytest

from guard.verify.activation.decide import Budget, decide
from guard.verify.activation.errors import LayerError
from guard.verify.activation.report import ActivationReport, LayerResult, Unaligned
from guard.zoo import faults


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("recurrent")


def _cases(folder, family, exporter, tensor, share, onnx_pairs=False, clean=False):
    return faults.layout_cases(folder, families=(family,), exporters=(exporter,),
                               faults={family: (("rnn", tensor, share),)},
                               onnx_pairs=onnx_pairs, clean=clean)


@pytest.mark.parametrize("family,exporter", [("gru", "torchscript"), ("gru", "dynamo"),
                                             ("lstm", "torchscript")])
def test_a_fault_inside_the_recurrent_module_is_named_there(folder, family, exporter):
    (case,) = _cases(folder, family, exporter, "weight_hh_l0", 0.03)
    report = faults.check(case)
    assert report.first_divergence is not None, report.undetermined
    assert report.first_divergence.name == "rnn"
    assert report.first_divergence.op == family.upper()
    assert not report.passed
    # The head after it adds nothing of its own: it is not a suspect above the rnn.
    assert faults.ranked_names(report)[0] == "rnn"
    assert not any(u.name == "rnn" for u in report.unaligned)


def test_onnx_vs_onnx_names_the_recurrent_op_and_a_clean_pair_names_none(folder):
    clean, torch_fault, onnx_fault = _cases(folder, "gru", "torchscript", "bias_hh_l0", 0.1,
                                            onnx_pairs=True, clean=True)
    assert clean.true_layer is None
    assert faults.check(clean).first_divergence is None
    assert faults.check(torch_fault).first_divergence.name == "rnn"
    named = faults.check(onnx_fault).first_divergence.name
    assert onnx_fault.true_layer == "/rnn/GRU"
    assert onnx_fault.names_true_layer(named)  # the GRU node (by its sequence output)


def _layer(name: str, propagated: float, isolated: float) -> LayerResult:
    return LayerResult(name, "Linear", name, name, LayerError(propagated, 1.0, propagated),
                       isolated=LayerError(isolated, 1.0, isolated))


def test_a_layer_that_adds_no_measurable_error_is_never_blamed_for_what_it_was_fed():
    """Tier 1 failed, the module that drifted has no counterpart, the layers that do add only
    fp32 noise: undetermined, naming the unaligned module, not the head after it."""
    report = ActivationReport("torch/onnx", 0.001)
    report.layers = [_layer("embed", 0.0, 0.0), _layer("head", 0.004, 6e-8)]
    report.unaligned = [Unaligned("reference", "rnn", "no counterpart")]
    decide(report, Budget(0.001, "test", tier1_failed=True), {}, {}, 2.0)
    assert report.first_divergence is None
    assert "adds a measurable error of its own" in report.undetermined
    assert "(rnn)" in report.undetermined
