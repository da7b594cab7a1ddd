"""What tier 2 found on one sample: per-layer errors, the first divergence, the suspects."""

from __future__ import annotations

from dataclasses import dataclass, field

from guard.verify.activation.errors import LayerError

# How many unaligned names / suspects an event carries (the report itself keeps all).
_SUMMARY_NAMES = 20


@dataclass
class LayerResult:
    name: str  # reference-side name: ONNX node name, or torch module path ("pool#1" if reused)
    op: str  # ONNX op type or torch module class
    module: str  # torch module path the layer belongs to, where the graph records it
    value: str  # the tensor compared (ONNX value name or torch call key)
    propagated: LayerError  # what reaches this layer on the primary, vs the reference
    isolated: LayerError | None = None  # the primary's layer fed the reference's own inputs
    isolation_note: str = ""  # why there is no isolated figure
    primary_nodes: list[str] = field(default_factory=list)  # ONNX primary: the nodes computing it
    divergent: bool = False

    def as_dict(self) -> dict:
        return {
            "layer": self.name, "op": self.op, "module": self.module, "value": self.value,
            "propagated": self.propagated.as_dict(),
            "isolated": self.isolated.as_dict() if self.isolated else None,
            "isolation_note": self.isolation_note, "primary_nodes": self.primary_nodes,
            "divergent": self.divergent,
        }


@dataclass
class Unaligned:
    side: str  # "reference" or "primary": whose layer found no counterpart
    name: str
    reason: str

    def as_dict(self) -> dict:
        return {"side": self.side, "layer": self.name, "reason": self.reason}


@dataclass
class ActivationReport:
    pair: str  # "onnx/onnx", "torch/onnx", "onnx/torch", "torch/torch" (reference/primary)
    threshold: float  # a layer diverges when its propagated relative error exceeds this
    layers: list[LayerResult] = field(default_factory=list)
    unaligned: list[Unaligned] = field(default_factory=list)
    primary_only: list[str] = field(default_factory=list)  # values the primary's derivation added
    suspects: list[LayerResult] = field(default_factory=list)  # by isolated error, largest first
    seconds: float = 0.0
    error: str = ""  # set when the check itself could not run (capture failed)

    @property
    def first_divergence(self) -> LayerResult | None:
        return next((layer for layer in self.layers if layer.divergent), None)

    @property
    def passed(self) -> bool:
        return not self.error and self.first_divergence is None

    def first_divergence_dict(self) -> dict | None:
        """The CONTRACT report shape: ``{"layer": ..., "error": ...}`` (plus context)."""
        first = self.first_divergence
        if first is None:
            return None
        return {"layer": first.name, "error": first.propagated.rel_error, "op": first.op,
                "module": first.module, "value": first.value,
                "isolated_error": first.isolated.rel_error if first.isolated else None}

    def summary(self, names: int = _SUMMARY_NAMES) -> dict:
        """Compact evidence for events and route transitions."""
        return {
            "pair": self.pair,
            "passed": self.passed,
            "threshold": self.threshold,
            "aligned": len(self.layers),
            "first_divergence": self.first_divergence_dict(),
            "suspects": [
                {"layer": s.name, "op": s.op, "module": s.module,
                 "isolated_error": s.isolated.rel_error if s.isolated else None,
                 "propagated_error": s.propagated.rel_error,
                 "primary_nodes": s.primary_nodes}
                for s in self.suspects
            ],
            "unaligned": [u.as_dict() for u in self.unaligned[:names]],
            "unaligned_count": len(self.unaligned),
            "primary_only_count": len(self.primary_only),
            "seconds": round(self.seconds, 4),
            **({"error": self.error} if self.error else {}),
        }

    def as_dict(self) -> dict:
        out = self.summary(names=len(self.unaligned))
        out["layers"] = [layer.as_dict() for layer in self.layers]
        out["primary_only"] = self.primary_only
        return out
