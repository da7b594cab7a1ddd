"""What every tier-3 checker shares: the result type and output selection."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TaskCheck:
    task: str
    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)  # why it failed; empty when it passed
    notes: list[str] = field(default_factory=list)  # facts worth knowing that do not fail it
    failure: str = ""  # "" when passed; "shape" (outputs do not line up) or "task"

    tier = "task"

    def summary(self) -> str:
        shown = ", ".join(f"{k} {_fmt(v)}" for k, v in self.metrics.items())
        if self.passed:
            return f"pass ({self.task}: {shown})" if shown else f"pass ({self.task})"
        return f"fail ({self.task}): " + "; ".join(self.reasons)

    def as_dict(self) -> dict:
        return {"task": self.task, "passed": self.passed, "metrics": dict(self.metrics),
                "reasons": list(self.reasons), "notes": list(self.notes),
                "failure": self.failure}


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


class OutputMissing(Exception):
    """The output a checker reads is absent or cannot be chosen."""

    def __init__(self, message: str, on_neither_side: bool = False):
        super().__init__(message)
        self.on_neither_side = on_neither_side  # e.g. the client asked for other outputs


def select_output(
    reference: dict[str, np.ndarray],
    primary: dict[str, np.ndarray],
    configured: str | None,
    preferred: str,
    key: str,
) -> str:
    """The output a checker reads: the configured one, else ``preferred``, else the only one."""
    if configured is not None:
        name = configured
    elif preferred in reference:
        name = preferred
    elif len(reference) == 1:
        name = next(iter(reference))
    else:
        raise OutputMissing(
            f"cannot tell which output to read: set checks.task.{key} "
            f"(outputs: {', '.join(sorted(reference)) or 'none'})"
        )
    if name not in reference and name not in primary:
        raise OutputMissing(f"neither side has output '{name}'", on_neither_side=True)
    for side, outputs in (("reference", reference), ("primary", primary)):
        if name not in outputs:
            raise OutputMissing(f"{side} lacks output '{name}'")
    return name


class TaskChecker(abc.ABC):
    task: str = ""

    def __init__(self, config):
        self.config = config  # the task's block of checks.task (e.g. ClassificationTaskConfig)

    def check(
        self,
        reference: dict[str, np.ndarray],
        primary: dict[str, np.ndarray],
        allowed: dict[str, float] | None = None,
    ) -> TaskCheck:
        """``allowed``: tier 1's allowed error per output (for tie margins), when known."""
        try:
            return self._check(reference, primary, allowed or {})
        except OutputMissing as exc:
            if exc.on_neither_side:
                raise  # not a disagreement: the Comparator leaves tier 3 out for this sample
            return TaskCheck(self.task, False, reasons=[str(exc)], failure="shape")

    @abc.abstractmethod
    def _check(self, reference, primary, allowed) -> TaskCheck: ...

    def _paired(self, reference, primary, configured: str | None, preferred: str, key: str):
        """(name, reference array, primary array, a failing TaskCheck if their shapes differ)."""
        name = select_output(reference, primary, configured, preferred, key)
        ref, out = np.asarray(reference[name]), np.asarray(primary[name])
        return name, ref, out, self._shape_mismatch(name, ref, out)

    def _shape_mismatch(self, name: str, ref: np.ndarray, out: np.ndarray) -> TaskCheck | None:
        if ref.shape != out.shape:
            return TaskCheck(self.task, False, failure="shape", reasons=[
                f"'{name}': primary shape {list(out.shape)} != reference {list(ref.shape)}"])
        return None
