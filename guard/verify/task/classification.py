"""Classification: top-1 agreement, tie-aware top-k overlap, flips beyond the logit margin.

Per row of the logits output (class axis last). A *flip* is a row whose top-1 differs. Its
reference margin is ``ref[top1_ref] - ref[top1_primary]``: how far apart the reference put the
two classes. A flip whose margin is within ``tie_margin`` is a near-tie flip (two logits that
tier 1's tolerance itself treats as equal may swap); it is reported apart and does not count
against ``min_top1_agreement``. A flip beyond the margin is a real one.

Top-k overlap is tie-aware: the reference's top-k set is extended by every class within
``tie_margin`` of its k-th value, so a tie at the boundary cannot cost overlap.

Cost: the common sample (a few rows of a few logits, every row agreeing) takes a pure-Python
path, about ten times cheaper than the ~25 small numpy calls of the general one, whose fixed
cost dominated a compared sample's checks; it computes the same figures in the same float64
arithmetic (see ``_agreeing_overlaps``). Any flip, NaN, or larger output takes the numpy path.
"""

from __future__ import annotations

import numpy as np

from guard.config import ClassificationTaskConfig
from guard.verify.task.base import TaskCheck, TaskChecker

# The pure-Python path's bounds: beyond ~128 logits numpy's per-call cost is the smaller one;
# below 8 rows numpy's mean is a plain left-to-right sum (its pairwise summation starts at 8),
# which the Python path repeats exactly.
_SMALL_VALUES = 128
_SMALL_ROWS = 7


class ClassificationChecker(TaskChecker):
    task = "classification"

    config: ClassificationTaskConfig

    def _check(self, reference, primary, allowed) -> TaskCheck:
        c = self.config
        name, ref, out, mismatch = self._paired(reference, primary, c.logits_output, "logits",
                                                "classification.logits_output")
        if mismatch:
            return mismatch
        if ref.ndim == 0 or ref.shape[-1] < 2 or ref.size == 0:
            return TaskCheck(self.task, False, failure="shape", reasons=[
                f"'{name}' {list(ref.shape)} has no class axis of 2 or more (last axis)"])
        tie = c.tie_margin if c.tie_margin is not None else 2.0 * allowed.get(name, 0.0)
        classes = ref.shape[-1]
        if (ref.size <= _SMALL_VALUES and ref.size <= _SMALL_ROWS * classes
                and ref.dtype.kind == "f" and out.dtype.kind == "f"
                and c.min_top1_agreement <= 1.0):
            overlaps = _agreeing_overlaps(ref.reshape(-1, classes).tolist(),
                                          out.reshape(-1, classes).tolist(),
                                          min(c.top_k, classes), tie)
            if overlaps is not None:
                return self._agreeing(overlaps, min(c.top_k, classes), tie)
        ref = ref.reshape(-1, classes).astype(np.float64)
        out = out.reshape(-1, classes).astype(np.float64)
        rows = np.arange(len(ref))
        top1_ref = np.argmax(ref, axis=1)
        top1_out = np.argmax(out, axis=1)
        flipped = top1_ref != top1_out
        margin = ref[rows, top1_ref] - ref[rows, top1_out]
        near_tie = flipped & (margin <= tie)
        real = flipped & ~near_tie
        n = len(ref)

        k = min(c.top_k, ref.shape[1])
        kth = -np.sort(-ref, axis=1)[:, k - 1]
        ref_set = ref >= (kth - tie)[:, None]  # tie-extended reference top-k
        top_out = np.argsort(-out, axis=1, kind="stable")[:, :k]
        overlap = np.take_along_axis(ref_set, top_out, axis=1).sum(axis=1) / k

        agreement = 1.0 - real.sum() / n
        metrics = {
            "rows": n,
            "top1_agreement": float(1.0 - flipped.sum() / n),
            "top1_agreement_beyond_ties": float(agreement),
            "real_flips": int(real.sum()),
            "near_tie_flips": int(near_tie.sum()),
            f"top{k}_overlap": float(overlap.mean()),
            "min_reference_margin_of_flips": float(margin[flipped].min()) if flipped.any()
            else 0.0,
            "tie_margin": float(tie),
        }
        check = TaskCheck(self.task, True, metrics)
        if near_tie.any():
            check.notes.append(f"{int(near_tie.sum())} near-tie flip(s) (reference margin <= "
                               f"{tie:.3g}) not counted against agreement")
        if agreement < c.min_top1_agreement:
            worst = int(np.argmax(np.where(real, margin, -np.inf)))
            check.reasons.append(
                f"top-1 agreement {agreement:.4f} < {c.min_top1_agreement} ({int(real.sum())} "
                f"real flip(s) of {n}; e.g. row {worst}: class {int(top1_ref[worst])} -> "
                f"{int(top1_out[worst])}, reference margin {margin[worst]:.3g})")
        if overlap.mean() < c.min_topk_overlap:
            check.reasons.append(f"top-{k} overlap {overlap.mean():.4f} < {c.min_topk_overlap}")
        if check.reasons:
            check.passed, check.failure = False, "task"
        return check

    def _agreeing(self, overlaps: list[float], k: int, tie: float) -> TaskCheck:
        """The numpy path's result for rows whose top-1 all agree (no flip, so agreement is 1)."""
        total = 0.0
        for value in overlaps:  # numpy's mean below 8 values: a left-to-right sum, then / n
            total += value
        overlap = total / len(overlaps)
        check = TaskCheck(self.task, True, {
            "rows": len(overlaps),
            "top1_agreement": 1.0,
            "top1_agreement_beyond_ties": 1.0,
            "real_flips": 0,
            "near_tie_flips": 0,
            f"top{k}_overlap": overlap,
            "min_reference_margin_of_flips": 0.0,
            "tie_margin": float(tie),
        })
        if overlap < self.config.min_topk_overlap:
            check.reasons.append(f"top-{k} overlap {overlap:.4f} < {self.config.min_topk_overlap}")
            check.passed, check.failure = False, "task"
        return check


def _agreeing_overlaps(ref: list[list[float]], out: list[list[float]], k: int,
                       tie: float) -> list[float] | None:
    """Per row, the tie-aware top-k overlap, when every row's top-1 agrees and no value is
    NaN; else None (the numpy path decides). Python floats are the float64 values numpy's
    path computes with; ``max`` returns the first maximum, as ``argmax`` does; the top-k of
    the primary is a stable descending sort, as ``argsort(-x, kind="stable")``."""
    overlaps = []
    for r, o in zip(ref, out):
        for v in r:
            if v != v:
                return None
        for v in o:
            if v != v:
                return None
        classes = range(len(r))
        if max(classes, key=r.__getitem__) != max(classes, key=o.__getitem__):
            return None
        bound = sorted(r, reverse=True)[k - 1] - tie
        top = sorted(classes, key=o.__getitem__, reverse=True)[:k]
        hits = 0
        for i in top:
            if r[i] >= bound:
                hits += 1
        overlaps.append(hits / k)
    return overlaps
