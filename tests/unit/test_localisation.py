"""Tier 2 names the broken layer: a seeded subset of the fault corpus (guard.zoo.faults), on
real ONNX Runtime sessions and torch modules, every activation key at its default.

The full corpus, beside Polygraphy, is benchmarks/localisation.py."""

from __future__ import annotations

import pytest

from guard.zoo import faults
from guard.zoo.faults import checker_for, ranked_names


@pytest.fixture(scope="module")
def folder(tmp_path_factory, zoo_folder):
    """The corpus's folder; the subfolders it exports zoo models into are links to the
    session's shared export folder, so the classifier, the detector, MiniLM and silero-vad
    exported by other tests are reused here (the corpus writes its faulty variants beside
    them, in this folder)."""
    folder = tmp_path_factory.mktemp("faults")
    for name in ("zoo", "detector", "minilm", "silero_vad"):
        (folder / name).symlink_to(zoo_folder, target_is_directory=True)
    return folder


def check(case):
    return faults.check(case)  # tier 1 through the case's adapters where it has them


def test_the_reported_six_mlps_name_the_perturbed_linear(folder):
    """The small faults: one Linear perturbed by 0.5-5%, tier-1 defaults. The old fixed 0.05
    named it in 1 of 6; isolated error against the tier-1 budget names it in each."""
    for case in faults.small_weight_cases(folder):
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
    """fp32 (the same file, torch vs its export, another thread count), int8 and fp16: none
    named, not even within the budget; the reduced-precision ones say why."""
    for case in faults.clean_cases(folder, seeds=[0]):
        report = check(case)
        assert not report.error and report.first_divergence is None, case.name
        assert not report.budget.tier1_failed, case.name
        assert report.passed and report.undetermined == "" and not report.within_budget
        if case.precision != "fp32":
            # Every quantised/halved layer differs measurably, by design: named none, and said.
            assert report.within_budget_note.startswith(f"the pair computes in {case.precision}")
            assert report.summary()["within_budget_note"] == report.within_budget_note
        else:
            assert report.within_budget_note == ""


def test_a_tiny_fault_within_the_budget_is_named_as_measurable_not_failed(folder):
    """0.1% on one layer: within what tier 1 allows at the output (tier 1 passes, no layer over
    its allowance), yet measurably beyond the reference's own noise: named, flagged
    ``within_budget``, and the check still passes (the budget drives the verdict)."""
    from guard.verify.activation.decide import BASIS_NOISE

    case = faults.weight_cases(folder, seeds=[0], shares=(0.001,))[0]
    report = check(case)
    assert not report.budget.tier1_failed
    assert not any(layer.divergent for layer in report.layers)
    first = report.first_divergence
    assert first is not None and first.name == case.true_layer
    assert report.within_budget and report.basis == BASIS_NOISE and report.passed
    assert first.measurable < first.isolated.rel_error <= first.allowance
    assert report.suspects[0].name == case.true_layer
    summary = report.summary()
    assert summary["passed"] and summary["first_divergence"]["within_budget"] is True


def test_tie_broken_nms_is_a_clean_pair(folder):
    """The zoo detector, torch vs its ONNX export: tier 1 through ``stable_nms`` passes whatever
    order the two sorts leave tied scores in, and tier 2 names nothing."""
    case = faults.nms_clean_case(folder)
    tier1, _raw_passed = faults.tier1_for(case)  # raw: fails where the tie broke otherwise
    assert tier1.passed, tier1.summary()
    report = check(case)
    assert not report.error and report.pair == "torch/onnx"
    assert report.first_divergence is None and report.passed and not report.within_budget
    assert report.budget.tier1_failed is False


def test_silero_vad_cases(folder):
    """silero-vad's real ONNX (convolutions, an LSTM cell): a clean pair names none, a 1% LSTM
    gate perturbation is named."""
    pytest.importorskip("silero_vad")
    cases = {c.name: c for c in faults.silero_cases(folder)}
    clean = check(cases["vad-clean-fp32"])
    assert clean.first_divergence is None and clean.passed
    case = cases["vad-weight-node_linear_1-0.01"]
    report = check(case)
    assert not report.error
    assert report.first_divergence is not None and report.first_divergence.name == case.true_layer
    assert ranked_names(report)[0] == case.true_layer


def test_budget_comes_from_tier1_when_given(folder):
    from guard.verify.tensor import Tolerance, compare_outputs

    case = faults.small_weight_cases(folder)[3]
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
