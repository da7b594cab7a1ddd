"""What "keep these ops back at reference precision" means for each kind of primary.

The repair search (guard/policy/repair.py) is the same for every primary; what differs is
answered here by one small strategy per primary kind, chosen from the primary's backend block
(:func:`keep_back_for`, registered in ``STRATEGIES`` by backend name):

- which spec tier 2 captures as the primary to find suspects (``capture_spec``);
- which candidate ops a suspect layer of tier 2 maps to (``ops_for``), and which ops to try
  when tier 2 names none (``every_op``);
- how to rebuild the primary with a set kept back (``rebuild_spec``: the same backend block
  with one option extended);
- how to check that the rebuilt backend really keeps them back (``not_kept_back``).

| primary | ops | rebuilt with |
| --- | --- | --- |
| onnxruntime int8 | fp32 ONNX nodes (``<node>_quant`` -> ``<node>``) | ``nodes_to_exclude`` |
| onnxruntime fp16 | fp32 ONNX nodes (same names; Casts dropped) | ``nodes_to_exclude`` |
| torch_compile (any) | submodule paths (``layers.0.attn``) | ``eager_fp32_modules`` |
| tensorrt fp16/int8 | TensorRT layer names = ONNX node names | ``fp32_layers`` |
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from guard.config import BackendConfig
from guard.policy.onnx_ops import (
    QuantisedGraph,
    computing_nodes,
    excluded_ops_missing,
    fp16_ops_not_fp32,
    fp16_rebuildable_ops,
    rebuildable_ops,
    source_node_names,
)

if TYPE_CHECKING:
    from guard.backends import Backend
    from guard.verify.activation.report import LayerResult


class KeepBack(ABC):
    """One primary kind. ``option``: the backend option that lists what is kept back."""

    option = ""
    what = "op"  # the unit, for messages ("module", "TensorRT layer")
    kept_as = "kept at fp32"
    # What a suspect's segment must hold to map to an op (in the "maps to no op" message).
    no_ops_because = "rebuildable op"

    def __init__(self, spec: BackendConfig):
        self.spec = spec
        self.base = list(spec.options.get(self.option, []))  # kept back by the config itself

    def capture_spec(self) -> BackendConfig:
        """The backend block tier 2 captures as the primary: the primary's own, or the copy it
        can hook that its backend declares (``BackendKind.capture_as``)."""
        from guard.backends import backend_kind

        copy = backend_kind(self.spec.backend).capture_as
        return copy(self.spec) if copy is not None else self.spec

    @abstractmethod
    def ops_for(self, layer: "LayerResult") -> list[str]:
        """The candidate ops a tier-2 layer (a suspect) maps to; [] when none."""

    def every_op(self, activation, inputs: dict[str, np.ndarray]) -> list[str]:
        """Candidates when no suspect maps to an op ([]: the repair ends there)."""
        return []

    def rebuild_spec(self, kept: list[str]) -> BackendConfig:
        spec = self.spec.model_copy(deep=True)
        spec.options = {**spec.options, self.option: self.base + list(kept)}
        return spec

    def not_kept_back(self, backend: "Backend", kept: list[str]) -> list[str]:
        """Ops of ``kept`` the rebuilt ``backend`` does not really keep back."""
        return []

    def within_threads(self, spec: BackendConfig, threads: int) -> BackendConfig:
        """``spec`` limited to ``threads`` CPU threads for validation (unchanged where the
        backend cannot limit one session: the default)."""
        return spec


class _OnnxRuntimeOps(KeepBack):
    """ONNX Runtime primaries: each session has its own thread pools."""

    option = "nodes_to_exclude"

    def within_threads(self, spec, threads):
        configured = spec.options.get("intra_op_threads", 0)  # 0: ORT's default, every core
        if 0 < configured <= threads:
            return spec
        limited = spec.model_copy(deep=True)
        limited.options = {**spec.options, "intra_op_threads": threads}
        return limited


class OnnxInt8Ops(_OnnxRuntimeOps):
    """ONNX Runtime int8 (``quantize_dynamic``): a suspect's segment names its quantised nodes
    ``<fp32 node>_quant``; the op to keep is the fp32 node (a Gather reading a quantised table
    keeps its name). Segments without a quantised node (a Relu that inherited error) map to
    none. Checked: the rebuilt model no longer quantises them."""

    no_ops_because = "quantised node"

    def ops_for(self, layer):
        return rebuildable_ops(layer.primary_nodes, self._graph())

    def _graph(self) -> QuantisedGraph | None:
        """The int8 variant as configured (cached by derive), to map segment nodes to ops."""
        if not hasattr(self, "_quantised"):
            from guard.backends.onnxruntime import derived_variant

            try:
                path = derived_variant(self.spec)  # its nodes_to_exclude are self.base
                self._quantised: QuantisedGraph | None = QuantisedGraph(path)
            except Exception:  # suffix rules still apply without it
                self._quantised = None
        return self._quantised

    def not_kept_back(self, backend, kept):
        model_path = getattr(backend, "model_path", None)
        return [] if model_path is None else excluded_ops_missing(model_path, kept)


class OnnxFp16Ops(_OnnxRuntimeOps):
    """ONNX Runtime fp16 (``onnxconverter_common``): node names are kept and only Casts are
    added, so a suspect's ops are its segment's nodes that the fp32 graph has. Rebuilt with the
    converter's block list; checked: every float input and output of the node is float32."""

    no_ops_because = "fp32 source node"

    def ops_for(self, layer):
        if not hasattr(self, "_source_names"):
            self._source_names = set(source_node_names(self.spec.path))
        return fp16_rebuildable_ops(layer.primary_nodes, self._source_names)

    def not_kept_back(self, backend, kept):
        model_path = getattr(backend, "model_path", None)
        return [] if model_path is None else fp16_ops_not_fp32(model_path, kept)


class TorchCompileModules(KeepBack):
    """``torch_compile`` at any precision: the ops are submodule paths, rebuilt with
    ``eager_fp32_modules`` (each runs eagerly on an fp32 copy, outside the compiled graph).

    The repair captures the primary on an eager copy of the module at the primary's precision
    (the kind's ``capture_as``, a ``torch`` block; tier 2's own check captures the compiled
    code, guard/backends/activations/compiled.py): this locates *precision* drift.
    Drift that exists only in the compiled kernels (a fusion that reorders a reduction) is not
    visible to it; when tier 2 names no module above ``min_isolated_error`` the candidates are
    every leaf submodule in forward order, and the search narrows them down. A suspect layer is
    a module call (``layers.0.lin``, ``pool#1`` for a second call): its op is the module path;
    or a unit tier 2 compared as one (``conv1+bn1``: a Conv and the BatchNorm an exporter folded
    into it, a Linear and its GELU): its ops are every member's path, since keeping only the
    first at fp32 leaves the rest of the unit's computation at the primary's precision.
    Checked: each kept path is wrapped, and its copy's parameters and buffers are fp32."""

    option = "eager_fp32_modules"
    what = "module"
    kept_as = "kept eager at fp32"
    no_ops_because = "submodule"

    def ops_for(self, layer):
        if layer.modules:
            return list(layer.modules)
        path = layer.module or layer.name.split("#")[0]
        return [path] if path else []

    def every_op(self, activation, inputs):
        side = getattr(activation, "primary", None)
        if side is None or not hasattr(side, "submodules"):
            return []
        leaves = {path for path, module in side.submodules.items()
                  if path and next(module.children(), None) is None}
        calls = side.capture(inputs).calls  # in the order the calls finish: forward order
        return list(dict.fromkeys(c.path for c in calls if c.path in leaves))

    def not_kept_back(self, backend, kept):
        from guard.backends.eager_modules import not_eager_fp32

        return not_eager_fp32(backend.module, kept)


class TensorRTLayers(KeepBack):
    """TensorRT fp16/int8: the ops are TensorRT layer names, rebuilt with ``fp32_layers``
    (precision constraints, ``OBEY_PRECISION_CONSTRAINTS``).

    The engine is built from the ONNX file, and TensorRT's ONNX parser (onnx-tensorrt,
    ``ImporterContext::registerLayer``) names each layer after the ONNX node it comes from (a second
    layer of the same node gets a numbered suffix and is not pinned by the node name). So tier 2
    captures the primary as ONNX Runtime's variant of the same file at the same precision (the
    kind's ``capture_as``) (fp16: the fp16 converter; int8: ``quantize_dynamic``, a different scheme
    from TensorRT's calibrated int8, so it locates layers whose precision matters rather than
    TensorRT's own kernels), its segments map to fp32 ONNX node names as for ONNX Runtime, and when
    it names none the candidates are the graph's nodes in order. The check is the builder's own:
    ``fp32_layers`` naming a layer the network lacks is a build error, and constraints it cannot
    obey fail the build.

    Not exercised here: TensorRT does not install on the project's CPU machines; the unit
    tests check the mapping and the rebuilt spec, tests/gpu the rebuild where TensorRT imports.
    """

    option = "fp32_layers"
    what = "TensorRT layer"
    no_ops_because = "ONNX node"

    def __init__(self, spec: BackendConfig):
        super().__init__(spec)
        self.onnx = keep_back_for(self.capture_spec())

    def ops_for(self, layer):
        return self.onnx.ops_for(layer)

    def every_op(self, activation, inputs):
        return computing_nodes(self.spec.path)


# The one registration: backend name -> precision -> the strategy for a primary of that precision
# (config validation admits ``action: fallback_ops`` for these only). A backend module knows
# nothing of the repair; its entry here says how the repair rebuilds it.
STRATEGIES: dict[str, dict[str, type[KeepBack]]] = {
    "onnxruntime": {"int8": OnnxInt8Ops, "fp16": OnnxFp16Ops},  # nodes_to_exclude
    "tensorrt": {p: TensorRTLayers for p in ("fp16", "int8")},  # fp32_layers
    "torch_compile": {p: TorchCompileModules  # eager_fp32_modules
                      for p in ("fp32", "fp16", "bf16")},
}


def keep_back_for(spec: BackendConfig) -> KeepBack:
    """The strategy for a primary (``STRATEGIES``; config validation admits only these)."""
    strategy = STRATEGIES.get(spec.backend, {}).get(spec.precision)
    if strategy is None:
        raise ValueError(f"policy.action 'fallback_ops' cannot rebuild a {spec.backend} "
                         f"{spec.precision} primary")
    return strategy(spec)


def repairable() -> dict[str, set[str]]:
    """backend -> precisions a strategy is registered for."""
    return {name: set(by_precision) for name, by_precision in STRATEGIES.items()}
