"""LiteRT backend (``ai-edge-litert``'s interpreter, CPU with XNNPACK): a ``.tflite`` file, or a
SavedModel / ``.keras`` converted by guard itself.

``{backend: litert, path: FILE.tflite}`` runs the file as it is (``precision: fp32``, whatever
the file holds). ``{backend: litert, path: SAVEDMODEL_DIR or FILE.keras, precision: fp32 |
fp16 | int8}`` converts with TensorFlow's converter in a child process and caches the result by
digest (guard/backends/tf_convert.py): fp16 weights; int8 dynamic-range by default, full int8
(float inputs and outputs) calibrated on ``options.calibration_inputs``. Deriving it itself, guard
knows how the variant was made. Measured drift against the fp32 model: fp32 5e-6 to 5e-5, fp16
weights 1.3e-3 to 0.1, dynamic-range int8 0.10 to 0.63, full int8 0.34 to 1.56 (logits of scale
7-9).

Names: the signature's keys (``options.signature``, default ``serving_default``, or the
file's only signature), as in the SavedModel it came from; a ``.tflite`` without signatures is
named by its raw tensor names (``serving_default_x:0``). The interpreter is not thread-safe:
one per calling thread, built from the same bytes, ``options.threads`` each (the reference:
``mirror.threads``). Only the interpreter is imported to run (0.3 s, ~40 MB); TensorFlow only
in the converting child, on a cache miss. Tier 2 and the op repair: not offered
(its ``no_activations`` says why).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from guard.backends.artifact import read_artifact
from guard.backends.base import Backend, BackendInfo, Role
from guard.backends.kind import BackendKind
from guard.backends.tf_runtime import tensor_spec
from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from guard.config import BackendConfig

NOT_INSTALLED = ("backend 'litert' needs the LiteRT interpreter: "
                 + install_hint("tensorflow", "ai-edge-litert"))


class LiteRtOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signature: str | None = Field(
        None, description="The signature to run; default serving_default, or the file's only "
        "signature. Its keys name the model's tensors.")
    threads: int = Field(0, ge=0, description="Interpreter threads for a primary or fallback "
                         "(0: LiteRT's default); the reference uses mirror.threads.")
    calibration_inputs: str | None = Field(
        None, description="precision int8 of a SavedModel or .keras: an .npz of real inputs "
        "(one array per input name, first axis = samples) for full integer quantisation; "
        "without it, dynamic-range int8 (int8 weights). Absolute, or relative to the working "
        "folder.")


def _interpreter_class():
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise BackendError(NOT_INSTALLED) from None
    return Interpreter


class LiteRtBackend(Backend):
    def __init__(self, spec: "BackendConfig", role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = LiteRtOptions.model_validate(spec.options)
        self.threads = threads if role == "reference" else self.options.threads
        self._local = threading.local()
        self._content: bytes | None = None
        self._artifact = str(spec.path)
        self._details: dict[str, str] = {}

    def load(self) -> None:
        Interpreter = _interpreter_class()
        if self.spec.path.endswith(".tflite"):
            self._content, digest = read_artifact(self.spec.path, self.spec.sha256)
        else:
            from guard.backends.tf_convert import derive

            derived = derive(self.spec.path, self.spec.precision, self.options.calibration_inputs,
                             sha256=self.spec.sha256)
            self._artifact = str(derived)
            self._content, digest = read_artifact(derived, None)
        self._Interpreter = Interpreter
        try:
            interpreter = self._interpreter()
        except Exception as exc:
            raise BackendError(f"litert cannot load {self._artifact}: {type(exc).__name__}: "
                               f"{exc}") from exc
        signatures = interpreter.get_signature_list()
        self.signature = self._choose(signatures)
        if self.signature is not None:
            runner = interpreter.get_signature_runner(self.signature)
            self._inputs = tuple(_spec(name, d) for name, d in
                                 sorted(runner.get_input_details().items()))
            self._outputs = tuple(_spec(name, d) for name, d in
                                  sorted(runner.get_output_details().items()))
        else:
            self._inputs = tuple(_spec(d["name"], d) for d in interpreter.get_input_details())
            self._outputs = tuple(_spec(d["name"], d) for d in interpreter.get_output_details())
        self._details = {"sha256": digest, "signature": self.signature or "(none: raw tensors)",
                         "threads": str(self.threads) if self.threads > 0 else "litert default",
                         "derived": self._derivation()}

    def _derivation(self) -> str:
        if self.spec.path.endswith(".tflite"):
            return "as given"
        if self.spec.precision == "int8":
            return ("full int8, calibrated" if self.options.calibration_inputs
                    else "dynamic-range int8 (int8 weights)")
        return {"fp16": "float16 weights", "fp32": "fp32"}[self.spec.precision]

    def _choose(self, signatures: dict) -> str | None:
        wanted = self.options.signature
        if wanted is not None:
            if wanted not in signatures:
                raise BackendError(f"{self._artifact} has no signature '{wanted}' (it has: "
                                   f"{', '.join(sorted(signatures)) or 'none'})",
                                   key="options.signature")
            return wanted
        if "serving_default" in signatures:
            return "serving_default"
        if len(signatures) == 1:
            return next(iter(signatures))
        if signatures:
            raise BackendError(f"{self._artifact} has signatures {', '.join(sorted(signatures))}: "
                               "name one with options.signature", key="options.signature")
        return None

    def _interpreter(self):
        return self._Interpreter(model_content=self._content,
                                 num_threads=self.threads if self.threads > 0 else None)

    def _local_runner(self):
        """This thread's interpreter (and signature runner): LiteRT's are not thread-safe."""
        runner = getattr(self._local, "runner", None)
        if runner is None:
            interpreter = self._interpreter()
            if self.signature is not None:
                runner = interpreter.get_signature_runner(self.signature)
            else:
                interpreter.allocate_tensors()
                runner = interpreter
            self._local.runner = runner
        return runner

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        runner = self._local_runner()
        if self.signature is not None:
            return dict(runner(**inputs))  # get_tensor copies: safe past the next call
        return _invoke_raw(runner, inputs)

    def describe(self) -> BackendInfo:
        return BackendInfo(
            backend="litert", artifact=self._artifact, precision=self.spec.precision,
            device=self.spec.device, inputs=self._inputs, outputs=self._outputs,
            details=dict(self._details))

    def close(self) -> None:
        self._local = threading.local()
        self._content = None


def _spec(name: str, detail: dict):
    shape = detail.get("shape_signature")
    if shape is None or len(shape) == 0:
        shape = detail["shape"]
    return tensor_spec(name, detail["dtype"], [int(d) for d in shape])


def _invoke_raw(interpreter, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A file without signatures: tensors by their raw names, resized to the request."""
    details = interpreter.get_input_details()
    resized = False
    for detail in details:
        value = inputs[detail["name"]]
        if tuple(detail["shape"]) != value.shape:
            interpreter.resize_tensor_input(detail["index"], value.shape)
            resized = True
    if resized:
        interpreter.allocate_tensors()
    for detail in details:
        interpreter.set_tensor(detail["index"], inputs[detail["name"]])
    interpreter.invoke()
    return {d["name"]: interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()}


def _check(spec) -> None:
    if spec.device != "cpu":
        raise ValueError("backend 'litert' runs on the CPU here: device must be cpu")
    path = Path(spec.path)
    if path.suffix == ".tflite":
        if spec.precision != "fp32":
            raise ValueError(f"precision {spec.precision} converts a SavedModel or a .keras; a "
                             ".tflite runs as it is (precision fp32, whatever it holds)")
        if spec.options.get("calibration_inputs"):
            raise ValueError("options.calibration_inputs is for precision int8 of a SavedModel "
                             "or a .keras")
        return
    if path.suffix not in ("", ".keras"):
        raise ValueError("backend 'litert' loads a .tflite, or converts a SavedModel directory "
                         "or a .keras file")
    if spec.options.get("calibration_inputs") and spec.precision != "int8":
        raise ValueError("options.calibration_inputs is for precision int8")


KINDS = {
    "litert": BackendKind(
        name="litert", extra="tensorflow", backend=LiteRtBackend, options=LiteRtOptions,
        precisions=frozenset({"fp32", "fp16", "int8"}),
        formats=frozenset({"tflite", "tf_saved_model", "keras"}),
        check=_check, threaded=True,
        no_activations="LiteRT's interpreter runs fused kernels (a convolution with its "
        "activation) and can run no single op on given tensors, so no layer could be isolated; "
        "compare the .keras it came from as a keras block",
    ),
}
