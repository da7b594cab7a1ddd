"""Keras side of tier 2: every layer call's outputs, captured by a model over them.

Capture: the ``.keras`` file is loaded again for tier 2 alone (never the serving model), and a
second functional model is built over that copy, its outputs every tensor each layer call of the
graph returns (``keras.Model(model.inputs, [...])``: the layers and weights are the copy's, the
serving model is neither changed nor called). One call of it gives every layer's outputs; each
layer call's inputs are the outputs of the calls it reads (or the model's inputs), as the
functional graph records them.

The graph is read as Keras itself runs it: the functional model's nodes by depth
(``Function._nodes_by_depth``) and each node's recorded arguments (``node.arguments.fill_in``),
Keras 3 internals (guard[tensorflow] takes ``keras>=3.15,<4``; the tests exercise them).

Names: a layer call is its Keras layer name (``conv2``); a layer called more than once in the
graph (a shared layer) has calls ``name#0``, ``name#1`` in graph order. A nested model (a
``Sequential`` used as a layer) is one layer: its inner layers are not captured.

Isolation: a layer's isolated output is its primary computation fed the reference's tensors.
Here that is a *segment*, as on ONNX: the layer calls that compute the layer's outputs, walked
back from it until tensors the other side also has (an aligned layer's outputs, or the model's
inputs), run eagerly one call at a time as the functional model runs them. A port's own layers
without a counterpart on the other side (a ``ZeroPadding2D`` in front of a ``valid``
convolution, a ``Permute`` to NHWC) are part of the segment of the next aligned layer, so a
layer is judged on the input the reference's graph feeds it: a stride-2 convolution written
``padding="same"`` where torch pads 1 on every side shows its own error there.

Tier 2 captures Keras on its tensorflow, jax and torch backends (eager calls; tensorflow and
jax are tested, torch is not); ``keras_backend: openvino`` compiles whole models only and is
refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.backends.activations.torch import CaptureUnsupported
from guard.backends.base import Role


@dataclass
class KerasCall:
    """One call of a layer (one node of the functional graph)."""

    name: str  # the layer's name
    index: int  # 0 for the layer's first call in this graph, 1 for the second...
    kind: str  # the layer's class name
    node: Any  # keras Node (keras is untyped): its arguments replay the call
    inputs: list[int]  # ids of the KerasTensors it reads (model inputs or other calls' outputs)
    outputs: list[int]  # ids of the KerasTensors it returns, flattened
    order: int  # position in graph (topological) order

    @property
    def key(self) -> str:
        return f"{self.name}#{self.index}"


@dataclass
class KerasCapture:
    """One run: every tensor of the graph by KerasTensor id (model inputs included)."""

    values: dict[int, np.ndarray] = field(default_factory=dict)


class KerasSide:
    """A private copy of a Keras model, its graph read once."""

    kind = "keras"

    def __init__(self, keras, model, input_names: list[str], label: str = "keras",
                 layer_map: dict[str, str] | None = None):
        self.keras = keras
        self.label = label
        self.model = model
        self.input_names = input_names
        self.layer_map = dict(layer_map or {})
        self.precision = "fp32"
        self._input_ids = [id(t) for t in model.inputs]
        self.input_of = dict(zip(self._input_ids, input_names))  # tensor id -> input name
        self.calls: list[KerasCall] = []
        self.shapes: dict[int, tuple] = {}  # tensor id -> its symbolic shape
        self.dtypes: dict[int, str] = {}
        for tensor in model.inputs:
            self.shapes[id(tensor)] = tuple(tensor.shape)
            self.dtypes[id(tensor)] = str(tensor.dtype)
        counts: dict[str, int] = {}
        for depth in sorted(model._nodes_by_depth, reverse=True):  # the graph's own order
            for node in model._nodes_by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                name = node.operation.name
                index = counts.get(name, 0)
                counts[name] = index + 1
                outputs = list(node.outputs)
                for tensor in outputs:
                    self.shapes[id(tensor)] = tuple(tensor.shape)
                    self.dtypes[id(tensor)] = str(tensor.dtype)
                self.calls.append(KerasCall(
                    name, index, type(node.operation).__name__, node,
                    [id(t) for t in node.input_tensors], [id(t) for t in outputs],
                    len(self.calls)))
        self.counts = counts
        self.by_key = {call.key: call for call in self.calls}
        self.producer = {t: call for call in self.calls for t in call.outputs}
        self._tensors = [t for call in self.calls for t in call.node.outputs]
        # The model over every layer call's outputs, on this copy's layers.
        self.capture_model = keras.Model(model.inputs, self._tensors, name="guard_capture")

    def call_name(self, call: KerasCall) -> str:
        """``conv2``, or ``conv2#1`` for a layer the graph calls more than once."""
        return call.name if self.counts.get(call.name, 1) == 1 else call.key

    def layer_kind(self, call: KerasCall) -> str:
        return call.kind

    # -- capture --------------------------------------------------------------------------------
    def _feed(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing inputs: {', '.join(missing)}")
        return [np.asarray(inputs[n]) for n in self.input_names]

    def capture(self, inputs: dict[str, np.ndarray]) -> KerasCapture:
        feed = self._feed(inputs)
        results = self.capture_model(feed, training=False)
        if not isinstance(results, (list, tuple)):
            results = [results]
        capture = KerasCapture()
        for tensor_id, array in zip(self._input_ids, feed):
            capture.values[tensor_id] = array
        for tensor, value in zip(self._tensors, results):
            capture.values[id(tensor)] = self._numpy(value)
        return capture

    def _numpy(self, value) -> np.ndarray:
        return np.array(self.keras.ops.convert_to_numpy(value), copy=True)

    def tensors(self, inputs: dict[str, np.ndarray],
                threads: int | None = None) -> dict[str, np.ndarray]:
        """Every call's outputs by ``name#index.j`` (tier 2's per-layer noise). ``threads`` is
        not applied: TensorFlow's thread pools are process-wide and set once."""
        capture = self.capture(inputs)
        return {f"{call.key}.{j}": capture.values[t] for call in self.calls
                for j, t in enumerate(call.outputs)}

    def outputs_of(self, call: KerasCall, capture: KerasCapture) -> list[np.ndarray]:
        return [capture.values[t] for t in call.outputs]

    # -- isolation ------------------------------------------------------------------------------
    def segment(self, target: KerasCall, boundary: set[int]) -> tuple[list[KerasCall], list[int]]:
        """The calls that compute ``target``'s outputs from ``boundary`` tensors, in graph
        order, and the boundary tensors they read. Raises KeyError when the walk reaches a
        model input the boundary lacks."""
        members: dict[str, KerasCall] = {}
        needed: list[int] = []
        stack = [target]
        while stack:
            call = stack.pop()
            if call.key in members:
                continue
            members[call.key] = call
            for tensor in call.inputs:
                if tensor in boundary:
                    if tensor not in needed:
                        needed.append(tensor)
                elif tensor in self.producer:
                    stack.append(self.producer[tensor])
                else:
                    raise KeyError(f"the segment of {self.call_name(target)} reaches the model "
                                   f"input '{self.input_of.get(tensor, tensor)}', which the "
                                   "other side does not provide")
        return sorted(members.values(), key=lambda c: c.order), needed

    def run_segment(self, calls: list[KerasCall], feeds: dict[int, np.ndarray]
                    ) -> dict[int, np.ndarray]:
        """Run ``calls`` (graph order) eagerly on ``feeds`` (tensor id -> array), as the
        functional model runs its nodes; returns every tensor computed, by id."""
        values = {t: self._cast(t, a) for t, a in feeds.items()}
        computed: dict[int, np.ndarray] = {}
        for call in calls:
            args, kwargs = call.node.arguments.fill_in(values)
            if "training" in _call_arguments(call.node.operation):
                kwargs = {**kwargs, "training": False}
            result = call.node.operation(*args, **kwargs)
            flat = self.keras.tree.flatten(result)
            for tensor, value in zip(call.outputs, flat):
                values[tensor] = value
                computed[tensor] = self._numpy(value)
        return computed

    def _cast(self, tensor: int, array: np.ndarray):
        dtype = self.dtypes.get(tensor)
        array = np.asarray(array)
        if dtype and array.dtype != np.dtype(dtype):
            array = array.astype(dtype)
        return self.keras.ops.convert_to_tensor(array)

    def close(self) -> None:
        self.capture_model = None
        self.model = None
        self.calls = []
        self.by_key.clear()
        self.producer.clear()


def _call_arguments(operation) -> tuple[str, ...]:
    import inspect

    try:
        return tuple(inspect.signature(operation.call).parameters)
    except (TypeError, ValueError, AttributeError):
        return ()


def keras_side(spec, role: Role, config, threads: int = 1, run_path=None,
               label: str = "keras") -> KerasSide:
    """Tier 2's side for a keras block (declared as its ``activations`` in
    guard/backends/keras.py): the ``.keras`` loaded again as the backend loads it (digest
    checked, ``safe_mode``), and the capture model built over that copy."""
    from guard.backends.keras import KerasBackend, KerasOptions

    options = KerasOptions.model_validate(spec.options)
    if options.keras_backend == "openvino":
        raise CaptureUnsupported(
            f"{label}: tier 2 runs Keras layers one at a time, which keras_backend 'openvino' "
            "cannot (it compiles whole models); capture the same .keras on keras_backend "
            "tensorflow, or compare it as an openvino block of its ONNX conversion")
    backend = KerasBackend(spec.model_copy(), role, threads)
    backend.load()
    # A Sequential runs a functional model of its layers (built when the model was).
    model = getattr(backend.model, "_functional", None) or backend.model
    if not hasattr(model, "_nodes_by_depth"):
        raise CaptureUnsupported(
            f"{label}: tier 2 reads the layers of a functional or Sequential Keras model; "
            f"{spec.path} holds a {type(model).__name__}")
    from guard.backends.keras import import_keras

    keras = import_keras(options.keras_backend, backend.threads)
    names = [s.name for s in backend.describe().inputs]
    return KerasSide(keras, model, names, label=label, layer_map=options.layer_map)
