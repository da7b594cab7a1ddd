"""Artifacts as backends load them: read once, pinned by sha256 on the very bytes loaded.

A ``sha256`` in a backend block is checked here, by the backend's ``load``, on the bytes it then
hands to the runtime (never on a path that is opened again later: the file could change in
between). Where a runtime can only read a path, the backend says so beside the call.

Formats whose loader can unpickle (run code from the file) are loaded only when pinned: a
``.pt2`` goes through ``torch.export.load``, which unpickles parts of the archive. TorchScript
(``.pt``) is read by TorchScript's own C++ loader and ONNX is a protobuf: neither runs Python.
The config refuses an unpinned ``.pt2`` already (guard/config/backend.py); ``require_pin``
holds the rule for backends built without a config file (``guard matrix``, tests, tools).

Factories (``package.module:function``) are code, not artifacts: imported with the config
file's folder *appended* to ``sys.path``, so a file in that folder cannot shadow an installed
module or the standard library.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from pathlib import Path
from typing import Any, Callable

from guard.errors import BackendError

# Suffix -> why a pin is required.
PICKLE_FORMATS = {
    ".pt2": "a torch.export program (.pt2) is loaded with torch.export.load, which can "
            "unpickle, i.e. run code from the file",
}


def pin_required(path: str | None) -> str:
    """Why ``path`` must be pinned by sha256, or '' when it need not be."""
    return PICKLE_FORMATS.get(Path(path).suffix, "") if path else ""


def require_pin(path: str, sha256: str | None) -> None:
    why = pin_required(path)
    if why and sha256 is None:
        raise BackendError(f"required for {Path(path).name}: {why}; pin the file with "
                           "sha256: <hex digest> (sha256sum FILE)", key="sha256")


def read_artifact(path: str | Path, sha256: str | None) -> tuple[bytes, str]:
    """The file's bytes and their sha256, read once; a pinned digest that differs is an error
    keyed ``sha256``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BackendError(f"cannot read {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise BackendError(f"{path} has sha256 {digest}, the config expects {sha256}",
                           key="sha256")
    return data, digest


def import_factory(ref: str, base_dir: Path | str | None) -> Callable[..., Any]:
    """The callable ``package.module:function``, importable from ``base_dir`` (appended to
    ``sys.path``). Raises ImportError or AttributeError; callers say which factory."""
    module_name, func_name = ref.split(":")
    if base_dir is not None and str(base_dir) not in sys.path:
        sys.path.append(str(base_dir))
    return getattr(importlib.import_module(module_name), func_name)
