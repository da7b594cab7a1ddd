"""How ONNX Runtime variants the guard derives name things, mapped back to the fp32 graph.

int8 (``quantize_dynamic``) renames a quantised MatMul/Conv ``<node>_quant`` (a Gemm is first
rewritten to ``<node>_MatMul``) and reads an embedding table as ``<weight>_quantized``; fp16
(``onnxconverter_common``) keeps every node's name and only adds Casts (``graph_input_cast0``,
``<node>_input_cast0``...). These helpers answer, for the keep-back strategies
(guard/policy/keep_back.py), which fp32 nodes a segment of such a variant computes, and whether
a rebuilt variant really keeps given nodes at fp32.
"""

from __future__ import annotations

from typing import Any

QUANT_SUFFIX = "_quant"
QUANT_WEIGHT_SUFFIX = "_quantized"


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
    return set(computing_nodes(source_path, constants=True))


def computing_nodes(source_path, constants: bool = False) -> list[str]:
    """Named nodes of an ONNX file in graph order (a topological order), Constants left out
    unless asked: what TensorRT names its layers after (a Constant becomes no layer)."""
    import onnx

    graph = onnx.load(str(source_path), load_external_data=False).graph
    return [node.name for node in graph.node
            if node.name and (constants or node.op_type != "Constant")]


def fp16_rebuildable_ops(primary_nodes: list[str], source_names) -> list[str]:
    """The fp32 nodes in an fp16 segment: the converter keeps node names and only inserts
    Casts, which the source graph does not have (and which the block list cannot name)."""
    return [name for name in primary_nodes if name in source_names]


def fp16_ops_not_fp32(model_path, kept: list[str]) -> list[str]:
    """Ops asked to stay fp32 that the rebuilt fp16 model lacks or still runs with a float16
    input or output (types from shape inference and the initializers)."""
    import onnx

    from guard.backends.activations.onnx import OnnxGraph

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
            init: Any = graph.initializers.get(name)  # (an onnx TensorProto)
            elem = init.data_type if init is not None else graph.elem_types.get(name)
            if elem == half:
                missing.append(op)
                break
    return missing
