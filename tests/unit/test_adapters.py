"""Deterministic adapters (guard/verify/adapters.py): they remove tie-order artefacts and
nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from guard.config import ChecksConfig, ModelConfig
from guard.errors import ConfigError
from guard.verify.adapters import (
    AdapterChain,
    deterministic_nms,
    softmax64,
)
from guard.verify.pipeline import Comparator


def greedy_nms_in_given_order(boxes, scores, labels, thr=0.5):
    """A backend's NMS: keeps candidates in the order its sort left them (ties unstable)."""
    from guard.verify.adapters import iou_matrix

    keep = []
    for i in range(len(boxes)):
        if all(iou_matrix(boxes[i:i + 1], boxes[j:j + 1])[0, 0] <= thr or labels[i] != labels[j]
               for j in keep):
            keep.append(i)
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep]}


# Candidates: two overlapping boxes with the *same* score (IoU 0.68), and a clear third one.
CANDIDATES = {
    "boxes": np.array([[0, 0, 10, 10], [2, 0, 12, 10], [40, 40, 50, 50]], np.float32),
    "scores": np.array([0.8, 0.8, 0.6], np.float32),
    "labels": np.array([3, 3, 1], np.int64),
}


def backend_output(order):
    """What a detector whose sort broke the tie in ``order`` returns after its own NMS."""
    return greedy_nms_in_given_order(*(CANDIDATES[k][order] for k in ("boxes", "scores",
                                                                       "labels")))


def detection_verifier(adapters):
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-5, "rtol": 1e-5},
                                          "task": {"detection": {"match_iou": 0.7}}})
    return Comparator(checks, task="detection", adapters=model_adapters(adapters))


def model_adapters(adapters):
    return ModelConfig.model_validate({
        "name": "d", "task": "detection", "primary": {"backend": "torch", "path": "x:y"},
        "adapters": adapters}).adapters


def test_tie_broken_differently_fails_without_adapter_and_passes_with_it():
    # Both sides saw identical candidates; their sorts broke the 0.8 tie in opposite orders, so
    # NMS kept a different box. The candidates, not the kept boxes, go through the adapter.
    ref_candidates = {k: v.copy() for k, v in CANDIDATES.items()}
    out_candidates = {k: v[[1, 0, 2]] for k, v in CANDIDATES.items()}
    ref_after, out_after = backend_output([0, 1, 2]), backend_output([1, 0, 2])
    without = detection_verifier([]).check(ref_after, out_after)
    assert not without.passed
    assert without.failed_tiers() == ["tensor", "task"], without.summary()
    with_adapter = detection_verifier(["stable_nms"]).check(ref_candidates, out_candidates)
    assert with_adapter.passed, with_adapter.summary()
    assert with_adapter.max_abs_error == 0.0


def test_adapter_does_not_hide_a_moved_box():
    ref_candidates = {k: v.copy() for k, v in CANDIDATES.items()}
    moved = {k: v[[1, 0, 2]].copy() for k, v in CANDIDATES.items()}
    moved["boxes"][2] += np.float32(6.0)  # the lone box moves: IoU 16/184 with where it was
    result = detection_verifier(["stable_nms"]).check(ref_candidates, moved)
    assert not result.passed
    assert set(result.failed_tiers()) == {"tensor", "task"}
    assert result.task.metrics["matched"] == 1


def test_deterministic_nms_orders_ties_by_x1_then_y1():
    boxes = np.array([[5, 0, 6, 1], [1, 9, 2, 10], [1, 2, 2, 3]], np.float32)
    kept = deterministic_nms(boxes, np.ones(3), None, 0.5)
    assert kept.tolist() == [2, 1, 0]
    assert deterministic_nms(boxes, np.array([0.1, 0.2, 0.0]), None, 0.5).tolist() == [1, 0]
    assert deterministic_nms(boxes, np.ones(3), None, 0.5, max_detections=1).tolist() == [2]


def test_score_decimals_treats_float_noise_as_a_tie():
    boxes = np.array([[3, 0, 4, 1], [0, 0, 1, 1]], np.float32)
    scores = np.array([0.7000001, 0.7], np.float64)
    assert deterministic_nms(boxes, scores, None, 0.5).tolist() == [0, 1]
    assert deterministic_nms(boxes, scores, None, 0.5, score_decimals=4).tolist() == [1, 0]


def test_batched_stable_nms_pads_with_minus_inf():
    batch = {k: np.stack([v, v[[1, 0, 2]]]) for k, v in CANDIDATES.items()}
    batch["scores"][1, 2] = 0.0  # dropped by score_threshold 0
    out = AdapterChain(model_adapters(["stable_nms"])).apply(batch)
    assert out["boxes"].shape == (2, 2, 4)
    np.testing.assert_array_equal(out["scores"][0], np.float32([0.8, 0.6]))
    np.testing.assert_array_equal(out["scores"][1], np.float32([0.8, -np.inf]))
    assert out["labels"][1, 1] == -1


def test_tie_aware_topk_canonical_order():
    values = np.array([[0.5, 0.5, 0.2]], np.float32)
    a = {"values": values, "indices": np.array([[7, 3, 1]])}
    b = {"values": values, "indices": np.array([[3, 7, 1]])}
    chain = AdapterChain(model_adapters(["tie_aware_topk"]))
    np.testing.assert_array_equal(chain.apply(a)["indices"], [[3, 7, 1]])
    np.testing.assert_array_equal(chain.apply(a)["indices"], chain.apply(b)["indices"])


def test_canonical_order_of_set_like_outputs():
    rows = np.array([[3, 1], [1, 2], [1, 1]], np.float32)
    names = np.array([30, 12, 11])
    chain = AdapterChain(model_adapters([{"canonical_order": {"outputs": ["pts", "ids"]}}]))
    out = chain.apply({"pts": rows, "ids": names, "other": np.arange(2)})
    np.testing.assert_array_equal(out["pts"], [[1, 1], [1, 2], [3, 1]])
    np.testing.assert_array_equal(out["ids"], [11, 12, 30])
    np.testing.assert_array_equal(out["other"], np.arange(2))  # untouched
    per_image = AdapterChain(model_adapters([{"canonical_order": {"outputs": ["pts"],
                                                                  "axis": 1}}]))
    out = per_image.apply({"pts": np.stack([rows, rows[::-1]])})
    np.testing.assert_array_equal(out["pts"][0], out["pts"][1])


def test_float64_softmax():
    logits = np.array([[1000.0, 1000.0, 0.0]], np.float32)
    chain = AdapterChain(model_adapters([{"float64_softmax": {"outputs": ["logits"]}}]))
    probs = chain.apply({"logits": logits})["logits"]
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, [[0.5, 0.5, 0.0]])
    np.testing.assert_allclose(softmax64(np.zeros((2, 4))).sum(axis=1), 1.0)


def test_adapter_on_missing_output_fails_the_check_with_the_reason():
    result = detection_verifier(["stable_nms"]).check({"y": np.zeros(2)}, {"y": np.zeros(2)})
    assert not result.passed
    assert "stable_nms: output 'boxes' not found" in result.summary()


@pytest.mark.parametrize("entry, message", [
    ("nms_please", "unknown adapter 'nms_please'"),
    ({"stable_nms": {"iou": 0.5}}, "options.iou: unknown key"),
    ({"float64_softmax": {}}, "options.outputs: Field required"),
])
def test_bad_adapter_config_is_a_config_error(tmp_path, entry, message):
    from guard.plan.complete import parse_config

    doc = {"version": 1, "models": [{"name": "d", "primary": {"backend": "torch",
                                                              "path": "pkg:fn"},
                                     "adapters": [entry]}]}
    with pytest.raises(ConfigError) as info:
        parse_config(doc, tmp_path)
    assert any(line.startswith("models[0].adapters[0]") and message in line
               for line in info.value.problems), info.value.problems
