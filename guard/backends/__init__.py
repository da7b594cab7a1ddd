"""Backends behind one interface; heavy libraries are imported only when a backend is built.

The one registration: a backend name and the module that declares it (``KINDS`` there, see
guard/backends/kind.py). Modules are imported when a config names their backend, so that
`guard config validate` never pays for torch or onnxruntime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from guard.backends.base import Backend, BackendInfo, Forwarding, Role, TensorSpec
from guard.backends.kind import BackendKind

if TYPE_CHECKING:
    from guard.config import BackendConfig

BACKEND_MODULES: dict[str, str] = {
    "keras": "guard.backends.keras",
    "litert": "guard.backends.litert",
    "llama_cpp": "guard.backends.llama_cpp",
    "onnxruntime": "guard.backends.onnxruntime",
    "openai": "guard.backends.openai",
    "openvino": "guard.backends.openvino",
    "tensorflow": "guard.backends.tensorflow",
    "tensorrt": "guard.backends.tensorrt",
    "torch": "guard.backends.torch",
    "torch_compile": "guard.backends.torch",
    "transformers": "guard.backends.transformers",
    "upstream": "guard.backends.upstream",
}
BACKEND_NAMES: tuple[str, ...] = tuple(sorted(BACKEND_MODULES))


def backend_kind(name: str) -> BackendKind:
    """The declaration of backend ``name`` (KeyError for a name nobody registered)."""
    return importlib.import_module(BACKEND_MODULES[name]).KINDS[name]


def backend_kinds() -> dict[str, BackendKind]:
    """Every declaration, by name (imports every backend module: not for the request path)."""
    return {name: backend_kind(name) for name in BACKEND_NAMES}


def create_backend(spec: "BackendConfig", role: Role, threads: int = 1) -> Backend:
    """Build (not load) the backend for ``spec``. ``threads`` is the reference's CPU budget."""
    return backend_kind(spec.backend).backend(spec, role, threads)


__all__ = ["BACKEND_NAMES", "Backend", "BackendInfo", "BackendKind", "Forwarding", "Role",
           "TensorSpec", "backend_kind", "backend_kinds", "create_backend"]
