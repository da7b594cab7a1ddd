"""guard/verify/batched.py: the batched tiers 1 and 3 give each record of a stacked batch the
reports ``Comparator.check`` gives it alone, with real ONNX Runtime sessions (the zoo CNN, int8
primary against its fp32 reference: some records pass, some fail, some flip top-1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from guard.config import ModelConfig
from guard.verify.batched import batchable, check_stacked
from guard.replay.execute import ModelRunner
from guard.replay.items import CHECKED, Batch, ReplayItem
from guard.verify.pipeline import Comparator
from guard.zoo.classifier import sample_inputs

# Optional statistics of a passing output: the batched path leaves them out (documented).
OPTIONAL = {"mean_abs", "p99_abs", "max_rel", "cosine_distance", "stats"}


def comparable(reports: dict) -> dict:
    out = {}
    for tier, r in reports.items():
        outputs = [{k: v for k, v in o.as_dict().items() if k not in OPTIONAL or not o.passed}
                   for o in r.outputs]
        out[tier] = (r.passed, r.summary, outputs, r.details)
    return out


@pytest.fixture(scope="module", params=[0.05, None], ids=["tie-0.05", "tie-2x-allowed"])
def runner(zoo_classifier, request):
    onnx = str(zoo_classifier["onnx"])
    config = ModelConfig.model_validate({
        "name": "cnn", "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx, "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": onnx},
        # about half the records within tier 1; tier 3 strict: any top-5 change fails it
        "checks": {"tensor": {"atol": 0.45, "rtol": 0.0},
                   "task": {"classification": {"min_top1_agreement": 1.0, "top_k": 5,
                                               "min_topk_overlap": 1.0,
                                               "tie_margin": request.param}}},
    })
    runner = ModelRunner(config).load()
    yield runner
    runner.close()


@pytest.mark.parametrize("max_rows", [3, 1], ids=["1-3-rows", "one-row-each"])
def test_stacked_checks_equal_record_by_record(runner, max_rows):
    images = sample_inputs(120, seed=5)
    items, start = [], 0
    while start < len(images):  # records of 1-3 rows, as the sidecar captures requests
        rows = 1 + len(items) % max_rows
        items.append(ReplayItem(len(items), "cnn", {"image": images[start:start + rows]}))
        start += rows
    inferred = runner.infer(Batch("cnn", items))
    assert inferred.stacked is not None and not inferred.done
    batched = check_stacked(runner.comparator, inferred.stacked.reference,
                            inferred.stacked.primary, [it.rows for it in items])
    fast = [k for k, r in enumerate(batched) if r is not None]
    assert 0 < len(fast) < len(items)  # both paths taken: a real comparison
    outcomes = runner.check(inferred)
    assert [o.index for o in outcomes] == [it.index for it in items]
    alone = inferred.stacked.split()
    verdicts = set()
    for outcome, (item, reference, primary) in zip(outcomes, alone):
        expected = runner.comparator.tier_reports(
            runner.comparator.check(reference, primary, inputs=item.inputs))
        assert outcome.status == CHECKED
        assert comparable(outcome.tiers) == comparable(expected), f"record {item.index}"
        verdicts.add(tuple(r.passed for r in expected.values()))
    # passes and tier-1 failures occurred; with a small tie margin, tier-3 failures too
    assert {(True, True), (False, True)} <= verdicts
    if runner.config.checks.task.classification.tie_margin is not None:
        assert any(not v[1] for v in verdicts)
    for k in fast:
        assert all(r.passed for r in batched[k].values())
        assert batched[k]["task"].details["metrics"]["rows"] == items[k].rows


def test_nonfinite_values_go_to_the_per_record_checks(runner):
    images = sample_inputs(4, seed=1)
    items = [ReplayItem(k, "cnn", {"image": images[k:k + 1]}) for k in range(4)]
    inferred = runner.infer(Batch("cnn", items))
    inferred.stacked.primary["logits"][2, 0] = np.nan
    batched = check_stacked(runner.comparator, inferred.stacked.reference,
                            inferred.stacked.primary, [1] * 4)
    assert batched[2] is None
    outcome = runner.check(inferred)[2]
    assert not outcome.tiers["tensor"].passed
    assert "NaN/Inf" in outcome.tiers["tensor"].summary
    assert math.isnan(inferred.stacked.primary["logits"][2, 0])


def test_adapters_and_extra_tiers_keep_the_per_record_path():
    base = {"name": "m", "task": "classification",
            "primary": {"backend": "torch", "path": "x:y"}}
    assert batchable(Comparator.for_model(ModelConfig.model_validate(base)))
    detection = ModelConfig.model_validate(base | {"task": "detection"})
    assert not batchable(Comparator.for_model(detection))
    sweep = Comparator.for_model(ModelConfig.model_validate(base))
    sweep.pass_stats = True
    assert not batchable(sweep)
    extra = Comparator.for_model(ModelConfig.model_validate(base))
    extra.add_tier(type("Tier", (), {"name": "activation", "check": lambda *a, **k: None})())
    assert not batchable(extra)
