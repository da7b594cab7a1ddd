"""The checks one mirrored (or replayed, or swept) sample goes through, wherever it came from.

The sidecar's mirror worker, offline replay and ``guard matrix`` all call ``Comparator.check``:

1. both sides' outputs are flattened to named arrays (nested lists/dicts: every leaf compared);
2. the model's deterministic adapters run on both sides (``verify/adapters.py``);
3. tier 1 (tensor) compares every output, with the reference's noise floor added to the
   allowed error when it was measured (``verify/noise.py``);
4. tier 3 (task) judges what the task cares about (``verify/task/``), unless ``task: generic``;
5. tier 2 (activation), for a model that enables it (``checks.activation``: a sample_rate
   above 0 or on_failure) and has a reference (see ``load_activation_tier``);
6. on a tier-1 failure, with ``checks.tensor.arbitration.enabled``, an fp64 run of the reference
   says which side was wrong (``verify/arbitrate.py``).

The result is a ``CheckResult`` with one entry per tier; ``.passed``, ``.max_abs_error``,
``.summary()`` and ``.outputs`` keep the shape of the tier-1 result callers used before.

``Comparator.tier_reports`` turns a ``CheckResult`` into one plain ``TierReport`` per tier: the
shape that capture records (guard/capture/) and replay reports (guard/replay/) share, so that a
tier shows up in both by being in ``CheckResult.tiers``. ``details`` per tier:

- ``tensor``: ``{"max_abs_error": float}`` (per-output figures are in ``outputs``);
- ``task``: ``{"metrics": {name: float}, ...}`` (``TaskCheck.as_dict()``);
- ``activation``: ``{"first_divergence": {"layer": str, "error": float, ...} | None,
  "layers": [{"layer": str, "error": float}, ...]}`` in network order (error: propagated
  relative error);
- any other tier: its ``as_dict()`` when it has one.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from guard.config import ChecksConfig, ModelConfig
from guard.verify.adapters import AdapterChain, AdapterError
from guard.verify.structure import flatten_outputs, is_flat
from guard.verify.task import GENERIC_NOTE, TaskCheck, task_checker
from guard.verify.task.base import OutputMissing
from guard.verify.tensor import OutputCheck, TensorCheck, Tolerance, compare_outputs

log = logging.getLogger("guard.verify")

ACTIVATION_MODULE = "guard.verify.activation"


class TierResult(Protocol):
    passed: bool

    def summary(self) -> str: ...


class ExtraTier(Protocol):
    """What tier 2 provides: ``name`` and ``check(...)`` returning a result with ``passed`` and
    ``summary()``, or None when it skips the sample (tier 2 runs on a sub-sample). ``results``
    holds the tiers already run for this sample."""

    name: str

    def check(self, *, inputs, reference, primary, results) -> TierResult | None: ...


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
    def __init__(
        self,
        checks: ChecksConfig,
        task: str = "generic",
        adapters=(),
        arbiter=None,
    ):
        self.checks = checks
        t = checks.tensor
        self.default = Tolerance(t.atol, t.rtol)
        self._overrides = {
            name: (o.atol if o.atol is not None else t.atol, o.rtol if o.rtol is not None else t.rtol)
            for name, o in t.outputs.items()
        }
        self.noise_floor: dict[str, float] = {}
        self.per_output = self._per_output()
        self.adapters = AdapterChain(adapters)
        self.task_name = task
        self.task_checker = task_checker(task, checks.task)
        self.arbiter = arbiter
        self.extra_tiers: list[ExtraTier] = []
        # Tier-1 statistics of passing outputs: sampled (None), or always (True: offline sweeps).
        self.pass_stats: bool | None = None
        self.tiers: tuple[str, ...] = ("tensor",) + (("task",) if self.task_checker else ())
        # The reference's outputs under the primary's names, where the two sides name them
        # differently (guard/backends/signature_match.py; set by the checked pair at load).
        self.reference_names = None

    def match_reference(self, match) -> None:
        """Rename the reference's outputs by ``match`` (an ``OutputMatch``) before comparing."""
        self.reference_names = match if match.renamed else None

    @classmethod
    def for_model(cls, config: ModelConfig, arbiter=None) -> "Comparator":
        return cls(config.checks, config.task, config.adapters, arbiter)

    # -- configuration after construction ---------------------------------------------------------
    def set_noise_floor(self, floor: dict[str, float]) -> None:
        """Per-output floors (max abs error of the reference against itself)."""
        self.noise_floor = dict(floor)
        self.per_output = self._per_output()

    def add_tier(self, tier: ExtraTier) -> None:
        """Register an extra tier (tier 2) that runs after tiers 1 and 3."""
        self.extra_tiers.append(tier)
        if tier.name not in self.tiers:
            self.tiers = self.tiers + (tier.name,)

    def _per_output(self) -> dict[str, Tolerance]:
        mult = self.checks.tensor.noise_floor.multiplier
        names = set(self._overrides) | set(self.noise_floor)
        out = {}
        for name in names:
            atol, rtol = self._overrides.get(name, (self.default.atol, self.default.rtol))
            out[name] = Tolerance(atol, rtol, mult * self.noise_floor.get(name, 0.0))
        return out

    # -- the check -----------------------------------------------------------------------------------
    def check(
        self,
        reference: dict[str, np.ndarray],
        primary: dict[str, np.ndarray],
        inputs: dict[str, np.ndarray] | None = None,
    ) -> CheckResult:
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
        tensor = compare_outputs(ref, out, self.default, self.per_output, self.pass_stats)
        result.tiers["tensor"] = tensor
        if self.task_checker is not None:
            allowed = {o.name: o.allowed for o in tensor.outputs}
            try:
                result.tiers["task"] = self.task_checker.check(ref, out, allowed)
            except OutputMissing as exc:  # on neither side: the request asked for other outputs
                result.notes.append(f"tier 3 not run on this sample: {exc}")
        elif self.task_name == "generic":
            result.notes.append(GENERIC_NOTE)
        for tier in self.extra_tiers:
            try:
                extra = tier.check(inputs=inputs, reference=ref, primary=out,
                                   results=dict(result.tiers))
                if extra is not None:  # None: the tier skipped this sample (tier 2 samples)
                    result.tiers[tier.name] = extra
            except Exception as exc:  # a tier-2 problem is reported, it never fails the primary
                log.exception("tier %s failed to run", tier.name)
                result.notes.append(f"tier {tier.name} could not run: {type(exc).__name__}: {exc}")
        if not tensor.passed and self.arbiter is not None and inputs is not None:
            verdict = self.arbiter.judge(inputs, ref, out, tensor,
                                         _Renaming(self.reference_names, self.adapters))
            result.arbitration = verdict
            if verdict.forgiven:
                result.notes.append("tier 1 failure forgiven: the fp64 arbiter found the "
                                    "reference further from fp64 than the primary")
                result.tiers["tensor"] = TensorCheck(True, tensor.outputs)
        return result

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


def load_activation_tier(config: ModelConfig, backends: dict) -> ExtraTier | None:
    """Tier 2 for a model: ``guard.verify.activation.build_tier(config, backends)``, imported
    here, when first needed. None when the model does not enable tier 2
    (``checks.activation``: a sample_rate above 0 or on_failure) or has no reference: it then
    runs tiers 1 and 3 only.
    """
    if importlib.util.find_spec(ACTIVATION_MODULE) is None:
        return None
    module = importlib.import_module(ACTIVATION_MODULE)
    build = getattr(module, "build_tier", None)
    return build(config, backends) if build is not None else None


@dataclass
class TierReport:
    """One tier's result on one sample, in the plain shape capture and replay share."""

    passed: bool
    summary: str
    outputs: list[OutputCheck] = field(default_factory=list)  # tensor tier: per output
    details: dict[str, Any] = field(default_factory=dict)


def _activation_details(tier: Any, details: dict[str, Any]) -> dict[str, Any]:
    """Tier 2's report reduced to what replay aggregates: the first divergence and the
    per-layer error profile (propagated relative error), in network order."""
    first = tier.first_divergence_dict() if hasattr(tier, "first_divergence_dict") else \
        details.get("first_divergence")
    layers = []
    for layer in details.get("layers", []):
        error = layer.get("error")
        if error is None:
            error = (layer.get("propagated") or {}).get("rel_error")
        if error is not None:
            layers.append({"layer": layer.get("layer", ""), "error": float(error)})
    return {"first_divergence": first, "layers": layers}


def tier_reports(result: CheckResult) -> dict[str, TierReport]:
    """One ``TierReport`` per tier that ran on this sample (see the module docstring)."""
    out: dict[str, TierReport] = {}
    for name, tier in result.tiers.items():
        if isinstance(tier, TensorCheck):
            out[name] = TierReport(tier.passed, tier.summary(), list(tier.outputs),
                                   {"max_abs_error": tier.max_abs_error})
            continue
        summary = tier.summary()
        details = tier.as_dict() if hasattr(tier, "as_dict") else {}
        if name == "activation":
            details = _activation_details(tier, details)
            if not isinstance(summary, str):  # tier 2 summarises as a dict of evidence
                first = details["first_divergence"]
                if first is None:
                    summary = "no layer diverges"
                elif first.get("within_budget"):  # measurable, but inside tier 1's budget
                    summary = f"first measurable divergence at {first['layer']} (within budget)"
                else:
                    summary = f"first divergence at {first['layer']}"
        out[name] = TierReport(bool(tier.passed), str(summary), [], details)
    return out

