"""Tier 1: tensor closeness, per output.

The rule (from the seed paper): an output passes when ``max|a - b| <= atol + rtol * max|ref|``
(plus, when measured, the reference's own noise floor on that output: ``+ floor``),
computed in float64 over the positions where both sides are finite, and when the two sides agree
on shape, dtype, and where they are NaN or +/-Inf. Every output either side produced is checked:
an output one side lacks is a failure with a reason, never a silent pass.

Alongside the verdict we keep the error statistics an engineer asks for next (mean and p99 of the
absolute error, the largest relative error, cosine distance) and, as Polygraphy does, the
smallest tolerance that would have passed, so thresholds can be set from evidence.

Cost: the verdict needs only ``max|a - b|`` and ``max|ref|``, taken in one pass: by the C kernel
``guard/verify/_verdict.c`` for float32/float64 (one read of each side, about one copy's cost),
else by numpy over cache-sized chunks (float16, or an install built without a C compiler). A NaN
or Inf anywhere propagates into them and sends the output down the full path.
The statistics cost several passes more, so they are computed for every failure and for a
sample of passes (``stats``: the first pass and one in ``PASS_STATS_EVERY`` after it, unless the
caller asks for all or none); a pass without them carries NaN in mean_abs, p99_abs, max_rel and
cosine_distance and ``stats=False``. max_abs, ref_max_abs, allowed and min_rtol are always exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_kernel: Callable[[np.ndarray, np.ndarray], tuple[float, float]] | None
try:  # the one-pass kernel; optional: built only where a C compiler was at install time
    from guard.verify._verdict import max_abs_pair as _kernel
except ImportError:  # pragma: no cover - depends on the install
    _kernel = None

# The float types the kernel takes (native byte order is checked by the caller).
_KERNEL_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
# Relative error divides by |ref|; below this the reference value counts as zero.
_REL_FLOOR = 1e-12
# Passes that get the full statistics: the first, then one in this many (per process).
PASS_STATS_EVERY = 16
# Elements per chunk of the one-pass verdict: 256 KB of float32, resident in L2.
_CHUNK = 1 << 16
_passes_seen = 0


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    floor: float = 0.0  # the reference's own noise on this output (see verify/noise.py)


@dataclass
class OutputCheck:
    name: str
    passed: bool
    reason: str = ""  # why it failed, "" when it passed
    max_abs: float = 0.0
    mean_abs: float = 0.0
    p99_abs: float = 0.0
    max_rel: float = 0.0
    cosine_distance: float = 0.0
    ref_max_abs: float = 0.0  # max|ref|, the scale rtol multiplies
    nonfinite_mismatch: int = 0  # positions where NaN/Inf disagree
    allowed: float = 0.0  # atol + rtol * max|ref| + floor
    min_rtol: float = 0.0  # the smallest rtol that would have passed with atol=0
    stats: bool = True  # mean_abs, p99_abs, max_rel, cosine_distance computed (else NaN)

    def as_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class TensorCheck:
    passed: bool
    outputs: list[OutputCheck] = field(default_factory=list)

    @property
    def max_abs_error(self) -> float:
        """Largest max-abs error over outputs that could be compared numerically."""
        values = [o.max_abs for o in self.outputs if math.isfinite(o.max_abs)]
        return max(values, default=0.0)

    @property
    def failures(self) -> list[OutputCheck]:
        return [o for o in self.outputs if not o.passed]

    def summary(self) -> str:
        if self.passed:
            return f"pass (max abs error {self.max_abs_error:.3g})"
        parts = [f"{o.name}: {o.reason}" for o in self.failures]
        return "fail: " + "; ".join(parts)


def _stats_due(stats: bool | None) -> bool:
    """Full statistics for this pass? ``stats`` True/False forces; None samples."""
    global _passes_seen
    if stats is not None:
        return stats
    due = _passes_seen % PASS_STATS_EVERY == 0
    _passes_seen += 1
    return due


def _decide(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """``max|a - b|`` and ``max|b|`` over flat same-dtype arrays, in one pass (the kernel, or
    numpy over chunks that stay in cache). NaN or Inf anywhere propagates into the result."""
    if (_kernel is not None and a.dtype in _KERNEL_DTYPES and a.flags.c_contiguous
            and b.flags.c_contiguous):  # a strided 1-D view stays strided after reshape(-1)
        return _kernel(a, b)
    return _decide_numpy(a, b)


def _decide_numpy(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    n = a.size
    if n <= _CHUNK:
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, meant
            d = np.subtract(a, b)
        np.abs(d, out=d)
        return float(d.max()), float(max(b.max(), -b.min()))
    with np.errstate(invalid="ignore", over="ignore"):
        return _decide_chunks(a, b, n)


def _decide_chunks(a: np.ndarray, b: np.ndarray, n: int) -> tuple[float, float]:
    buf = np.empty(_CHUNK, dtype=a.dtype)
    diffs, highs, lows = [], [], []
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        x, y, d = a[start:stop], b[start:stop], buf[: stop - start]
        np.subtract(x, y, out=d)
        diffs.append(max(d.max(), -d.min()))  # two in-cache reductions beat abs + max
        highs.append(y.max())
        lows.append(y.min())
    return float(np.max(diffs)), float(max(np.max(highs), -np.min(lows)))


def compare_output(name: str, ref: np.ndarray, out: np.ndarray, tol: Tolerance,
                   stats: bool | None = None) -> OutputCheck:
    """``stats``: full statistics on a pass (True), never (False), or sampled (None); a failure
    always gets them."""
    ref = np.asarray(ref)
    out = np.asarray(out)
    if (ref.shape == out.shape and out.dtype == ref.dtype and out.dtype.kind == "f"
            and out.size and ref.dtype.isnative):
        a, b = out.reshape(-1), ref.reshape(-1)  # a view for contiguous arrays
        max_abs, ref_max = _decide(a, b)
        allowed = tol.atol + tol.rtol * ref_max + tol.floor
        if max_abs <= allowed and ref_max < math.inf and not _stats_due(stats):
            nan = math.nan
            return OutputCheck(name, True, "", max_abs, nan, nan, nan, nan, ref_max, 0, allowed,
                               max_abs / ref_max if ref_max > 0 else 0.0, stats=False)
    if ref.shape != out.shape:
        return OutputCheck(name, False, f"shape {out.shape} != reference {ref.shape}",
                           max_abs=math.inf)
    problems = []
    if ref.dtype != out.dtype:
        problems.append(f"dtype {out.dtype} != reference {ref.dtype}")
    if not (np.issubdtype(ref.dtype, np.number) or ref.dtype == np.bool_) or not (
        np.issubdtype(out.dtype, np.number) or out.dtype == np.bool_
    ):
        # Strings, None, objects: no tolerance applies, equality does.
        equal = not problems and _exactly_equal(ref, out)
        return OutputCheck(name, equal, "" if equal else (
            "; ".join(problems) or f"non-numeric values differ ({out.dtype}/{ref.dtype})"),
            max_abs=0.0 if equal else math.inf)

    if (out.dtype == ref.dtype and out.dtype.kind == "f" and out.size
            and _all_finite(out) and _all_finite(ref)):
        max_abs, mean_abs, p99, max_rel, cosine, ref_max = _float_stats(
            np.ascontiguousarray(out).ravel(), np.ascontiguousarray(ref).ravel())
        return _verdict(name, problems, tol, max_abs, mean_abs, p99, max_rel, cosine,
                        ref_max, 0)

    a = out.astype(np.float64, copy=False).ravel()
    b = ref.astype(np.float64, copy=False).ravel()
    finite_a, finite_b = np.isfinite(a), np.isfinite(b)
    both = finite_a & finite_b
    # NaN where the other is not, or Inf of another sign: a disagreement tolerance cannot excuse.
    nonfinite = ~(finite_a & finite_b)
    same_nonfinite = nonfinite & ((np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b)))
    mismatch = int(np.count_nonzero(nonfinite & ~same_nonfinite))
    if mismatch:
        problems.append(f"{mismatch} NaN/Inf position(s) differ")

    a, b = a[both], b[both]
    if a.size:
        diff = np.abs(a - b)
        ref_abs = np.abs(b)
        ref_max = float(ref_abs.max())
        max_abs = float(diff.max())
        mean_abs = float(diff.mean())
        p99 = float(np.percentile(diff, 99))
        rel = diff / np.maximum(ref_abs, _REL_FLOOR)
        max_rel = float(rel[ref_abs > _REL_FLOOR].max()) if np.any(ref_abs > _REL_FLOOR) else 0.0
        norm = float(np.linalg.norm(a) * np.linalg.norm(b))
        cosine = 0.0 if norm == 0.0 else max(0.0, 1.0 - float(np.dot(a, b)) / norm)
    else:
        ref_max = max_abs = mean_abs = p99 = max_rel = cosine = 0.0

    return _verdict(name, problems, tol, max_abs, mean_abs, p99, max_rel, cosine, ref_max,
                    mismatch)


def _verdict(name, problems, tol, max_abs, mean_abs, p99, max_rel, cosine, ref_max,
             mismatch) -> OutputCheck:
    allowed = tol.atol + tol.rtol * ref_max + tol.floor
    if max_abs > allowed:
        problems.append(f"max abs error {max_abs:.3g} > allowed {allowed:.3g}")
    return OutputCheck(
        name=name,
        passed=not problems,
        reason="; ".join(problems),
        max_abs=max_abs,
        mean_abs=mean_abs,
        p99_abs=p99,
        max_rel=max_rel,
        cosine_distance=cosine,
        ref_max_abs=ref_max,
        nonfinite_mismatch=mismatch,
        allowed=allowed,
        min_rtol=max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else math.inf),
    )


def _all_finite(x: np.ndarray) -> bool:
    """One summing pass: a NaN or Inf anywhere makes the float64 sum non-finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.add.reduce(x, axis=None, dtype=np.float64)))


def _sum_of_squares(x: np.ndarray) -> float:
    """Σx², accumulated in float64; a float16 array is squared in float32, where its squares
    past 65504 (values past 256) would be inf and the cosine distance NaN, read as 0."""
    if x.dtype.itemsize < 4:
        x = x.astype(np.float32)
    return float(np.add.reduce(np.square(x), dtype=np.float64))


def _float_stats(a: np.ndarray, b: np.ndarray):
    """The common case (same float dtype, all finite) in few passes and two temporaries.

    The difference is taken in the arrays' own precision (exact to half an ulp of the
    difference), sums accumulate in float64, and cosine distance comes from the norm of the
    difference, ``(|a-b|^2 - (|a|-|b|)^2) / (2|a||b|)``, which stays accurate when the two
    vectors are nearly parallel (where ``1 - a.b/|a||b|`` cancels to noise)."""
    diff = np.subtract(a, b)
    np.abs(diff, out=diff)
    max_abs = float(diff.max())
    mean_abs = float(np.add.reduce(diff, dtype=np.float64)) / diff.size
    d2 = _sum_of_squares(diff)
    ref_abs = np.abs(b)
    ref_max = float(ref_abs.max())
    if ref_max > _REL_FLOOR:
        rel = np.divide(diff, np.maximum(ref_abs, _REL_FLOOR, out=ref_abs))
        rel[ref_abs <= _REL_FLOOR] = 0.0  # a zero reference has no relative error
        max_rel = float(rel.max())
        del rel
    else:
        max_rel = 0.0
    a2, b2 = _sum_of_squares(a), _sum_of_squares(b)
    norm = math.sqrt(a2 * b2)
    cosine = 0.0 if norm == 0.0 else max(0.0, (d2 - (math.sqrt(a2) - math.sqrt(b2)) ** 2)
                                          / (2.0 * norm))
    p99 = _percentile_99(diff)
    return max_abs, mean_abs, p99, max_rel, cosine, ref_max


def _percentile_99(values: np.ndarray) -> float:
    """numpy's default (linear) 99th percentile, exactly, without sorting the whole array.

    A strided sample guesses a threshold below the 99th percentile; only the values above it
    (a few percent) are partially sorted. If the guess was too high, the whole array is."""
    n = values.size
    position = 0.99 * (n - 1)
    low = int(math.floor(position))
    high = min(low + 1, n - 1)
    fraction = position - low
    candidates, offset = values, 0
    if n > 8192:
        sample = values[:: n // 4096]
        cut = int(0.97 * (sample.size - 1))
        threshold = np.partition(sample, cut)[cut]
        top = values[values >= threshold]  # the top.size largest values, ties included
        if top.size >= n - low:
            candidates, offset = top, n - top.size
    i, j = low - offset, high - offset
    candidates.partition([i, j])
    return float(candidates[i] + (candidates[j] - candidates[i]) * fraction)


def _exactly_equal(a: np.ndarray, b: np.ndarray) -> bool:
    try:
        return bool(np.array_equal(a, b))
    except (TypeError, ValueError):
        return False


def compare_outputs(
    reference: dict[str, np.ndarray],
    candidate: dict[str, np.ndarray],
    default: Tolerance,
    per_output: dict[str, Tolerance] | None = None,
    stats: bool | None = None,
) -> TensorCheck:
    """Compare every output either side produced; missing ones fail with a reason.
    ``stats``: statistics of passing outputs always (True), never (False), sampled (None)."""
    per_output = per_output or {}
    checks = []
    for name in sorted(set(reference) | set(candidate)):
        if name not in reference:
            checks.append(OutputCheck(name, False, "reference lacks this output", max_abs=math.inf))
        elif name not in candidate:
            checks.append(OutputCheck(name, False, "primary lacks this output", max_abs=math.inf))
        else:
            tol = per_output.get(name, default)
            checks.append(compare_output(name, reference[name], candidate[name], tol, stats))
    return TensorCheck(passed=bool(checks) and all(c.passed for c in checks), outputs=checks)


class TensorTier:
    """Tier 1 for one model: every output against its allowed error (``atol + rtol *
    max|ref|`` plus the reference's noise floor when it was measured)."""

    name = "tensor"

    def __init__(self, checks):
        t = checks.tensor
        self.multiplier = t.noise_floor.multiplier
        self.default = Tolerance(t.atol, t.rtol)
        self._overrides = {
            name: (o.atol if o.atol is not None else t.atol,
                   o.rtol if o.rtol is not None else t.rtol)
            for name, o in t.outputs.items()
        }
        self.noise_floor: dict[str, float] = {}
        # Tier-1 statistics of passing outputs: sampled (None), or always (True: offline sweeps).
        self.pass_stats: bool | None = None
        self.per_output = self._per_output()

    def set_noise_floor(self, floor: dict[str, float]) -> None:
        self.noise_floor = dict(floor)
        self.per_output = self._per_output()

    def _per_output(self) -> dict[str, Tolerance]:
        out = {}
        for name in set(self._overrides) | set(self.noise_floor):
            atol, rtol = self._overrides.get(name, (self.default.atol, self.default.rtol))
            out[name] = Tolerance(atol, rtol, self.multiplier * self.noise_floor.get(name, 0.0))
        return out

    def check(self, sample) -> TensorCheck:
        return compare_outputs(sample.reference, sample.primary, self.default, self.per_output,
                               self.pass_stats)


def _tensor_details(check: TensorCheck) -> dict:
    return {"max_abs_error": check.max_abs_error}


def _build(setup):
    return TensorTier(setup.checks)


def _declare():
    from guard.verify.tiers import TierKind

    return TierKind("tensor", build=_build, details=_tensor_details)


TIER = _declare()
