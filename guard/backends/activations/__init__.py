"""Capturing a model's intermediate tensors (activations): a backend capability.

Tier 2 (guard/verify/activation/) compares what a capture hands it; how a backend's
computation is hooked is the backend's own knowledge, kept here beside it, as Polygraphy's
runners do: ``torch`` (forward hooks on an eager module), ``compiled`` (hooks compiled into a
``torch.compile`` graph), ``onnx`` (every node output of a private copy of the graph, ONNX
Runtime), ``openvino`` (the same graph compiled by OpenVINO), ``keras`` (every layer call of a
Keras 3 model). ``scopes`` reads which torch modules an exported ONNX node came from.

A backend declares its capture in its ``KINDS`` (``BackendKind.activations``, a
``"module:function"`` imported only when a side is built); nothing heavy is imported here.
"""

from __future__ import annotations

from typing import Callable

from guard.errors import GuardError


class CaptureUnsupported(GuardError):
    """This side cannot be captured as configured; the message says what to configure."""


def capturable() -> frozenset[str]:
    """The backend names whose activations can be captured (their declarations say so)."""
    from guard.backends import backend_kinds

    return frozenset(name for name, kind in backend_kinds().items() if kind.activations)


def capture_side(backend: str) -> Callable | None:
    """The builder of ``backend``'s capture side, or None: it declares no capture."""
    from guard.backends import BACKEND_NAMES, backend_kind
    from guard.backends.kind import load_ref

    if backend not in BACKEND_NAMES:
        return None
    ref = backend_kind(backend).activations
    return load_ref(ref) if ref else None
