"""Tier 3 (guard/verify/task/): each task's metrics on hand-made outputs with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from guard.config import ChecksConfig, TaskCheckConfig
from guard.verify.pipeline import Comparator
from guard.verify.task import task_checker
from guard.verify.task.detection import average_precision


def checker(task: str, **block):
    return task_checker(task, TaskCheckConfig.model_validate({task: block} if block else {}))


# -- classification --------------------------------------------------------------------------------
def test_classification_identical_logits_agree_fully():
    logits = np.random.default_rng(0).normal(size=(8, 10)).astype(np.float32)
    check = checker("classification").check({"logits": logits}, {"logits": logits.copy()})
    assert check.passed, check.summary()
    assert check.metrics["top1_agreement"] == 1.0
    assert check.metrics["top5_overlap"] == 1.0
    assert check.metrics["real_flips"] == 0 and check.metrics["near_tie_flips"] == 0


def test_near_tie_flip_is_reported_apart_and_does_not_fail():
    ref = np.array([[2.0, 2.0 - 1e-6, -1.0], [5.0, 0.0, 0.0]])
    out = np.array([[2.0 - 2e-6, 2.0, -1.0], [5.0, 0.0, 0.0]])
    check = checker("classification", tie_margin=1e-4).check({"logits": ref}, {"logits": out})
    assert check.passed, check.summary()
    assert check.metrics["top1_agreement"] == 0.5  # raw agreement still shows the flip
    assert check.metrics["near_tie_flips"] == 1 and check.metrics["real_flips"] == 0
    assert check.metrics["top1_agreement_beyond_ties"] == 1.0
    assert any("near-tie" in n for n in check.notes)


def test_real_flip_beyond_the_margin_fails_with_the_row():
    ref = np.array([[3.0, 1.0, 0.0], [0.0, 4.0, 1.0]])
    out = np.array([[3.0, 1.0, 0.0], [0.0, 1.0, 4.0]])
    check = checker("classification", tie_margin=1e-3).check({"logits": ref}, {"logits": out})
    assert not check.passed and check.failure == "task"
    assert check.metrics["real_flips"] == 1
    assert "row 1: class 1 -> 2" in check.reasons[0]
    assert "reference margin 3" in check.reasons[0]


def test_default_tie_margin_is_twice_tier_one_allowed_error():
    ref = np.array([[1.0, 1.0 - 1e-5, 0.0]])
    out = np.array([[1.0 - 1e-5, 1.0, 0.0]])
    cls = checker("classification")
    # Without tier 1's allowed error the flip is real; with it (2 x 1e-5 > margin) a near tie.
    assert not cls.check({"logits": ref}, {"logits": out}).passed
    check = cls.check({"logits": ref}, {"logits": out}, allowed={"logits": 1e-5})
    assert check.passed and check.metrics["tie_margin"] == pytest.approx(2e-5)


def test_topk_overlap_threshold_and_tie_awareness():
    ref = np.array([[9.0, 8.0, 7.0, 1.0, 1.0, 0.0]])
    swapped = np.array([[9.0, 8.0, 1.0, 7.0, 1.0, 0.0]])  # top-3 loses class 2
    failing = checker("classification", top_k=3, min_topk_overlap=1.0)
    check = failing.check({"logits": ref}, {"logits": swapped})
    assert check.metrics["top3_overlap"] == pytest.approx(2 / 3)
    assert not check.passed and "top-3 overlap" in check.reasons[0]
    # Classes 3 and 4 tie in the reference at the boundary of its top-4: either one counts.
    tied = checker("classification", top_k=4, min_topk_overlap=1.0, tie_margin=0.0)
    ref4 = np.array([[9.0, 8.0, 7.0, 1.0, 1.0, 0.0]])
    out4 = np.array([[9.0, 8.0, 7.0, 0.5, 1.5, 0.0]])
    assert tied.check({"logits": ref4}, {"logits": out4}).passed


def test_classification_small_path_gives_the_numpy_paths_result(monkeypatch):
    """Small agreeing logits take a pure-Python path; on random logits (ties, +/-0, Inf, NaN,
    flips, float16/32/64, 1-8 rows, every top_k / tie margin / overlap bound) its result is
    the numpy path's, figure for figure."""
    import guard.verify.task.classification as classification

    rng = np.random.default_rng(20)
    taken = []
    agreeing = classification.ClassificationChecker._agreeing
    monkeypatch.setattr(classification.ClassificationChecker, "_agreeing",
                        lambda self, *a: taken.append(1) or agreeing(self, *a))
    for _ in range(1500):
        dtype = rng.choice([np.float16, np.float32, np.float64])
        ref = rng.standard_normal((int(rng.integers(1, 9)), int(rng.choice([2, 3, 10])))
                                  ).astype(dtype)
        kind = rng.integers(0, 4)
        if kind == 1:
            ref = (np.round(ref * 2) / 2).astype(dtype)  # exact ties
        out = (ref + rng.standard_normal(ref.shape) * 10.0 ** -int(rng.integers(1, 6))
               ).astype(dtype)
        if kind == 2:
            out = ref.copy()
        if kind == 3:
            side = ref if rng.random() < 0.5 else out
            side[tuple(rng.integers(0, n) for n in ref.shape)] = rng.choice(
                [np.inf, -np.inf, np.nan, -0.0])
        block = {"top_k": int(rng.integers(1, 7))}
        if rng.random() < 0.3:
            block["tie_margin"] = float(rng.choice([0.0, 1e-3, 0.5]))
        if rng.random() < 0.3:
            block["min_topk_overlap"] = float(rng.choice([0.5, 0.9, 1.0]))
        allowed = {"logits": float(rng.choice([0.0, 1e-4, 0.3]))}
        check = checker("classification", **block)
        with np.errstate(invalid="ignore"):
            fast = check.check({"logits": ref}, {"logits": out}, allowed)
            monkeypatch.setattr(classification, "_SMALL_VALUES", 0)
            general = check.check({"logits": ref}, {"logits": out}, allowed)
        monkeypatch.setattr(classification, "_SMALL_VALUES", 128)
        assert repr(fast.as_dict()) == repr(general.as_dict()) and \
            fast.summary() == general.summary()
    assert len(taken) > 300  # the small path was taken, not only the general one


def test_classification_output_selection_and_missing_output():
    logits = np.zeros((1, 3))
    two = {"a": logits, "b": logits}
    check = checker("classification").check(two, two)
    assert not check.passed and check.failure == "shape"
    assert "set checks.task.classification.logits_output" in check.reasons[0]
    check = checker("classification", logits_output="a").check(two, {"b": logits})
    assert not check.passed and "primary lacks output 'a'" in check.reasons[0]
    shape = checker("classification").check({"y": np.zeros((2, 3))}, {"y": np.zeros((2, 4))})
    assert not shape.passed and shape.failure == "shape" and "shape" in shape.reasons[0]


# -- detection -------------------------------------------------------------------------------------
def dets(boxes, scores, labels):
    return {"boxes": np.array(boxes, np.float32).reshape(-1, 4),
            "scores": np.array(scores, np.float32), "labels": np.array(labels, np.int64)}


REF = dets([[0, 0, 10, 10], [20, 20, 30, 30], [0, 20, 10, 30]], [0.9, 0.8, 0.7], [1, 2, 1])


def test_detection_permuted_boxes_match_fully():
    perm = [2, 0, 1]
    out = {k: v[perm] for k, v in REF.items()}
    check = checker("detection").check(REF, out)
    assert check.passed, check.summary()
    assert check.metrics["map"] == 1.0 and check.metrics["recall"] == 1.0
    assert check.metrics["count_mismatch"] == 0 and check.metrics["class_disagreements"] == 0


def test_detection_moved_box_fails_and_class_swap_is_counted():
    moved = {k: v.copy() for k, v in REF.items()}
    moved["boxes"][1] += 8  # IoU with its reference box: 4/196 < 0.5
    check = checker("detection").check(REF, moved)
    assert not check.passed and check.metrics["matched"] == 2
    assert check.metrics["map"] == pytest.approx(0.5)  # class 1: AP 1; class 2: AP 0
    assert "mAP" in check.reasons[0]
    swapped = {k: v.copy() for k, v in REF.items()}
    swapped["labels"][0] = 2
    check = checker("detection").check(REF, swapped)
    assert not check.passed and check.metrics["class_disagreements"] == 1


def test_detection_count_mismatch_and_padding_ignored():
    extra = dets(np.vstack([REF["boxes"], [[50, 50, 60, 60]]]), [0.9, 0.8, 0.7, 0.6],
                 [1, 2, 1, 1])
    check = checker("detection").check(REF, extra)
    assert check.metrics["count_mismatch"] == 1 and not check.passed
    assert "box count differs by 1" in " ".join(check.reasons)
    padded = dets(np.vstack([REF["boxes"], [[0, 0, 0, 0]]]), [0.9, 0.8, 0.7, -np.inf],
                  [1, 2, 1, -1])
    assert checker("detection").check(REF, padded).passed


def test_detection_batched_and_class_agnostic():
    ref = {"boxes": np.stack([REF["boxes"], REF["boxes"]]), "scores": np.stack([REF["scores"]] * 2)}
    out = {k: v.copy() for k, v in ref.items()}
    check = checker("detection").check(ref, out)
    assert check.passed and check.metrics["images"] == 2
    assert any("class-agnostic" in n for n in check.notes)
    bad = checker("detection").check(ref, {"boxes": ref["boxes"][:1], "scores": ref["scores"][:1]})
    assert not bad.passed and bad.failure == "shape"


def test_average_precision_known_values():
    assert average_precision(np.array([1, 1]), 2) == 1.0
    assert average_precision(np.array([0, 1]), 1) == pytest.approx(0.5)
    assert average_precision(np.array([1, 0, 1]), 4) == pytest.approx(0.25 + 0.25 * 2 / 3)
    assert average_precision(np.array([]), 0) == 1.0


# -- segmentation ----------------------------------------------------------------------------------
def test_segmentation_pixel_agreement_and_miou():
    ref = np.zeros((1, 2, 4, 4), np.float32)
    ref[:, 1, :, :2] = 1.0  # class 1 on the left half
    out = ref.copy()
    out[:, 1, 0, 2] = 2.0  # one pixel flips to class 1
    check = checker("segmentation", min_pixel_agreement=0.9, min_miou=0.5).check(
        {"mask": ref}, {"mask": out})
    assert check.passed
    assert check.metrics["pixel_agreement"] == pytest.approx(15 / 16)
    assert check.metrics["miou"] == pytest.approx((8 / 9 + 7 / 8) / 2)
    strict = checker("segmentation").check({"mask": ref}, {"mask": out})
    assert not strict.passed and "pixel agreement" in strict.reasons[0]


def test_segmentation_integer_label_masks():
    ref = np.array([[0, 1], [2, 2]])
    check = checker("segmentation").check({"mask": ref}, {"mask": ref.copy()})
    assert check.passed and check.metrics["miou"] == 1.0 and check.metrics["classes"] == 3


# -- embedding -------------------------------------------------------------------------------------
def test_embedding_cosine_and_neighbours():
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(6, 16))
    near = ref + 1e-6 * rng.normal(size=ref.shape)
    check = checker("embedding").check({"embedding": ref}, {"embedding": near})
    assert check.passed and check.metrics["neighbour_agreement"] == 1.0
    assert check.metrics["min_cosine"] > 0.9999
    rotated = ref.copy()
    rotated[2] = -ref[2]
    check = checker("embedding").check({"embedding": ref}, {"embedding": rotated})
    assert not check.passed and "row 2" in check.reasons[0]


def test_embedding_small_batch_states_neighbours_not_applicable():
    ref = np.eye(2)
    check = checker("embedding").check({"e": ref}, {"e": ref})
    assert check.passed and "not applicable" in check.notes[0]


# -- generic and the Comparator --------------------------------------------------------------------
def test_generic_has_no_task_tier_and_says_so():
    comparator = Comparator(ChecksConfig(), task="generic")
    assert comparator.tiers == ("tensor",)
    result = comparator.check({"y": np.zeros(3)}, {"y": np.zeros(3)})
    assert result.passed and list(result.tiers) == ["tensor"]
    assert "tier 1 (tensor) only" in result.notes[0]


def test_verifier_runs_task_tier_with_tier_one_tie_margin():
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-3, "rtol": 0.0}})
    comparator = Comparator(checks, task="classification")
    assert comparator.tiers == ("tensor", "task")
    ref = {"logits": np.array([[1.0, 1.0 - 1e-4, 0.0]])}
    out = {"logits": np.array([[1.0 - 1e-4, 1.0, 0.0]])}
    result = comparator.check(ref, out)
    assert result.passed, result.summary()
    assert result.task.metrics["near_tie_flips"] == 1
    moved = {"logits": np.array([[0.0, 1.0, 5.0]])}
    result = comparator.check(ref, moved)
    assert not result.passed and result.failed_tiers() == ["tensor", "task"]
    assert "task: fail (classification)" in result.summary()


def test_task_block_of_another_task_is_a_config_error(tmp_path):
    from guard.plan.complete import parse_config
    from guard.errors import ConfigError

    doc = {"version": 1, "models": [{"name": "c", "task": "classification",
                                     "primary": {"backend": "torch", "path": "pkg:fn"},
                                     "checks": {"task": {"detection": {"match_iou": 0.5}}}}]}
    with pytest.raises(ConfigError) as info:
        parse_config(doc, tmp_path)
    assert info.value.problems == [
        "models[0]: checks.task.detection is set but the model's task is 'classification'"]


def test_task_tier_is_left_out_when_neither_side_has_its_output():
    # A client that asked for other outputs only: nothing to judge, nothing to count.
    comparator = Comparator(ChecksConfig(), task="detection")
    result = comparator.check({"feat": np.zeros(2)}, {"feat": np.zeros(2)})
    assert list(result.tiers) == ["tensor"] and result.passed
    assert "tier 3 not run on this sample: neither side has output 'boxes'" in result.notes[0]
