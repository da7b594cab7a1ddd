"""Embeddings: cosine per vector, and nearest-neighbour agreement over the batch.

Neighbour agreement: for each row, its nearest other row by cosine under the primary must be
one of the reference's nearest (the best, or any within ``neighbour_tie`` of it: a tie at the
top cannot count as a disagreement). It needs three rows or more; below that it is reported
as not applicable and does not fail the check.
"""

from __future__ import annotations

import numpy as np

from guard.config import EmbeddingTaskConfig
from guard.verify.task.base import TaskCheck, TaskChecker


def _unit(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norms = np.linalg.norm(rows, axis=1)
    safe = np.where(norms > 0, norms, 1.0)
    return rows / safe[:, None], norms


def row_cosines(ref: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Cosine per row; two zero vectors agree (1), a zero against a non-zero does not (0)."""
    ur, nr = _unit(ref)
    uo, no = _unit(out)
    cos = np.sum(ur * uo, axis=1)
    both_zero = (nr == 0) & (no == 0)
    return np.where(both_zero, 1.0, np.where((nr == 0) | (no == 0), 0.0, cos))


def neighbour_agreement(ref: np.ndarray, out: np.ndarray, tie: float) -> np.ndarray:
    """Per row: does the primary's nearest neighbour belong to the reference's (tied) nearest?"""
    ur, _ = _unit(ref)
    uo, _ = _unit(out)
    sim_ref = ur @ ur.T
    sim_out = uo @ uo.T
    np.fill_diagonal(sim_ref, -np.inf)
    np.fill_diagonal(sim_out, -np.inf)
    best = sim_ref.max(axis=1)
    nearest_out = np.argmax(sim_out, axis=1)
    rows = np.arange(len(ref))
    return sim_ref[rows, nearest_out] >= best - tie


class EmbeddingChecker(TaskChecker):
    task = "embedding"

    config: EmbeddingTaskConfig

    def _check(self, reference, primary, allowed) -> TaskCheck:
        c = self.config
        name, ref, out, mismatch = self._paired(reference, primary, c.embedding_output,
                                                "embedding", "embedding.embedding_output")
        if mismatch:
            return mismatch
        if ref.size == 0 or ref.ndim == 0:
            return TaskCheck(self.task, False, failure="shape", reasons=[f"'{name}' is empty"])
        ref = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
        out = out.reshape(-1, out.shape[-1]).astype(np.float64)
        cos = row_cosines(ref, out)
        metrics = {"rows": len(ref), "min_cosine": float(cos.min()),
                   "mean_cosine": float(cos.mean())}
        check = TaskCheck(self.task, True, metrics)
        if cos.min() < c.min_cosine:
            worst = int(np.argmin(cos))
            check.reasons.append(f"cosine {cos.min():.6f} < {c.min_cosine} (row {worst})")
        if len(ref) >= 3:
            agree = neighbour_agreement(ref, out, c.neighbour_tie)
            metrics["neighbour_agreement"] = float(agree.mean())
            if agree.mean() < c.min_neighbour_agreement:
                check.reasons.append(f"nearest-neighbour agreement {agree.mean():.4f} < "
                                     f"{c.min_neighbour_agreement}")
        else:
            check.notes.append(f"nearest-neighbour agreement not applicable to a batch of "
                               f"{len(ref)} (needs 3 or more)")
        if check.reasons:
            check.passed, check.failure = False, "task"
        return check
