"""Tier 2 names the broken layer: a seeded subset of the fault corpus (guard.zoo.faults), on
real ONNX Runtime sessions and torch modules, every activation key at its default.

The full corpus, beside Polygraphy, is benchmarks/localisation.py."""

from __future__ import annotations

import pytest

from guard.zoo import faults
from guard.zoo.faults import checker_for, ranked_names


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


def check(case):
    checker = checker_for(case)
    try:
        return checker.check(case.inputs)
    finally:
        checker.close()


def test_the_reported_six_mlps_name_the_perturbed_linear(folder):
    """The issue's corpus: one Linear perturbed by 0.5-5%, tier-1 defaults. The old fixed 0.05
    named it in 1 of 6; isolated error against the tier-1 budget names it in each."""
    for case in faults.issue_cases(folder):
        report = check(case)
        first = report.first_divergence
        assert first is not None and first.name == case.true_layer, case.name
        assert first.isolated.rel_error > first.allowance
        # Only the perturbed layer adds error of its own: nothing after it is blamed.
        assert [layer.name for layer in report.layers if layer.divergent] == [case.true_layer]


@pytest.mark.parametrize("kind", ["bias", "activation", "int8_outlier", "fp16_overflow",
                                  "torch_onnx"])
def test_other_faults_are_named(folder, kind):
    for case in [c for c in faults.other_fault_cases(folder, seeds=[1]) if c.kind == kind]:
        report = check(case)
        assert not report.error, report.error
        assert report.first_divergence is not None, (case.name, report.undetermined)
        assert report.first_divergence.name == case.true_layer, case.name
        assert ranked_names(report)[0] == case.true_layer


def test_clean_pairs_name_none_across_precisions(folder):
    for case in faults.clean_cases(folder, seeds=[0]):
        report = check(case)
        assert not report.error and report.first_divergence is None, case.name
        assert not report.budget.tier1_failed, case.name
        assert report.passed and report.undetermined == ""


def test_a_tiny_fault_within_the_budget_names_none_but_ranks_first(folder):
    """0.1% on one layer: its isolated error is within what tier 1 allows at the output, so no
    layer diverges (tier 1 passes too), yet the suspects still rank it first."""
    case = faults.weight_cases(folder, seeds=[0], shares=(0.001,))[0]
    report = check(case)
    assert report.first_divergence is None and not report.budget.tier1_failed
    assert report.suspects[0].name == case.true_layer


def test_budget_comes_from_tier1_when_given(folder):
    from guard.verify.tensor import Tolerance, compare_outputs

    case = faults.issue_cases(folder)[3]
    checker = checker_for(case)
    ref = checker.reference.capture(case.inputs)["y"]
    prim = checker.primary.capture(case.inputs)["y"]
    tier1 = compare_outputs({"y": ref}, {"y": prim}, Tolerance(1e-4, 1e-3))
    report = checker.check(case.inputs, tier1=tier1)
    out = tier1.outputs[0]
    assert report.budget.relative == pytest.approx(out.allowed / out.ref_max_abs)
    assert report.budget.tier1_failed == (not tier1.passed)
    assert report.first_divergence.name == case.true_layer
    checker.close()
