"""The checks one mirrored (or replayed) sample goes through, independent of where it came from.

The sidecar's mirror worker and offline replay (guard/replay/) both call ``Verifier.check``; today
it runs tier 1, and the activation and task tiers slot in here.

``Verifier.tier_results`` turns what ``check`` returned into one ``TierResult`` per tier in
``Verifier.tiers``: the shape that capture records, replay reports and per-tier counters share,
so that a new tier shows up in all of them by extending this one method. What each tier puts in
``details`` (JSON-able), as the replay report reads it:

- ``tensor``: ``{"max_abs_error": float}`` (per-output figures are in ``outputs``).
- ``activation``: ``{"first_divergence": {"layer": str, "error": float} | None,
  "layers": [{"layer": str, "error": float}, ...]}`` in network order.
- ``task``: ``{"metrics": {name: float}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.config import ChecksConfig
from guard.verify.tensor import OutputCheck, TensorCheck, Tolerance, compare_outputs


@dataclass
class TierResult:
    """What one tier found on one sample."""

    passed: bool
    summary: str
    outputs: list[OutputCheck] = field(default_factory=list)  # tensor tier: per output
    details: dict[str, Any] = field(default_factory=dict)


class Verifier:
    tiers: tuple[str, ...] = ("tensor",)

    def __init__(self, checks: ChecksConfig):
        t = checks.tensor
        self.default = Tolerance(t.atol, t.rtol)
        self.per_output = {
            name: Tolerance(
                o.atol if o.atol is not None else t.atol,
                o.rtol if o.rtol is not None else t.rtol,
            )
            for name, o in t.outputs.items()
        }

    def check(
        self, reference: dict[str, np.ndarray], primary: dict[str, np.ndarray]
    ) -> TensorCheck:
        return compare_outputs(reference, primary, self.default, self.per_output)

    def tier_results(self, check: TensorCheck) -> dict[str, TierResult]:
        """One ``TierResult`` per tier that ran on this sample (see the module docstring)."""
        return {
            "tensor": TierResult(
                passed=check.passed,
                summary=check.summary(),
                outputs=list(check.outputs),
                details={"max_abs_error": check.max_abs_error},
            )
        }
