"""The checks one mirrored (or replayed) sample goes through, independent of where it came from.

The sidecar's mirror worker and offline replay both call ``Verifier.check``; today it runs tier 1,
and the activation and task tiers slot in here.
"""

from __future__ import annotations

import numpy as np

from guard.config import ChecksConfig
from guard.verify.tensor import TensorCheck, Tolerance, compare_outputs


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
