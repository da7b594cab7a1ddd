"""The vectorised detection check equals the readable original, metric for metric, bit for bit.

``reference_match``, ``reference_map`` and ``reference_metrics`` below are the original
implementation of guard/verify/task/detection.py (one IoU row per ranked detection, Python tuples
for the ranking), kept here on purpose as the readable statement of the contract that the fast one
must equal. Do not "fix" them to follow the module: a difference here is a change of results.
"""

from __future__ import annotations

import numpy as np
import pytest

from guard.config import TaskCheckConfig
from guard.verify.adapters import iou_matrix, stable_order
from guard.verify.task import task_checker
from guard.verify.task.detection import _images, average_precision, match


# -- the original, kept as the reference -----------------------------------------------------------
def reference_match(ref, out, iou_thr, class_aware=True):
    (rb, rs, rl), (ob, _, ol) = ref, out
    if len(rb) == 0 or len(ob) == 0:
        return []
    iou = iou_matrix(rb, ob)
    ok = iou >= iou_thr
    if class_aware:
        ok &= rl[:, None] == ol[None, :]
    ri, oi = np.nonzero(ok)
    order = np.lexsort((oi, ri, -rs[ri], -iou[ri, oi]))
    used_r, used_o, pairs = set(), set(), []
    for k in order:
        r, o = int(ri[k]), int(oi[k])
        if r in used_r or o in used_o:
            continue
        used_r.add(r)
        used_o.add(o)
        pairs.append((r, o, float(iou[r, o])))
    return pairs


def reference_map(refs, outs, iou_thr):
    classes = sorted({int(c) for _, _, labels in refs for c in labels})
    if not classes:
        return 1.0 if all(len(o[0]) == 0 for o in outs) else 0.0
    aps = []
    for c in classes:
        ranked = []  # (image, index) of the primary's class-c detections, globally ranked
        for img, (ob, os_, ol) in enumerate(outs):
            idx = np.nonzero(ol == c)[0]
            for rank, j in enumerate(idx[stable_order(ob[idx], os_[idx])]):
                ranked.append((-os_[j], ob[j, 0], ob[j, 1], img, rank, int(j)))
        ranked.sort()
        n_gt = sum(int(np.count_nonzero(rl == c)) for _, _, rl in refs)
        taken = [np.zeros(len(r[0]), bool) for r in refs]
        tp = np.zeros(len(ranked))
        for k, (*_, img, _, j) in enumerate(ranked):
            rb, _, rl = refs[img]
            cand = np.nonzero((rl == c) & ~taken[img])[0]
            if cand.size == 0:
                continue
            ious = iou_matrix(outs[img][0][j:j + 1], rb[cand])[0]
            best = int(np.argmax(ious))
            if ious[best] >= iou_thr:
                taken[img][cand[best]] = True
                tp[k] = 1
        aps.append(average_precision(tp, n_gt))
    return float(np.mean(aps))


def reference_metrics(reference, primary, config, class_aware):
    """The metrics the original DetectionChecker._check reported (inputs already line up)."""
    def images(side):
        labels = side["labels"] if class_aware else None
        return _images(side["boxes"], side["scores"], labels, config.score_threshold)

    refs, outs = images(reference), images(primary)
    matched = matched_any = count_mismatch = 0
    ious = []
    for ref, out in zip(refs, outs):
        pairs = reference_match(ref, out, config.match_iou, class_aware)
        matched += len(pairs)
        ious += [p[2] for p in pairs]
        if class_aware:
            matched_any += len(reference_match(ref, out, config.match_iou, False))
        count_mismatch = max(count_mismatch, abs(len(ref[0]) - len(out[0])))
    n_ref = sum(len(r[0]) for r in refs)
    n_out = sum(len(o[0]) for o in outs)
    metrics = {
        "images": len(refs), "reference_boxes": n_ref, "primary_boxes": n_out,
        "matched": matched,
        "recall": matched / n_ref if n_ref else 1.0,
        "precision": matched / n_out if n_out else 1.0,
        "mean_matched_iou": float(np.mean(ious)) if ious else (1.0 if n_ref == 0 else 0.0),
        "map": reference_map(refs, outs, config.match_iou),
        "count_mismatch": count_mismatch,
    }
    if class_aware:
        metrics["class_disagreements"] = max(0, matched_any - matched)
    return metrics, refs, outs


# -- seeded random cases that stress the ties ------------------------------------------------------
def random_side(rng, batch, n, like=None):
    """Boxes on a coarse grid (duplicates and exact IoU ties), scores from a small set (equal
    scores), some padding rows; ``like`` makes a jittered, shuffled, partly relabelled copy."""
    shape = (n,) if batch is None else (batch, n)
    if like is not None and rng.random() < 0.7 and like["boxes"].shape[-2] == n:
        boxes = like["boxes"].astype(np.float64).copy()
        moved = rng.random(shape) < 0.3
        boxes[moved] += rng.integers(-1, 2, size=(int(moved.sum()), 4))
        perm = rng.permutation(n)
        boxes = boxes[..., perm, :]
        scores = like["scores"].astype(np.float64)[..., perm].copy()
        labels = like["labels"][..., perm].copy()
        flip = rng.random(shape) < 0.15
        labels[flip] = rng.integers(0, 3, size=int(flip.sum()))
    else:
        if rng.random() < 0.8:  # integer grid: many identical boxes and equal IoUs
            span = int(rng.choice([3, 6]))  # 3: crowded, most boxes overlap
            xy = rng.integers(0, span, size=shape + (2,))
            wh = rng.integers(1, 4, size=shape + (2,))
        else:
            xy = rng.uniform(0, 10, size=shape + (2,))
            wh = rng.uniform(0, 4, size=shape + (2,))  # 0 width: degenerate boxes
        boxes = np.concatenate([xy, xy + wh], axis=-1).astype(np.float64)
        scores = rng.choice([0.3, 0.5, 0.5, 0.9], size=shape) if rng.random() < 0.6 else \
            rng.uniform(0, 1, size=shape)
        labels = rng.integers(0, int(rng.choice([1, 2, 3])), size=shape)
    if n > 1 and rng.random() < 0.5:  # exact duplicates: ties broken by index alone
        src, dst = rng.integers(0, n, size=2)
        boxes[..., dst, :], scores[..., dst], labels[..., dst] = \
            boxes[..., src, :], scores[..., src], labels[..., src]
    padding = rng.random(shape) < rng.choice([0.0, 0.0, 0.2, 0.5, 1.0])  # 1.0: empty images
    scores = np.where(padding, rng.choice([-np.inf, np.nan, 0.0]), scores)
    dtype = rng.choice([np.float32, np.float64])
    return {"boxes": boxes.astype(dtype), "scores": scores.astype(dtype),
            "labels": labels.astype(np.int64)}


CASES = 400


@pytest.mark.parametrize("seed", range(4))
def test_fast_detection_check_equals_the_original(seed):
    rng = np.random.default_rng(seed)
    seen = {"matched": 0, "unmatched": 0, "empty image": 0, "class-agnostic": 0, "batched": 0,
            "equal scores": 0, "iou ties": 0}
    for _ in range(CASES // 4):
        batch = None if rng.random() < 0.4 else int(rng.integers(1, 4))
        reference = random_side(rng, batch, int(rng.integers(0, 10)))
        n = reference["boxes"].shape[-2] if rng.random() < 0.7 else int(rng.integers(0, 10))
        primary = random_side(rng, batch, n, like=reference)
        class_aware = rng.random() < 0.7
        block = {"match_iou": float(rng.choice([0.0, 0.25, 0.5, 0.7, 1.0])),
                 "score_threshold": float(rng.choice([0.0, 0.4])),
                 **({} if class_aware else {"classes_output": None})}
        checker = task_checker("detection", TaskCheckConfig.model_validate({"detection": block}))
        expected, refs, outs = reference_metrics(reference, primary, checker.config, class_aware)

        check = checker.check(reference, primary)
        assert check.metrics == expected, (block, reference, primary)
        for ref, out in zip(refs, outs):
            iou = iou_matrix(ref[0], out[0])
            for aware in (True, False):
                assert match(ref, out, iou, block["match_iou"], aware) == \
                    reference_match(ref, out, block["match_iou"], aware)
            side = np.concatenate([ref[1], out[1]])
            seen["equal scores"] += len(np.unique(side)) < len(side)
            seen["iou ties"] += len(np.unique(iou[iou > 0])) < np.count_nonzero(iou > 0)
            seen["empty image"] += len(ref[0]) == 0 or len(out[0]) == 0
        seen["matched"] += expected["matched"] > 0
        seen["unmatched"] += expected["matched"] < expected["reference_boxes"]
        seen["class-agnostic"] += not class_aware
        seen["batched"] += batch is not None
    # The cases did reach what they are meant to stress.
    assert all(seen.values()), seen


def test_exact_iou_tie_between_reference_boxes_goes_to_the_lower_index():
    # The first detection overlaps both reference boxes at IoU 3/5 exactly; taking box 0 leaves
    # the second detection (box 0 itself) only box 1 at IoU 1/3: one hit of two, AP 0.5.
    reference = {"boxes": np.array([[0, 0, 2, 2], [1, 0, 3, 2]], np.float32),
                 "scores": np.array([0.9, 0.9], np.float32), "labels": np.array([0, 0])}
    primary = {"boxes": np.array([[0.5, 0, 2.5, 2], [0, 0, 2, 2]], np.float32),
               "scores": np.array([0.8, 0.7], np.float32), "labels": np.array([0, 0])}
    checker = task_checker("detection", TaskCheckConfig.model_validate({"detection": {}}))
    expected, _, _ = reference_metrics(reference, primary, checker.config, class_aware=True)
    assert expected["map"] == 0.5
    assert checker.check(reference, primary).metrics == expected
