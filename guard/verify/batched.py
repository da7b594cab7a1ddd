"""Tiers 1 and 3 over a stacked batch at once, for the records whose verdict is a plain pass.

Offline replay (guard/replay/execute.py) and the verifier's mirror
(guard/verifier_process/mirror.py) both check many samples (records) at once, stacked along
the first axis (guard/backends/batching.py). ``Comparator.check`` per record costs tens to a
few hundred microseconds of Python (arrays, dataclasses, strings for every record), more than a
small reference needs to infer it. But what a record's tier-1 and tier-3 (classification)
verdict rests on is computed row by row, then reduced over the record's rows with reductions
that do not depend on order:

- tier 1: per output, ``max|primary - reference|`` and ``max|reference|`` in the outputs' own
  dtype (a maximum is exact in any order), then ``allowed = atol + rtol * max|ref| + floor``;
- tier 3 (classification): per row, both argmaxes, the reference margin, the tie-extended
  top-k overlap; per record, integer counts, and means/minima over its own rows' values.

So they are computed once for the batch and sliced per record: the figures are bit for bit the
ones ``Comparator.check`` computes on that record alone. Only a record that passes both tiers on
this path is reported from it. Everything else goes to ``Comparator.check`` one record at a time,
exactly as before: a failure (which gets full statistics, reasons, and the fp64 arbiter), a
NaN or Inf anywhere, outputs whose shapes or dtypes differ, a task checker other than
classification. A whole batch takes the per-record path when the comparator has adapters, extra
tiers (tier 2) or is asked for statistics of every pass (``pass_stats``).

One difference, by design: a passing output's optional statistics (mean_abs, p99_abs, max_rel,
cosine_distance; ``Comparator.check`` computes them for one pass in 16) are not computed here
(NaN, ``stats=False``). Neither the replay report nor the verifier's metrics and detectors use
them; the verdicts and every figure they show are unchanged.

``check_stacked_results`` gives each record its ``CheckResult`` (the mirror's shape: detectors
and capture take it), ``check_stacked`` its ``tier_reports`` (replay's).
"""

from __future__ import annotations

import math
from itertools import accumulate

import numpy as np

from guard.verify.pipeline import CheckResult, Comparator, TierReport
from guard.verify.structure import is_flat
from guard.verify.task import GENERIC_NOTE
from guard.verify.task.base import OutputMissing, TaskCheck
from guard.verify.task.classification import ClassificationChecker
from guard.verify.tensor import OutputCheck, TensorCheck

NAN = math.nan


def batchable(comparator: Comparator) -> bool:
    """Can this verifier's checks take the batched path at all? Not with adapters, extra tiers
    (tier 2), statistics of every pass, or outputs renamed between the sides (each record then
    goes through ``Comparator.check``)."""
    checker = comparator.task_checker
    return (not comparator.adapters and not comparator.extra_tiers
            and comparator.pass_stats is not True and comparator.reference_names is None
            and (checker is None or type(checker) is ClassificationChecker))


def _per_record(reduce, rowwise: np.ndarray, starts: list[int] | None) -> list:
    """``rowwise`` reduced over each record's rows (``starts``: each record's first row; None
    when every record is one row, the usual case: nothing to reduce)."""
    if starts is not None:
        return reduce.reduceat(rowwise, starts).tolist()
    return (rowwise.astype(np.int64) if rowwise.dtype == np.bool_ else rowwise).tolist()


def _starts(rows: list[int]) -> list[int] | None:
    """Each record's first row; None when every record is one row."""
    return None if all(n == 1 for n in rows) else list(accumulate(rows, initial=0))[:-1]


def _tensor_figures(comparator: Comparator, reference: dict, primary: dict,
                    starts: list[int] | None, total: int) -> dict[str, tuple] | None:
    """Per output name (sorted, as ``compare_outputs``): per record (max_abs, ref_max,
    allowed), or None when some output cannot take this path."""
    if sorted(reference) != sorted(primary):
        return None
    figures = {}
    for name in sorted(reference):
        ref, out = reference[name], primary[name]
        if not (isinstance(ref, np.ndarray) and isinstance(out, np.ndarray)
                and ref.shape == out.shape and ref.dtype == out.dtype
                and ref.dtype.kind == "f" and ref.dtype.isnative and ref.size
                and ref.ndim and ref.shape[0] == total):
            return None
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, sent per record
            diff = np.subtract(out, ref).reshape(total, -1)
        np.abs(diff, out=diff)
        max_abs = _per_record(np.maximum, diff.max(axis=1), starts)
        ref_max = _per_record(np.maximum, np.abs(ref.reshape(total, -1)).max(axis=1), starts)
        tol = comparator.per_output.get(name, comparator.default)
        allowed = [tol.atol + tol.rtol * r + tol.floor for r in ref_max]
        figures[name] = (max_abs, ref_max, allowed)
    return figures


class _Classification:
    """Row-wise classification figures of the whole batch; per record on demand."""

    def __init__(self, checker: ClassificationChecker, reference: dict, primary: dict,
                 rows: list[int], allowed: dict[str, list[float]]):
        c = self.config = checker.config
        self.task = checker.task
        self.name = name = _select(checker, reference, primary)
        ref, out = np.asarray(reference[name]), np.asarray(primary[name])
        # The first axis is the records' (checked in tier 1); the class axis is the last.
        if ref.shape != out.shape or ref.ndim < 2 or ref.shape[-1] < 2:
            raise _PerRecord
        per_row = math.prod(ref.shape[1:-1])  # logit rows per input row
        rows = [n * per_row for n in rows]  # what the checker counts as a record's rows
        ref = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
        out = out.reshape(-1, out.shape[-1]).astype(np.float64)
        # tie margin per record (tier 1's allowed error on this output), repeated per row
        self.ties = [c.tie_margin if c.tie_margin is not None else 2.0 * a
                     for a in allowed.get(name, [0.0] * len(rows))]
        tie = np.asarray(self.ties, dtype=np.float64)
        if len(ref) != len(rows):
            tie = np.repeat(tie, rows)
        index = np.arange(len(ref))
        top1_ref = np.argmax(ref, axis=1)
        top1_out = np.argmax(out, axis=1)
        self.flipped = flipped = top1_ref != top1_out
        self.margin = ref[index, top1_ref] - ref[index, top1_out]
        near_tie = flipped & (self.margin <= tie)
        real = flipped & ~near_tie
        self.k = k = min(c.top_k, ref.shape[1])
        kth = -np.partition(-ref, k - 1, axis=1)[:, k - 1]
        ref_set = ref >= (kth - tie)[:, None]
        top_out = np.argsort(-out, axis=1, kind="stable")[:, :k]
        self.overlap = np.take_along_axis(ref_set, top_out, axis=1).sum(axis=1) / k
        self.bounds = list(accumulate(rows, initial=0))
        starts = _starts(rows)
        self.flips = _per_record(np.add, flipped, starts)
        self.near = _per_record(np.add, near_tie, starts)
        self.real = _per_record(np.add, real, starts)
        self.overlap_list = self.overlap.tolist()

    def record(self, j: int) -> TaskCheck | None:
        """Record j as ``ClassificationChecker`` reports it, or None unless it passes."""
        lo, hi = self.bounds[j], self.bounds[j + 1]
        c, n = self.config, hi - lo
        flips, near, real = self.flips[j], self.near[j], self.real[j]
        agreement = 1.0 - real / n
        overlap = self.overlap_list[lo] if n == 1 else float(self.overlap[lo:hi].mean())
        if agreement < c.min_top1_agreement or overlap < c.min_topk_overlap:
            return None  # a failure: Comparator.check says why
        tie = self.ties[j]
        metrics = {
            "rows": n,
            "top1_agreement": 1.0 - flips / n,
            "top1_agreement_beyond_ties": agreement,
            "real_flips": real,
            "near_tie_flips": near,
            f"top{self.k}_overlap": overlap,
            "min_reference_margin_of_flips":
                float(self.margin[lo:hi][self.flipped[lo:hi]].min()) if flips else 0.0,
            "tie_margin": float(tie),
        }
        check = TaskCheck(self.task, True, metrics)
        if near:
            check.notes.append(f"{near} near-tie flip(s) (reference margin <= "
                               f"{tie:.3g}) not counted against agreement")
        return check


class _PerRecord(Exception):
    """This batch's task output does not fit the batched path: check record by record."""


def _select(checker: ClassificationChecker, reference: dict, primary: dict) -> str:
    from guard.verify.task.base import select_output

    try:
        return select_output(reference, primary, checker.config.logits_output, "logits",
                             "classification.logits_output")
    except OutputMissing:
        raise _PerRecord from None


def check_stacked_results(comparator: Comparator, reference: dict, primary: dict,
                          rows: list[int]) -> list[CheckResult | None]:
    """Per record of a stacked batch (``rows`` rows each, in order): its ``CheckResult`` when it
    passes tiers 1 and 3 on the batched path, else None (check it alone)."""
    none: list[CheckResult | None] = [None] * len(rows)
    if not (batchable(comparator) and all(rows) and is_flat(reference) and is_flat(primary)):
        return none
    figures = _tensor_figures(comparator, reference, primary, _starts(rows), sum(rows))
    if figures is None:
        return none
    task = None
    if comparator.task_checker is not None:
        try:
            task = _Classification(comparator.task_checker, reference, primary, rows,
                                   {n: f[2] for n, f in figures.items()})
        except _PerRecord:
            return none
    notes = [GENERIC_NOTE] if task is None and comparator.task_name == "generic" else []
    out: list[CheckResult | None] = []
    for j in range(len(rows)):
        checks = []
        for name, (max_abs, ref_max, allowed) in figures.items():
            m, r, a = max_abs[j], ref_max[j], allowed[j]
            if not (m <= a and r < math.inf):
                checks = None  # fails, or NaN/Inf: Comparator.check alone
                break
            checks.append(OutputCheck(name, True, "", m, NAN, NAN, NAN, NAN, r, 0, a,
                                      m / r if r > 0 else 0.0, stats=False))
        if checks is None:
            out.append(None)
            continue
        result = CheckResult({"tensor": TensorCheck(True, checks)}, list(notes))
        if task is not None:
            check = task.record(j)
            if check is None:
                out.append(None)
                continue
            result.tiers["task"] = check
        out.append(result)
    return out


def check_stacked(comparator: Comparator, reference: dict, primary: dict,
                  rows: list[int]) -> list[dict[str, TierReport] | None]:
    """Per record of a stacked batch: its tier reports when it passes tiers 1 and 3 on the
    batched path, else None (check it alone)."""
    return [None if result is None else Comparator.tier_reports(result)
            for result in check_stacked_results(comparator, reference, primary, rows)]
