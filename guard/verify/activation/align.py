"""Align the captures of two sides layer by layer, by name.

- ONNX vs ONNX (fp32 vs its derived int8/fp16, or two optimisation levels): value names. The
  derivations keep the names of the values they do not replace; what they add (``_quantized``,
  ``_scale``, casts) has no counterpart and is listed as primary-only, and a reference value the
  primary lacks is listed as unaligned.
- torch vs ONNX exported from it: the k-th call of module ``path`` is the k-th connected group
  of nodes whose exporter scope is ``path`` (or below it); its outputs are the group's values
  read outside it. Modules that left no scope (fused, inlined, called a different number of
  times than the graph shows) are listed as unaligned with the reason.
- torch vs torch: module path and call index.

Each aligned layer comes with a thunk that computes its *isolated* output: the primary's layer
fed the reference's own inputs for it, where the primary's backend allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from guard.verify.activation.onnx_side import OnnxSide
from guard.verify.activation.report import Unaligned
from guard.verify.activation.torch_side import ModuleCall, TorchCapture, TorchSide

# (output, primary node names) of a layer run on the reference's inputs.
Isolator = Callable[[], tuple[np.ndarray, list[str]]]


@dataclass
class Pairing:
    name: str
    op: str
    module: str
    value: str
    reference: np.ndarray
    primary: np.ndarray
    isolate: Isolator | None = None
    isolation_note: str = ""
    inputs: list[str] = field(default_factory=list)  # values (this side's names) it reads
    isolate_is_free: bool = False  # the primary computes it exactly as the reference does
    ref_key: str = ""  # the reference's own key for this tensor (its per-layer noise), else value


@dataclass
class Alignment:
    pairings: list[Pairing] = field(default_factory=list)
    unaligned: list[Unaligned] = field(default_factory=list)
    primary_only: list[str] = field(default_factory=list)


def _module_of(side: OnnxSide, value: str) -> str:
    from guard.verify.activation.onnx_side import _node_module

    node = side.source.node_of(value) or side.graph.node_of(value)
    module = _node_module(node) if node is not None else None
    return module or ""


def _fetcher(values: dict[str, np.ndarray], dtypes: dict[str, np.ndarray]):
    """Reference tensors cast to the dtype the primary holds for the same value."""

    def fetch(name: str) -> np.ndarray:
        array = values[name]
        like = dtypes.get(name)
        if like is not None and array.dtype != like.dtype:
            array = array.astype(like.dtype)
        return array

    return fetch


# -- ONNX vs ONNX -------------------------------------------------------------------------------
def align_onnx_onnx(ref: OnnxSide, prim: OnnxSide, ref_cap: dict[str, np.ndarray],
                    prim_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> Alignment:
    out = Alignment()
    common = [v for v in ref.values if v in ref_cap and v in prim_cap]
    available = dict(inputs)
    available.update({v: ref_cap[v] for v in common})
    boundary = set(available)
    fetch = _fetcher(available, prim_cap)
    for value in ref.values:
        node = ref.graph.node_of(value)
        name = node.name or value
        if len([o for o in node.output if o]) > 1:
            name = f"{name}[{value}]"  # one layer per output of a multi-output node
        if value not in ref_cap:
            continue  # not produced by this run (a branch not taken)
        if value not in prim_cap:
            out.unaligned.append(Unaligned(
                "reference", name, f"value '{value}' is not in the primary's graph"))
            continue

        free = prim.computes_like(ref, value, boundary)
        if free:
            def isolate(value=value, node=node) -> tuple[np.ndarray, list[str]]:
                return ref_cap[value], [node.name]  # same computation: no error of its own
        else:
            def isolate(value=value) -> tuple[np.ndarray, list[str]]:
                return prim.isolate(value, boundary, fetch)

        out.pairings.append(Pairing(name, node.op_type, _module_of(ref, value), value,
                                    ref_cap[value], prim_cap[value], isolate,
                                    inputs=[i for i in node.input if i], isolate_is_free=free))
    ref_values = set(ref.values)
    out.primary_only = [v for v in prim.values if v not in ref_values and v in prim_cap]
    return out


# -- torch vs ONNX ------------------------------------------------------------------------------
@dataclass
class _Match:
    call: ModuleCall
    outputs: list[str]  # ONNX values, one per torch output
    inputs: list[str] | None  # ONNX values, one per torch input (None: not matchable)


def _instances_of(path: str, scopes: dict, torch_paths: set[str]) -> list:
    """The graph's calls of module ``path``. The TorchScript exporter names the second call of
    a reused module ``pool_1`` (``/pool_1/MaxPool``), the dynamo exporter keeps ``pool``."""
    instances = list(scopes.get(path, []))
    suffix = 1
    while f"{path}_{suffix}" in scopes and f"{path}_{suffix}" not in torch_paths:
        instances += scopes[f"{path}_{suffix}"]
        suffix += 1
    return instances


def _match_calls(torch_cap: TorchCapture, onnx: OnnxSide, onnx_cap: dict[str, np.ndarray],
                 torch_side_name: str, torch_paths: set[str]
                 ) -> tuple[list[_Match], list[Unaligned]]:
    scopes = onnx.scope_instances()
    by_path = torch_cap.by_path()
    matches: list[_Match] = []
    unaligned: list[Unaligned] = []
    for call in torch_cap.calls:
        calls = by_path[call.path]
        name = call.path if len(calls) == 1 else call.key
        if not call.outputs:
            continue  # a module that returns no tensor has nothing to compare
        if not scopes:
            unaligned.append(Unaligned(torch_side_name, name,
                                       "the ONNX graph records no module scopes (neither "
                                       "pkg.torch.onnx.name_scopes metadata nor /module/Op "
                                       "node names)"))
            continue
        instances = _instances_of(call.path, scopes, torch_paths)
        if not instances:
            unaligned.append(Unaligned(torch_side_name, name,
                                       "no ONNX node carries this module's scope (fused away, "
                                       "folded into a constant or inlined by the exporter)"))
            continue
        if len(instances) != len(calls):
            unaligned.append(Unaligned(
                torch_side_name, name,
                f"called {len(calls)} time(s) in torch but {len(instances)} group(s) of nodes "
                "carry its scope in ONNX"))
            continue
        instance = instances[call.index]
        if len(instance.outputs) != len(call.outputs):
            unaligned.append(Unaligned(
                torch_side_name, name,
                f"{len(call.outputs)} tensor output(s) in torch, {len(instance.outputs)} "
                f"value(s) leave its scope in ONNX ({', '.join(instance.outputs)})"))
            continue
        missing = [v for v in instance.outputs if v not in onnx_cap]
        if missing:
            unaligned.append(Unaligned(
                torch_side_name, name,
                f"ONNX value(s) {', '.join(missing)} are not produced by the graph that runs "
                "(renamed or removed when the variant was derived)"))
            continue
        shapes_ok = len(instance.inputs) == len(call.inputs) and all(
            v in onnx_cap and onnx_cap[v].shape == t.shape
            for v, t in zip(instance.inputs, call.inputs))
        matches.append(_Match(call, instance.outputs, instance.inputs if shapes_ok else None))
    return matches, unaligned


def _call_name(call: ModuleCall, torch_cap: TorchCapture, j: int, n: int) -> str:
    calls = sum(1 for c in torch_cap.calls if c.path == call.path)
    base = call.path if calls == 1 else call.key
    return base if n == 1 else f"{base}.{j}"


def align_torch_onnx(torch_side: TorchSide, onnx: OnnxSide, torch_cap: TorchCapture,
                     onnx_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                     torch_is_reference: bool) -> Alignment:
    out = Alignment()
    torch_role = "reference" if torch_is_reference else "primary"
    matches, out.unaligned = _match_calls(torch_cap, onnx, onnx_cap, torch_role,
                                          set(torch_side.submodules))

    if torch_is_reference:
        # Everything torch computed that has a name in the graph is a boundary the ONNX
        # primary's segments can start from.
        available: dict[str, np.ndarray] = {n: a for n, a in inputs.items()}
        for m in matches:
            for v, t in zip(m.outputs, m.call.outputs):
                available[v] = t
            for v, t in zip(m.inputs or [], m.call.inputs):
                available.setdefault(v, t)
        boundary = set(available)
        fetch = _fetcher(available, onnx_cap)
    for m in matches:
        n = len(m.outputs)
        for j, (value, tensor) in enumerate(zip(m.outputs, m.call.outputs)):
            name = _call_name(m.call, torch_cap, j, n)
            if torch_is_reference:
                def isolate(value=value) -> tuple[np.ndarray, list[str]]:
                    return onnx.isolate(value, boundary, fetch)

                out.pairings.append(Pairing(name, m.call.kind, m.call.path, value, tensor,
                                            onnx_cap[value], isolate,
                                            ref_key=f"{m.call.key}.{j}"))
            else:
                isolate = None
                note = ""
                if m.inputs is None:
                    note = "the module's inputs could not be matched to ONNX values"
                else:
                    def isolate(m=m, j=j) -> tuple[np.ndarray, list[str]]:
                        args = [onnx_cap[v] for v in m.inputs]
                        return torch_side.run_module(m.call.path, args)[j], []
                out.pairings.append(Pairing(name, m.call.kind, m.call.path, value,
                                            onnx_cap[value], tensor, isolate, note))
    if not torch_is_reference:
        return _reorder_by_graph(out, onnx)
    return out


def _reorder_by_graph(out: Alignment, onnx: OnnxSide) -> Alignment:
    """With ONNX as the reference, layers go in the reference graph's order."""
    order = {v: i for i, v in enumerate(onnx.values)}
    out.pairings.sort(key=lambda p: order.get(p.value, len(order)))
    return out


# -- torch vs torch -----------------------------------------------------------------------------
def align_torch_torch(ref: TorchSide, prim: TorchSide, ref_cap: TorchCapture,
                      prim_cap: TorchCapture) -> Alignment:
    out = Alignment()
    prim_calls = {c.key: c for c in prim_cap.calls}
    for call in ref_cap.calls:
        other = prim_calls.get(call.key)
        n = len(call.outputs)
        if other is None:
            out.unaligned.append(Unaligned("reference", call.key,
                                           "the primary made no such module call"))
            continue
        if len(other.outputs) != n:
            out.unaligned.append(Unaligned(
                "reference", call.key, f"{n} tensor output(s) vs {len(other.outputs)}"))
            continue
        for j in range(n):
            def isolate(call=call, j=j) -> tuple[np.ndarray, list[str]]:
                return prim.run_module(call.path, call.inputs)[j], []

            out.pairings.append(Pairing(_call_name(call, ref_cap, j, n), call.kind, call.path,
                                        call.key, call.outputs[j], other.outputs[j], isolate,
                                        ref_key=f"{call.key}.{j}"))
    ref_keys = {c.key for c in ref_cap.calls}
    out.primary_only = [c.key for c in prim_cap.calls if c.key not in ref_keys]
    return out
