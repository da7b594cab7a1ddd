"""Align the captures of two sides layer by layer, by name.

- ONNX vs ONNX (fp32 vs its derived int8/fp16, or two optimisation levels): value names. The
  derivations keep the names of the values they do not replace; what they add (``_quantized``,
  ``_scale``, casts) has no counterpart and is listed as primary-only, and a reference value the
  primary lacks is listed as unaligned.
- torch vs ONNX exported from it: the k-th call of module ``path`` (at any depth) is the k-th
  connected group of nodes whose exporter scope stack holds ``path`` (scopes.py reads both
  exporters'); its outputs are the group's values read outside it. A module the exporter folded
  into its neighbour (a BatchNorm into the Conv before it, an activation into a fused op) has
  no scope of its own: where the torch dataflow shows the chain (the BatchNorm reads only the
  Conv's output, and is its only reader), the chain is one unit, ``layer1.0.conv1+layer1.0.bn1``,
  compared on the chain's last output. What a runtime's optimiser fused after export, on nodes
  without a scope, is joined likewise: a Linear's bias with GELU in BiasGelu; a Linear's bias,
  the residual add and the next LayerNorm in SkipLayerNormalization
  (``blocks.0.attn.out+blocks.0.ln2``); q, k and v packed with the attention's own code into
  one Attention node (``blocks.1.attn.{q,k,v}``: the members are the Linears whose weights tile
  its packed weight, packed.py). Anything else without a scope is listed as unaligned with
  the reason, and the neighbour that may hold its computation is flagged ``unsure`` (tier 2
  then says undetermined rather than name it). A container whose output is its last child's
  (a ``Sequential``) is that child; a container with code of its own (a residual add) is
  compared on it, and isolated on that code alone (its children's tensors fed from the
  reference).
- ONNX vs ONNX, a primary node the reference lacks whose weights pack several of the
  reference's (that Attention node) is named after the reference's nodes reading them.
- torch vs torch (eager, or torch.compile captured on the compiled code: compiled_side.py):
  module path and call index; a container isolated on its own code, its children returning the
  reference's tensors (a compiled container is not re-run: its leaves are).

Each aligned layer comes with a thunk that computes its *isolated* output: the primary's layer
fed the reference's own inputs for it, where the primary's backend allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from guard.backends.activations.onnx import OnnxSide, ScopeInstance
from guard.verify.activation.packed import brace, pack_order
from guard.verify.activation.report import Unaligned
from guard.backends.activations.scopes import node_module, node_scopes
from guard.backends.activations.torch import ModuleCall, TorchCapture, TorchSide

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
    unsure: str = ""  # why the two tensors may not be the same computation (never named then)
    # The torch module paths it computes, in call order: one call's, or every member of a unit
    # the graph computes as one (a Conv with the BatchNorm folded into it); [] for ONNX vs ONNX.
    modules: list[str] = field(default_factory=list)
    # ``isolate`` runs the reference's layer on the primary's captured inputs (a primary that
    # can only be observed: llama.cpp's eval callback); its isolated error is then the
    # primary's output against that, not the primary's re-run against the reference's.
    against_primary: bool = False


@dataclass
class Alignment:
    pairings: list[Pairing] = field(default_factory=list)
    unaligned: list[Unaligned] = field(default_factory=list)
    primary_only: list[str] = field(default_factory=list)
    # Per layer value, the groups of layers it is judged against, in order of preference (the
    # same module in every block, then every module of its class): set where every layer
    # differs by design and only one that stands out from its peers diverges (a quantized
    # GGUF, gguf_align.py; decide.py). Empty: each layer against its own allowance.
    peers: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _module_of(side: OnnxSide, value: str) -> str:
    node = side.source.node_of(value) or side.graph.node_of(value)
    module = node_module(node) if node is not None else None
    return module or ""


def dtype_fetcher(values: dict[str, np.ndarray], dtypes: dict[str, np.ndarray]):
    """Reference tensors cast to the dtype the primary holds for the same value."""

    def fetch(name: str) -> np.ndarray:
        array = values[name]
        like = dtypes.get(name)
        if like is not None and array.dtype != like.dtype:
            array = array.astype(like.dtype)
        return array

    return fetch


# -- ONNX vs ONNX -------------------------------------------------------------------------------
def _arrays(graph, names) -> list[tuple[str, np.ndarray]]:
    from onnx import numpy_helper

    return [(name, numpy_helper.to_array(graph.initializers[name])) for name in names]


def _packed_members(ref: OnnxSide, prim: OnnxSide, value: str, boundary: set[str]
                    ) -> list[str] | None:
    """When the primary computes ``value`` with a node the reference lacks whose weights pack
    several of the reference's (ONNX Runtime's Attention: q, k, v projections concatenated),
    the reference's nodes that read those weights, packed order (weights, then biases): the
    layer is then that unit, named by them, not by the reference node that happens to produce
    ``value`` (the heads' Reshape after the attention)."""
    node = prim.graph.node_of(value)
    if node is None or node.name in ref.graph.by_name():
        return None
    packed = [n for n in node.input if n in prim.graph.initializers]
    if not packed:
        return None
    try:
        nodes, _ = ref.graph.segment(value, boundary)
    except KeyError:
        return None
    readers: dict[str, str] = {}  # the reference's weight -> the first node reading it
    for index in nodes:
        for name in ref.graph.nodes[index].input:
            if name in ref.graph.initializers:
                readers.setdefault(name, ref.graph.nodes[index].name or name)
    candidates = []
    for name, array in _arrays(ref.graph, readers):
        candidates.append((name, array))
        if array.ndim == 2:
            candidates.append((name, array.T))  # a Gemm's [out, in] weight
    out: list[str] = []
    for _name, array in _arrays(prim.graph, packed):
        order = pack_order(array, candidates)
        if order:
            out += [readers[n] for n in order if readers[n] not in out]
    return out if len(out) >= 2 else None


def align_onnx_onnx(ref: OnnxSide, prim: OnnxSide, ref_cap: dict[str, np.ndarray],
                    prim_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> Alignment:
    out = Alignment()
    common = [v for v in ref.values if v in ref_cap and v in prim_cap]
    available = dict(inputs)
    available.update({v: ref_cap[v] for v in common})
    boundary = set(available)
    fetch = dtype_fetcher(available, prim_cap)
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

        packed = _packed_members(ref, prim, value, boundary)
        if packed:
            name = brace(packed, "/")
        free = prim.computes_like(ref, value, boundary)
        isolate: Isolator
        if free:
            def same(value=value, node=node) -> tuple[np.ndarray, list[str]]:
                return ref_cap[value], [node.name]  # same computation: no error of its own
            isolate = same
        else:
            def rerun(value=value) -> tuple[np.ndarray, list[str]]:
                return prim.isolate(value, boundary, fetch)
            isolate = rerun

        out.pairings.append(Pairing(name, node.op_type, _module_of(ref, value), value,
                                    ref_cap[value], prim_cap[value], isolate,
                                    inputs=[i for i in node.input if i], isolate_is_free=free))
    ref_values = set(ref.values)
    out.primary_only = [v for v in prim.values if v not in ref_values and v in prim_cap]
    return out


# -- torch vs ONNX ------------------------------------------------------------------------------
# What an exporter or a runtime folds into the op before it, leaving no scope of its own: a
# BatchNorm into the Conv (or Linear) it follows in eval mode, an activation into a fused
# Conv/MatMul. The unit is then compared as one, under a name that lists its members.
_FOLDABLE = frozenset({
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "ReLU", "ReLU6", "GELU", "SiLU", "Sigmoid",
    "Tanh", "LeakyReLU", "Hardswish", "Hardsigmoid", "ELU", "Mish"})


def _foldable(kind: str) -> bool:
    """A module an exporter or runtime may fold into the op before it (transformers names its
    activation modules ``GELUActivation``, ``SiLUActivation``...)."""
    return kind in _FOLDABLE or kind.endswith("Activation")
# Modules that can absorb a foldable one, and the ONNX ops that compute them.
_ABSORBING = {"Conv1d": {"Conv"}, "Conv2d": {"Conv"}, "Conv3d": {"Conv"},
              "ConvTranspose1d": {"ConvTranspose"}, "ConvTranspose2d": {"ConvTranspose"},
              "ConvTranspose3d": {"ConvTranspose"}, "Linear": {"Gemm", "MatMul"}}
# What ONNX Runtime fuses a Linear's bias, a residual add and a LayerNorm into (unscoped).
_RESIDUAL_NORMS = frozenset({"SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})
_NO_SCOPE = ("no ONNX node carries this module's scope (fused away, folded into a constant or "
             "inlined by the exporter)")


@dataclass
class _Unit:
    """Module calls compared as one: a call, or a chain the graph computes as one group of
    nodes (``layer1.0.conv1+layer1.0.bn1``)."""

    members: list[ModuleCall]
    instance: ScopeInstance  # the group of nodes that computes it
    unsure: str = ""  # why the pairing may compare different computations
    outputs: list[str] | None = None  # its ONNX values, where not the group's own (a fold)
    # The torch tensors compared, where not its last member's outputs (a packed attention's:
    # what the module after it reads).
    tensors: list[np.ndarray] | None = None
    # Why torch cannot re-run it member by member (its parent's code runs between them).
    composite: str = ""
    # (ONNX value, torch tensor) pairs inside the unit that segments may start from (a fused
    # residual norm's sum output: the norm's own input).
    extra: list[tuple[str, np.ndarray]] = field(default_factory=list)
    packed: bool = False  # its members are packed into one op: named with braces
    fused: list[int] = field(default_factory=list)  # unscoped nodes it stands for (their index)

    @property
    def torch_outputs(self) -> list[np.ndarray]:
        return self.tensors if self.tensors is not None else self.last.outputs

    @property
    def first(self) -> ModuleCall:
        return self.members[0]

    @property
    def last(self) -> ModuleCall:
        return self.members[-1]

    @property
    def order(self) -> int:
        return max(m.order for m in self.members)


@dataclass
class _Match:
    unit: _Unit
    outputs: list[str]  # ONNX values, one per torch output of the unit's last member
    inputs: list[str] | None  # ONNX values, one per torch input of its first (None: not matchable)
    # Which torch output each ONNX value is, where not one for one (a recurrent module whose
    # final states the graph does not read).
    indices: list[int] | None = None

    @property
    def torch_indices(self) -> list[int]:
        return self.indices if self.indices is not None else list(range(len(self.outputs)))

    @property
    def tensors(self) -> list[np.ndarray]:
        outputs = self.unit.torch_outputs
        return [outputs[j] for j in self.torch_indices]


def _instances_of(path: str, scopes: dict, torch_paths: set[str]) -> list:
    """The graph's calls of module ``path``. The TorchScript exporter names the second call of
    a reused module ``pool_1`` (``/pool_1/MaxPool``), the dynamo exporter keeps ``pool``."""
    instances = list(scopes.get(path, []))
    suffix = 1
    while f"{path}_{suffix}" in scopes and f"{path}_{suffix}" not in torch_paths:
        instances += scopes[f"{path}_{suffix}"]
        suffix += 1
    instances.sort(key=lambda inst: min(inst.nodes))
    return instances


def _label(call: ModuleCall, calls_per_path: dict[str, int]) -> str:
    return call.path if calls_per_path.get(call.path, 1) == 1 else call.key


class _Units:
    """Torch calls matched to the graph's groups of nodes, folded units joined."""

    def __init__(self, torch_cap: TorchCapture, onnx: OnnxSide, role: str, torch_paths: set[str],
                 weight_of: Callable[[str], np.ndarray | None] | None = None):
        self.cap = torch_cap
        self.onnx = onnx
        self.role = role
        self.by_key = torch_cap.by_key()
        self.consumers = torch_cap.consumers()
        self.counts = {path: len(calls) for path, calls in torch_cap.by_path().items()}
        self.units: dict[str, _Unit] = {}  # member key -> its unit
        self.missing: dict[str, ModuleCall] = {}  # calls without a scope of their own
        self.unaligned: list[Unaligned] = []
        self.absorbed: set[tuple[str, ...]] = set()  # a unit's outputs before a join changed them
        scopes = onnx.scope_instances(torch_paths)
        by_path = torch_cap.by_path()
        for call in torch_cap.calls:
            if not call.outputs:
                continue  # a module that returns no tensor has nothing to compare
            name = self.name(call)
            if not scopes:
                self.unaligned.append(Unaligned(
                    role, name, "the ONNX graph records no module scopes (neither "
                    "pkg.torch.onnx.name_scopes metadata nor /module/Op node names)"))
                continue
            instances = _instances_of(call.path, scopes, torch_paths)
            if not instances:
                self.missing[call.key] = call
                continue
            calls = by_path[call.path]
            if len(instances) != len(calls):
                self.unaligned.append(Unaligned(
                    role, name, f"called {len(calls)} time(s) in torch but {len(instances)} "
                    "group(s) of nodes carry its scope in ONNX"))
                continue
            self.units[call.key] = _Unit([call], instances[call.index])
        self._fold()
        if weight_of is not None:
            self._pack(weight_of)
        self._join_residual_norms()
        self._explain_missing()
        self._flag_rewritten()

    def name(self, call: ModuleCall) -> str:
        return _label(call, self.counts)

    def unit_name(self, unit: _Unit) -> str:
        names = [self.name(m) for m in unit.members]
        return brace(names) if unit.packed else "+".join(names)

    # -- folded units ---------------------------------------------------------------------------
    def _sole_consumer(self, key: str) -> ModuleCall | None:
        consumers = self.consumers.get(key, [])
        return consumers[0] if len(consumers) == 1 else None

    def _fold(self) -> None:
        changed = True
        while changed:
            changed = False
            for key, call in list(self.missing.items()):
                if call.leaf and not call.identity and (self._append(call) or self._prepend(call)):
                    del self.missing[key]
                    changed = True

    def _append(self, call: ModuleCall) -> bool:
        """The module before keeps its scope, this one has none: folded into that group of
        nodes (the TorchScript exporter's Conv+BatchNorm), or computed by an unscoped node a
        runtime's optimiser fused right after it (MatMul -> BiasGelu: the unit's output is then
        that node's, as the next module's group reads it)."""
        if not _foldable(call.kind) or len(call.sources) != 1 or call.sources[0] is None:
            return False
        unit = self.units.get(call.sources[0])
        if (unit is None or unit.last.key != call.sources[0]
                or unit.first.kind not in _ABSORBING
                or not all(_foldable(m.kind) for m in unit.members[1:])
                or self._sole_consumer(unit.last.key) is not call):
            return False
        outputs = self._read_outputs(unit)
        if len(outputs) != 1:
            return False
        value = self._folded_output(call, outputs[0])
        if value is None:
            return False
        if value != outputs[0]:
            # The group's own output (BiasGelu's MatMul before it) is no module's output now:
            # a container returning the folded module's output is that unit, not that value.
            self.absorbed.add(tuple(outputs))
        unit.members.append(call)
        unit.outputs = [value]
        self.units[call.key] = unit
        return True

    def _folded_output(self, call: ModuleCall, value: str) -> str | None:
        """The ONNX value holding ``call``'s output when it has no scope and ``value`` is the
        output of the group before it, or None when the graph does not show the fold."""
        graph = self.onnx.source
        consumer = self._sole_consumer(call.key)
        after = self.units.get(consumer.key) if consumer is not None else None
        if after is not None and after.first is consumer:
            index = consumer.sources.index(call.key)
            if len(after.instance.inputs) != len(consumer.sources):
                return None
            read = after.instance.inputs[index]
            if read == value:
                return value  # folded into the group before
            node = graph.node_of(read)
            if node is not None and node_scopes(node) is None and value in node.input:
                return read  # one unscoped node between the two groups computes it
            return None
        # Read by a parent's own code (a residual add): every reader of the value is scoped.
        readers = [graph.nodes[i] for i in graph.consumers.get(value, [])]
        if readers and all(node_scopes(n) is not None for n in readers):
            return value
        return None

    def _prepend(self, call: ModuleCall) -> bool:
        """Dynamo exporter: the fused Conv carries the BatchNorm's scope, the Conv has none."""
        if call.kind not in _ABSORBING:
            return False
        consumer = self._sole_consumer(call.key)
        unit = self.units.get(consumer.key) if consumer is not None else None
        if (unit is None or unit.first is not consumer or consumer.sources != [call.key]
                or not all(_foldable(m.kind) for m in unit.members)):
            return False
        ops = {self.onnx.source.nodes[i].op_type for i in unit.instance.nodes}
        if not ops & _ABSORBING[call.kind]:
            return False  # the group does not compute this module's op: not folded into it
        unit.members.insert(0, call)
        self.units[call.key] = unit
        return True

    # -- what a runtime's optimiser fused across modules -----------------------------------------
    def _ancestors(self, key: str) -> set[str]:
        out, call = set(), self.by_key.get(key)
        while call is not None and call.parent is not None:
            out.add(call.parent)
            call = self.by_key.get(call.parent)
        return out

    def _reader(self, value: str) -> tuple[ModuleCall, int] | None:
        """The first module call of a unit whose group reads ``value``, and at which of its
        inputs (the torch tensor it read there is what ``value`` holds)."""
        for index in self.onnx.source.consumers.get(value, []):
            node = self.onnx.source.nodes[index]
            if node_scopes(node) is None:
                continue
            for unit in {id(u): u for u in self.units.values()}.values():
                inputs = unit.instance.inputs
                if (index in unit.instance.nodes and value in inputs
                        and len(inputs) == len(unit.first.inputs)):
                    return unit.first, inputs.index(value)
        return None

    def _join_residual_norms(self) -> None:
        """ONNX Runtime's transformer optimiser fuses a Linear's bias, the residual add after
        it (its parent's code) and the LayerNorm that reads the sum into one unscoped
        SkipLayerNormalization: the Linear's group then ends before its bias, and the
        LayerNorm has no scope. Both are one unit, ``blocks.0.attn.out+blocks.0.ln2``,
        compared on the node's first output (the LayerNorm's, as the next module reads it);
        its sum output is the LayerNorm's own input, a boundary the next such node's segment
        starts from."""
        graph = self.onnx.source
        for key, norm in list(self.missing.items()):
            if not norm.leaf or len(norm.inputs) != 1 or len(norm.outputs) != 1:
                continue
            node = None
            # Its readers, containers included (a pooler's own code slices the last norm's).
            for consumer in [c for c in self.cap.calls if norm.key in c.sources]:
                after = self.units.get(consumer.key)
                if (after is None or after.first is not consumer
                        or len(after.instance.inputs) != len(consumer.sources)):
                    continue
                read = after.instance.inputs[consumer.sources.index(norm.key)]
                candidate = graph.node_of(read)
                if (candidate is not None and candidate.op_type in _RESIDUAL_NORMS
                        and node_scopes(candidate) is None and candidate.output[0] == read):
                    node = candidate
                    break
            if node is None:
                continue
            linears = []
            for value in node.input[:2]:
                for unit in {id(u): u for u in self.units.values()}.values():
                    if (unit.last.leaf and unit.first.kind == "Linear" and len(unit.members) == 1
                            and self._read_outputs(unit) == [value]):
                        linears.append(unit)
            if len(linears) != 1:
                continue  # no Linear, or two: which one's bias the node holds is unknown
            unit = linears[0]
            # The norm reads the residual sum that code around the Linear computed from its
            # output: a container holding the Linear returned it, or (no module returned it
            # yet) the norm's own parent's code, which also holds the Linear, did.
            around = self._ancestors(unit.last.key)
            source = norm.sources[0]
            if not (source in around or source is None and norm.parent in around):
                continue
            self.absorbed.add(tuple(self._read_outputs(unit)))
            unit.members.append(norm)
            unit.outputs = [node.output[0]]
            unit.composite = (f"its parent's residual add runs between {unit.first.path} "
                              f"and {norm.path}")
            if len(node.output) > 3 and node.output[3]:
                unit.extra.append((node.output[3], norm.inputs[0]))
            unit.fused.append(graph.producer[node.output[0]])
            self.units[key] = unit
            del self.missing[key]

    def _pack(self, weight_of: Callable[[str], np.ndarray | None]) -> None:
        """Linear modules without a scope whose weights an unscoped node packs (ONNX Runtime's
        Attention: q, k, v concatenated along the output axis, the attention's own code
        inside): one unit, ``blocks.1.attn.{q,k,v}``, fed what they all read, compared on the
        node's output against what the module after it reads in torch. The members are the
        modules whose weights tile the packed one (packed.pack_order), not guesses from
        names."""
        from onnx import TensorProto, numpy_helper

        graph = self.onnx.source
        groups: dict[tuple, list[ModuleCall]] = {}
        for call in self.missing.values():
            if (call.kind == "Linear" and call.leaf and len(call.inputs) == 1
                    and len(call.sources) == 1 and len(call.outputs) == 1):
                groups.setdefault((call.sources[0], call.parent), []).append(call)
        for (_, parent), calls in groups.items():
            if len(calls) < 2:
                continue
            weights = []
            for call in calls:
                w = weight_of(call.path)
                if w is not None and w.ndim == 2:
                    weights += [(call.key, w.T), (call.key, w)]  # [in, out] and [out, in] layouts
            if not weights:
                continue
            for index, node in enumerate(graph.nodes):
                if node_scopes(node) is not None or not node.input or not node.output:
                    continue
                order = None
                for name in node.input[1:]:
                    init = graph.initializers.get(name)
                    if isinstance(init, TensorProto) and len(init.dims) == 2:
                        order = pack_order(numpy_helper.to_array(init), weights)
                        if order:
                            break
                if not order:
                    continue
                reader = self._reader(node.output[0])
                if reader is None:
                    continue
                # What the module after them reads is their parent's code's (not yet returned
                # by any module: no source), or one of theirs.
                source = reader[0].sources[reader[1]]
                if not (source in {parent, *order}
                        or source is None and reader[0].parent == parent):
                    continue
                members = sorted((self.by_key[k] for k in order), key=lambda c: c.order)
                owner = self.by_key[parent].path if parent in self.by_key else ""
                unit = _Unit(members, ScopeInstance(owner, [index], [node.input[0]],
                                                    [node.output[0]]),
                             outputs=[node.output[0]],
                             tensors=[reader[0].inputs[reader[1]]], packed=True,
                             fused=[index],
                             composite=f"{node.op_type} packs them with their parent's code")
                for member in members:
                    self.units[member.key] = unit
                    self.missing.pop(member.key, None)
                break

    def _explain_missing(self) -> None:
        """Calls left without a scope: listed with the reason; a neighbour whose group of nodes
        may hold their computation is flagged unsure (never silently blamed for it)."""
        for call in self.missing.values():
            name = self.name(call)
            if call.identity:
                self.unaligned.append(Unaligned(
                    self.role, name, "returns its input unchanged (Identity, eval-mode "
                    "Dropout): the graph has no op of its own to compare"))
                continue
            self.unaligned.append(Unaligned(self.role, name, _NO_SCOPE))
            if not call.leaf:
                continue
            source = call.sources[0] if len(call.sources) == 1 else None
            before = self.units.get(source) if source is not None else None
            if (before is not None and before.last.key == source and before.last.leaf
                    and self._sole_consumer(source) is call):
                before.unsure = (f"its output in the graph may already include {name} "
                                 f"({call.kind}), which has no scope of its own")
            for consumer in self.consumers.get(call.key, []):
                after = self.units.get(consumer.key)
                if after is not None and after.first is consumer and set(
                        consumer.sources) == {call.key}:
                    after.unsure = (f"its group of nodes may already include {name} "
                                    f"({call.kind}), which has no scope of its own")

    def _flag_rewritten(self) -> None:
        """A unit whose output a node without any scope reads (a runtime's optimiser fused it
        there: a bias and a residual add into SkipLayerNormalization) may not be computed in
        its group alone: unsure."""
        graph = self.onnx.source
        units = {id(u): u for u in self.units.values()}.values()
        # An unscoped node a unit stands for (a packed Attention, the next residual norm that
        # reads this one's output as its skip) computes that unit, not part of this one.
        claimed = {i for u in units for i in u.fused}
        for unit in units:
            if unit.unsure:
                continue
            for value in self._read_outputs(unit):
                readers = [graph.nodes[i] for i in graph.consumers.get(value, [])
                           if i not in claimed]
                loose = [n for n in readers if node_scopes(n) is None]
                if loose:
                    unit.unsure = (f"its output is read by {loose[0].name or loose[0].op_type} "
                                   f"({loose[0].op_type}), a node without a module scope (fused "
                                   "after export), which may compute part of it")
                    break

    # -- matches --------------------------------------------------------------------------------
    def _read_outputs(self, unit: _Unit) -> list[str]:
        """The unit's ONNX outputs. A group with more values leaving it than torch returns (an
        RMSNorm whose input cast is also read by the residual add) is matched on the one value
        the next modules' groups read, when exactly one is."""
        if unit.outputs is not None:
            return list(unit.outputs)
        outputs = list(unit.instance.outputs)
        if len(unit.last.outputs) != 1 or len(outputs) < 2:
            return outputs
        read = set()
        for consumer in self.consumers.get(unit.last.key, []):
            after = self.units.get(consumer.key)
            if after is not None and after.first is consumer:
                read.update(after.instance.inputs)
        chosen = [v for v in outputs if v in read]
        return chosen if len(chosen) == 1 else outputs

    def matches(self, onnx_cap: dict[str, np.ndarray]) -> list[_Match]:
        """One match per unit, in the order the units finish; a unit whose outputs are those
        of a unit inside it (a Sequential's output is its last child's) is that unit."""
        out: list[_Match] = []
        # A container whose output is a joined unit's former output is that unit's member.
        seen: set[tuple[str, ...]] = set(self.absorbed)
        units = sorted({id(u): u for u in self.units.values()}.values(), key=lambda u: u.order)
        for unit in units:
            instance = unit.instance
            name = self.unit_name(unit)
            outputs = self._read_outputs(unit)
            indices = None
            if len(outputs) != len(unit.torch_outputs):
                indices = _recurrent_outputs(unit, outputs, onnx_cap)
            if len(outputs) != len(unit.torch_outputs) and indices is None:
                self.unaligned.append(Unaligned(
                    self.role, name,
                    f"{len(unit.torch_outputs)} tensor output(s) in torch, "
                    f"{len(outputs)} value(s) leave its scope in ONNX "
                    f"({', '.join(outputs)})"))
                continue
            missing = [v for v in outputs if v not in onnx_cap]
            if missing:
                self.unaligned.append(Unaligned(
                    self.role, name,
                    f"ONNX value(s) {', '.join(missing)} are not produced by the graph that runs "
                    "(renamed or removed when the variant was derived)"))
                continue
            key = tuple(outputs)
            if key in seen:
                continue
            seen.add(key)
            first = unit.first
            shapes_ok = len(instance.inputs) == len(first.inputs) and all(
                v in onnx_cap and onnx_cap[v].shape == t.shape
                for v, t in zip(instance.inputs, first.inputs))
            out.append(_Match(unit, outputs,
                              list(instance.inputs) if shapes_ok else None, indices))
        return out


# Recurrent modules the exporters turn into one ONNX RNN/GRU/LSTM op: torch returns the output
# sequence and the final states, the graph keeps only what something reads.
_RECURRENT = frozenset({"RNN", "GRU", "LSTM"})


def _recurrent_outputs(unit: _Unit, outputs: list[str], onnx_cap: dict[str, np.ndarray]
                       ) -> list[int] | None:
    """For a recurrent module whose scope lets fewer values out than torch returns (its final
    states unread): the torch output each value is, the one of its shape; None where the
    module is not recurrent or a shape does not name exactly one."""
    if unit.last.kind not in _RECURRENT or len(unit.members) != 1:
        return None
    shapes = [t.shape for t in unit.torch_outputs]
    indices = []
    for value in outputs:
        if value not in onnx_cap:
            return None
        same = [j for j, shape in enumerate(shapes) if shape == onnx_cap[value].shape]
        if len(same) != 1 or same[0] in indices:
            return None
        indices.append(same[0])
    return indices


def _output_name(base: str, j: int, n: int) -> str:
    return base if n == 1 else f"{base}.{j}"


def _call_name(call: ModuleCall, torch_cap: TorchCapture, j: int, n: int) -> str:
    calls = sum(1 for c in torch_cap.calls if c.path == call.path)
    return _output_name(call.path if calls == 1 else call.key, j, n)


def align_torch_onnx(torch_side: TorchSide, onnx: OnnxSide, torch_cap: TorchCapture,
                     onnx_cap: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                     torch_is_reference: bool) -> Alignment:
    out = Alignment()
    torch_role = "reference" if torch_is_reference else "primary"
    units = _Units(torch_cap, onnx, torch_role, set(torch_side.submodules),
                   torch_side.weight)
    matches = units.matches(onnx_cap)
    out.unaligned = units.unaligned

    if torch_is_reference:
        # Everything torch computed that has a name in the graph is a boundary the ONNX
        # primary's segments can start from.
        available: dict[str, np.ndarray] = {n: a for n, a in inputs.items()}
        for m in matches:
            if m.unit.unsure:
                continue  # its tensor may be another computation's: no segment starts there
            for v, t in zip(m.outputs, m.tensors):
                available[v] = t
            for v, t in zip(m.inputs or [], m.unit.first.inputs):
                available.setdefault(v, t)
            for v, t in m.unit.extra:
                available.setdefault(v, t)
        boundary = set(available)
        fetch = dtype_fetcher(available, onnx_cap)
    else:
        # What the ONNX reference computed for each matched call: a container run on its own
        # gets its children's reference outputs in place of its children (its own code alone).
        # (A packed unit's tensor is what the module after it reads, no member's output.)
        reference_of = {m.unit.last.key: [onnx_cap[v] for v in m.outputs] for m in matches
                        if m.unit.tensors is None and m.indices is None}
    for m in matches:
        unit = m.unit
        n = len(m.outputs)
        base = units.unit_name(unit)
        for j, value, tensor in zip(m.torch_indices, m.outputs, m.tensors):
            name = _output_name(base, j, n)
            if torch_is_reference:
                def rerun_onnx(value=value) -> tuple[np.ndarray, list[str]]:
                    return onnx.isolate(value, boundary, fetch)

                out.pairings.append(Pairing(name, _kind(unit), unit.first.path, value, tensor,
                                            onnx_cap[value], rerun_onnx,
                                            inputs=list(unit.instance.inputs),
                                            ref_key=f"{unit.last.key}.{j}", unsure=unit.unsure,
                                            modules=_paths(unit)))
            else:
                isolate: Isolator | None = None
                note = ""
                if unit.composite:
                    note = f"not re-run in torch member by member: {unit.composite}"
                elif m.inputs is None:
                    note = "the module's inputs could not be matched to ONNX values"
                else:
                    def rerun_torch(m=m, j=j) -> tuple[np.ndarray, list[str]]:
                        args = [onnx_cap[v] for v in m.inputs]
                        for member in m.unit.members:
                            args = torch_side.run_module(member.path, args, _substitutes(
                                torch_cap, member, reference_of.get))
                        return args[j], []
                    isolate = rerun_torch
                out.pairings.append(Pairing(name, _kind(unit), unit.first.path, value,
                                            onnx_cap[value], tensor, isolate, note,
                                            inputs=list(unit.instance.inputs),
                                            unsure=unit.unsure, modules=_paths(unit)))
    if not torch_is_reference:
        return _reorder_by_graph(out, onnx)
    return out


def _kind(unit: _Unit) -> str:
    return "+".join(m.kind for m in unit.members)


def _paths(unit: _Unit) -> list[str]:
    return list(dict.fromkeys(m.path for m in unit.members))


def _substitutes(cap: TorchCapture, call: ModuleCall,
                 value_of: Callable[[str], list[np.ndarray] | None]
                 ) -> dict[str, list[list[np.ndarray]]] | None:
    """For a container's call: what each call inside it returns instead of computing (the
    other side's tensors, where known), by path, in call order. A call whose tensors are not
    known gets ``[]``: ``run_module`` lets a call compute whose entry does not match its
    outputs."""
    if call.leaf:
        return None
    out: dict[str, list[list[np.ndarray]]] = {}
    known = False
    for inner in cap.descendants(call.key):
        value = value_of(inner.key)
        known = known or value is not None
        out.setdefault(inner.path, []).append(value if value is not None else [])
    return out if known else None


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
    reference_of = {c.key: c.outputs for c in ref_cap.calls}
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
                # A container is judged on its own code: its children return the reference's.
                return prim.run_module(call.path, call.inputs,
                                       _substitutes(ref_cap, call, reference_of.get))[j], []

            out.pairings.append(Pairing(_call_name(call, ref_cap, j, n), call.kind, call.path,
                                        call.key, call.outputs[j], other.outputs[j], isolate,
                                        ref_key=f"{call.key}.{j}", modules=[call.path]))
    ref_keys = {c.key for c in ref_cap.calls}
    out.primary_only = [c.key for c in prim_cap.calls if c.key not in ref_keys]
    return out
