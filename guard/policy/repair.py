"""Selective op fallback (``policy.action: fallback_ops``): repair only what drifts.

When the detector trips on a model whose primary the guard can rebuild with a few ops kept back
at reference precision, the model goes to its whole-model fallback while this runs, off the
request path. What an "op" is, and how it is kept back, depends on the primary
(guard/policy/keep_back.py, one strategy each): ONNX Runtime int8 and fp16 (fp32 ONNX nodes,
``nodes_to_exclude``), ``torch_compile`` at any precision (submodules run eagerly in fp32,
``eager_fp32_modules``) and TensorRT fp16/int8 (layers pinned to fp32, ``fp32_layers``). The
search below is the same for all of them:

1. Suspects: tier 2 on recent failing samples (from the bounded buffer of mirrored inputs);
   layers ranked by *isolated* error (the layer's own contribution, not what it inherited).
2. Ops: the strategy maps each suspect to candidate ops (int8: its segment's quantised nodes
   ``<node>_quant`` -> ``<node>``; fp16: its segment's nodes that the fp32 graph has; torch:
   the module path, every member's for a fused unit; TensorRT: the ONNX node names its layers
   are named after). Suspects that map to none (a Relu that inherited error) drop out. When
   none is left, a strategy may offer every op in forward order (torch_compile, TensorRT:
   drift tier 2's stand-in capture cannot see); otherwise the repair ends.
3. Search over arbitrary op sets: start with every candidate op kept back (it must pass, or
   nothing will); then try to put back the largest untested segment, keeping the change when
   the candidate still passes and splitting the segment in two when it fails. The result keeps
   back only ops whose reduced precision alone breaks the thresholds. (Polygraphy bisects a
   prefix or suffix of the layer list; drift sits anywhere.)
4. Each candidate is rebuilt from the primary's backend block with the strategy's option
   extended, checked to really keep those ops back (int8: the quantised node is gone; fp16:
   every float input and output of the node is float32; torch: each module is wrapped and its
   copy is fp32; TensorRT: the builder refuses names and constraints it cannot honour), and
   validated on the buffered inputs against the reference through the model's own tier-1/3
   checks (the inputs that failed on the primary first; validation stops as soon as the
   candidate has failed more than ``max_failure_share`` allows, since most candidates fail).
   A candidate the rebuild refuses (e.g. a variant ONNX Runtime cannot load) is a failed
   candidate, not the end of the repair.
5. The passing candidate is handed back loaded; the caller swaps it in atomically (a dict item:
   requests in flight finish on the old backend, which is never closed under them).

Any fault (no rebuildable op, a rebuild or candidate that throws, budget spent with nothing
passing) ends the repair with a reason; the caller keeps the whole-model fallback.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from guard.backends import Backend, create_backend
from guard.config import BackendConfig, RepairConfig
from guard.errors import BackendError
from guard.policy.keep_back import KeepBack, keep_back_for
from guard.policy.onnx_ops import (  # noqa: F401  (their historical home: tests, benchmarks)
    QuantisedGraph,
    excluded_ops_missing,
    fp16_ops_not_fp32,
    fp16_rebuildable_ops,
    rebuildable_ops,
    source_node_names,
)


@dataclass
class BufferedSample:
    inputs: dict[str, np.ndarray]
    failed: bool
    size: int = 0  # bytes of the inputs


class RepairBuffer:
    """The last ``size`` mirrored inputs and whether they failed: bounded in items and in
    bytes (``max_bytes``: the oldest go first; a single sample larger than it is not kept)."""

    def __init__(self, size: int, max_bytes: int | None = None):
        self._items: deque[BufferedSample] = deque(maxlen=size)
        self._max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, inputs: dict[str, np.ndarray], failed: bool) -> None:
        size = sum(getattr(a, "nbytes", 0) for a in inputs.values())
        if self._max_bytes is not None and size > self._max_bytes:
            return
        with self._lock:
            if len(self._items) == self._items.maxlen:
                self._bytes -= self._items[0].size
            self._items.append(BufferedSample(inputs, failed, size))
            self._bytes += size
            while self._max_bytes is not None and self._bytes > self._max_bytes:
                self._bytes -= self._items.popleft().size

    def snapshot(self) -> list[BufferedSample]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Suspect:
    layer: str
    isolated_error: float
    ops: list[str]


@dataclass
class RepairOutcome:
    ok: bool
    reason: str
    kept: list[str] = field(default_factory=list)
    backend: Backend | None = None
    suspects: list[Suspect] = field(default_factory=list)
    candidates_tried: int = 0
    seconds: float = 0.0
    steps: list[dict] = field(default_factory=list)

    def evidence(self) -> dict:
        return {
            "ok": self.ok, "reason": self.reason, "ops_kept_fp32": self.kept,
            "candidates_tried": self.candidates_tried, "seconds": round(self.seconds, 3),
            "suspects": [{"layer": s.layer, "isolated_error": round(s.isolated_error, 6),
                          "ops": s.ops} for s in self.suspects],
            "steps": self.steps,
        }


class RepairAborted(Exception):
    """A fault that ends the repair (the caller keeps the whole-model fallback)."""


class OpRepair:
    """One repair attempt; what is kept back, and how, is the primary's :class:`KeepBack`."""

    def __init__(
        self,
        primary_spec: BackendConfig,
        reference: Backend,
        validate: Callable[[dict, dict, dict], bool],
        config: RepairConfig,
        activation=None,
        build: Callable[[BackendConfig], Backend] | None = None,
        on_step: Callable[[dict], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.spec = primary_spec
        self.reference = reference
        self.validate = validate  # (reference outputs, candidate outputs, inputs) -> passed
        self.config = config
        self.activation = activation
        self.build = build or self._build
        self.on_step = on_step or (lambda step: None)
        self.clock = clock
        self.keep_back: KeepBack = keep_back_for(primary_spec)

    # -- the attempt ----------------------------------------------------------------------------
    def run(self, samples: list[BufferedSample],
            suspects: list[Suspect] | None = None) -> RepairOutcome:
        started = self.clock()
        outcome = RepairOutcome(False, "")
        try:
            if not samples:
                raise RepairAborted("no buffered samples to find suspects on or validate with")
            outcome.suspects = suspects if suspects is not None else self.find_suspects(samples)
            ops = self.candidate_ops(outcome.suspects, samples)
            # The samples that failed on the primary first: a candidate that has not fixed
            # the drift fails on them soonest, and its validation stops there.
            samples = sorted(samples, key=lambda s: not s.failed)
            references = [self.reference.infer(s.inputs) for s in samples]
            kept, backend = self._search(ops, samples, references, outcome, started)
            backend = self._serving(kept, backend, samples, references)
            outcome.ok, outcome.kept, outcome.backend = True, kept, backend
            outcome.reason = (f"{len(kept)} {self.keep_back.what}(s) {self.keep_back.kept_as}"
                              f" pass the checks on {len(samples)} buffered samples")
        except RepairAborted as exc:
            outcome.reason = str(exc)
        except Exception as exc:  # a fault anywhere: reported, the whole-model fallback stays
            outcome.reason = f"repair failed: {type(exc).__name__}: {exc}"
        outcome.seconds = self.clock() - started
        return outcome

    def find_suspects(self, samples: list[BufferedSample]) -> list[Suspect]:
        if self.activation is None:
            raise RepairAborted("no tier-2 checker to find suspects with")
        failing = [s for s in samples if s.failed] or samples
        worst: dict[str, Suspect] = {}
        for sample in failing[: self.config.suspect_samples]:
            report = self.activation.check(sample.inputs)
            if report.error:
                raise RepairAborted(f"tier 2 could not run: {report.error}")
            for layer in report.layers:
                if layer.isolated is None:
                    continue
                error = layer.isolated.rel_error
                known = worst.get(layer.name)
                if known is None or error > known.isolated_error:
                    worst[layer.name] = Suspect(layer.name, error,
                                                self.keep_back.ops_for(layer))
        ranked = sorted(worst.values(), key=lambda s: s.isolated_error, reverse=True)
        self.on_step({"step": "suspects", "ranked": [
            {"layer": s.layer, "isolated_error": round(s.isolated_error, 6), "ops": s.ops}
            for s in ranked[:10]]})
        return ranked

    def candidate_ops(self, suspects: list[Suspect], samples) -> list[str]:
        """The ops the search starts from: the suspects' ops in their rank order (or every op,
        where the strategy offers them and tier 2 names none), at most ``max_ops``."""
        ops: list[str] = []
        for suspect in suspects:
            if suspect.isolated_error < self.config.min_isolated_error:
                continue
            for op in suspect.ops:
                if op not in ops and op not in self.keep_back.base:
                    ops.append(op)
        note = None
        if not ops and self.activation is not None:
            # Drift tier 2 cannot see (torch_compile: only in compiled kernels): every op, in
            # forward order, and the search narrows them down.
            ops = [op for op in self.keep_back.every_op(self.activation, samples[0].inputs)
                   if op not in self.keep_back.base]
            note = (f"tier 2 named no {self.keep_back.no_ops_because} above isolated error "
                    f"{self.config.min_isolated_error}: trying every {self.keep_back.what}")
        ops = ops[: self.config.max_ops]
        if not ops:
            raise RepairAborted(
                "the suspects map to no rebuildable op (their segments hold no "
                f"{self.keep_back.no_ops_because} "
                f"above isolated error {self.config.min_isolated_error}): "
                + ", ".join(f"{s.layer} ({s.isolated_error:.3g})" for s in suspects[:5]))
        self.on_step({"step": "candidate_ops", "ops": ops, **({"note": note} if note else {})})
        return ops

    # -- search -----------------------------------------------------------------------------------
    def _search(self, ops: list[str], samples, references, outcome: RepairOutcome,
                started: float) -> tuple[list[str], Backend]:
        def evaluate(kept: list[str]) -> Backend | None:
            if outcome.candidates_tried >= self.config.max_candidates:
                raise _BudgetSpent(f"max_candidates={self.config.max_candidates}")
            if self.clock() - started > self.config.budget_s:
                raise _BudgetSpent(f"budget_s={self.config.budget_s:g}")
            outcome.candidates_tried += 1
            try:
                backend = self.rebuild(kept)
            except BackendError as exc:  # e.g. a variant ONNX Runtime refuses to load
                step = {"step": "candidate", "kept": kept, "passed": False,
                        "error": str(exc)[:300]}
                outcome.steps.append(step)
                self.on_step(step)
                return None
            allowed = int(self.config.max_failure_share * len(samples))
            try:
                failures = self._failures(backend, samples, references, allowed)
            except Exception:
                backend.close()  # a candidate that crashes on validation is not left loaded
                raise
            passed = failures <= allowed
            step = {"step": "candidate", "kept": kept, "failures": failures,
                    "samples": len(samples), "passed": passed}
            if not passed:
                step["failures_at_least"] = True  # validation stopped once it could not pass
            outcome.steps.append(step)
            self.on_step(step)
            if passed:
                return backend
            backend.close()
            return None

        try:
            best = evaluate(ops)
        except _BudgetSpent as exc:
            raise RepairAborted(f"budget spent before the first candidate ({exc})") from None
        if best is None and outcome.steps and "error" in outcome.steps[-1]:
            raise RepairAborted(
                f"keeping every candidate {self.keep_back.what} back ({len(ops)}) gives no "
                "usable variant: "
                + outcome.steps[-1]["error"])
        if best is None:
            raise RepairAborted(
                f"keeping every candidate {self.keep_back.what} back ({len(ops)}) still fails "
                f"the checks: the drift is not in the {self.keep_back.what}s tier 2 points at")
        kept = list(ops)
        untested = [list(ops)]
        try:
            while untested:
                segment = max(untested, key=len)
                untested.remove(segment)
                trial = [op for op in kept if op not in segment]
                if trial == kept:
                    continue
                backend = evaluate(trial) if trial else None
                if backend is not None:
                    best.close()
                    best, kept = backend, trial
                elif len(segment) > 1:
                    half = len(segment) // 2
                    untested += [segment[:half], segment[half:]]
        except _BudgetSpent as exc:
            self.on_step({"step": "budget_spent", "limit": str(exc), "kept": kept})
        return kept, best

    def _serving(self, kept: list[str], validated: Backend, samples, references) -> Backend:
        """The passing variant as it will serve: candidates ran within ``repair.threads``;
        where that changed the session, load it again with the primary's own options and
        validate it once more (more threads may sum in another order)."""
        spec = self.keep_back.rebuild_spec(kept)
        if self.keep_back.within_threads(spec, self.config.threads) == spec:
            return validated
        validated.close()
        backend = self.build(spec)
        try:
            failures = self._failures(backend, samples, references, allowed=len(samples))
        except Exception:
            backend.close()
            raise
        allowed = int(self.config.max_failure_share * len(samples))
        self.on_step({"step": "serving_variant", "kept": kept, "failures": failures,
                      "samples": len(samples), "passed": failures <= allowed})
        if failures > allowed:
            backend.close()
            raise RepairAborted(f"the variant that passed within repair.threads="
                                f"{self.config.threads} fails {failures} of {len(samples)} "
                                "buffered samples with the primary's own options")
        return backend

    def rebuild(self, kept: list[str]) -> Backend:
        """The primary rebuilt with ``kept`` ops kept back, loaded and checked to keep them
        (RepairAborted where it does not): what one step of the search evaluates, public for
        the benchmarks that map the search space (benchmarks/selective_fallback_sets.py)."""
        spec = self.keep_back.within_threads(self.keep_back.rebuild_spec(kept),
                                             self.config.threads)
        backend = self.build(spec)
        missing = self.keep_back.not_kept_back(backend, kept)
        if missing:
            backend.close()
            raise RepairAborted(f"rebuilding with {self.keep_back.option} did not keep "
                                f"{', '.join(missing)} back ({self.keep_back.kept_as})")
        return backend

    def _failures(self, backend: Backend, samples, references, allowed: int) -> int:
        """Failing buffered samples, counted until one more than ``allowed``: a candidate
        that cannot pass any more is not run on the rest (most candidates of a search fail,
        and validation is most of a candidate's cost)."""
        failures = 0
        for sample, reference in zip(samples, references):
            outputs = backend.infer(sample.inputs)
            failures += not self.validate(reference, outputs, sample.inputs)
            if failures > allowed:
                break
        return failures

    @staticmethod
    def _build(spec: BackendConfig) -> Backend:
        backend = create_backend(spec, "primary")
        backend.load()
        return backend


class _BudgetSpent(Exception):
    pass
