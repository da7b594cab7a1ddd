"""A backend block (``primary``, ``reference``, ``fallback``): its shape only.

What is valid for each backend (its name, the precisions it derives, its options, a pinned
artifact) its own module declares (guard/backends/kind.py), and the plan step checks a block
against that declaration (guard/plan/serving.py): config/ imports no backend.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator

from guard.config.base import BackendName, FACTORY_REF, Precision, WithContext


class BackendConfig(WithContext):
    backend: BackendName = Field(
        description="A registered backend (the schema of `guard config schema` lists them; "
        "guard/backends/__init__.py registers them)."
    )
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

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ValueError(f"device '{value}' must be cpu, cuda or cuda:N")
        return value

    @property
    def is_factory(self) -> bool:
        return (self.path is not None and FACTORY_REF.match(self.path) is not None
                and not Path(self.path).exists())

    @property
    def artifact_path(self) -> str:
        """``path`` of a block that names a file: every artifact backend needs one (the plan
        checks it, guard/plan/serving.py); a ValueError saying so where it is missing."""
        if self.path is None:
            raise ValueError(f"backend '{self.backend}' needs 'path'")
        return self.path

    @property
    def remote(self) -> bool:
        """A block that names a server (``target`` + ``model``), not an artifact ``path``."""
        return self.path is None and self.target is not None

    def describe(self) -> str:
        if self.remote:
            return f"{self.backend} {self.model}@{self.target}"
        suffix = "" if self.precision == "fp32" else f" {self.precision}"
        return f"{self.backend}{suffix} {self.path}"
