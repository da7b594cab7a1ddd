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


class TaskTier:
    """Tier 3 for one model: its task's checker on both sides' outputs, each output allowed
    what tier 1 allowed it."""

    name = "task"

    def __init__(self, checker: TaskChecker):
        self.checker = checker

    def check(self, sample) -> TaskCheck | None:
        from guard.verify.task.base import OutputMissing

        tensor = sample.results.get("tensor")
        allowed = {o.name: o.allowed for o in tensor.outputs} if tensor is not None else {}
        try:
            return self.checker.check(sample.reference, sample.primary, allowed)
        except OutputMissing as exc:  # on neither side: the request asked for other outputs
            sample.notes.append(f"tier 3 not run on this sample: {exc}")
            return None


def _build(setup) -> TaskTier | None:
    checker = task_checker(setup.task, setup.checks.task)
    return TaskTier(checker) if checker is not None else None


def _declare():
    from guard.verify.tiers import TierKind

    return TierKind("task", build=_build)


TIER = _declare()

__all__ = ["GENERIC_NOTE", "TaskCheck", "TaskChecker", "TaskTier", "task_checker"]
