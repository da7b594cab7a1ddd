"""The shared ground of the config models: the strict base, the value types (names, precisions,
ranges), where a config came from (``ConfigContext``) and the path rule.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, PrivateAttr

# A backend's name: registered once (guard/backends/__init__.py), what each backend is its own
# module declares. config/ is the schema only and imports no backend: the plan step checks a
# name against the registry (guard/plan/serving.py) and the schema it prints lists them
# (guard/plan/schema.py).
BackendName = str
Precision = Literal["fp32", "fp16", "bf16", "int8"]
Task = Literal["classification", "detection", "segmentation", "embedding", "generation",
               "generic"]
Action = Literal["alert", "fallback_model", "fallback_ops"]


@dataclasses.dataclass(frozen=True)
class ConfigContext:
    """Where a config came from, kept beside the validated models (``GuardConfig.context``,
    ``BackendConfig.context``) and passed explicitly to whoever needs it.

    - ``base_dir``: the config file's folder; relative paths were resolved against it and a
      ``module:factory`` is imported from it.
    - ``source_hash``: sha256 of the file's text, 16 hex digits (events and capture records
      name it, so that a verdict can be tied to the config that produced it; reload compares).
    - ``source_path``: the file as given (what a reload re-reads); None for a config that did
      not come from a file (a child process's copy, a test).
    """

    base_dir: Path | None = None
    source_hash: str = ""
    source_path: Path | None = None


# A Python model given as "package.module:factory" instead of a file.
FACTORY_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _unit_interval(value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be in [0, 1]")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def _non_negative(value: float) -> float:
    if value < 0:
        raise ValueError("must be >= 0")
    return value


Fraction = Annotated[float, AfterValidator(_unit_interval)]
PositiveFloat = Annotated[float, AfterValidator(_positive)]
NonNegativeFloat = Annotated[float, AfterValidator(_non_negative)]


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port in [0, 65535] (0 picks a free port)")
    return value


Port = Annotated[int, AfterValidator(_port)]


def _positive_int(value: int) -> int:
    if value < 1:
        raise ValueError("must be >= 1")
    return value


PositiveInt = Annotated[int, AfterValidator(_positive_int)]


class Strict(BaseModel):
    """Base for every config block: unknown keys are errors, values are not coerced silently."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class WithContext(Strict):
    """A block that knows where its config came from (``context``, set by parse_config): not
    a field, so no key of the YAML, not in the schema or a dump; copies keep it."""

    _context: ConfigContext = PrivateAttr(default_factory=ConfigContext)

    @property
    def context(self) -> ConfigContext:
        return self._context

    @context.setter
    def context(self, context: ConfigContext) -> None:
        self._context = context


def _percent(value: float) -> float:
    if not 0.0 <= value <= 100.0:
        raise ValueError("must be in [0, 100]")
    return value


def _absolute(base_dir: Path, value: str) -> Path:
    """``value`` against the config file's folder, symlinks NOT followed: under a Kubernetes
    ConfigMap volume the file is reached through the '..data' symlink, whose target changes on
    every update; a path through it would change too, and every model would reload."""
    return Path(os.path.normpath(os.path.join(base_dir, os.path.expanduser(value))))
