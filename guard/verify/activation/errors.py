"""Error figures of one aligned layer: relative L2 error, cosine similarity, max abs error.

Relative L2 (``||out - ref|| / ||ref||``) rather than max-abs: layers differ in scale by orders of
magnitude, and one figure that means the same at every depth is what ranking layers needs.
Computed in float64 so that fp16/int8 activations are judged, not the arithmetic of the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerError:
    rel_error: float  # ||out - ref||_2 / ||ref||_2 (inf where they disagree on NaN/Inf)
    cosine: float  # <out, ref> / (|out| |ref|); 1.0 = same direction
    max_abs: float

    def as_dict(self) -> dict[str, float]:
        return {"rel_error": _round(self.rel_error), "cosine": _round(self.cosine),
                "max_abs": _round(self.max_abs)}


def _round(value: float) -> float:
    return value if not math.isfinite(value) else float(f"{value:.6g}")


class ShapeMismatch(ValueError):
    """The two sides produced differently shaped tensors for what was aligned as one layer."""


def layer_error(reference: np.ndarray, output: np.ndarray) -> LayerError:
    ref = np.asarray(reference)
    out = np.asarray(output)
    if ref.shape != out.shape:
        raise ShapeMismatch(f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    r = ref.astype(np.float64, copy=False).ravel()
    o = out.astype(np.float64, copy=False).ravel()
    finite_r, finite_o = np.isfinite(r), np.isfinite(o)
    if not (finite_r.all() and finite_o.all()):
        same = (np.isnan(r) & np.isnan(o)) | (r == o)
        if not same[~(finite_r & finite_o)].all():
            return LayerError(math.inf, 0.0, math.inf)
        both = finite_r & finite_o
        r, o = r[both], o[both]
    if r.size == 0:
        return LayerError(0.0, 1.0, 0.0)
    diff = o - r
    diff_norm = float(np.linalg.norm(diff))
    ref_norm = float(np.linalg.norm(r))
    out_norm = float(np.linalg.norm(o))
    if ref_norm == 0.0:
        rel = 0.0 if diff_norm == 0.0 else math.inf
    else:
        rel = diff_norm / ref_norm
    if ref_norm == 0.0 and out_norm == 0.0:
        cosine = 1.0
    elif ref_norm == 0.0 or out_norm == 0.0:
        cosine = 0.0
    else:
        cosine = float(np.dot(o, r)) / (ref_norm * out_norm)
    return LayerError(rel, cosine, float(np.abs(diff).max()))
