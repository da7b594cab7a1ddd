"""Segmentation: pixel agreement and mIoU of the argmax masks."""

from __future__ import annotations

import numpy as np

from guard.config import SegmentationTaskConfig
from guard.verify.task.base import TaskCheck, TaskChecker


def label_mask(array: np.ndarray, class_axis: int) -> np.ndarray:
    """An integer mask as is; class scores reduced by argmax over ``class_axis``."""
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return array.astype(np.int64)
    return np.argmax(array, axis=class_axis)


def mean_iou(ref: np.ndarray, out: np.ndarray) -> tuple[float, dict[int, float]]:
    """Mean IoU over the classes present in either mask (1.0 for two empty masks)."""
    classes = np.union1d(np.unique(ref), np.unique(out))
    per_class = {}
    for c in classes:
        r, o = ref == c, out == c
        union = np.count_nonzero(r | o)
        per_class[int(c)] = np.count_nonzero(r & o) / union if union else 1.0
    return (float(np.mean(list(per_class.values()))) if per_class else 1.0), per_class


class SegmentationChecker(TaskChecker):
    task = "segmentation"

    config: SegmentationTaskConfig

    def _check(self, reference, primary, allowed) -> TaskCheck:
        c = self.config
        name, ref, out, mismatch = self._paired(reference, primary, c.mask_output, "mask",
                                                "segmentation.mask_output")
        if mismatch:
            return mismatch
        is_labels = np.issubdtype(ref.dtype, np.integer) or ref.dtype == np.bool_
        if not is_labels and not -ref.ndim <= c.class_axis < ref.ndim:
            return TaskCheck(self.task, False, failure="shape", reasons=[
                f"class_axis {c.class_axis} out of range for '{name}' {list(ref.shape)}"])
        ref_mask, out_mask = label_mask(ref, c.class_axis), label_mask(out, c.class_axis)
        if ref_mask.size == 0:
            return TaskCheck(self.task, False, failure="shape", reasons=[f"'{name}' is empty"])
        agreement = float(np.mean(ref_mask == out_mask))
        miou, per_class = mean_iou(ref_mask, out_mask)
        worst = min(per_class, key=per_class.__getitem__) if per_class else None
        metrics = {"pixels": int(ref_mask.size), "pixel_agreement": agreement, "miou": miou,
                   "classes": len(per_class)}
        if worst is not None:
            metrics["worst_class"] = worst
            metrics["worst_class_iou"] = per_class[worst]
        check = TaskCheck(self.task, True, metrics)
        if agreement < c.min_pixel_agreement:
            check.reasons.append(f"pixel agreement {agreement:.4f} < {c.min_pixel_agreement}")
        if miou < c.min_miou:
            worst_iou = per_class[worst] if worst is not None else float("nan")
            check.reasons.append(f"mIoU {miou:.4f} < {c.min_miou} (worst class {worst}: IoU "
                                 f"{worst_iou:.3f})")
        if check.reasons:
            check.passed, check.failure = False, "task"
        return check
