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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from guard.errors import BackendError

# Re-exported: these moved to the protocol's ground floor (guard/protocol/tensors.py).
from guard.protocol.tensors import (  # noqa: F401
    MAX_ELEMENTS,
    MAX_RANK,
    NUMPY_TO_OIP,
    OIP_TO_NUMPY,
    TensorSpec,
    decode_bytes_elements,
    element_count,
    oip_datatype,
    widen_bf16,
    wire_contents,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

Role = Literal["primary", "reference", "fallback"]


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


def require_cuda(device: str) -> None:
    """A torch-based backend asked for ``device``: a BackendError where it names cuda and this
    torch build or machine has none, said before anything loads (torch imported only then)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BackendError(f"device {device}: this torch build or machine has no CUDA")


def backend_details(backends: Mapping[str, Backend]) -> dict[str, dict[str, str]]:
    """``{role: describe().details}`` of the backends that said something at load (for the
    ``model_verifier_loaded`` event)."""
    return {role: dict(info.details) for role, backend in backends.items()
            if (info := backend.describe()).details}


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

    def close(self) -> None:  # noqa: B027 (a default, not abstract: most hold nothing to free)
        """Release sessions and memory. Default: nothing to release."""


class ForwardingError(Exception):
    """The server a ``Forwarding`` backend forwards to answered with a gRPC error: ``status`` is
    its StatusCode name, which the client gets unchanged."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class ForwardingUnreachable(ForwardingError):
    """No connection could be made to the server: the call was not sent (it may go to another
    upstream: the data planes' fallback spill)."""

    def __init__(self, message: str):
        super().__init__("UNAVAILABLE", message)


# How long a fallback no connection could be made to is skipped (its calls answered by the
# primary) before a call tries it again: short, so that a fallback that is back serves within
# seconds.
SKIP_S = 5.0


class Forwarding(abc.ABC):
    """A declared capability (``BackendKind.forwards``): the backend forwards the client's
    Open Inference Protocol messages to a server itself instead of inferring on arrays.

    ``skip``/``skipped``: a server no connection could be made to is skipped for a while by
    the data plane that routes to it (a fallback's calls then go to the primary)."""

    forwards = True
    _skipped_until = 0.0  # (time.monotonic) until when calls routed here skip it

    def skip(self, seconds: float = SKIP_S) -> None:
        """No connection could be made to this server: calls routed to it go elsewhere for
        ``seconds``, then the next one tries it again."""
        self._skipped_until = time.monotonic() + seconds

    @property
    def skipped(self) -> bool:
        return time.monotonic() < self._skipped_until

    @abc.abstractmethod
    async def connect(self, timeout: float = 5.0) -> bool:
        """Open the connection inside the serving event loop; True when it is ready."""

    @abc.abstractmethod
    async def forward(self, request, timeout: float | None, metadata=()):
        """Forward a parsed ModelInferRequest; returns the server's ModelInferResponse."""

    @abc.abstractmethod
    async def forward_raw(self, data: bytes, timeout: float | None, metadata=()) -> bytes:
        """Forward a serialized ModelInferRequest; returns the serialized response."""

    # Both forward methods raise ForwardingError for the server's gRPC errors, and
    # ForwardingUnreachable where no connection could be made (the call was not sent).
