"""What the TensorFlow-family backends (``tensorflow``, ``keras``, ``litert``) share: importing
TensorFlow quietly with its threads pinned, the digest of a SavedModel directory, dtype names.

``import tensorflow`` costs ~5 s and 650-800 MB of resident memory, and is process-wide in two
ways that matter here:

- TensorFlow's intra- and inter-op thread pools are created once, by the first op; their sizes
  cannot change afterwards. The first TensorFlow block loaded in a process sets them (a
  reference: its ``mirror.threads``; a primary or fallback: its ``options.threads``, 0 leaving
  TensorFlow's default); a later block that asks for another count runs with the pools as
  they are, and its ``describe()`` says so (``details.threads``).
- Its C++ logging: ``TF_CPP_MIN_LOG_LEVEL`` is read at import. guard sets it to 2 (errors
  only) unless the environment says otherwise; TensorFlow's "could not find cuda drivers"
  on a CPU-only machine is harmless either way.

Nothing here imports TensorFlow at module level: this module is imported by the backends'
modules, which the config validation imports.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from guard.errors import BackendError, install_hint
from guard.protocol.tensors import TensorSpec, oip_datatype

NOT_INSTALLED = ("backend '{name}' needs TensorFlow: "
                 + install_hint("tensorflow", "tensorflow, keras, ai-edge-litert, tf2onnx"))

_lock = threading.Lock()
_threads: tuple[int, int] | None = None  # (intra, inter) as pinned in this process


def quiet_environment() -> None:
    """Set before TensorFlow is imported: C++ logs at errors only (unless the user chose)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def import_tensorflow(name: str, threads: int = 0):
    """The ``tensorflow`` module, imported with quiet logs and, the first time in a process,
    ``threads`` intra-op threads and one inter-op thread (``threads`` 0: TensorFlow's own
    defaults). Returns ``(tf, threads_note)``: what the process's pools are, for describe()."""
    global _threads
    quiet_environment()
    try:
        import tensorflow as tf
    except ImportError:
        raise BackendError(NOT_INSTALLED.format(name=name)) from None
    with _lock:
        if _threads is None and threads > 0:
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(1)
                _threads = (threads, 1)
            except RuntimeError:  # TensorFlow ran an op already (another library's use)
                _threads = (0, 0)
        elif _threads is None:
            _threads = (0, 0)
        intra, inter = _threads
    pinned = f"intra {intra}, inter {inter}" if intra else "tensorflow's default"
    if threads and intra != threads:
        pinned += f" (asked {threads}: TensorFlow's thread pools are process-wide, set once)"
    return tf, pinned


def tree_sha256(path: str | Path) -> str:
    """sha256 of an artifact: a file's bytes, or a directory's files (a SavedModel) as the
    sorted list of ``relative path, sha256 of its bytes`` lines."""
    path = Path(path)
    if path.is_file():
        return _file_sha256(path)
    if not path.is_dir():
        raise BackendError(f"cannot read {path}: no such file or directory")
    lines = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        lines.append(f"{file.relative_to(path).as_posix()} {_file_sha256(file)}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        raise BackendError(f"cannot read {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def check_pin(path: str | Path, sha256: str | None) -> str:
    """The artifact's digest (``tree_sha256``); a pinned one that differs is an error keyed
    ``sha256``. TensorFlow reads a SavedModel from its path, after this check: whoever can
    write the directory between the two can change what loads (a .keras and a .tflite are
    loaded from the bytes checked instead)."""
    digest = tree_sha256(path)
    if sha256 is not None and digest != sha256:
        raise BackendError(f"{path} has sha256 {digest}, the config expects {sha256} (for a "
                           "directory: the digest guard's tree_sha256 computes; see "
                           "docs/backends-tensorflow.md)", key="sha256")
    return digest


def is_saved_model(path: str | Path) -> bool:
    return (Path(path) / "saved_model.pb").is_file()


def tensor_spec(name: str, dtype, shape) -> TensorSpec:
    """A TensorSpec from a numpy-convertible dtype and a shape with None/-1 for any size."""
    try:
        datatype = oip_datatype(np.dtype(dtype))
    except TypeError:
        datatype = ""
    dims = tuple(-1 if d is None or int(d) < 0 else int(d) for d in (shape or ()))
    return TensorSpec(name, datatype, dims)
