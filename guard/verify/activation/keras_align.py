"""Align a Keras side with a Keras, torch or ONNX side, layer call by layer call.

- Keras vs Keras (a ``.keras`` against another, or against itself on another Keras backend):
  the layer's name and call index (``conv2#0``).
- torch vs Keras (a port, either side the reference): a Keras layer is the torch module named
  in the Keras block's ``options.layer_map`` (Keras layer name -> torch module path), else the
  torch module whose path, every ``.`` read as ``_``, is the layer's name (torch
  ``features.0``, Keras ``features_0``); the k-th call of the one is the k-th call of the other.
  A Keras layer with no torch counterpart (a ``Permute`` to NHWC, a ``ZeroPadding2D``, an
  activation torch computes in ``forward`` code) is listed as primary-only when Keras is the
  primary; a torch module without a Keras layer is listed as unaligned.
- Keras vs ONNX (tf2onnx's conversion of the ``.keras``, run by ONNX Runtime or OpenVINO): a
  layer is the group of nodes whose name holds its scope
  (``StatefulPartitionedCall/functional_1/conv1_1/BiasAdd``: the layer name, with TensorFlow's
  ``_N`` suffix), compared on the value leaving the group. tf2onnx folds some layers away (a
  ``ZeroPadding2D`` into the Conv's pads, Permutes cancelled against its own Transposes) and
  names some nodes itself (``Conv__34``): those layers are unaligned, and such nodes run in the
  next aligned layer's segment (listed in its primary nodes). A torch reference against that
  conversion of its port aligns the same way, a torch module being the layer its path names.

Layouts: torch computes images NCHW, a Keras port NHWC. Each aligned tensor pair is compared
after moving the channel axis of the Keras tensor to where torch has it, when that is what makes
the shapes agree (4-D and 5-D tensors try the move first, others the shapes as they are). The
error figures (relative L2, cosine, max abs) do not depend on the layout.

Isolation (the primary's layer fed the reference's tensors):

- a Keras primary runs the *segment* of the layer (keras_side.py): the layer calls from the
  tensors the reference also has (aligned layers' outputs, the model's inputs) to the layer, so
  a port's own padding or permute layers in front of a layer run with it, on the reference's
  tensors; where the port lacks a layer the reference has (a ``ZeroPadding2D`` replaced by
  ``padding="same"``), the layer is fed what the reference's graph fed it and shows its error;
- a torch primary runs its module on the Keras reference's input to the counterpart layer,
  walked back through Keras layers without a torch counterpart (a padding layer) to the tensor
  whose shape is the one torch's module reads.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

import numpy as np

from guard.verify.activation.align import Alignment, Pairing, _substitutes, dtype_fetcher
from guard.backends.activations.keras import KerasCall, KerasCapture, KerasSide
from guard.verify.activation.report import Unaligned
from guard.backends.activations.torch import ModuleCall, TorchCapture, TorchSide

_WALK_BACK = 8  # layers without a counterpart a torch module's input may sit behind

# A move torch layout -> Keras layout: the permutation of the axes, None for as is.
Perm: TypeAlias = tuple[int, ...] | None


def _output_name(base: str, j: int, n: int) -> str:
    return base if n == 1 else f"{base}.{j}"


def _value(call: KerasCall, j: int) -> str:
    return _output_name(call.key, j, len(call.outputs))


def _input_values(side: KerasSide, call: KerasCall) -> list[str]:
    """The values (``name#index[.j]``) of the calls ``call`` reads."""
    out = []
    for tensor in call.inputs:
        producer = side.producer.get(tensor)
        if producer is not None:
            value = _value(producer, producer.outputs.index(tensor))
            if value not in out:
                out.append(value)
    return out


# -- Keras vs Keras -----------------------------------------------------------------------------
def align_keras_keras(ref: KerasSide, prim: KerasSide, ref_cap: KerasCapture,
                      prim_cap: KerasCapture, inputs: dict[str, np.ndarray]) -> Alignment:
    out = Alignment()
    pairs: list[tuple[KerasCall, KerasCall]] = []
    for call in ref.calls:
        other = prim.by_key.get(call.key)
        name = ref.call_name(call)
        if other is None:
            out.unaligned.append(Unaligned("reference", name,
                                           f"the primary has no layer call {call.key}"))
        elif len(other.outputs) != len(call.outputs):
            out.unaligned.append(Unaligned(
                "reference", name, f"{len(call.outputs)} output(s) vs {len(other.outputs)}"))
        else:
            pairs.append((call, other))
    given = _model_inputs(prim, inputs)
    for call, other in pairs:
        for rt, pt in zip(call.outputs, other.outputs):
            if ref_cap.values[rt].shape == prim_cap.values[pt].shape:
                given[pt] = ref_cap.values[rt]
    for call, other in pairs:
        n = len(call.outputs)
        for j, (rt, pt) in enumerate(zip(call.outputs, other.outputs)):
            out.pairings.append(Pairing(
                _output_name(ref.call_name(call), j, n), call.kind, call.name, _value(call, j),
                ref_cap.values[rt], prim_cap.values[pt],
                _keras_isolator(prim, other, j, given, lambda a: a),
                inputs=_input_values(ref, call), ref_key=f"{call.key}.{j}"))
    out.primary_only = [prim.call_name(c) for c in prim.calls if c.key not in ref.by_key]
    return out


def _model_inputs(side: KerasSide, inputs: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    return {t: inputs[name] for t, name in side.input_of.items() if name in inputs}


def _keras_isolator(prim: KerasSide, call: KerasCall, j: int, given: dict[int, np.ndarray],
                    back):
    """The segment of ``call`` from the tensors in ``given`` (the reference's, in Keras's
    layout), its ``j``-th output put back in the reference's layout by ``back``."""

    def isolate() -> tuple[np.ndarray, list[str]]:
        boundary = set(given) - set(call.outputs)
        calls, needed = prim.segment(call, boundary)
        computed = prim.run_segment(calls, {t: given[t] for t in needed})
        return back(computed[call.outputs[j]]), [prim.call_name(c) for c in calls]

    return isolate


# -- layouts ------------------------------------------------------------------------------------
def _moves(ndim: int) -> list[Perm]:
    """Candidate permutations torch layout -> Keras layout, the likelier first (None: as is)."""
    last = (0, *range(2, ndim), 1) if ndim >= 3 else None
    if last is None:
        return [None]
    return [last, None] if ndim >= 4 else [None, last]


def to_keras_layout(torch_shape: tuple, keras_shape: tuple) -> Perm | Literal[False]:
    """The permutation that puts a torch tensor in the Keras tensor's layout (None: none
    needed), or False when neither candidate gives the Keras shape."""
    torch_shape, keras_shape = tuple(torch_shape), tuple(keras_shape)
    for perm in _moves(len(torch_shape)):
        shape = torch_shape if perm is None else tuple(torch_shape[i] for i in perm)
        if shape == keras_shape:
            return perm
    return False


def _apply(array: np.ndarray, perm) -> np.ndarray:
    return array if perm is None else np.ascontiguousarray(np.transpose(array, perm))


def _undo(array: np.ndarray, perm) -> np.ndarray:
    return array if perm is None else np.ascontiguousarray(np.transpose(array, np.argsort(perm)))


# -- torch vs Keras -----------------------------------------------------------------------------
def _normalised(path: str) -> str:
    return path.replace(".", "_")


def keras_counterparts(keras: KerasSide, torch_paths: set[str]
                       ) -> tuple[dict[str, str], list[Unaligned]]:
    """Keras layer name -> torch module path (options.layer_map first, then names equal after
    every '.' is read as '_'), and the map entries that name no torch module."""
    problems: list[Unaligned] = []
    by_norm: dict[str, list[str]] = {}
    for path in torch_paths:
        if path:
            by_norm.setdefault(_normalised(path), []).append(path)
    mapped: dict[str, str] = {}
    layers = {call.name for call in keras.calls}
    for layer, path in keras.layer_map.items():
        if layer not in layers:
            problems.append(Unaligned("keras", layer, "options.layer_map names a Keras layer "
                                      "the model does not have"))
        elif path not in torch_paths:
            problems.append(Unaligned("keras", layer, f"options.layer_map maps it to torch "
                                      f"module '{path}', which the torch model does not have"))
        else:
            mapped[layer] = path
    taken = set(mapped.values())
    for layer in sorted(layers - set(mapped)):
        candidates = [p for p in by_norm.get(_normalised(layer), []) if p not in taken]
        if len(candidates) == 1:
            mapped[layer] = candidates[0]
        elif len(candidates) > 1:
            problems.append(Unaligned("keras", layer, "several torch modules match its name "
                                      f"({', '.join(sorted(candidates))}): name one in "
                                      "options.layer_map"))
    return mapped, problems


def align_torch_keras(torch_side: TorchSide, keras: KerasSide, torch_cap: TorchCapture,
                      keras_cap: KerasCapture, inputs: dict[str, np.ndarray],
                      torch_is_reference: bool) -> Alignment:
    out = Alignment()
    keras_role = "primary" if torch_is_reference else "reference"
    mapping, problems = keras_counterparts(keras, set(torch_side.submodules))
    for problem in problems:
        out.unaligned.append(Unaligned(keras_role, problem.name, problem.reason))
    torch_calls = torch_cap.by_key()
    torch_counts = {path: len(calls) for path, calls in torch_cap.by_path().items()}
    pairs: list[tuple[ModuleCall, KerasCall]] = []
    for call in keras.calls:
        path = mapping.get(call.name)
        tcall = torch_calls.get(f"{path}#{call.index}") if path is not None else None
        if tcall is None:
            if path is not None:
                out.unaligned.append(Unaligned(
                    keras_role, keras.call_name(call),
                    f"torch module '{path}' made no call #{call.index}"))
            elif torch_is_reference:
                out.primary_only.append(keras.call_name(call))
            else:
                out.unaligned.append(Unaligned("reference", keras.call_name(call),
                                               "no torch module has this layer's name"))
            continue
        if len(tcall.outputs) != len(call.outputs):
            out.unaligned.append(Unaligned(
                keras_role, keras.call_name(call),
                f"{len(call.outputs)} output(s) in Keras, {len(tcall.outputs)} in torch "
                f"module '{path}'"))
            continue
        pairs.append((tcall, call))
    paired = {t.key for t, _ in pairs}
    # torch's leaf modules without a Keras layer (a container is structure; its own code, a
    # residual add, is forward code the Keras side has as layers of its own).
    for tcall in torch_cap.calls:
        if tcall.key in paired or not tcall.leaf or not tcall.outputs or tcall.identity:
            continue
        if torch_is_reference:
            out.unaligned.append(Unaligned(
                "reference", _torch_name(tcall, torch_counts),
                "no Keras layer has its name (every '.' read as '_') or is mapped to it in "
                "options.layer_map"))
        else:
            out.primary_only.append(_torch_name(tcall, torch_counts))
    # Each aligned tensor pair's layout move (torch -> Keras); False: the shapes disagree.
    perms = {}
    for tcall, kcall in pairs:
        for j, tensor in enumerate(kcall.outputs):
            perms[(kcall.key, j)] = to_keras_layout(tcall.outputs[j].shape,
                                                    keras_cap.values[tensor].shape)
    if torch_is_reference:
        _torch_reference(out, keras, pairs, perms, keras_cap, inputs, torch_counts)
    else:
        _keras_reference(out, torch_side, keras, pairs, perms, torch_cap, keras_cap)
    return out


def _torch_name(call: ModuleCall, counts: dict[str, int]) -> str:
    return call.path if counts.get(call.path, 1) == 1 else call.key


def _compared(array: np.ndarray, perm) -> np.ndarray:
    """A Keras tensor in torch's layout (as is where the shapes do not agree either way:
    the comparison then reports the mismatch)."""
    return array if perm is False else _undo(array, perm)


def _torch_reference(out: Alignment, keras: KerasSide, pairs, perms, keras_cap: KerasCapture,
                     inputs, counts) -> None:
    given = _model_inputs(keras, inputs)
    for tcall, kcall in pairs:
        for j, tensor in enumerate(kcall.outputs):
            perm = perms[(kcall.key, j)]
            if perm is not False:
                given[tensor] = _apply(tcall.outputs[j], perm)
    for tcall, kcall in pairs:
        n = len(tcall.outputs)
        for j, tensor in enumerate(kcall.outputs):
            perm = perms[(kcall.key, j)]
            isolate = None
            note = ""
            if perm is False:
                note = "its output's shape differs from the torch module's in any layout"
            else:
                isolate = _keras_isolator(keras, kcall, j, given,
                                          lambda a, perm=perm: _undo(a, perm))
            out.pairings.append(Pairing(
                _output_name(_torch_name(tcall, counts), j, n), tcall.kind, tcall.path,
                _output_name(tcall.key, j, n), tcall.outputs[j],
                _compared(keras_cap.values[tensor], perm), isolate, note,
                inputs=[s for s in tcall.sources if s is not None],
                ref_key=f"{tcall.key}.{j}"))


def _keras_reference(out: Alignment, torch_side: TorchSide, keras: KerasSide, pairs, perms,
                     torch_cap: TorchCapture, keras_cap: KerasCapture) -> None:
    aligned = {kcall.key for _, kcall in pairs}
    # What the Keras reference computed for each paired torch call, in torch's layout (a
    # container run on its own gets its children's in their place).
    reference_of = {
        tcall.key: [_compared(keras_cap.values[t], perms[(kcall.key, j)])
                    for j, t in enumerate(kcall.outputs)]
        for tcall, kcall in pairs}
    for tcall, kcall in pairs:
        n = len(kcall.outputs)
        feeds, note = _torch_feeds(keras, kcall, tcall, keras_cap, aligned)
        for j, tensor in enumerate(kcall.outputs):
            perm = perms[(kcall.key, j)]
            isolate = None
            if feeds is not None:
                def isolate(tcall=tcall, feeds=feeds, j=j) -> tuple[np.ndarray, list[str]]:
                    result = torch_side.run_module(tcall.path, feeds, _substitutes(
                        torch_cap, tcall, reference_of.get))
                    return result[j], [tcall.path]
            out.pairings.append(Pairing(
                _output_name(keras.call_name(kcall), j, n), kcall.kind, tcall.path,
                _value(kcall, j), _compared(keras_cap.values[tensor], perm),
                tcall.outputs[j], isolate, note, inputs=_input_values(keras, kcall),
                ref_key=f"{kcall.key}.{j}"))


def _torch_feeds(keras: KerasSide, kcall: KerasCall, tcall: ModuleCall,
                 keras_cap: KerasCapture, aligned: set[str]
                 ) -> tuple[list[np.ndarray] | None, str]:
    """The Keras reference's tensors for the torch module's inputs, in torch's layout: the
    layer's own inputs, or, where a Keras layer without a torch counterpart sits in front (a
    padding layer), the tensor behind it whose shape is the one torch reads."""
    if len(kcall.inputs) != len(tcall.inputs):
        return None, (f"the Keras layer reads {len(kcall.inputs)} tensor(s), the torch module "
                      f"{len(tcall.inputs)}")
    feeds = []
    for tensor, want in zip(kcall.inputs, tcall.inputs):
        found = None
        for _ in range(_WALK_BACK):
            array = keras_cap.values[tensor]
            perm = to_keras_layout(want.shape, array.shape)
            if perm is not False:
                found = _undo(array, perm).astype(want.dtype, copy=False)
                break
            producer = keras.producer.get(tensor)
            if producer is None or producer.key in aligned or len(producer.inputs) != 1:
                break
            tensor = producer.inputs[0]
        if found is None:
            return None, ("no tensor of the Keras reference in front of the layer has the "
                          f"shape torch's module reads ({tuple(want.shape)})")
        feeds.append(found)
    return feeds, ""


# -- Keras vs ONNX (tf2onnx's conversion) ---------------------------------------------------------
def onnx_layer(node_name: str, layers: set[str]) -> str | None:
    """The Keras layer a tf2onnx node came from: the innermost scope segment of its name
    (``StatefulPartitionedCall/functional_1/conv1_1/BiasAdd``) that is a layer's name, or one
    with TensorFlow's ``_N`` uniquifying suffix; None for a node tf2onnx made itself
    (``Conv__34``, ``Transpose__12``)."""
    segments = node_name.split("/")[:-1]
    for segment in reversed(segments):
        if segment in layers:
            return segment
        stem, _, suffix = segment.rpartition("_")
        if suffix.isdigit() and stem in layers:
            return stem
    return None


def _groups(layers: set[str], onnx) -> dict[str, tuple[list[str], list[str]]]:
    """Keras layer -> (the ONNX values its nodes read from outside, the values read outside
    its nodes or leaving the graph)."""
    graph = onnx.source
    members: dict[str, set[int]] = {}
    for index, node in enumerate(graph.nodes):
        if node.op_type == "Constant":
            continue
        layer = onnx_layer(node.name, layers)
        if layer is not None:
            members.setdefault(layer, set()).add(index)
    out = {}
    graph_outputs = set(graph.outputs)
    for layer, nodes in members.items():
        produced = {v for i in nodes for v in graph.nodes[i].output if v}
        if produced <= graph.static:
            continue  # weights folded under the layer's scope: no computation of its own
        reads = [v for i in sorted(nodes) for v in graph.nodes[i].input
                 if v and v not in produced and v not in graph.initializers
                 and v not in graph.static]
        leaves = [v for i in sorted(nodes) for v in graph.nodes[i].output if v and (
            v in graph_outputs or any(c not in nodes for c in graph.consumers.get(v, [])))]
        out[layer] = (list(dict.fromkeys(reads)), leaves)
    return out


def align_keras_onnx(keras: KerasSide, onnx, keras_cap: KerasCapture,
                     onnx_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                     keras_is_reference: bool) -> Alignment:
    """A ``.keras`` and tf2onnx's conversion of it: each Keras layer is the group of nodes
    named under its scope, compared on the group's output (NCHW inside the ONNX graph is
    moved to Keras's NHWC). tf2onnx folds some layers into others (a ``ZeroPadding2D`` into
    the Conv's pads, Permutes cancelled against its Transposes) and names some nodes itself
    (``Conv__34``): those layers are unaligned, and the nodes run in the next aligned layer's
    segment."""
    out = Alignment()
    keras_role = "reference" if keras_is_reference else "primary"
    groups = _groups({call.name for call in keras.calls}, onnx)
    pairs: list[tuple[KerasCall, str, list[str], Perm]] = []  # call, value, reads, perm
    for call in keras.calls:
        name = keras.call_name(call)
        group = groups.get(call.name)
        if group is None:
            if keras_is_reference:
                out.unaligned.append(Unaligned(
                    "reference", name, "no node of the ONNX graph carries its scope (tf2onnx "
                    "folded it into a neighbour, or named the node itself)"))
            else:
                out.primary_only.append(name)
            continue
        reads, leaves = group
        if keras.counts.get(call.name, 1) > 1 or len(call.outputs) != 1:
            out.unaligned.append(Unaligned(keras_role, name, "a layer called more than once "
                                           "or with several outputs is not aligned by scope"))
            continue
        array = keras_cap.values[call.outputs[0]]
        chosen = [(v, p) for v in leaves if v in onnx_cap
                  for p in [to_keras_layout(onnx_cap[v].shape, array.shape)] if p is not False]
        if len(chosen) != 1:
            out.unaligned.append(Unaligned(
                keras_role, name, f"{len(leaves)} value(s) leave its nodes in ONNX "
                f"({', '.join(leaves[:4])}), {len(chosen)} of its output's shape"))
            continue
        value, perm = chosen[0]
        pairs.append((call, value, reads, perm))
    if keras_is_reference:
        available = {n: a for n, a in inputs.items()}
        for call, value, _, perm in pairs:
            available[value] = _undo(keras_cap.values[call.outputs[0]], perm)
        boundary = set(available)
        fetch = dtype_fetcher(available, onnx_cap)
        for call, value, reads, perm in pairs:
            def isolate(value=value, perm=perm) -> tuple[np.ndarray, list[str]]:
                result, nodes = onnx.isolate(value, boundary - {value}, fetch)
                return _apply(result, perm), nodes

            out.pairings.append(Pairing(
                keras.call_name(call), call.kind, call.name, value,
                keras_cap.values[call.outputs[0]], _apply(onnx_cap[value], perm), isolate,
                inputs=reads, ref_key=f"{call.key}.0"))
        return out
    given = _model_inputs(keras, inputs)
    for call, value, _, perm in pairs:
        given[call.outputs[0]] = _apply(onnx_cap[value], perm)
    for call, value, reads, perm in pairs:
        out.pairings.append(Pairing(
            keras.call_name(call), call.kind, call.name, value, _apply(onnx_cap[value], perm),
            keras_cap.values[call.outputs[0]], _keras_isolator(keras, call, 0, given,
                                                               lambda a: a),
            inputs=reads))
    return out


def keras_scoped(onnx, torch_paths) -> bool:
    """True when some node of the graph is named under a Keras layer scope that a torch module
    path names (tf2onnx's conversion of a port of the torch model)."""
    layers = {_normalised(path) for path in torch_paths if path}
    return any(onnx_layer(node.name, layers) for node in onnx.source.nodes)


def align_torch_tf2onnx(torch_side: TorchSide, onnx, torch_cap: TorchCapture,
                        onnx_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray]
                        ) -> Alignment:
    """A torch reference against tf2onnx's conversion of its Keras port: the graph carries the
    port's Keras layer scopes, not torch's, so a torch module is the group of nodes under the
    layer its path names (every '.' read as '_', as for torch vs Keras), compared on the
    group's output in torch's layout; the ONNX side is isolated on segments as for any ONNX
    primary."""
    out = Alignment()
    counts = {path: len(calls) for path, calls in torch_cap.by_path().items()}
    layers = {_normalised(call.path): call.path for call in torch_cap.calls if call.leaf}
    groups = _groups(set(layers), onnx)
    pairs = []  # call, value, reads, perm (torch -> ONNX layout)
    for call in torch_cap.calls:
        if not call.leaf or not call.outputs or call.identity:
            continue
        name = _torch_name(call, counts)
        group = groups.get(_normalised(call.path))
        if group is None:
            out.unaligned.append(Unaligned(
                "reference", name, "no node of the ONNX graph carries a layer scope named "
                "after it (every '.' read as '_'), or tf2onnx folded that layer away"))
            continue
        reads, leaves = group
        if counts.get(call.path, 1) > 1 or len(call.outputs) != 1:
            out.unaligned.append(Unaligned("reference", name, "a module called more than once "
                                           "or with several outputs is not aligned by scope"))
            continue
        chosen = [(v, p) for v in leaves if v in onnx_cap
                  for p in [to_keras_layout(call.outputs[0].shape, onnx_cap[v].shape)]
                  if p is not False]
        if len(chosen) != 1:
            out.unaligned.append(Unaligned(
                "reference", name, f"{len(leaves)} value(s) leave its nodes in ONNX, "
                f"{len(chosen)} of its output's shape"))
            continue
        pairs.append((call, *chosen[0], reads))
    available = {n: a for n, a in inputs.items()}
    for call, value, perm, _ in pairs:
        available[value] = _apply(call.outputs[0], perm)
    boundary = set(available)
    fetch = dtype_fetcher(available, onnx_cap)
    for call, value, perm, reads in pairs:
        def isolate(value=value, perm=perm) -> tuple[np.ndarray, list[str]]:
            result, nodes = onnx.isolate(value, boundary - {value}, fetch)
            return _undo(result, perm), nodes

        out.pairings.append(Pairing(
            _torch_name(call, counts), call.kind, call.path, value, call.outputs[0],
            _undo(onnx_cap[value], perm), isolate, inputs=reads, ref_key=f"{call.key}.0"))
    return out
