"""The one interface every backend implements (Polygraphy's runner idea).

A backend turns a dict of named numpy arrays into a dict of named numpy arrays. It knows nothing
about gRPC, sampling or checks: the data plane and the verifier are written against this class
only, so a new backend is one new module.

Roles matter for one thing: a backend built as the *reference* pins determinism (fixed threads,
deterministic algorithms, sequential execution, TF32 off), because its answers are the truth the
others are judged by. Primary and fallback run as configured.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Role = Literal["primary", "reference", "fallback"]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: OIP datatype name (``FP32``...) and shape with -1 for any size."""

    name: str
    datatype: str = ""  # "" when the backend cannot tell (e.g. TorchScript without metadata)
    shape: tuple[int, ...] = ()  # () with datatype "" means unknown


@dataclass(frozen=True)
class BackendInfo:
    """What ``describe()`` returns: enough for OIP ModelMetadata and for logs and events."""

    backend: str
    artifact: str
    precision: str
    device: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    details: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        return f"{self.backend}/{self.precision}/{self.device} {self.artifact}"


class Backend(abc.ABC):
    """Load once, infer many times from any thread, close once."""

    @abc.abstractmethod
    def load(self) -> None:
        """Build the session/module. May take seconds (derivation, compilation)."""

    @abc.abstractmethod
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one inference. Must be safe to call from several threads at once."""

    @abc.abstractmethod
    def describe(self) -> BackendInfo:
        """Inputs, outputs and what was loaded; valid after ``load()``."""

    def close(self) -> None:
        """Release sessions and memory. Default: nothing to release."""


# OIP datatype names <-> numpy dtypes. BF16 and BYTES have no numpy tensor form a backend here
# computes with: they are rejected by the data plane with a clear message.
OIP_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_OIP: dict[np.dtype, str] = {v: k for k, v in OIP_TO_NUMPY.items()}


def oip_datatype(dtype: np.dtype) -> str:
    """OIP name of a numpy dtype, whatever its byte order (the wire is little-endian)."""
    key = np.dtype(dtype)
    if key.byteorder not in ("=", "|"):
        key = key.newbyteorder("=")
    try:
        return NUMPY_TO_OIP[key]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no Open Inference Protocol datatype") from None
