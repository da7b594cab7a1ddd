"""Detection: boxes matched by IoU with class agreement, mAP against the reference, counts.

The reference's detections are the ground truth. Per image, detections scoring at most
``score_threshold`` (and non-finite ones: padding) are dropped. Then:

- matching: greedy over every (reference, primary) pair of the same class with IoU >=
  ``match_iou``, taken in a total order (IoU desc, reference score desc, reference index,
  primary index), so equal IoUs are broken the same way every time (tie-aware, deterministic).
  Pairs that overlap enough but disagree on the class are counted as class disagreements.
- mAP: per class, the primary's detections ranked by score (stable order: score desc, x1, y1)
  are true positives when they hit an unmatched reference box of that class at ``match_iou``;
  AP is the area under the precision envelope (all points), mAP their mean over the classes
  the reference has. No reference boxes: mAP 1 if the primary has none either, else 0.
- count mismatch: the largest per-image difference in the number of detections.
"""

from __future__ import annotations

import numpy as np

from guard.config import DetectionTaskConfig
from guard.verify.adapters import iou_matrix, stable_order
from guard.verify.task.base import OutputMissing, TaskCheck, TaskChecker


def _images(boxes, scores, labels, threshold):
    """Split batched outputs into per-image (boxes, scores, labels) with padding removed."""
    if boxes.ndim == 2:
        boxes, scores = boxes[None], scores[None]
        labels = labels[None] if labels is not None else None
    images = []
    for b in range(boxes.shape[0]):
        s = scores[b].astype(np.float64)
        keep = np.isfinite(s) & (s > threshold) & np.all(np.isfinite(boxes[b]), axis=1)
        lab = labels[b][keep].astype(np.int64) if labels is not None else np.zeros(
            int(keep.sum()), np.int64)
        images.append((boxes[b][keep].astype(np.float64), s[keep], lab))
    return images


def match(ref, out, iou_thr: float, class_aware: bool = True):
    """Greedy tie-aware matching; returns [(ref_index, primary_index, iou)]."""
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


def average_precision(tp: np.ndarray, n_gt: int) -> float:
    """All-point AP from a ranked TP/FP sequence."""
    if n_gt == 0:
        return 1.0 if len(tp) == 0 else 0.0
    if len(tp) == 0:
        return 0.0
    ctp = np.cumsum(tp)
    recall = ctp / n_gt
    precision = ctp / np.arange(1, len(tp) + 1)
    mrec = np.concatenate(([0.0], recall, [1.0]))
    mpre = np.concatenate(([0.0], precision, [0.0]))
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]
    idx = np.nonzero(mrec[1:] != mrec[:-1])[0]
    return float(np.sum((mrec[idx + 1] - mrec[idx]) * mpre[idx + 1]))


def mean_average_precision(refs, outs, iou_thr: float) -> float:
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


class DetectionChecker(TaskChecker):
    task = "detection"

    def __init__(self, config: DetectionTaskConfig):
        self.config = config

    def _arrays(self, outputs, side):
        c = self.config
        for name in (c.boxes_output, c.scores_output):
            if name not in outputs and side == "reference" and name not in self._other:
                raise OutputMissing(f"neither side has output '{name}'", on_neither_side=True)
            if name not in outputs:
                raise OutputMissing(f"{side} lacks output '{name}' (set checks.task.detection."
                                    f"{'boxes' if name == c.boxes_output else 'scores'}_output)")
        labels = outputs.get(c.classes_output) if c.classes_output else None
        return (np.asarray(outputs[c.boxes_output]), np.asarray(outputs[c.scores_output]),
                None if labels is None else np.asarray(labels))

    def _check(self, reference, primary, allowed) -> TaskCheck:
        c = self.config
        self._other = primary
        rb, rs, rl = self._arrays(reference, "reference")
        ob, os_, ol = self._arrays(primary, "primary")
        for side, (b, s, lab) in (("reference", (rb, rs, rl)), ("primary", (ob, os_, ol))):
            if b.ndim not in (2, 3) or b.shape[-1] != 4 or s.shape != b.shape[:-1] or (
                    lab is not None and lab.shape != s.shape):
                return TaskCheck(self.task, False, failure="shape", reasons=[
                    f"{side} detections do not line up: boxes {list(b.shape)}, scores "
                    f"{list(s.shape)}" + (f", labels {list(lab.shape)}" if lab is not None
                                          else "")])
        if (rb.ndim == 3) != (ob.ndim == 3) or (rb.ndim == 3 and rb.shape[0] != ob.shape[0]):
            return TaskCheck(self.task, False, failure="shape", reasons=[
                f"batch differs: primary boxes {list(ob.shape)}, reference {list(rb.shape)}"])
        class_aware = rl is not None and ol is not None
        notes = [] if class_aware else ["no class output on both sides: class-agnostic match"]
        refs = _images(rb, rs, rl if class_aware else None, c.score_threshold)
        outs = _images(ob, os_, ol if class_aware else None, c.score_threshold)

        matched = matched_any = 0
        ious: list[float] = []
        count_mismatch = 0
        for ref, out in zip(refs, outs):
            pairs = match(ref, out, c.match_iou, class_aware)
            matched += len(pairs)
            ious += [p[2] for p in pairs]
            if class_aware:
                matched_any += len(match(ref, out, c.match_iou, False))
            count_mismatch = max(count_mismatch, abs(len(ref[0]) - len(out[0])))
        n_ref = sum(len(r[0]) for r in refs)
        n_out = sum(len(o[0]) for o in outs)
        m_ap = mean_average_precision(refs, outs, c.match_iou)
        metrics = {
            "images": len(refs),
            "reference_boxes": n_ref,
            "primary_boxes": n_out,
            "matched": matched,
            "recall": matched / n_ref if n_ref else 1.0,
            "precision": matched / n_out if n_out else 1.0,
            "mean_matched_iou": float(np.mean(ious)) if ious else (1.0 if n_ref == 0 else 0.0),
            "map": m_ap,
            "count_mismatch": count_mismatch,
        }
        if class_aware:
            metrics["class_disagreements"] = max(0, matched_any - matched)
        check = TaskCheck(self.task, True, metrics, notes=notes)
        if m_ap < c.min_map:
            check.reasons.append(f"mAP {m_ap:.4f} < {c.min_map} ({matched} of {n_ref} reference "
                                 f"boxes matched at IoU {c.match_iou})")
        if c.max_count_mismatch is not None and count_mismatch > c.max_count_mismatch:
            check.reasons.append(f"box count differs by {count_mismatch} in an image (primary "
                                 f"{n_out}, reference {n_ref} in all) > {c.max_count_mismatch}")
        if check.reasons:
            check.passed, check.failure = False, "task"
        return check
