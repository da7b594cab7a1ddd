"""Tier 2 for one model: build the capture sides once, then check samples.

``ActivationChecker`` is deliberately separate from the tier-1 ``Comparator``: it owns sessions
of its own (built from the artifacts, never the production ones), costs far more than tier 1,
and so runs only on a sub-sample in the mirror worker (``checks.activation.sample_rate``) and,
with ``on_failure``, on tier-1 failures while the mirror queue has room.

Per sample: capture both sides, align them, and for every aligned layer compute the relative
error and cosine of what reaches it (propagated) and of the primary's layer fed the reference's
own inputs (isolated). Isolated error decides (``decide.py``): a layer diverges when the error it
adds itself exceeds its allowance, the relative error tier 1 allows at the output plus the
reference's own noise on that layer (measured once, as tier 1's floor is). No layer is blamed for
what it was fed. The suspects are the layers ranked by isolated error over allowance.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

import numpy as np

from guard.config import ActivationCheckConfig, BackendConfig, ModelConfig, TensorCheckConfig
from guard.verify.activation.align import (
    Alignment,
    Pairing,
    align_onnx_onnx,
    align_torch_onnx,
    align_torch_torch,
)
from guard.verify.activation.decide import (
    Budget,
    budget_from_outputs,
    budget_from_tier1,
    decide,
    rank_suspects,
)
from guard.verify.activation.errors import ShapeMismatch, layer_error
from guard.backends.activations.keras import KerasSide
from guard.backends.activations.onnx import OnnxSide
from guard.verify.activation.report import ActivationReport, LayerResult, Unaligned
from guard.backends.activations import capture_side
from guard.backends.activations.llama_cpp import LlamaCppSide
from guard.backends.activations.torch import CaptureUnsupported, TorchSide
from guard.backends.activations.transformers import TransformersSide

log = logging.getLogger("guard.activation")

Side = OnnxSide | TorchSide | KerasSide | LlamaCppSide


def build_side(spec: BackendConfig, role: str, config: ActivationCheckConfig,
               threads: int = 1, run_path: str | Path | None = None) -> Side:
    """A capture side for one backend block: private sessions/modules built from its artifact.

    ``run_path`` overrides the ONNX file that runs (e.g. a variant rebuilt with ops kept back).
    """
    label = f"{role} ({spec.describe()})"
    build = capture_side(spec.backend)
    if build is None:
        raise CaptureUnsupported(
            f"{label}: tier 2 cannot capture intermediate tensors of backend '{spec.backend}'")
    side = build(spec, role, config, threads, run_path, label)
    if spec.precision != "fp32":  # a hint the side's own graph may not show (OpenVINO fp16)
        side.precision = spec.precision
    return side


class ActivationChecker:
    """Tier 2 for one (reference, primary) pair."""

    def __init__(self, config: ActivationCheckConfig, reference: Side, primary: Side,
                 rng: random.Random | None = None, tensor: TensorCheckConfig | None = None):
        self.config = config
        self.tensor = tensor or TensorCheckConfig()  # tier 1's tolerances: the budget
        self._noise: dict[str, float] | None = None  # the reference's per-layer noise
        self._noise_note = ""
        from guard.verify.activation.gguf_align import check_pair

        check_pair(reference, primary)
        self.reference = reference
        self.primary = primary
        self.pair = f"{reference.kind}/{primary.kind}"
        self._rng = rng or random.Random()
        # One check at a time: torch captures hook shared modules, and the mirror worker and a
        # repair may both ask.
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model: ModelConfig, threads: int = 1,
                  primary_spec: BackendConfig | None = None) -> "ActivationChecker":
        """``primary_spec``: what to capture as the primary instead of ``model.primary`` (the
        repair's stand-in: an eager copy of a torch_compile module, ONNX Runtime's variant of
        a TensorRT engine's ONNX, which tier 2 cannot read)."""
        config = model.checks.activation
        if model.reference is None:
            raise CaptureUnsupported(f"models[{model.name}]: tier 2 needs a reference backend")
        reference = build_side(model.reference, "reference", config, threads)
        try:
            primary = build_side(primary_spec or model.activation_primary(), "primary", config,
                                 threads)
            return cls(config, reference, primary, tensor=model.checks.tensor)
        except Exception:
            reference.close()
            raise

    # -- when to run (mirror worker) ------------------------------------------------------------
    def due(self, tier1_failed: bool, queue_fill: float) -> bool:
        """Should this compared sample also get tier 2? ``queue_fill`` is the mirror queue's
        depth over its size: a failure is always checked while the queue has room."""
        if (tier1_failed and self.config.on_failure
                and queue_fill <= self.config.max_queue_fill):
            return True
        rate = self.config.sample_rate
        return rate > 0 and (rate >= 1.0 or self._rng.random() < rate)

    # -- the check ----------------------------------------------------------------------------
    def check(self, inputs: dict[str, np.ndarray], tier1=None) -> ActivationReport:
        """``tier1``: the sample's tier-1 ``TensorCheck`` (its budget and verdict), when known;
        without it tier 2 applies tier 1's tolerances to the aligned outputs itself."""
        with self._lock:
            return self._check(inputs, tier1)

    def _check(self, inputs: dict[str, np.ndarray], tier1=None) -> ActivationReport:
        started = time.perf_counter()
        report = ActivationReport(self.pair, self.config.rel_error or 0.0)
        try:
            alignment = self._align(inputs)
        except Exception as exc:  # a capture that fails is reported, never raised into the mirror
            report.error = f"capture failed: {type(exc).__name__}: {exc}"
            report.seconds = time.perf_counter() - started
            return report
        report.capture_seconds = time.perf_counter() - started
        report.unaligned = list(alignment.unaligned)
        report.primary_only = alignment.primary_only
        compared: list[tuple[LayerResult, Pairing]] = []
        for pairing in alignment.pairings:
            try:
                propagated = layer_error(pairing.reference, pairing.primary)
            except ShapeMismatch as exc:
                report.unaligned.append(Unaligned("reference", pairing.name, str(exc)))
                continue
            layer = LayerResult(
                pairing.name, pairing.op, pairing.module, pairing.value, propagated,
                isolation_note=pairing.isolation_note, unsure=pairing.unsure,
                modules=pairing.modules)
            report.layers.append(layer)
            compared.append((layer, pairing))
        isolating = time.perf_counter()
        # Judged against its peers, every layer needs its isolated figure (and each is one
        # module call of the reference's).
        self._isolate(compared, everything=bool(alignment.peers))
        report.isolate_seconds = time.perf_counter() - isolating
        noise = self._layer_noise(inputs)
        report.noise_note = self._noise_note
        decide(report, self._budget(tier1, [p for _, p in compared], bool(alignment.peers)),
               noise, {p.value: p.ref_key or p.value for _, p in compared},
               self.tensor.noise_floor.multiplier, self.config.rel_error, self._precision(),
               alignment.peers)
        report.suspects = rank_suspects(report.layers, self.config.top_k)
        report.seconds = time.perf_counter() - started
        return report

    def _precision(self) -> str:
        """``fp32`` when both sides compute in it, else the reduced one (the primary's first)."""
        reduced = [p for p in (getattr(self.primary, "precision", "fp32"),
                               getattr(self.reference, "precision", "fp32")) if p != "fp32"]
        return reduced[0] if reduced else "fp32"

    def _budget(self, tier1, pairings: list[Pairing], peers: bool = False) -> Budget:
        budget = budget_from_tier1(tier1) if tier1 is not None else None
        if budget is not None:
            return budget
        names = {n for side in (self.reference, self.primary) if isinstance(side, OnnxSide)
                 for n in side.graph.outputs}
        t = self.tensor
        per_output = {n: (o.atol if o.atol is not None else t.atol,
                          o.rtol if o.rtol is not None else t.rtol) for n, o in t.outputs.items()}
        budget = budget_from_outputs([(p.value, p.reference, p.primary) for p in pairings
                                      if p.value in names], t.atol, t.rtol, per_output)
        if budget is not None:
            return budget
        last = pairings[-1].reference if pairings else np.zeros(0)
        finite = np.asarray(last, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        scale = float(np.abs(finite).max()) if finite.size else 0.0
        source = ("checks.tensor's tolerances at the last aligned layer; a layer with peers is "
                  "judged against them" if peers else
                  "tier 1's tolerances at the last aligned layer (no aligned output)")
        # A tier without tensor outputs (the generation tier) still says whether it failed.
        failed = None if getattr(tier1, "passed", None) is None else not tier1.passed
        return Budget(t.rtol + (t.atol / scale if scale > 0 else 0.0), source, failed)

    def _layer_noise(self, inputs: dict[str, np.ndarray]) -> dict[str, float]:
        """The reference's per-layer noise, measured once (on the noise-floor .npz when the
        config names one, else on the first checked sample's inputs)."""
        if self._noise is not None:
            return self._noise
        from guard.verify.noise import layer_noise

        floor = self.tensor.noise_floor
        self._noise = {}
        if not floor.enabled:
            self._noise_note = "per-layer noise not measured (noise_floor.enabled is false)"
            return self._noise
        ref = self.reference
        if isinstance(ref, OnnxSide):
            def run(feed, threads):
                return ref.capture(feed, threads)
        elif isinstance(ref, LlamaCppSide):  # never: check_pair makes llama.cpp the primary
            self._noise_note = "per-layer noise not measured (a llama_cpp reference)"
            return self._noise
        else:
            def run(feed, threads):
                return ref.tensors(feed, threads)
        source = "the first checked sample"
        if floor.inputs:
            with np.load(floor.inputs) as data:
                inputs, source = {k: data[k] for k in data.files}, Path(floor.inputs).name
        try:
            self._noise, comparisons = layer_noise(run, inputs, floor.samples,
                                                   list(floor.thread_counts))
            self._noise_note = f"{', '.join(comparisons) or 'no comparison'} on {source}"
        except Exception as exc:  # no noise figure: the budget alone is the allowance
            self._noise_note = f"per-layer noise not measured: {type(exc).__name__}: {exc}"
        return self._noise

    def _align(self, inputs: dict[str, np.ndarray]) -> Alignment:
        ref, prim = self.reference, self.primary
        if isinstance(ref, KerasSide) or isinstance(prim, KerasSide):
            return self._align_keras(inputs)
        if isinstance(prim, LlamaCppSide) and isinstance(ref, TransformersSide):
            from guard.verify.activation.gguf_align import align_transformers_llama_cpp

            return align_transformers_llama_cpp(ref, prim, ref.capture(inputs),
                                                prim.capture(inputs))

        def onnx_values(side: OnnxSide) -> dict[str, np.ndarray]:
            # Graph inputs are values too: a segment or a module may start from them.
            return {**{n: inputs[n] for n in side.graph.inputs if n in inputs},
                    **side.capture(inputs)}

        if isinstance(ref, OnnxSide) and isinstance(prim, OnnxSide):
            return align_onnx_onnx(ref, prim, onnx_values(ref), onnx_values(prim), inputs)
        if (isinstance(ref, TorchSide) and isinstance(prim, OnnxSide)
                and not prim.source.has_scopes()):
            from guard.verify.activation.keras_align import align_torch_tf2onnx, keras_scoped

            if keras_scoped(prim, ref.submodules):
                # tf2onnx's conversion of a Keras port: named by the port's layers.
                return align_torch_tf2onnx(ref, prim, ref.capture(inputs),
                                           onnx_values(prim), inputs)
        if isinstance(ref, TorchSide) and isinstance(prim, OnnxSide):
            return align_torch_onnx(ref, prim, ref.capture(inputs), onnx_values(prim), inputs,
                                    torch_is_reference=True)
        if isinstance(ref, OnnxSide) and isinstance(prim, TorchSide):
            return align_torch_onnx(prim, ref, prim.capture(inputs), onnx_values(ref), inputs,
                                    torch_is_reference=False)
        if isinstance(ref, TorchSide) and isinstance(prim, TorchSide):
            return align_torch_torch(ref, prim, ref.capture(inputs), prim.capture(inputs))
        raise CaptureUnsupported(f"tier 2 cannot align the pair {self.pair}")

    def _align_keras(self, inputs: dict[str, np.ndarray]) -> Alignment:
        from guard.verify.activation.keras_align import (
            align_keras_keras,
            align_keras_onnx,
            align_torch_keras,
        )

        ref, prim = self.reference, self.primary
        if isinstance(ref, KerasSide) and isinstance(prim, KerasSide):
            return align_keras_keras(ref, prim, ref.capture(inputs), prim.capture(inputs),
                                     inputs)
        if isinstance(ref, TorchSide) and isinstance(prim, KerasSide):
            return align_torch_keras(ref, prim, ref.capture(inputs), prim.capture(inputs),
                                     inputs, torch_is_reference=True)
        if isinstance(ref, KerasSide) and isinstance(prim, TorchSide):
            return align_torch_keras(prim, ref, prim.capture(inputs), ref.capture(inputs),
                                     inputs, torch_is_reference=False)

        def onnx_values(side: OnnxSide) -> dict[str, np.ndarray]:
            return {**{n: inputs[n] for n in side.graph.inputs if n in inputs},
                    **side.capture(inputs)}

        if isinstance(ref, KerasSide) and isinstance(prim, OnnxSide):
            return align_keras_onnx(ref, prim, ref.capture(inputs), onnx_values(prim), inputs,
                                    keras_is_reference=True)
        if isinstance(ref, OnnxSide) and isinstance(prim, KerasSide):
            return align_keras_onnx(prim, ref, prim.capture(inputs), onnx_values(ref), inputs,
                                    keras_is_reference=False)
        raise CaptureUnsupported(f"tier 2 cannot align the pair {self.pair}")

    def _isolate(self, compared: list[tuple[LayerResult, Pairing]],
                 everything: bool = False) -> None:
        """Isolated error for the layers most likely to *add* error, up to the budget: ranked by
        how much the propagated error grows over the layer's inputs (where the alignment knows
        them), else by the propagated error itself. A Reshape after a drifting MatMul carries
        the MatMul's error but adds none; the budget goes to the MatMul."""
        errors = {layer.value: layer.propagated.rel_error for layer, _ in compared}

        def growth(item: tuple[LayerResult, Pairing]) -> float:
            layer, pairing = item
            inherited = [errors[i] for i in pairing.inputs if i in errors]
            return layer.propagated.rel_error - max(inherited, default=0.0)

        ranked = sorted(compared, key=growth, reverse=True)
        cheap = [item for item in ranked if item[1].isolate_is_free]
        ranked = [item for item in ranked if not item[1].isolate_is_free] + cheap
        for rank, (layer, pairing) in enumerate(ranked):
            if pairing.isolate is None:
                layer.isolation_note = layer.isolation_note or "not isolatable on this backend"
                continue
            if (rank >= self.config.max_isolated and not pairing.isolate_is_free
                    and not everything):
                layer.isolation_note = (f"outside the isolation budget (max_isolated="
                                        f"{self.config.max_isolated})")
                continue
            try:
                output, nodes = pairing.isolate()
                layer.isolated = (layer_error(output, pairing.primary) if pairing.against_primary
                                  else layer_error(pairing.reference, output))
                layer.primary_nodes = nodes
            except Exception as exc:  # one layer that cannot be re-run is a note, not a failure
                layer.isolation_note = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.reference.close()
        self.primary.close()
