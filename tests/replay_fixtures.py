"""A row-wise variant of ``fixture_models.Affine`` for replay tests.

``Affine`` decides drift for the whole batch (any row triggers it), which is right for the
sidecar's per-request tests but makes a stacked replay batch drift as a whole. ``RowAffine``
drifts only the rows whose first feature is ``>= DRIFT_TRIGGER``, as a real row-independent
model behaves, so a batched replay must reproduce the sidecar's per-request verdicts.
Same weights, same signature (``x`` FP32 [-1, 4] -> ``y`` FP32 [-1, 3]).
"""

from __future__ import annotations

from fixture_models import DRIFT_TRIGGER, FAIL_TRIGGER, Affine


class RowAffine(Affine):
    def forward(self, x):
        if self.fail_on_trigger and bool((x[:, 0] == FAIL_TRIGGER).any()):
            raise RuntimeError("fixture model failure on trigger input")
        y = self.linear(x)
        if self.drift_on_trigger:
            y = y + (x[:, :1] >= DRIFT_TRIGGER).to(y.dtype)
        return y


def row_affine(**kwargs) -> RowAffine:
    return RowAffine(**kwargs)
