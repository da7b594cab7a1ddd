"""Tier 3: task-level agreement, the verdict a user of the model cares about.

One checker per ``task`` of the config; each compares the reference's outputs (after the
adapters) with the primary's and returns a ``TaskCheck``: pass/fail, the task's metrics, the
reasons for a failure and notes (near-tie flips, metrics that do not apply to this batch).
``task: generic`` has no tier 3: tier 1 alone judges it, and ``task_checker`` returns None.
"""

from __future__ import annotations

from guard.config import TaskCheckConfig
from guard.verify.task.base import TaskCheck, TaskChecker
from guard.verify.task.classification import ClassificationChecker
from guard.verify.task.detection import DetectionChecker
from guard.verify.task.embedding import EmbeddingChecker
from guard.verify.task.segmentation import SegmentationChecker

GENERIC_NOTE = "task 'generic': judged by tier 1 (tensor) only"

_CHECKERS = {
    "classification": ("classification", ClassificationChecker),
    "detection": ("detection", DetectionChecker),
    "segmentation": ("segmentation", SegmentationChecker),
    "embedding": ("embedding", EmbeddingChecker),
}


def task_checker(task: str, config: TaskCheckConfig) -> TaskChecker | None:
    """The checker for ``task``, or None for ``generic`` (or when tier 3 is disabled)."""
    if task not in _CHECKERS or not config.enabled:
        return None
    block, cls = _CHECKERS[task]
    return cls(getattr(config, block))


__all__ = ["GENERIC_NOTE", "TaskCheck", "TaskChecker", "task_checker"]
