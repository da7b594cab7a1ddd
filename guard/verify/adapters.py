"""Deterministic adapters: post-processing applied to *both* sides before tiers 1 and 3.

Two backends can compute the same numbers and still answer differently because post-processing
breaks ties in another order: a detector's NMS keeps the first of two equally scored boxes, a
top-k returns tied classes in the order its sort visited them, a set-like output comes back
permuted. That is drift of the post-processing, not of the model. An adapter replaces that step
with one that is deterministic in the values alone, on both sides, so the checks see the model.

An adapter never hides a real change: it reorders, suppresses by a fixed rule or recomputes in
float64; a box that moved still moves, a score that changed still changes.

Adapters are named per model in the YAML (``adapters: [stable_nms, {float64_softmax: {outputs:
[logits]}}]``) and run in the order given. Options are strict (unknown keys are errors).

- ``stable_nms``: sort candidates by (score desc, x1, y1), then greedy NMS in numpy (float64
  IoU). Input: candidate ``boxes`` [N, 4] or [B, N, 4] (x1, y1, x2, y2), ``scores`` [N] /
  [B, N], optional ``labels``. Output: the kept detections in that order; batched outputs are
  padded to the longest image with boxes 0, scores -inf, labels -1.
- ``tie_aware_topk``: a top-k output pair (``values``, ``indices``) reordered per row by
  (value desc, index asc), so tied entries come in one order whatever the backend's sort did.
- ``canonical_order``: set-like outputs sorted along an axis by the lexicographic order of their
  rows (the outputs listed share one permutation, taken from all of them in the order listed).
- ``float64_softmax``: the named logits outputs replaced by softmax computed in float64.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class AdapterError(ValueError):
    """An adapter cannot run on these outputs (missing output, wrong shape)."""


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StableNmsOptions(_Options):
    boxes_output: str = Field("boxes", description="Candidate boxes [N, 4] or [B, N, 4].")
    scores_output: str = Field("scores", description="Candidate scores [N] or [B, N].")
    classes_output: str | None = Field(
        "labels", description="Class ids; used when the outputs have it (per-class NMS)."
    )
    iou_threshold: float = Field(0.5, gt=0, le=1, description="Suppress IoU above this.")
    score_threshold: float = Field(
        0.0, description="Candidates scoring at most this are dropped before NMS."
    )
    max_detections: int | None = Field(None, ge=1, description="Keep at most this many.")
    class_agnostic: bool = Field(False, description="Suppress across classes too.")
    score_decimals: int | None = Field(
        None, ge=0, le=12,
        description="Round scores to this many decimals for the ordering only, so that scores "
        "equal up to float noise count as tied and fall to (x1, y1).",
    )


class TieAwareTopkOptions(_Options):
    values_output: str = Field("values", description="Top-k values [..., k].")
    indices_output: str = Field("indices", description="Top-k indices [..., k].")
    tie_tolerance: float = Field(
        0.0, ge=0, description="Values within this of each other (bucketed) count as tied."
    )


class CanonicalOrderOptions(_Options):
    outputs: list[str] = Field(min_length=1, description="Outputs sharing one set axis.")
    axis: int = Field(0, ge=0, le=1, description="The set axis; 1 means axis 0 is a batch.")
    decimals: int | None = Field(
        None, ge=0, le=12, description="Round the sort key to this many decimals."
    )


class Float64SoftmaxOptions(_Options):
    outputs: list[str] = Field(min_length=1,
                               description="Logits outputs to turn into probabilities.")
    axis: int = Field(-1, description="The class axis.")


def _require(outputs: dict[str, np.ndarray], name: str, adapter: str) -> np.ndarray:
    if name not in outputs:
        raise AdapterError(f"{adapter}: output '{name}' not found (have: "
                           f"{', '.join(sorted(outputs)) or 'none'})")
    return np.asarray(outputs[name])


# -- stable NMS ------------------------------------------------------------------------------------
def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in ``a`` [N, 4] with every box in ``b`` [M, 4], in float64."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def stable_order(boxes: np.ndarray, scores: np.ndarray, decimals: int | None = None) -> np.ndarray:
    """Indices sorted by (score desc, x1 asc, y1 asc), then original index (a total order)."""
    key = np.asarray(scores, np.float64)
    if decimals is not None:
        key = np.round(key, decimals)
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    # lexsort: the last key is the primary one.
    return np.lexsort((np.arange(len(key)), boxes[:, 1], boxes[:, 0], -key))


def deterministic_nms(
    boxes: np.ndarray,
    scores: np.ndarray,
    labels: np.ndarray | None,
    iou_threshold: float,
    score_threshold: float = 0.0,
    max_detections: int | None = None,
    class_agnostic: bool = False,
    score_decimals: int | None = None,
) -> np.ndarray:
    """Greedy NMS over candidates in stable order; returns the kept indices, in that order."""
    scores = np.asarray(scores, np.float64).reshape(-1)
    boxes = np.asarray(boxes, np.float64).reshape(-1, 4)
    order = stable_order(boxes, scores, score_decimals)
    order = order[scores[order] > score_threshold]
    if order.size == 0:
        return order
    iou = iou_matrix(boxes[order], boxes[order])
    same_class = (np.ones_like(iou, bool) if class_agnostic or labels is None
                  else labels[order][:, None] == labels[order][None, :])
    suppressed = np.zeros(order.size, bool)
    kept: list[int] = []
    for i in range(order.size):
        if suppressed[i]:
            continue
        kept.append(i)
        if max_detections is not None and len(kept) >= max_detections:
            break
        suppressed |= (iou[i] > iou_threshold) & same_class[i]
    return order[np.asarray(kept, dtype=np.int64)]


class StableNms:
    name = "stable_nms"

    def __init__(self, options: StableNmsOptions):
        self.o = options

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        o = self.o
        boxes = _require(outputs, o.boxes_output, self.name)
        scores = _require(outputs, o.scores_output, self.name)
        classes = o.classes_output
        labels = np.asarray(outputs[classes]) if classes and classes in outputs else None
        batched = boxes.ndim == 3
        if boxes.shape[-1:] != (4,) or boxes.ndim not in (2, 3):
            raise AdapterError(f"{self.name}: '{o.boxes_output}' must be [N, 4] or [B, N, 4], "
                               f"got {list(boxes.shape)}")
        if scores.shape != boxes.shape[:-1] or (labels is not None
                                                and labels.shape != scores.shape):
            raise AdapterError(
                f"{self.name}: shapes do not line up: boxes {list(boxes.shape)}, scores "
                f"{list(scores.shape)}" + (f", labels {list(labels.shape)}" if labels is not None
                                           else ""))
        if not batched:
            boxes, scores = boxes[None], scores[None]
            labels = labels[None] if labels is not None else None
        kept = [
            deterministic_nms(boxes[b], scores[b], None if labels is None else labels[b],
                              o.iou_threshold, o.score_threshold, o.max_detections,
                              o.class_agnostic, o.score_decimals)
            for b in range(boxes.shape[0])
        ]
        result = dict(outputs)
        if not batched:
            idx = kept[0]
            result[o.boxes_output] = boxes[0][idx]
            result[o.scores_output] = scores[0][idx]
            if labels is not None and classes is not None:  # (labels come with classes)
                result[classes] = labels[0][idx]
            return result
        width = max((len(k) for k in kept), default=0)
        out_boxes = np.zeros((len(kept), width, 4), boxes.dtype)
        out_scores = np.full((len(kept), width), -np.inf, scores.dtype)
        out_labels = None if labels is None else np.full((len(kept), width), -1, labels.dtype)
        for b, idx in enumerate(kept):
            out_boxes[b, : len(idx)] = boxes[b][idx]
            out_scores[b, : len(idx)] = scores[b][idx]
            if out_labels is not None and labels is not None:  # (one comes with the other)
                out_labels[b, : len(idx)] = labels[b][idx]
        result[o.boxes_output] = out_boxes
        result[o.scores_output] = out_scores
        if out_labels is not None and classes is not None:
            result[classes] = out_labels
        return result


# -- tie-aware top-k -------------------------------------------------------------------------------
class TieAwareTopk:
    name = "tie_aware_topk"

    def __init__(self, options: TieAwareTopkOptions):
        self.o = options

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        o = self.o
        values = _require(outputs, o.values_output, self.name)
        indices = _require(outputs, o.indices_output, self.name)
        if values.shape != indices.shape or values.ndim == 0:
            raise AdapterError(f"{self.name}: values {list(values.shape)} and indices "
                               f"{list(indices.shape)} must have one shape")
        key = values.astype(np.float64)
        if o.tie_tolerance > 0:
            key = np.floor(key / o.tie_tolerance)
        flat_key = key.reshape(-1, key.shape[-1])
        flat_idx = indices.reshape(-1, indices.shape[-1])
        order = np.stack([np.lexsort((flat_idx[r], -flat_key[r])) for r in range(len(flat_key))])
        order = order.reshape(values.shape)
        result = dict(outputs)
        result[o.values_output] = np.take_along_axis(values, order, axis=-1)
        result[o.indices_output] = np.take_along_axis(indices, order, axis=-1)
        return result


# -- canonical order of set-like outputs -----------------------------------------------------------
def _row_order(columns: np.ndarray) -> np.ndarray:
    """Lexicographic order of the rows of a 2-D array (first column most significant)."""
    if columns.shape[1] == 0:
        return np.arange(columns.shape[0])
    return np.lexsort(columns.T[::-1])


class CanonicalOrder:
    name = "canonical_order"

    def __init__(self, options: CanonicalOrderOptions):
        self.o = options

    def _key(self, arrays: list[np.ndarray]) -> np.ndarray:
        cols = [a.reshape(a.shape[0], -1).astype(np.float64) for a in arrays]
        key = np.concatenate(cols, axis=1)
        return np.round(key, self.o.decimals) if self.o.decimals is not None else key

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        o = self.o
        arrays = [_require(outputs, name, self.name) for name in o.outputs]
        lengths = {a.shape[o.axis] if a.ndim > o.axis else None for a in arrays}
        batches = {a.shape[0] if a.ndim > 0 else None for a in arrays}
        if None in lengths or len(lengths) != 1 or (o.axis == 1 and len(batches) != 1):
            raise AdapterError(f"{self.name}: outputs {o.outputs} do not share axis {o.axis} "
                               f"(shapes {[list(a.shape) for a in arrays]})")
        result = dict(outputs)
        if o.axis == 0:
            order = _row_order(self._key(arrays))
            for name, a in zip(o.outputs, arrays):
                result[name] = a[order]
            return result
        sorted_arrays = [a.copy() for a in arrays]
        for b in range(arrays[0].shape[0]):
            order = _row_order(self._key([a[b] for a in arrays]))
            for s, a in zip(sorted_arrays, arrays):
                s[b] = a[b][order]
        result.update(zip(o.outputs, sorted_arrays))
        return result


# -- float64 softmax -------------------------------------------------------------------------------
def softmax64(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


class Float64Softmax:
    name = "float64_softmax"

    def __init__(self, options: Float64SoftmaxOptions):
        self.o = options

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = dict(outputs)
        for name in self.o.outputs:
            logits = _require(outputs, name, self.name)
            if logits.ndim == 0 or not -logits.ndim <= self.o.axis < logits.ndim:
                raise AdapterError(f"{self.name}: axis {self.o.axis} out of range for "
                                   f"'{name}' {list(logits.shape)}")
            result[name] = softmax64(logits, self.o.axis)
        return result


# -- registry --------------------------------------------------------------------------------------
ADAPTERS: dict[str, tuple[type[_Options], Callable[[Any], Any]]] = {
    "stable_nms": (StableNmsOptions, StableNms),
    "tie_aware_topk": (TieAwareTopkOptions, TieAwareTopk),
    "canonical_order": (CanonicalOrderOptions, CanonicalOrder),
    "float64_softmax": (Float64SoftmaxOptions, Float64Softmax),
}


def validate_adapter_options(name: str, options: dict[str, Any]) -> list[str]:
    """Problems as ``options.key: message`` strings (empty when valid)."""
    model, _ = ADAPTERS[name]
    try:
        model.model_validate(options)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc = ".".join(str(p) for p in error["loc"])
            msg = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            lines.append(f"options.{loc}: {msg}" if loc else f"options: {msg}")
        return lines
    return []


def build_adapter(name: str, options: dict[str, Any]):
    model, cls = ADAPTERS[name]
    return cls(model.model_validate(options))


class AdapterChain:
    """The adapters of one model, in order. ``apply`` returns new dicts; inputs are untouched."""

    def __init__(self, configs=()):
        self.adapters = [build_adapter(c.name, c.options) for c in configs]

    def __bool__(self) -> bool:
        return bool(self.adapters)

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    def apply(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for adapter in self.adapters:
            outputs = adapter.apply(outputs)
        return outputs
