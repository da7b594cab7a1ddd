"""Keras 3 backend: a ``.keras`` file run on one of Keras's backends (CPU).

``{backend: keras, path: FILE.keras, options: {keras_backend: tensorflow | jax | torch |
openvino}}`` (default tensorflow). A ``.keras`` saved under one Keras backend loads and runs
under the others (measured on small CNNs, MobileNetV2 and ResNet50: <= 7e-5 apart, top-1 equal).

One Keras backend per process: Keras reads ``KERAS_BACKEND`` once, at its first import. The
config refuses two Keras blocks that ask for different backends anywhere in one guard.yaml
(every model's serving blocks share the serving process, every reference and primary the
verifier process), naming both keys; run such models in two guards. A block loaded into a
process where Keras already runs on another backend (a tool that imported Keras itself) is a
load error naming both backends.

Names, as ``model.export`` names them, so that a ``.keras`` and its own SavedModel or LiteRT
conversion agree: inputs by the Keras inputs' names (give ``keras.Input(name=...)``: an
unnamed input's generated name differs between processes), outputs by the output dict's keys,
else ``output_0``, ``output_1``... by position. ``options.output_names: layers`` names them by
Keras's output layer names instead (to pair with a model whose outputs are named so).
``describe().details.output_layers`` reports the mapping.

The file is read once, checked against ``sha256`` and loaded from a private copy of those
bytes (Keras loads from a path); ``safe_mode`` stays on, so a file with lambda layers (Python
bytecode) is refused. ``keras_backend: jax`` needs ``pip install 'jax[cpu]'`` (not part of
``guard[tensorflow]``: with jax installed, ``import tensorflow`` imports jax as well, +140 MB).
Tier 2 captures it (guard/backends/activations/keras.py: against a Keras or torch side,
``options.layer_map`` pairing Keras layers with torch modules); the op repair: not offered.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from guard.backends.artifact import read_artifact
from guard.backends.base import Backend, BackendInfo, Role
from guard.backends.kind import BackendKind
from guard.backends.tf_runtime import NOT_INSTALLED, import_tensorflow, tensor_spec
from guard.errors import BackendError

if TYPE_CHECKING:
    from guard.config import BackendConfig

KerasBackendName = Literal["tensorflow", "jax", "torch", "openvino"]

# What each Keras backend needs besides keras (the import that fails without it).
_BACKEND_PACKAGES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch",
                     "openvino": "openvino"}

_process_lock = threading.Lock()


class KerasOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keras_backend: KerasBackendName = Field(
        "tensorflow", description="The Keras backend the model runs on. Keras chooses it once "
        "per process: every Keras block of one config must name the same.")
    output_names: Literal["export", "layers"] = Field(
        "export", description="How outputs are named: 'export' as model.export names them "
        "(the output dict's keys, else output_0, output_1...), so a .keras agrees with its "
        "own SavedModel and LiteRT conversion; 'layers': by Keras's output layer names.")
    layer_map: dict[str, str] = Field(
        default_factory=dict, description="Tier 2 against a torch side: Keras layer name -> "
        "torch module path, for layers whose names do not match. Unmapped layers match the "
        "torch module whose path equals the layer's name with every '.' read as '_' "
        "(features.0 and features_0).")
    threads: int = Field(0, ge=0, description="keras_backend tensorflow: TensorFlow intra-op "
                         "threads for a primary or fallback (0: TensorFlow's default); the "
                         "reference uses mirror.threads. Process-wide, set once.")


def import_keras(wanted: str, threads: int = 0):
    """The ``keras`` module on backend ``wanted``: set before Keras's first import in this
    process, or checked against the backend it already runs on."""
    import sys

    with _process_lock:
        if "keras" not in sys.modules:
            os.environ["KERAS_BACKEND"] = wanted
        if wanted == "tensorflow":
            import_tensorflow("keras", threads)  # quiet logs and pinned threads first
        try:
            import keras
        except ImportError as exc:
            raise BackendError(_missing(wanted, exc)) from None
    running = keras.backend.backend()
    if running != wanted:
        raise BackendError(
            f"options.keras_backend is '{wanted}' but Keras runs on '{running}' in this process "
            "already (Keras chooses its backend once per process, at its first import); run "
            "this model in a process of its own", key="options.keras_backend")
    return keras


def _missing(wanted: str, exc: ImportError) -> str:
    package = _BACKEND_PACKAGES[wanted]
    if wanted == "jax":
        return "keras_backend 'jax' needs jax: pip install 'jax[cpu]'"
    if getattr(exc, "name", "") in (package, None) or wanted == "tensorflow":
        return NOT_INSTALLED.format(name="keras") + f" (keras_backend '{wanted}': {exc})"
    return f"keras_backend '{wanted}' cannot import: {exc}"


def _names(structure: Any, mode: str, layer_names: list[str] | None) -> list[str]:
    """Output names by the rule of the module docstring, in the order of ``keras.tree``'s
    flattening (a dict's keys sorted, as Keras flattens them)."""
    if isinstance(structure, dict):
        return sorted(structure)
    count = len(structure) if isinstance(structure, (list, tuple)) else 1
    if mode == "layers" and layer_names and len(layer_names) == count:
        return list(layer_names)
    return [f"output_{i}" for i in range(count)]


def _load_model(keras, path: str, data: bytes):
    """The model from a private copy of the checked bytes (Keras loads from a path), with
    ``safe_mode`` on; a model without declared inputs is refused (nothing to name)."""
    with tempfile.TemporaryDirectory(prefix="guard-keras-") as tmp:
        copy = Path(tmp) / Path(path).name
        copy.write_bytes(data)
        try:
            model = keras.saving.load_model(copy, compile=False, safe_mode=True)
        except Exception as exc:
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            raise BackendError(f"keras cannot load {path}: {type(exc).__name__}: {first}") from exc
    try:
        declared = model.inputs
    except Exception:  # a subclassed model that was never called raises here
        declared = None
    if not declared:
        raise BackendError(f"{path} holds a Keras model without declared inputs (a subclassed "
                           "model): guard names tensors by a functional or Sequential model's "
                           "inputs; save one built on keras.Input")
    return model


def _input_specs(model) -> tuple[list[str], tuple]:
    """Input names (a dict input's keys, sorted; else the inputs' own names) and specs."""
    structure = model.input
    if isinstance(structure, dict):
        names = sorted(structure)
        tensors = [structure[name] for name in names]
    else:
        tensors = list(model.inputs)
        names = [t.name for t in tensors]
    return names, tuple(tensor_spec(n, t.dtype, t.shape) for n, t in zip(names, tensors))


def _output_specs(model, mode: str, layer_names: list[str] | None) -> tuple[list[str], tuple]:
    structure = model.output
    names = _names(structure, mode, layer_names)
    flat = ([structure[name] for name in names] if isinstance(structure, dict)
            else list(structure) if isinstance(structure, (list, tuple)) else [structure])
    return names, tuple(tensor_spec(n, t.dtype, t.shape) for n, t in zip(names, flat))


class KerasBackend(Backend):
    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = KerasOptions.model_validate(spec.options)
        self.threads = threads if role == "reference" else self.options.threads
        self.model = None
        self._lock = threading.Lock()
        self._details: dict[str, str] = {}

    def load(self) -> None:
        data, digest = read_artifact(self.spec.path, self.spec.sha256)
        keras = import_keras(self.options.keras_backend, self.threads)
        self.model = _load_model(keras, self.spec.path, data)
        self._input_structure = self.model.input
        self._input_names, self._inputs = _input_specs(self.model)
        layer_names = getattr(self.model, "output_names", None)
        self._output_names, self._outputs = _output_specs(self.model, self.options.output_names,
                                                          layer_names)
        self._details = {"version": keras.__version__,
                         "keras_backend": keras.backend.backend(), "sha256": digest}
        if layer_names:
            self._details["output_layers"] = ",".join(
                f"{name}={layer}" for name, layer in zip(self._output_names, layer_names))
        if self.options.keras_backend == "tensorflow":
            _, self._details["threads"] = import_tensorflow("keras", self.threads)
        # Keras's TensorFlow backend runs a tf.function, callable from several threads; the
        # other backends' predict paths are not documented thread-safe: one call at a time.
        self._serialise = self.options.keras_backend != "tensorflow"
        self._warm_up()

    def _warm_up(self) -> None:
        """One batch-1 call of zeros when the inputs' shapes are known past the batch axis:
        Keras builds its predict function on the first call (not thread-safe), and on the
        OpenVINO backend this compiles the model, whose precision is then reported."""
        if not all(s.shape and all(d >= 0 for d in s.shape[1:]) and s.datatype
                   for s in self._inputs):
            return
        from guard.protocol.tensors import OIP_TO_NUMPY

        zeros = {s.name: np.zeros((1, *s.shape[1:]), OIP_TO_NUMPY[s.datatype])
                 for s in self._inputs}
        try:
            self.infer(zeros)
        except Exception as exc:
            raise BackendError(f"keras cannot run {self.spec.path} on a batch of zeros: "
                               f"{type(exc).__name__}: {exc}") from exc
        compiled = getattr(self.model, "ov_compiled_model", None)  # Keras's OpenVINO trainer
        if compiled is not None:
            # Keras compiles with OpenVINO's default precision: bf16 on a CPU with bf16
            # kernels (avx512_bf16, AMX), where a guard openvino block would pin f32.
            self._details["inference_precision"] = (
                compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())

    def _feed(self, inputs: dict[str, np.ndarray]):
        if isinstance(self._input_structure, dict):
            return {name: inputs[name] for name in self._input_names}
        if isinstance(self._input_structure, (list, tuple)):
            return [inputs[name] for name in self._input_names]
        return inputs[self._input_names[0]]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = self._feed(inputs)
        if self._serialise or not getattr(self, "_warm", False):
            with self._lock:  # the first call builds Keras's predict function
                results = self.model.predict_on_batch(feed)
                self._warm = True
        else:
            results = self.model.predict_on_batch(feed)
        if isinstance(results, dict):
            return {name: np.asarray(results[name]) for name in self._output_names}
        if not isinstance(results, (list, tuple)):
            results = [results]
        return {name: np.asarray(value) for name, value in zip(self._output_names, results)}

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend="keras", artifact=str(self.spec.path), precision=self.spec.precision,
            device=self.spec.device, inputs=self._inputs, outputs=self._outputs,
            details=dict(self._details))

    def close(self) -> None:
        self.model = None


def _check(spec) -> None:
    if spec.device != "cpu":
        raise ValueError("backend 'keras' runs on the CPU here: device must be cpu")
    if not spec.path.endswith(".keras"):
        raise ValueError("backend 'keras' loads a Keras 3 file (.keras); a SavedModel "
                         "directory is backend 'tensorflow', a .tflite backend 'litert'")


def check_config(config) -> None:
    """Every Keras block of one config on one Keras backend (one per process): the first two
    that differ are named."""
    first: tuple[str, str] | None = None
    for i, model in enumerate(config.models):
        for role in ("primary", "reference", "fallback"):
            spec = getattr(model, role)
            if spec is None or spec.backend != "keras":
                continue
            wanted = spec.options.get("keras_backend", "tensorflow")
            key = f"models[{i}].{role}.options.keras_backend"
            if first is None:
                first = (key, wanted)
            elif wanted != first[1]:
                raise ValueError(
                    f"{key} is '{wanted}' but {first[0]} is '{first[1]}': Keras runs on one "
                    "backend per process, and one guard loads these blocks into one process; "
                    "name the same keras_backend, or run the models in two guards")


KINDS = {
    "keras": BackendKind(
        name="keras", extra="tensorflow", backend=KerasBackend, options=KerasOptions,
        formats=frozenset({"keras"}), check=_check, check_config=check_config,
        activations="guard.backends.activations.keras:keras_side",
    ),
}
