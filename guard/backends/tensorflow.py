"""TensorFlow backend: a SavedModel directory run through one of its signatures (CPU).

``{backend: tensorflow, path: SAVEDMODEL_DIR, options: {signature: serving_default}}``. The
signature's keys name the inputs and outputs (a Keras ``model.export`` names a single unnamed
output ``output_0``). The signature is a concrete function: callable from several threads.

Threads: TensorFlow's pools are process-wide and set once (guard/backends/tf_runtime.py): a
reference asks for ``mirror.threads``, a primary or fallback for ``options.threads``; what the
process runs with is ``describe().details.threads``. No thread comparison for the noise floor
(``threaded`` off): a second instance would share the same pools.

``sha256`` pins the directory by guard's tree digest (every file's path and bytes); TensorFlow
then reads the directory from its path. Tier 2 and the op repair: not offered
(its ``no_activations`` says why).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from guard.backends.base import Backend, BackendInfo, Role
from guard.backends.kind import BackendKind
from guard.backends.tf_runtime import check_pin, import_tensorflow, is_saved_model, tensor_spec
from guard.errors import BackendError

if TYPE_CHECKING:
    from guard.config import BackendConfig


NOT_A_SAVED_MODEL = ("backend 'tensorflow' loads a SavedModel directory (with a saved_model.pb); "
                     "a .keras file is backend 'keras', a .tflite backend 'litert'")


class TensorFlowOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signature: str = Field("serving_default", description="The SavedModel signature to run; "
                           "its input and output keys name the model's tensors.")
    threads: int = Field(0, ge=0, description="TensorFlow intra-op threads for a primary or "
                         "fallback (0: TensorFlow's default); the reference uses mirror.threads. "
                         "Process-wide: the first TensorFlow block loaded sets them.")


class TensorFlowBackend(Backend):
    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = TensorFlowOptions.model_validate(spec.options)
        self.threads = threads if role == "reference" else self.options.threads
        self.function = None
        self._details: dict[str, str] = {}

    def load(self) -> None:
        if not is_saved_model(self.spec.path):
            raise BackendError(f"{self.spec.path}: {NOT_A_SAVED_MODEL}", key="path")
        digest = check_pin(self.spec.path, self.spec.sha256)
        tf, threads = import_tensorflow("tensorflow", self.threads)
        try:
            loaded = tf.saved_model.load(str(self.spec.path))
        except Exception as exc:
            raise BackendError(f"tensorflow cannot load the SavedModel {self.spec.path}: "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
        signatures = dict(loaded.signatures)
        if self.options.signature not in signatures:
            raise BackendError(f"the SavedModel {self.spec.path} has no signature "
                               f"'{self.options.signature}' (it has: "
                               f"{', '.join(sorted(signatures)) or 'none'})",
                               key="options.signature")
        self._loaded = loaded  # the signature's variables live as long as the loaded object
        self.function = signatures[self.options.signature]
        _, kwargs = self.function.structured_input_signature
        self._inputs = tuple(tensor_spec(name, s.dtype.as_numpy_dtype, s.shape.as_list())
                             for name, s in sorted(kwargs.items()))
        outputs = self.function.structured_outputs
        self._outputs = tuple(tensor_spec(name, s.dtype.as_numpy_dtype, s.shape.as_list())
                              for name, s in sorted(outputs.items()))
        self._tf = tf
        self._details = {"version": tf.__version__, "signature": self.options.signature,
                         "threads": threads, "sha256": digest}

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tf = self._tf
        results = self.function(**{name: tf.constant(value) for name, value in inputs.items()})
        return {name: value.numpy() for name, value in results.items()}

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend="tensorflow", artifact=str(self.spec.path), precision=self.spec.precision,
            device=self.spec.device, inputs=self._inputs, outputs=self._outputs,
            details=dict(self._details))

    def close(self) -> None:
        self.function = None
        self._loaded = None


def _check(spec) -> None:
    if spec.device != "cpu":
        raise ValueError("backend 'tensorflow' runs on the CPU here: device must be cpu")
    if Path(spec.path).suffix in (".keras", ".tflite", ".onnx", ".h5"):
        raise ValueError(NOT_A_SAVED_MODEL)


KINDS = {
    "tensorflow": BackendKind(
        name="tensorflow", extra="tensorflow",
        backend=TensorFlowBackend, options=TensorFlowOptions,
        formats=frozenset({"tf_saved_model"}), check=_check,
        no_activations="a SavedModel's signature is one TensorFlow graph function without "
        "Keras layers to capture; compare the .keras it was exported from as a keras block",
    ),
}
