"""Selective op fallback (``policy.action: fallback_ops``): repair only what drifts.

When the detector trips on a model whose int8 or fp16 primary the guard derived itself, the
model goes to its whole-model fallback while this runs, off the request path:

1. Suspects: tier 2 on recent failing samples (from the bounded buffer of mirrored inputs);
   layers ranked by *isolated* error (the layer's own contribution, not what it inherited).
2. Ops: each suspect's segment in the int8 graph names its quantised nodes; ``quantize_dynamic``
   names them ``<fp32 node>_quant`` (a Gemm is first rewritten to ``<name>_MatMul``), so the
   node to keep at fp32 is the name without the suffix (``node_linear_MatMul``). Suspects whose
   segment holds no quantised node (a Relu that inherited error) drop out. fp16
   (``onnxconverter_common``) keeps every node's name and only adds Casts (``graph_input_cast0``,
   ``<node>_input_cast0``...): a suspect's ops are the segment's nodes that the fp32 source
   graph has under the same name.
3. Search over arbitrary node sets: start with every candidate op kept at fp32 (it must pass,
   or nothing will); then try to quantise the largest untested segment again, keeping the
   change when the candidate still passes and splitting the segment in two when it fails. The
   result keeps back only ops whose re-quantisation alone breaks the thresholds. (Polygraphy
   bisects a prefix or suffix of the layer list; drift sits anywhere.)
4. Each candidate is rebuilt with ``nodes_to_exclude`` (derived, cached; for fp16 the
   converter's ``node_block_list``), checked to really exclude those ops (int8: the quantised
   node is gone; fp16: every float input and output of the node is float32), and validated on
   every buffered input against the reference through the model's own tier-1/3 checks. A
   candidate the rebuild refuses (e.g. a variant ONNX Runtime cannot load) is a failed
   candidate, not the end of the repair.
5. The passing candidate is handed back loaded; the caller swaps it in atomically (a dict item:
   requests in flight finish on the old session, which is never closed under them).

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

QUANT_SUFFIX = "_quant"


@dataclass
class BufferedSample:
    inputs: dict[str, np.ndarray]
    failed: bool


class SampleBuffer:
    """The last ``size`` mirrored inputs and whether they failed: bounded, in memory."""

    def __init__(self, size: int):
        self._items: deque[BufferedSample] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, inputs: dict[str, np.ndarray], failed: bool) -> None:
        with self._lock:
            self._items.append(BufferedSample(inputs, failed))

    def snapshot(self) -> list[BufferedSample]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


class QuantisedGraph:
    """Node names, inputs and weights of a ``quantize_dynamic`` output, read once."""

    def __init__(self, model_path):
        import onnx

        graph = onnx.load(str(model_path), load_external_data=False).graph
        self.nodes = {node.name: node for node in graph.node}
        self.initializers = {init.name for init in graph.initializer}

    def reads_quantised_weight(self, name: str) -> bool:
        node = self.nodes.get(name)
        return node is not None and any(
            i.endswith(QUANT_WEIGHT_SUFFIX) and i in self.initializers for i in node.input)


QUANT_WEIGHT_SUFFIX = "_quantized"


def rebuildable_ops(primary_nodes: list[str], graph: QuantisedGraph | None = None) -> list[str]:
    """The fp32 nodes whose int8 forms sit in a segment: what ``nodes_to_exclude`` must name.

    ``quantize_dynamic`` replaces a MatMul/Conv by ``<name>_quant`` (a Gemm is first rewritten
    to ``<name>_MatMul``); a Gather of an embedding table keeps its name and reads the table
    as ``<weight>_quantized`` (dequantised after it)."""
    ops = []
    for name in primary_nodes:
        if name.endswith(QUANT_SUFFIX):
            ops.append(name[: -len(QUANT_SUFFIX)])
        elif graph is not None and graph.reads_quantised_weight(name):
            ops.append(name)
    return ops


def excluded_ops_missing(model_path, kept: list[str]) -> list[str]:
    """Ops asked to stay fp32 that the rebuilt model still quantises (or lacks entirely)."""
    graph = QuantisedGraph(model_path)
    return [op for op in kept
            if op + QUANT_SUFFIX in graph.nodes or op not in graph.nodes
            or graph.reads_quantised_weight(op)]


def source_node_names(source_path) -> set[str]:
    """Node names of the fp32 artifact: what an fp16 variant's node names map back to."""
    import onnx

    graph = onnx.load(str(source_path), load_external_data=False).graph
    return {node.name for node in graph.node if node.name}


def fp16_rebuildable_ops(primary_nodes: list[str], source_names: set[str]) -> list[str]:
    """The fp32 nodes in an fp16 segment: the converter keeps node names and only inserts
    Casts, which the source graph does not have (and which the block list cannot name)."""
    return [name for name in primary_nodes if name in source_names]


def fp16_ops_not_fp32(model_path, kept: list[str]) -> list[str]:
    """Ops asked to stay fp32 that the rebuilt fp16 model lacks or still runs with a float16
    input or output (types from shape inference and the initializers)."""
    import onnx

    from guard.verify.activation.onnx_side import OnnxGraph

    graph = OnnxGraph.load(model_path)
    nodes = graph.by_name()
    half = onnx.TensorProto.FLOAT16
    missing = []
    for op in kept:
        node = nodes.get(op)
        if node is None:
            missing.append(op)
            continue
        for name in [n for n in list(node.input) + list(node.output) if n]:
            init = graph.initializers.get(name)
            elem = init.data_type if init is not None else graph.elem_types.get(name)
            if elem == half:
                missing.append(op)
                break
    return missing


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
    """One repair attempt for an int8 or fp16 ONNX Runtime primary the guard derived."""

    def __init__(
        self,
        primary_spec: BackendConfig,
        reference: Backend,
        validate: Callable[[dict, dict, dict], bool],
        config: RepairConfig,
        activation=None,
        build: Callable[[BackendConfig], Backend] | None = None,
        on_step: Callable[[dict], None] | None = None,
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
        self._base_excluded = list(primary_spec.options.get("nodes_to_exclude", []))

    # -- the attempt ----------------------------------------------------------------------------
    def run(self, samples: list[BufferedSample],
            suspects: list[Suspect] | None = None) -> RepairOutcome:
        started = self.clock()
        outcome = RepairOutcome(False, "")
        try:
            if not samples:
                raise RepairAborted("no buffered samples to find suspects on or validate with")
            outcome.suspects = suspects if suspects is not None else self.find_suspects(samples)
            ops = self._candidate_ops(outcome.suspects)
            # The samples that failed on the primary first: a candidate that has not fixed
            # the drift fails on them soonest, and its validation stops there.
            samples = sorted(samples, key=lambda s: not s.failed)
            references = [self.reference.infer(s.inputs) for s in samples]
            kept, backend = self._search(ops, samples, references, outcome, started)
            outcome.ok, outcome.kept, outcome.backend = True, kept, backend
            outcome.reason = (f"{len(kept)} op(s) kept at fp32 pass the checks on "
                              f"{len(samples)} buffered samples")
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
                                                self._rebuildable(layer.primary_nodes))
        ranked = sorted(worst.values(), key=lambda s: s.isolated_error, reverse=True)
        self.on_step({"step": "suspects", "ranked": [
            {"layer": s.layer, "isolated_error": round(s.isolated_error, 6), "ops": s.ops}
            for s in ranked[:10]]})
        return ranked

    def _candidate_ops(self, suspects: list[Suspect]) -> list[str]:
        ops: list[str] = []
        for suspect in suspects:
            if suspect.isolated_error < self.config.min_isolated_error:
                continue
            for op in suspect.ops:
                if op not in ops and op not in self._base_excluded:
                    ops.append(op)
        ops = ops[: self.config.max_ops]
        if not ops:
            raise RepairAborted(
                "the suspects map to no rebuildable op (their segments hold no "
                f"{'fp32 source node' if self.spec.precision == 'fp16' else 'quantised node'} "
                f"above isolated error {self.config.min_isolated_error}): "
                + ", ".join(f"{s.layer} ({s.isolated_error:.3g})" for s in suspects[:5]))
        self.on_step({"step": "candidate_ops", "ops": ops})
        return ops

    def _rebuildable(self, primary_nodes: list[str]) -> list[str]:
        if self.spec.precision == "fp16":
            if not hasattr(self, "_source_names"):
                self._source_names = source_node_names(self.spec.path)
            return fp16_rebuildable_ops(primary_nodes, self._source_names)
        return rebuildable_ops(primary_nodes, self._graph())

    def _missing(self, model_path, kept: list[str]) -> list[str]:
        if self.spec.precision == "fp16":
            return fp16_ops_not_fp32(model_path, kept)
        return excluded_ops_missing(model_path, kept)

    def _graph(self) -> QuantisedGraph | None:
        """The int8 variant as configured (cached by derive), to map segment nodes to ops."""
        if not hasattr(self, "_quantised"):
            from guard.backends.derive import derive_onnx

            try:
                path = derive_onnx(self.spec.path, self.spec.precision, self._base_excluded,
                                   bool(self.spec.options.get("per_channel", False)))
                self._quantised = QuantisedGraph(path)
            except Exception:  # suffix rules still apply without it
                self._quantised = None
        return self._quantised

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
                backend = self._rebuild(kept)
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
                f"keeping every candidate op at fp32 ({len(ops)}) gives no usable variant: "
                + outcome.steps[-1]["error"])
        if best is None:
            raise RepairAborted(
                f"keeping every candidate op at fp32 ({len(ops)}) still fails the checks: the "
                "drift is not in the ops tier 2 points at")
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

    def _rebuild(self, kept: list[str]) -> Backend:
        spec = self.spec.model_copy(deep=True)
        spec.options = {**spec.options, "nodes_to_exclude": self._base_excluded + kept}
        backend = self.build(spec)
        model_path = getattr(backend, "model_path", None)
        if model_path is not None:
            missing = self._missing(model_path, kept)
            if missing:
                backend.close()
                raise RepairAborted(f"rebuilding with nodes_to_exclude did not keep "
                                    f"{', '.join(missing)} at fp32")
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
