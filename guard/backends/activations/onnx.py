"""ONNX side of tier 2: every intermediate value of a graph, captured on a private copy of it.

Capture: a copy of the model with every node output added as a graph output, run in its own
ONNX Runtime session with graph optimisations disabled, so that the values keep the names they
have in the file (an optimiser fuses nodes and renames what it fuses). The production session
is never touched: marking extra outputs on it would change what it computes.

Isolation: to tell a layer that *causes* error from one that inherits it, a layer is re-run on
the other side's values for its inputs. Here that is a *segment*: the nodes that compute one
value, walked back from it until values the other side also has (or weights). On an int8 graph
derived by ``quantize_dynamic`` the segment of ``linear`` is the whole quantised chain
(DynamicQuantizeLinear, MatMulInteger, Cast, Mul, Add) that replaced the fp32 ``Gemm``, which is
how a quantised layer maps back to its fp32 origin. Each segment becomes a small model of its
own, built once and cached.

Module scopes (for torch vs ONNX): which modules' calls a node belongs to, read from either
exporter's conventions (scopes.py).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from guard.backends.activations.scopes import node_scopes

if TYPE_CHECKING:
    from onnx import ModelProto, TensorProto

# Ops whose outputs are bookkeeping (shapes, constants), never worth comparing.
_BOOKKEEPING_OPS = frozenset({"Constant", "Shape", "Size", "ConstantOfShape"})


def _same_node(a, b, graph_a: "OnnxGraph", graph_b: "OnnxGraph") -> bool:
    if (a.op_type != b.op_type or a.domain != b.domain or list(a.input) != list(b.input)
            or list(a.output) != list(b.output)
            or [x.SerializeToString() for x in a.attribute]
            != [x.SerializeToString() for x in b.attribute]):
        return False
    for name in a.input:  # the same weights, bit for bit
        wa, wb = graph_a.initializers.get(name), graph_b.initializers.get(name)
        if (wa is None) != (wb is None):
            return False
        if wa is not None and not _same_weight(wa, wb):
            return False
    return True


def _same_weight(a, b) -> bool:
    """Equal tensors, whichever field (raw_data, float_data...) each file stores them in."""
    if a.SerializeToString() == b.SerializeToString():
        return True
    from onnx import numpy_helper

    x, y = numpy_helper.to_array(a), numpy_helper.to_array(b)
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)


def _subgraph_inputs(node) -> list[str]:
    """Outer-scope values that a node's subgraphs (If/Loop/Scan bodies) read."""
    names: list[str] = []
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for graph in graphs:
            defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
            for inner in graph.node:
                for name in list(inner.input) + _subgraph_inputs(inner):
                    if name and name not in defined:
                        names.append(name)
                defined.update(inner.output)
    return names


@dataclass
class ScopeInstance:
    """One call of a torch module as it appears in the graph: its nodes, inputs and outputs."""

    module: str
    nodes: list[int]
    inputs: list[str]  # values from outside the instance (not weights or constants)
    outputs: list[str]  # values the rest of the graph (or the caller) reads


@dataclass
class OnnxGraph:
    """Static facts about one graph: node order, producers, consumers, weights, scopes."""

    model: ModelProto
    nodes: list = field(default_factory=list)
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[int]] = field(default_factory=dict)
    initializers: dict[str, TensorProto] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    static: set[str] = field(default_factory=set)  # computed from weights/constants only
    elem_types: dict[str, int] = field(default_factory=dict)  # from shape inference

    @classmethod
    def from_model(cls, model) -> "OnnxGraph":
        import onnx

        graph = model.graph
        self = cls(model=model, nodes=list(graph.node))
        self.initializers = {i.name: i for i in graph.initializer}
        self.inputs = [i.name for i in graph.input if i.name not in self.initializers]
        self.outputs = [o.name for o in graph.output]
        for index, node in enumerate(self.nodes):
            for name in node.output:
                if name:
                    self.producer[name] = index
            for name in list(node.input) + _subgraph_inputs(node):
                if name:
                    self.consumers.setdefault(name, []).append(index)
        known_static = set(self.initializers)
        for node in self.nodes:
            inputs = [n for n in list(node.input) + _subgraph_inputs(node) if n]
            if all(n in known_static for n in inputs):
                known_static.update(n for n in node.output if n)
        self.static = known_static - set(self.initializers)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            infos = list(inferred.graph.value_info) + list(inferred.graph.output) + list(
                inferred.graph.input)
        except Exception:  # shape inference is a help, never a requirement
            infos = list(graph.value_info) + list(graph.output) + list(graph.input)
        for info in infos:
            kind = info.type.WhichOneof("value")
            if kind == "tensor_type":
                self.elem_types[info.name] = info.type.tensor_type.elem_type
            elif kind is not None:
                self.elem_types[info.name] = -1  # sequence/map/optional: not a tensor
        return self

    @classmethod
    def load(cls, path: str | Path) -> "OnnxGraph":
        import onnx

        return cls.from_model(onnx.load(str(path)))

    # -- values -------------------------------------------------------------------------------
    def comparable_values(self) -> list[str]:
        """Node outputs worth comparing, in graph order: tensors, not shapes or constants."""
        import onnx

        floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                  onnx.TensorProto.BFLOAT16}
        names = []
        for node in self.nodes:
            if node.op_type in _BOOKKEEPING_OPS:
                continue
            for name in node.output:
                if not name or name in self.static:
                    continue
                elem = self.elem_types.get(name)
                if elem is not None and elem not in floats:
                    continue
                names.append(name)
        return names

    def by_name(self) -> dict:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.nodes if n.name}
        return self._by_name

    def node_of(self, value: str):
        index = self.producer.get(value)
        return None if index is None else self.nodes[index]

    # -- module scopes (torch exporter metadata) ----------------------------------------------
    def has_scopes(self) -> bool:
        return any(node_scopes(n) is not None for n in self.nodes)

    def scope_instances(self, known: Collection[str] | None = None
                        ) -> dict[str, list[ScopeInstance]]:
        """For every module path: its calls, as connected groups of nodes, in graph order. A
        node belongs to every module on its call stack (``layer1.0.conv1`` is in ``layer1.0``
        and ``layer1``); ``known``: the torch module's paths, to resolve the TorchScript
        exporter's segments against (scopes.py)."""
        members: dict[str, list[int]] = {}
        for index, node in enumerate(self.nodes):
            if node.op_type == "Constant":
                continue
            for module in node_scopes(node, known) or []:
                members.setdefault(module, []).append(index)
        return {module: self._instances(module, nodes) for module, nodes in members.items()}

    def _instances(self, module: str, nodes: list[int]) -> list[ScopeInstance]:
        node_set = set(nodes)
        parent = {n: n for n in nodes}

        def find(n: int) -> int:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for n in nodes:
            for name in self.nodes[n].output:
                for consumer in self.consumers.get(name, []):
                    if consumer in node_set:
                        parent[find(consumer)] = find(n)
        groups: dict[int, list[int]] = {}
        for n in nodes:
            groups.setdefault(find(n), []).append(n)
        instances = []
        graph_outputs = set(self.outputs)
        for group in sorted(groups.values(), key=min):
            inside = set(group)
            produced = {name for n in group for name in self.nodes[n].output if name}
            if produced <= self.static:
                continue  # a group that only folds constants is no call of the module
            inputs: list[str] = []
            for n in group:
                node = self.nodes[n]
                for name in list(node.input) + _subgraph_inputs(node):
                    if (name and name not in produced and name not in self.initializers
                            and name not in self.static and name not in inputs):
                        inputs.append(name)
            outputs = [
                name for n in group for name in self.nodes[n].output
                if name and (name in graph_outputs
                             or any(c not in inside for c in self.consumers.get(name, [])))
            ]
            instances.append(ScopeInstance(module, group, inputs, outputs))
        return instances

    # -- segments -------------------------------------------------------------------------------
    def segment(self, target: str, boundary: set[str]) -> tuple[list[int], list[str]]:
        """Nodes that compute ``target`` from ``boundary`` values (and weights), and the boundary
        values they read. Raises KeyError when the walk reaches a graph input not in boundary."""
        if target not in self.producer:
            raise KeyError(f"'{target}' is not computed by any node")
        nodes: set[int] = set()
        needed: list[str] = []
        stack = [self.producer[target]]
        while stack:
            index = stack.pop()
            if index in nodes:
                continue
            nodes.add(index)
            node = self.nodes[index]
            for name in list(node.input) + _subgraph_inputs(node):
                if not name or name in self.initializers:
                    continue
                if name in boundary and name != target:
                    if name not in needed:
                        needed.append(name)
                elif name in self.producer:
                    stack.append(self.producer[name])
                else:
                    raise KeyError(f"segment of '{target}' reaches '{name}', which the other "
                                   "side does not provide")
        return sorted(nodes), needed

    def segment_model(self, nodes: list[int], inputs: dict[str, np.dtype], target: str,
                      target_elem: int):
        """A standalone model: ``inputs`` -> the segment's nodes -> ``target``."""
        from onnx import helper

        used: set[str] = set()
        for index in nodes:
            node = self.nodes[index]
            used.update(n for n in list(node.input) + _subgraph_inputs(node) if n)
        graph = helper.make_graph(
            [self.nodes[i] for i in nodes],
            f"segment_{target}",
            [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype), None)
             for name, dtype in inputs.items()],
            [helper.make_tensor_value_info(target, target_elem, None)],
            initializer=[init for name, init in self.initializers.items() if name in used],
        )
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        model.ir_version = self.model.ir_version
        model.functions.extend(self.model.functions)
        return model


class CaptureSession(Protocol):
    """What a side runs a capture copy or a segment on: ONNX Runtime's ``InferenceSession``
    interface (another runtime's side wraps its own in it: activations/openvino.py)."""

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray]) -> list[Any]: ...

    def get_outputs(self) -> list[Any]: ...


def _session(model_bytes: bytes, threads: int) -> CaptureSession:
    import onnxruntime as ort

    so = ort.SessionOptions()
    # Disabled: the optimiser would fuse nodes and rename values, and names are the alignment.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


_QUANT_OPS = {"QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
              "QLinearMatMul", "QLinearConv", "MatMulIntegerToFloat", "DynamicQuantizeMatMul"}


def graph_precision(graph: "OnnxGraph") -> str:
    """``int8`` when the graph holds quantised ops, ``fp16``/``bf16`` when it holds such
    tensors, else ``fp32``."""
    import onnx

    if any(node.op_type in _QUANT_OPS for node in graph.nodes):
        return "int8"
    types = set(graph.elem_types.values()) | {i.data_type for i in graph.initializers.values()}
    if onnx.TensorProto.FLOAT16 in types:
        return "fp16"
    if onnx.TensorProto.BFLOAT16 in types:
        return "bf16"
    return "fp32"


class OnnxSide:
    """One ONNX artifact, run for capture on a private session.

    ``run_path`` is what the backend actually runs (for a derived int8/fp16 variant, the derived
    file); ``source_path`` is the fp32 file it was derived from, whose exporter metadata maps
    nodes to torch modules (the quantiser drops that metadata on the nodes it rewrites).
    """

    kind = "onnx"

    def __init__(self, run_path: str | Path, source_path: str | Path | None = None,
                 threads: int = 1, label: str = "onnx", precision: str | None = None):
        self.label = label
        self.run_path = Path(run_path)
        self.graph = OnnxGraph.load(self.run_path)
        if source_path is None or Path(source_path) == self.run_path:
            self.source = self.graph
        else:
            self.source = OnnxGraph.load(source_path)
        # What the side computes in: the backend block's precision where known, else read off
        # the graph (quantised ops: int8; float16/bfloat16 tensors: fp16/bf16).
        self.precision = precision or graph_precision(self.graph)
        self.threads = threads
        self.values = self.graph.comparable_values()
        self._session: CaptureSession | None = None
        self._capture_bytes: bytes | None = None  # the capture copy, serialised with _session
        self._output_names: list[str] = []
        self._segments: dict[tuple[str, tuple[str, ...]], CaptureSession] = {}
        self._lock = threading.Lock()
        self._scopes: tuple | None = None  # (known paths, instances)
        self._same: dict[tuple, bool] = {}
        self._by_threads: dict[int, CaptureSession] = {}

    def _new_session(self, model_bytes: bytes, threads: int) -> CaptureSession:
        """A session for a capture copy or a segment: ``run(names, feeds)``, ``get_outputs()``
        (ONNX Runtime's; another runtime's side overrides this)."""
        return _session(model_bytes, threads)

    def _capture_session(self, threads: int | None = None) -> CaptureSession:
        if threads is not None and threads != self.threads:
            # Another thread count (tier 2's per-layer noise): a session of its own, kept.
            other = self._by_threads.get(threads)
            if other is None:
                self._capture_session()
                assert self._capture_bytes is not None  # serialised by the call above
                other = self._new_session(self._capture_bytes, threads)
                self._by_threads[threads] = other
            return other
        if self._session is None:
            import copy

            from onnx import ValueInfoProto, helper

            model = copy.deepcopy(self.graph.model)
            existing = {o.name for o in model.graph.output}
            for name in self.values:
                if name in existing:
                    continue
                elem = self.graph.elem_types.get(name)
                if elem and elem > 0:
                    model.graph.output.append(helper.make_tensor_value_info(name, elem, None))
                else:
                    model.graph.output.append(ValueInfoProto(name=name))
            self._capture_bytes = model.SerializeToString()
            session = self._session = self._new_session(self._capture_bytes, self.threads)
            self._output_names = [o.name for o in session.get_outputs()]
        return self._session

    def capture(self, inputs: dict[str, np.ndarray],
                threads: int | None = None) -> dict[str, np.ndarray]:
        """Every comparable value (and the graph outputs) for these inputs, by value name.
        ``threads``: run on a capture session with that many intra-op threads instead."""
        session = self._capture_session(threads)
        feeds = {name: inputs[name] for name in self.graph.inputs if name in inputs}
        results = session.run(self._output_names, feeds)
        return dict(zip(self._output_names, results))

    def scope_instances(self, known: Collection[str] | None = None
                        ) -> dict[str, list[ScopeInstance]]:
        key = frozenset(known) if known is not None else None
        if self._scopes is None or self._scopes[0] != key:
            self._scopes = (key, self.source.scope_instances(known))
        return self._scopes[1]

    def isolate(self, target: str, boundary: set[str],
                fetch: Callable[[str], np.ndarray]) -> tuple[np.ndarray, list[str]]:
        """Run the segment that computes ``target`` from ``boundary`` values, each value taken
        from ``fetch`` (the other side's tensor, in this graph's dtype). Returns the result and
        the names of the segment's nodes."""
        nodes, needed = self.graph.segment(target, boundary)
        feeds = {name: fetch(name) for name in needed}
        key = (target, tuple(needed))
        with self._lock:
            session = self._segments.get(key)
            if session is None:
                elem = self.graph.elem_types.get(target) or 1  # FLOAT when inference was silent
                model = self.graph.segment_model(
                    nodes, {n: feeds[n].dtype for n in needed}, target, elem)
                session = self._new_session(model.SerializeToString(), self.threads)
                self._segments[key] = session
        result = session.run([target], feeds)[0]
        return result, [self.graph.nodes[i].name for i in nodes]

    def segment_nodes(self, target: str, boundary: set[str]) -> list[str]:
        """Names of the nodes that compute ``target`` from ``boundary`` (for reports, repair)."""
        nodes, _ = self.graph.segment(target, boundary)
        return [self.graph.nodes[i].name for i in nodes]

    def computes_like(self, other: "OnnxSide", target: str, boundary: set[str]) -> bool:
        """True when this graph computes ``target`` from ``boundary`` exactly as ``other`` does:
        every node of the segment is in ``other`` under its name, with the same op, attributes,
        inputs and weights, and the output type matches. Its isolated error is then zero by
        construction, and no segment needs to run (most nodes of an int8 variant)."""
        # Static for a pair of graphs and a boundary: computed once per value.
        key = (id(other), target, len(boundary))
        cached = self._same.get(key)
        if cached is not None:
            return cached
        self._same[key] = result = self._computes_like(other, target, boundary)
        return result

    def _computes_like(self, other: "OnnxSide", target: str, boundary: set[str]) -> bool:
        try:
            nodes, _ = self.graph.segment(target, boundary)
        except KeyError:
            return False
        if self.graph.elem_types.get(target) != other.graph.elem_types.get(target):
            return False
        theirs_by_name = other.graph.by_name()
        for index in nodes:
            mine = self.graph.nodes[index]
            theirs = theirs_by_name.get(mine.name) if mine.name else None
            if theirs is None or not _same_node(mine, theirs, self.graph, other.graph):
                return False
        return True

    def close(self) -> None:
        self._session = None
        self._segments.clear()
        self._by_threads.clear()


def onnxruntime_side(spec, role: str, config, threads: int = 1, run_path=None,
                     label: str = "onnx") -> OnnxSide:
    """Tier 2's side for an onnxruntime block (declared as its ``activations`` in
    guard/backends/onnxruntime.py): the variant it runs (derived as the backend derives it),
    or ``run_path``."""
    from guard.backends.onnxruntime import derived_variant, onnx_source

    path = run_path or derived_variant(spec)
    # The fp32 graph the variant came from (for a SavedModel or .keras: its tf2onnx conversion).
    source, _ = onnx_source(spec)
    return OnnxSide(path, source_path=source, threads=threads, label=label,
                    precision=spec.precision)
