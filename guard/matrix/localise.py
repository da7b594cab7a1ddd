"""Tier 2 in the sweep (``tiers: [..., activation]``): the layer a failing column diverges at.

Per (model, column), the two capture sides are built once, as tier 2 builds them
(guard/verify/activation): the column's block as it runs, and the reference from the model's
eager module where the reference is a torch artifact (forward hooks cannot see inside
TorchScript). In each tolerance cell, tier 2 runs on the first sample tier 1 failed there, with
that sample's tier-1 budget, and the record names the first divergent layer (``stats``:
``first_divergence``, ``suspects``); where tier 1 failed and no layer can be named, the record
fails as ``undetermined`` with tier 2's reason. A cell whose tier 1 passed records ``pass`` with
nothing to localise; a column tier 2 cannot capture (LiteRT, a SavedModel, torch.compile, a
column run in a process of its own) records ``skip`` with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from guard.config import ActivationCheckConfig, BackendConfig, TensorCheckConfig

if TYPE_CHECKING:
    from guard.verify.activation.checker import Side

ACTIVATION = ActivationCheckConfig(on_failure=True)


def capture_reference(prepared, ref_spec: BackendConfig) -> BackendConfig:
    """The reference tier 2 captures: a torch artifact's eager module, when the model has
    one (the zoo's ``guard.zoo:eager``), else the reference block itself."""
    if ref_spec.backend != "torch" or not prepared.eager_factory:
        return ref_spec
    spec = BackendConfig.model_validate({
        "backend": "torch", "path": prepared.eager_factory,
        "options": {"kwargs": dict(prepared.factory_kwargs)}})
    spec.context = ref_spec.context
    return spec


def _not_captured(backend: str) -> str:
    from guard.backends import backend_kind

    kind = backend_kind(backend)
    if kind.activations:
        return ""
    why = kind.no_activations or "compiled kernels or a remote server: nothing to hook"
    return f"tier 2 does not capture backend '{backend}': {why}"


class Localiser:
    """Tier 2 for one (model, column): sides built on first use, reused across cells."""

    def __init__(self, reference: BackendConfig, primary: BackendConfig | str, apart: bool):
        self.reference = reference
        self.primary = primary
        if isinstance(primary, str):
            self.skip = primary
        elif apart:
            self.skip = ("the column runs in a process of its own; tier 2 runs in the sweep's "
                         "process")
        else:
            self.skip = _not_captured(primary.backend) or _not_captured(reference.backend)
        self.failed = ""  # why the sides did not load (each cell's record says so)
        self._sides: tuple[Side, Side] | None = None

    def _build(self) -> tuple[Side, Side]:
        from guard.verify.activation import build_side

        if self._sides is None:
            if isinstance(self.primary, str):  # (a skipped column is never built)
                raise ValueError(f"no primary to capture: {self.primary}")
            reference = build_side(self.reference, "reference", ACTIVATION)
            try:
                primary = build_side(self.primary, "primary", ACTIVATION)
            except Exception:
                reference.close()
                raise
            self._sides = (reference, primary)
        return self._sides

    def record(self, atol: float, rtol: float, results: list, samples: list[dict]) -> dict:
        """``status``, ``reason``, ``failure_type`` and ``stats`` of the cell's tier-2 record."""
        from guard.verify.activation import ActivationChecker, CaptureUnsupported

        if self.skip:
            return {"status": "skip", "failure_type": None, "reason": self.skip}
        failing = next((i for i, r in enumerate(results) if not r.tensor.passed), None)
        if failing is None:
            return {"status": "pass", "failure_type": None,
                    "reason": "tier 1 passed: no layer to localise", "stats": {}}
        if self.failed:
            return {"status": "fail", "failure_type": "exception", "reason": self.failed[:400]}
        try:
            reference, primary = self._build()
        except CaptureUnsupported as exc:
            self.skip = f"tier 2 cannot capture this pair: {exc}"
            return {"status": "skip", "failure_type": None, "reason": self.skip}
        except Exception as exc:  # this column's failure, not the sweep's
            self.failed = f"tier 2's capture sides did not load: {type(exc).__name__}: {exc}"
        if self.failed:
            return {"status": "fail", "failure_type": "exception", "reason": self.failed[:400]}
        tensor = TensorCheckConfig.model_validate(
            {"atol": atol, "rtol": rtol, "noise_floor": {"enabled": False}})
        checker = ActivationChecker(ACTIVATION, reference, primary, tensor=tensor)
        report = checker.check(samples[failing], tier1=results[failing].tensor)
        first = report.first_divergence_dict()
        if report.error:
            status, failure, reason = "fail", "exception", report.error
        elif first is not None:
            status = "pass" if report.passed else "fail"
            failure, reason = "numeric", f"first divergence: {first['layer']} ({report.basis})"
        else:  # tier 1 failed and no layer can be named: the localisation failed
            status, failure = "fail", "undetermined"
            reason = report.undetermined or "no layer named"
        return {"status": status, "failure_type": None if status == "pass" else failure,
                "reason": reason[:400],
                "stats": {"sample": failing, "first_divergence": first,
                          "suspects": [s.name for s in report.suspects[:3]],
                          "aligned": len(report.layers), "unaligned": len(report.unaligned)}}

    def close(self) -> None:
        if self._sides is not None:
            for side in self._sides:
                side.close()
            self._sides = None
