"""The checks one mirrored (or replayed, or swept) sample goes through, wherever it came from.

The sidecar's mirror worker, offline replay and ``guard matrix`` all call ``Comparator.check``:

1. both sides' outputs are flattened to named arrays (nested lists/dicts: every leaf compared);
2. the model's deterministic adapters run on both sides (``verify/adapters.py``);
3. every registered tier the model runs judges the sample, in registration order
   (guard/verify/tiers.py: ``tensor``, tier 1, with the reference's noise floor added to the
   allowed error when it was measured; ``task``, tier 3, unless ``task: generic``;
   ``activation``, tier 2, for a model that enables it and has a reference); a tier that raises
   is reported in the notes, it never fails the primary;
4. on a tier-1 failure, with ``checks.tensor.arbitration.enabled``, an fp64 run of the reference
   says which side was wrong (``verify/arbitrate.py``).

The result is a ``CheckResult`` with one entry per tier that ran; ``.passed``,
``.max_abs_error``, ``.summary()`` and ``.outputs`` keep the shape of the tier-1 result.

``tier_reports`` turns a ``CheckResult`` into one plain ``TierReport`` per tier: the shape that
capture records (guard/capture/) and replay reports (guard/replay/) share, so that a tier shows
up in both by being registered. ``details`` per tier are its kind's ``details(result)``
(default: the result's ``as_dict()``):

- ``tensor``: ``{"max_abs_error": float}`` (per-output figures are in ``outputs``);
- ``task``: ``{"metrics": {name: float}, ...}`` (``TaskCheck.as_dict()``);
- ``activation``: ``{"first_divergence": {"layer": str, "error": float, ...} | None,
  "layers": [{"layer": str, "error": float}, ...]}`` in network order (error: propagated
  relative error).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from guard.config import ChecksConfig, ModelConfig
from guard.verify.adapters import AdapterChain, AdapterError
from guard.verify.structure import flatten_outputs, is_flat
from guard.verify.task import GENERIC_NOTE, TaskCheck, TaskTier
from guard.verify.tensor import OutputCheck, TensorCheck, TensorTier
from guard.verify.tiers import (
    Compared,
    Tier,
    TierResult,
    TierSetup,
    sample_kind,
    tier_kind,
    tier_kinds,
)

log = logging.getLogger("guard.verify")

__all__ = ["CheckResult", "Comparator", "TierReport", "TierResult", "tier_report", "tier_reports"]


@dataclass
class CheckResult:
    tiers: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    arbitration: Any = None  # an arbitrate.Verdict when the fp64 arbiter ran
    # Outputs only one side gave (after renaming and the adapters): a naming difference, not
    # drift; the sidecar's mirror counts such a sample as an error, never as a failed check.
    unmatched: dict[str, list[str]] = field(default_factory=dict)

    # -- the shape callers of the tier-1-only Comparator relied on --------------------------------
    @property
    def passed(self) -> bool:
        return bool(self.tiers) and all(t.passed for t in self.tiers.values())

    @property
    def tensor(self) -> TensorCheck:
        return self.tiers["tensor"]

    @property
    def task(self) -> TaskCheck | None:
        return self.tiers.get("task")

    @property
    def max_abs_error(self) -> float:
        return self.tensor.max_abs_error

    @property
    def outputs(self) -> list[OutputCheck]:
        return self.tensor.outputs

    @property
    def failures(self) -> list[OutputCheck]:
        return self.tensor.failures

    def failed_tiers(self) -> list[str]:
        return [name for name, t in self.tiers.items() if not t.passed]

    def summary(self) -> str:
        parts = [f"{name}: {t.summary()}" for name, t in self.tiers.items()]
        if self.arbitration is not None:
            parts.append(f"fp64 arbiter: {self.arbitration.summary()}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"passed": self.passed, "tiers": {}}
        for name, t in self.tiers.items():
            if isinstance(t, TensorCheck):
                out["tiers"][name] = {"passed": t.passed, "max_abs_error": t.max_abs_error,
                                      "outputs": [o.as_dict() for o in t.outputs]}
            elif hasattr(t, "as_dict"):
                out["tiers"][name] = t.as_dict()
            else:
                out["tiers"][name] = {"passed": t.passed, "summary": t.summary()}
        if self.notes:
            out["notes"] = list(self.notes)
        if self.arbitration is not None:
            out["arbitration"] = self.arbitration.as_dict()
        return out


class Comparator:
    """The registered tiers for one model, run on each sample (see the module docstring).

    A model runs the registered tiers that take its kind of sample (``sample_kind(task)``):
    tensors (tier 1 then always runs: it judges every sample, and its allowed errors are what
    tier 3 allows), or a generative model's sampled calls (handed to its tiers as they come:
    no flattening, no adapters, no tier 1). ``model`` and ``backends``: the whole model block
    and its built backends, for a tier built from more than ``checks`` and ``task`` (tier 2
    captures beside the backends); a comparator without them (a sweep's) runs the tiers that
    need neither."""

    def __init__(self, checks: ChecksConfig, task: str = "generic", adapters=(), arbiter=None,
                 model: ModelConfig | None = None, backends: dict | None = None):
        self.checks = checks
        self.adapters = AdapterChain(adapters)
        self.task_name = task
        self.arbiter = arbiter
        setup = TierSetup(checks, task, model, backends)
        self.samples = sample_kind(task)
        self.tensor = TensorTier(checks)
        self.runs: list[Tier] = [self.tensor] if self.samples == "tensors" else []
        for kind in tier_kinds():
            if kind.name != self.tensor.name and kind.judges(self.samples):
                built = kind.build(setup)
                if built is not None:
                    self.runs.append(built)
        # The reference's outputs under the primary's names, where the two sides name them
        # differently (guard/backends/signature_match.py; set by the checked pair at load).
        self.reference_names = None

    def match_reference(self, match) -> None:
        """Rename the reference's outputs by ``match`` (an ``OutputMatch``) before comparing."""
        self.reference_names = match if match.renamed else None

    @classmethod
    def for_model(cls, config: ModelConfig, arbiter=None,
                  backends: dict | None = None) -> "Comparator":
        return cls(config.checks, config.task, config.adapters, arbiter, config, backends)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The names of the tiers this model runs, in run order (the metrics' ``tier`` labels)."""
        return tuple(t.name for t in self.runs)

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.runs if t.name == name), None)

    # -- tier 1's settings, read by replay's batched check and the sweeps --------------------------
    @property
    def default(self):
        return self.tensor.default

    @property
    def per_output(self):
        return self.tensor.per_output

    @property
    def noise_floor(self) -> dict[str, float]:
        return self.tensor.noise_floor

    @property
    def pass_stats(self) -> bool | None:
        return self.tensor.pass_stats

    @pass_stats.setter
    def pass_stats(self, value: bool | None) -> None:
        self.tensor.pass_stats = value

    @property
    def task_checker(self):
        task = cast(TaskTier | None, self.tier("task"))  # (the registry's tier 3)
        return task.checker if task is not None else None

    @property
    def extra_tiers(self) -> list[Tier]:
        """Tiers beyond tiers 1 and 3 (replay's batched check takes only those two)."""
        return [t for t in self.runs if t.name not in ("tensor", "task")]

    # -- configuration after construction ---------------------------------------------------------
    def set_noise_floor(self, floor: dict[str, float]) -> None:
        """Per-output floors (max abs error of the reference against itself)."""
        self.tensor.set_noise_floor(floor)

    def add_tier(self, tier: Tier) -> None:
        """Run one more tier instance after the others (one built by hand)."""
        self.runs.append(tier)

    # -- the check ---------------------------------------------------------------------------------
    def check(
        self,
        reference: dict[str, np.ndarray] | Any,
        primary: dict[str, np.ndarray] | Any,
        inputs: dict[str, np.ndarray] | None = None,
    ) -> CheckResult:
        """Both sides' answers through the tiers. A tensor model's are named output arrays; a
        generative model's (``samples`` other than ``tensors``) are what its tiers take, as
        ``Compared`` says: the reference's scores and the sampled call."""
        if self.samples != "tensors":
            result = CheckResult()
            self._run(Compared(reference, primary, inputs, result.tiers, result.notes), result)
            return result
        raw_reference = reference if is_flat(reference) else flatten_outputs(reference)
        raw_primary = primary if is_flat(primary) else flatten_outputs(primary)
        if self.reference_names is not None:
            raw_reference = self.reference_names.apply(raw_reference)
        result = CheckResult()
        try:
            ref = self.adapters.apply(raw_reference)
            out = self.adapters.apply(raw_primary)
        except AdapterError as exc:
            reason = f"adapter failed: {exc}"
            result.tiers["tensor"] = TensorCheck(False, [OutputCheck("(adapters)", False, reason,
                                                                     max_abs=float("inf"))])
            if self.task_checker is not None:
                result.tiers["task"] = TaskCheck(self.task_name, False, reasons=[reason],
                                                 failure="shape")
            return result
        if set(ref) != set(out):
            result.unmatched = {"reference": sorted(set(ref) - set(out)),
                                "primary": sorted(set(out) - set(ref))}
        self._run(Compared(ref, out, inputs, result.tiers, result.notes), result)
        if self.task_checker is None and self.task_name == "generic":
            result.notes.append(GENERIC_NOTE)
        tensor = result.tiers["tensor"]
        if not tensor.passed and self.arbiter is not None and inputs is not None:
            verdict = self.arbiter.judge(inputs, ref, out, tensor,
                                         _Renaming(self.reference_names, self.adapters))
            result.arbitration = verdict
            if verdict.forgiven:
                result.notes.append("tier 1 failure forgiven: the fp64 arbiter found the "
                                    "reference further from fp64 than the primary")
                result.tiers["tensor"] = TensorCheck(True, tensor.outputs)
        return result

    def _run(self, sample: Compared, result: CheckResult) -> None:
        for tier in self.runs:
            if tier is self.tensor:  # tier 1's problems are the sample's verdict, not a note
                result.tiers[tier.name] = tier.check(sample)
                continue
            try:
                checked = tier.check(sample)
                if checked is not None:  # None: the tier skipped this sample (tier 2 samples)
                    result.tiers[tier.name] = checked
            except Exception as exc:  # a tier's problem is reported, it never fails the primary
                log.exception("tier %s failed to run", tier.name)
                result.notes.append(f"tier {tier.name} could not run: {type(exc).__name__}: {exc}")

    @staticmethod
    def tier_reports(result: CheckResult) -> dict[str, "TierReport"]:
        """Per tier, the plain ``TierReport`` capture and replay share (``tier_reports``)."""
        return tier_reports(result)


class _Renaming:
    """The fp64 arbiter's run of the reference, under the primary's names, then the adapters."""

    def __init__(self, names, adapters: AdapterChain):
        self.names, self.adapters = names, adapters

    def apply(self, outputs: dict) -> dict:
        outputs = outputs if self.names is None else self.names.apply(outputs)
        return self.adapters.apply(outputs) if self.adapters else outputs


@dataclass
class TierReport:
    """One tier's result on one sample, in the plain shape capture and replay share."""

    passed: bool
    summary: str
    outputs: list[OutputCheck] = field(default_factory=list)  # tensor tier: per output
    details: dict[str, Any] = field(default_factory=dict)


def tier_reports(result: CheckResult) -> dict[str, TierReport]:
    """One ``TierReport`` per tier that ran on this sample (see the module docstring)."""
    return {name: tier_report(name, tier) for name, tier in result.tiers.items()}


def tier_report(name: str, tier: TierResult) -> TierReport:
    """Tier ``name``'s result on one sample as a ``TierReport``: its kind's ``details`` and
    ``summary`` where it declares them, else the result's own ``as_dict()`` and ``summary()``."""
    kind = _kind(name)
    if kind is not None and kind.details is not None:
        details = kind.details(tier)
    else:
        details = tier.as_dict() if hasattr(tier, "as_dict") else {}
    summary = kind.summary(tier, details) if kind is not None and kind.summary else \
        tier.summary()
    outputs = list(tier.outputs) if isinstance(tier, TensorCheck) else []
    return TierReport(bool(tier.passed), str(summary), outputs, details)


def _kind(name: str):
    """The registered kind of a result's tier; None for one added by hand (``add_tier``)."""
    try:
        return tier_kind(name)
    except KeyError:
        return None
