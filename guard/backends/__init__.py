"""Backends behind one interface; heavy libraries are imported only when a backend is built."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from guard.backends.base import Backend, BackendInfo, Role, TensorSpec

if TYPE_CHECKING:
    from guard.config import BackendConfig

# backend name -> "module:class", imported lazily so that `guard config validate` never pays for
# torch or onnxruntime.
_REGISTRY = {
    "onnxruntime": "guard.backends.onnxruntime:OnnxRuntimeBackend",
    "torch": "guard.backends.torch:TorchBackend",
    "torch_compile": "guard.backends.torch:TorchCompileBackend",
    "upstream": "guard.backends.upstream:UpstreamBackend",
    "tensorrt": "guard.backends.tensorrt:TensorRTBackend",
}


def create_backend(spec: "BackendConfig", role: Role, threads: int = 1) -> Backend:
    """Build (not load) the backend for ``spec``. ``threads`` is the reference's CPU budget."""
    module_name, class_name = _REGISTRY[spec.backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(spec, role, threads)


__all__ = ["Backend", "BackendInfo", "Role", "TensorSpec", "create_backend"]
