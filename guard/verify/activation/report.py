"""What tier 2 found on one sample: per-layer errors, the first divergence, the suspects."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from guard.verify.activation.errors import LayerError, _round

if TYPE_CHECKING:  # decide.py imports this module
    from guard.verify.activation.decide import Budget

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
    divergent: bool = False  # its isolated error exceeds its allowance (see decide.py)
    noise: float = 0.0  # the reference's own relative error on this layer against itself
    allowance: float | None = None  # budget + multiplier * noise (or the fixed rel_error)
    measurable: float | None = None  # isolated error beyond which it differs measurably
    unsure: str = ""  # why the alignment may compare different computations (never named)
    modules: list[str] = field(default_factory=list)  # torch paths it computes (every member)
    # judged against its peers (decide.py): their median isolated error and the group
    peer_level: float | None = None
    peer_group: str = ""

    @property
    def ratio(self) -> float:
        """Isolated error over allowance (> 1: divergent); 0 without an isolated figure."""
        if self.isolated is None:
            return 0.0
        if not self.allowance:
            return math.inf if self.isolated.rel_error > 0 else 0.0
        return self.isolated.rel_error / self.allowance

    def as_dict(self) -> dict:
        return {
            "layer": self.name, "op": self.op, "module": self.module, "value": self.value,
            "propagated": self.propagated.as_dict(),
            "isolated": self.isolated.as_dict() if self.isolated else None,
            "isolation_note": self.isolation_note, "primary_nodes": self.primary_nodes,
            "divergent": self.divergent, "noise": _round(self.noise),
            "allowance": None if self.allowance is None else _round(self.allowance),
            "measurable": None if self.measurable is None else _round(self.measurable),
            **({"unsure": self.unsure} if self.unsure else {}),
            **({"peers": {"group": self.peer_group, "median_isolated": _round(self.peer_level)}}
               if self.peer_group and self.peer_level is not None else {}),
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
    threshold: float  # the budget (relative error tier 1 allows at the output), or rel_error
    layers: list[LayerResult] = field(default_factory=list)
    unaligned: list[Unaligned] = field(default_factory=list)
    primary_only: list[str] = field(default_factory=list)  # values the primary's derivation added
    suspects: list[LayerResult] = field(default_factory=list)  # by isolated error, largest first
    seconds: float = 0.0
    capture_seconds: float = 0.0  # both sides captured and aligned
    isolate_seconds: float = 0.0  # the layers re-run in isolation (at most max_isolated)
    error: str = ""  # set when the check itself could not run (capture failed)
    budget: Budget | None = None  # what the allowances derive from (set by decide.decide)
    first: LayerResult | None = None  # set by decide.decide
    basis: str = ""  # the rule that named the first divergence
    undetermined: str = ""  # tier 1 failed but no layer can be named: exactly why
    noise_note: str = ""  # how the per-layer noise was measured, or why it was not
    # ``first`` differs measurably but every layer is within its allowance (decide.py): named,
    # not a failure.
    within_budget: bool = False
    within_budget_note: str = ""  # why no layer is named within the budget (reduced precision)
    # a layer over its allowance would be named, but its alignment is unsure: not passed, and
    # ``undetermined`` says why no layer is named
    unsure_divergence: bool = False

    @property
    def first_divergence(self) -> LayerResult | None:
        if self.first is not None or self.undetermined:
            return self.first
        return next((layer for layer in self.layers if layer.divergent), None)

    @property
    def passed(self) -> bool:
        """Driven by the budget: a first divergence named within it does not fail the check."""
        return not self.error and not self.unsure_divergence and (
            self.first_divergence is None or self.within_budget)

    def first_divergence_dict(self) -> dict | None:
        """The CONTRACT report shape: ``{"layer": ..., "error": ...}`` (plus context)."""
        first = self.first_divergence
        if first is None:
            return None
        return {"layer": first.name, "error": first.propagated.rel_error, "op": first.op,
                "module": first.module, "value": first.value,
                "isolated_error": first.isolated.rel_error if first.isolated else None,
                "allowance": first.allowance, "basis": self.basis,
                "within_budget": self.within_budget}

    def summary(self, names: int = _SUMMARY_NAMES) -> dict:
        """Compact evidence for events and route transitions."""
        return {
            "pair": self.pair,
            "passed": self.passed,
            "threshold": self.threshold,
            "aligned": len(self.layers),
            "first_divergence": self.first_divergence_dict(),
            **({"undetermined": self.undetermined} if self.undetermined else {}),
            **({"within_budget_note": self.within_budget_note}
               if self.within_budget_note else {}),
            "budget": self.budget.as_dict() if self.budget is not None else None,
            "suspects": [
                {"layer": s.name, "op": s.op, "module": s.module,
                 "isolated_error": s.isolated.rel_error if s.isolated else None,
                 "propagated_error": s.propagated.rel_error, "allowance": s.allowance,
                 "primary_nodes": s.primary_nodes}
                for s in self.suspects
            ],
            "unaligned": [u.as_dict() for u in self.unaligned[:names]],
            "unaligned_count": len(self.unaligned),
            "primary_only_count": len(self.primary_only),
            "seconds": round(self.seconds, 4), "noise": self.noise_note,
            **({"error": self.error} if self.error else {}),
        }

    def as_dict(self) -> dict:
        out = self.summary(names=len(self.unaligned))
        out["layers"] = [layer.as_dict() for layer in self.layers]
        out["primary_only"] = self.primary_only
        return out
