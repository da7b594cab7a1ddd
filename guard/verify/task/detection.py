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
from guard.verify.adapters import iou_matrix
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


def match(ref, out, iou: np.ndarray, iou_thr: float, class_aware: bool = True):
    """Greedy tie-aware matching; returns [(ref_index, primary_index, iou)].

    ``iou`` is the image's reference x primary IoU matrix (computed once, shared with mAP).
    """
    (_, rs, rl), (_, _, ol) = ref, out
    if iou.size == 0:
        return []
    ok = iou >= iou_thr
    if class_aware:
        ok &= rl[:, None] == ol[None, :]
    ri, oi = np.nonzero(ok)
    pair_iou = iou[ri, oi]
    order = np.lexsort((oi, ri, -rs[ri], -pair_iou))
    # The greedy pass is sequential by nature; walk it over plain Python values (numpy scalars
    # cost several times more per step in this loop).
    used_r, used_o, pairs = set(), set(), []
    for r, o, v in zip(ri[order].tolist(), oi[order].tolist(), pair_iou[order].tolist()):
        if r in used_r or o in used_o:
            continue
        used_r.add(r)
        used_o.add(o)
        pairs.append((r, o, v))
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


def mean_average_precision(refs, outs, ious, iou_thr: float) -> float:
    """mAP of the primary with the reference as ground truth; ``ious`` as for ``match``, per image.

    Each ranked detection takes the best-IoU (then lowest-index) still unmatched reference box of
    its class and image when that IoU reaches ``iou_thr``. That is the same as walking the
    candidate pairs (IoU >= ``iou_thr``, same class) in order of (detection rank, IoU desc,
    reference index) and taking the first pair whose reference box is free, which needs one IoU
    matrix per image instead of one IoU row per detection.
    """
    classes, n_gt = np.unique(np.concatenate([r[2] for r in refs]), return_counts=True)
    if not len(classes):
        return 1.0 if all(len(o[0]) == 0 for o in outs) else 0.0
    # Every primary detection of every image, ranked per class by (score desc, x1, y1, image,
    # index): the per-image stable order merged across images in image order.
    image = np.concatenate([np.full(len(o[0]), i) for i, o in enumerate(outs)])
    index = np.concatenate([np.arange(len(o[0])) for o in outs])
    boxes = np.concatenate([o[0] for o in outs]).reshape(-1, 4)
    scores = np.concatenate([o[1] for o in outs])
    labels = np.concatenate([o[2] for o in outs])
    order = np.lexsort((index, image, boxes[:, 1], boxes[:, 0], -scores, labels))
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    # Candidate pairs (detection rank, IoU, reference id), reference ids unique across images.
    det_ranks, pair_ious, ref_ids = [], [], []
    first = np.cumsum([0] + [len(o[0]) for o in outs])
    ref_first = np.cumsum([0] + [len(r[0]) for r in refs])
    for img, ((_, _, rl), (_, _, ol), iou) in enumerate(zip(refs, outs, ious)):
        ri, oi = np.nonzero((iou >= iou_thr) & (rl[:, None] == ol[None, :]))
        det_ranks.append(rank[first[img] + oi])
        pair_ious.append(iou[ri, oi])
        ref_ids.append(ref_first[img] + ri)
    ref_id, pair_iou, det_rank = (np.concatenate(a) for a in (ref_ids, pair_ious, det_ranks))
    walk = np.lexsort((ref_id, -pair_iou, det_rank))
    tp = np.zeros(len(order))
    taken, done = set(), set()
    for d, r in zip(det_rank[walk].tolist(), ref_id[walk].tolist()):
        if d in done or r in taken:
            continue
        done.add(d)
        taken.add(r)
        tp[d] = 1
    # Ranked by class first: each class's detections are one slice of ``tp``.
    lo = np.searchsorted(labels[order], classes, "left").tolist()
    hi = np.searchsorted(labels[order], classes, "right").tolist()
    aps = [average_precision(tp[a:b], n) for a, b, n in zip(lo, hi, n_gt.tolist())]
    return float(np.mean(aps))


class DetectionChecker(TaskChecker):
    task = "detection"

    config: DetectionTaskConfig

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
        # One reference x primary IoU matrix per image, shared by both matchings and mAP.
        image_ious = [iou_matrix(ref[0], out[0]) for ref, out in zip(refs, outs)]
        for ref, out, iou in zip(refs, outs, image_ious):
            pairs = match(ref, out, iou, c.match_iou, class_aware)
            matched += len(pairs)
            ious += [p[2] for p in pairs]
            if class_aware:
                matched_any += len(match(ref, out, iou, c.match_iou, False))
            count_mismatch = max(count_mismatch, abs(len(ref[0]) - len(out[0])))
        n_ref = sum(len(r[0]) for r in refs)
        n_out = sum(len(o[0]) for o in outs)
        m_ap = mean_average_precision(refs, outs, image_ious, c.match_iou)
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
