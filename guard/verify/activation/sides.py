"""Which backends tier 2 can capture, and the function that builds each one's capture side.

Tier 2 owns this table: a backend module declares what the backend is (guard/backends/kind.py)
and knows nothing of the checks; the capture code of a backend lives here beside tier 2
(``onnx_side``, ``torch_side``, ``openvino_side``), keyed by the backend's config name. A
builder takes ``(spec, role, config, threads, run_path, label)`` and returns a side; it is
imported only when a side is built. A backend absent here (``upstream``, ``tensorrt``: an
engine's layers cannot be read) cannot be captured; the op repair captures a copy in its place
where the backend declares one (``BackendKind.capture_as``).

``torch_compile`` is captured through hooks compiled into its graph (compiled_side.py), and only
beside a torch side (``PAIRED_WITH``): its calls align by module path; against an ONNX graph the
exporter's folds are told from tensor identities, which the compiled capture's clones lack.

A Keras side aligns by Keras layer name with a Keras, torch or ONNX side (keras_align.py; an
ONNX graph by tf2onnx's node scopes). ``litert`` and ``tensorflow`` are not captured;
``NOT_CAPTURED`` says why, and the config error repeats it.
"""

from __future__ import annotations

from typing import Callable

from guard.backends.kind import load_ref

SIDES: dict[str, str] = {
    "keras": "guard.verify.activation.keras_side:keras_side",
    "onnxruntime": "guard.verify.activation.onnx_side:onnxruntime_side",
    "openvino": "guard.verify.activation.openvino_side:openvino_side",
    "torch": "guard.verify.activation.torch_side:torch_side",
    "torch_compile": "guard.verify.activation.compiled_side:torch_compile_side",
}
# Backends captured only beside one of these on the other side of the pair.
PAIRED_WITH: dict[str, frozenset[str]] = {"torch_compile": frozenset({"torch", "torch_compile"})}

# Why a backend of the TensorFlow family is not captured (the config error's reason).
NOT_CAPTURED: dict[str, str] = {
    "litert": "LiteRT's interpreter runs fused kernels (a convolution with its activation) and "
              "can run no single op on given tensors, so no layer could be isolated; compare "
              "the .keras it came from as a keras block",
    "tensorflow": "a SavedModel's signature is one TensorFlow graph function without Keras "
                  "layers to capture; compare the .keras it was exported from as a keras "
                  "block",
}


def capturable() -> frozenset[str]:
    """The backend names tier 2 can capture (config validation reads this)."""
    return frozenset(SIDES)


def capture_side(backend: str) -> Callable | None:
    """The builder of ``backend``'s capture side, or None: tier 2 cannot capture it."""
    ref = SIDES.get(backend)
    return load_ref(ref) if ref else None

