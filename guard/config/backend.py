"""A backend block (``primary``, ``reference``, ``fallback``); what is valid for each backend its
own module declares (guard/backends/kind.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from guard.backends import BACKEND_NAMES, backend_kind
from guard.backends.artifact import pin_required
from guard.config.base import BackendName, FACTORY_REF, Precision, WithContext


class BackendConfig(WithContext):
    backend: BackendName
    path: str | None = Field(
        None,
        description="The artifact (.onnx, .pt TorchScript, .pt2 torch.export) or, for torch, "
        "a Python factory 'package.module:function'. Relative to the config file.",
    )
    precision: Precision = Field(
        "fp32", description="Variant the guard derives itself from the fp32 artifact."
    )
    device: str = Field("cpu", description="cpu, cuda or cuda:N.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Backend-specific settings, checked per backend."
    )
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="Expected sha256 of the artifact file: the backend reads the file "
        "once, hashes those bytes and loads them. Required for a torch.export program (.pt2), "
        "whose loader can unpickle; an error on upstream and 'module:factory' backends, which "
        "have no artifact file to pin."
    )
    target: str | None = Field(None, description="upstream: host:port of an OIP server; "
                               "openai: the base URL of an OpenAI-compatible server.")
    model: str | None = Field(None, description="upstream, openai: the model's name on that "
                              "server.")

    @field_validator("sha256")
    @classmethod
    def _check_sha256(cls, value: str | None, info: ValidationInfo) -> str | None:
        backend = info.data.get("backend")
        if backend in BACKEND_NAMES and not backend_kind(backend).artifact and value is not None:
            raise ValueError(f"backend '{backend}' has no artifact to pin (the remote server "
                             "loads its own model): remove sha256")
        why = pin_required(info.data.get("path"))
        if why and value is None:
            raise ValueError(f"required: {why}; pin the file with sha256: <hex digest> "
                             "(sha256sum FILE)")
        return value

    @model_validator(mode="after")
    def _check_backend(self) -> "BackendConfig":
        kind = backend_kind(self.backend)
        if not kind.artifact:
            kind.check(self)
            return self
        if self.path is None:
            raise ValueError(f"backend '{self.backend}' needs 'path'")
        if self.target is not None or self.model is not None:
            raise ValueError("'target' and 'model' are for remote backends only (upstream, "
                             "openai)")
        if self.precision not in kind.precisions:
            raise ValueError(
                f"precision '{self.precision}' cannot be derived by backend '{self.backend}' "
                f"(it can derive: {', '.join(sorted(kind.precisions))})"
            )
        if kind.check is not None:
            kind.check(self)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device '{self.device}' must be cpu, cuda or cuda:N")
        return self

    @property
    def is_factory(self) -> bool:
        return bool(self.path and FACTORY_REF.match(self.path)) and not Path(self.path).exists()

    def describe(self) -> str:
        if not backend_kind(self.backend).artifact:
            return f"{self.backend} {self.model}@{self.target}"
        suffix = "" if self.precision == "fp32" else f" {self.precision}"
        return f"{self.backend}{suffix} {self.path}"
