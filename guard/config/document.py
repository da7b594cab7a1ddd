"""The whole document: ``GuardConfig``, reading and validating a file against the schema
(``load_document``, ``parse_document``, ``read_yaml``), its problems as ``dotted.path: message``
lines, and the JSON Schema of the document alone.

This is the schema step only. A config is used after the plan step (guard/plan/) has checked it
against what the layers above config/ declare (the backends, the tiers, the repair):
``guard.plan.serving.load_config`` / ``guard.plan.complete.load_config``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from guard.config.backend import BackendConfig
from guard.config.base import ConfigContext, FACTORY_REF, WithContext, _absolute
from guard.config.model import ModelConfig
from guard.config.envoy import check_envoy_mode
from guard.config.server import ServerConfig, _check_server
from guard.errors import ConfigError


class GuardConfig(WithContext):
    version: Literal[1]
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelConfig] = Field(min_length=1)


    @model_validator(mode="after")
    def _unique_names(self) -> "GuardConfig":
        seen: set[str] = set()
        for model in self.models:
            if model.name in seen:
                raise ValueError(f"model name '{model.name}' appears twice")
            seen.add(model.name)
        return self

    def model(self, name: str) -> ModelConfig:
        return next(m for m in self.models if m.name == name)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    message = str(error["msg"])
    # pydantic prefixes messages raised from our validators.
    return message.removeprefix("Value error, ")


def format_validation_error(exc: ValidationError) -> list[str]:
    """One ``dotted.path: message`` line per problem, in the order the fields are declared."""
    lines = []
    for error in exc.errors():
        # Literal/union errors carry the discriminating value in the loc; keep the field path.
        loc = tuple(p for p in error["loc"]
                    if not (isinstance(p, str) and p.startswith("function-")))
        lines.append(f"{_dotted(loc)}: {_message(error)}")
    return lines


def parse_document(data: Any, base_dir: Path | ConfigContext,
                   source: str | None = None) -> GuardConfig:
    """Validate a parsed YAML document against the schema; resolve and check artifact paths
    against ``base_dir`` (a folder, or the whole ``ConfigContext`` the config and its backend
    blocks then carry). A ``path`` of the form ``module:factory`` with no such file is left as
    it is (the plan step checks that its backend imports factories)."""
    config, problems = resolve_document(data, base_dir, source)
    if problems:
        raise ConfigError(problems, source)
    return config


def resolve_document(data: Any, base_dir: Path | ConfigContext, source: str | None = None,
                     files: bool = True) -> tuple[GuardConfig, list[str]]:
    """``parse_document``'s work, its path problems returned beside the config (for the plan
    step to name with its own); ``ConfigError`` when the document breaks the schema.
    ``files=False``: paths are made absolute, but the files are not looked for (a manifest
    built where they are not: they are the Pod's)."""
    context = base_dir if isinstance(base_dir, ConfigContext) else ConfigContext(base_dir)
    folder = context.base_dir
    if folder is None:
        raise ValueError("a config document is resolved against its folder: the context has "
                         "no base_dir")
    if not isinstance(data, dict):
        raise ConfigError(["(top level): must be a mapping with 'version' and 'models'"], source)
    try:
        config = GuardConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), source) from None
    problems = _check_server(config.server, folder, files) + check_envoy_mode(config)
    for i, model in enumerate(config.models):
        if model.tap and config.server.tap is None:
            problems.append(f"models[{i}].tap: needs server.tap (the Tap listener that the "
                            "model's own server reports to)")
        for role in ("primary", "reference", "fallback"):
            spec: BackendConfig | None = getattr(model, role)
            if spec is None or spec.path is None:
                continue
            spec.context = context
            if FACTORY_REF.match(spec.path) and not (folder / spec.path).exists():
                # A Python factory, imported when the backend loads: code, not a file to pin.
                if spec.sha256 is not None:
                    problems.append(
                        f"models[{i}].{role}.sha256: '{spec.path}' is a Python factory, not an "
                        "artifact file: sha256 cannot pin it; remove sha256 (or export the "
                        "model to .pt/.pt2/.onnx and pin that)")
                continue
            resolved = _absolute(folder, spec.path)
            if files and not resolved.exists():
                problems.append(f"models[{i}].{role}.path: file not found: {resolved}")
            spec.path = str(resolved)
        if model.capture is not None:
            model.capture.dir = str(_absolute(folder, model.capture.dir))
        activation = model.checks.activation
        if activation.primary_gguf is not None:
            resolved = _absolute(folder, activation.primary_gguf)
            if files and not resolved.is_file():
                problems.append(f"models[{i}].checks.activation.primary_gguf: file not found: "
                                f"{resolved}")
            activation.primary_gguf = str(resolved)
        floor = model.checks.tensor.noise_floor
        if floor.inputs is not None:
            resolved = _absolute(folder, floor.inputs)
            if files and not resolved.exists():
                problems.append(
                    f"models[{i}].checks.tensor.noise_floor.inputs: file not found: {resolved}")
            floor.inputs = str(resolved)
    config.context = context
    return config, problems


def read_yaml(path: str | Path) -> tuple[str, Any]:
    """A YAML file's text and data; ``ConfigError`` with one ``(file)`` or ``(yaml)`` line
    (the line and column of a syntax error) when it cannot be read or parsed. Every YAML the
    guard reads (its config, the matrix config, the config behind alert rules) goes through it."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"(file): cannot read: {exc.strerror or exc}"], str(path)) from None
    try:
        return text, yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"(yaml): {where}{problem}"], str(path)) from None


def read_document(path: str | Path) -> tuple[Any, ConfigContext]:
    """A config file's data and the context it is read in (``ConfigError`` when it cannot be
    read or parsed as YAML)."""
    path = Path(path)
    text, data = read_yaml(path)
    # Not path.resolve(): see _absolute (ConfigMap '..data' symlinks).
    return data, ConfigContext(base_dir=Path(os.path.abspath(path)).parent,
                               source_hash=hashlib.sha256(text.encode()).hexdigest()[:16],
                               source_path=path)


def load_document(path: str | Path) -> GuardConfig:
    """Read, validate against the schema and resolve a config file; raises ``ConfigError``
    naming every problem."""
    data, context = read_document(path)
    return parse_document(data, context, str(path))


def document_json_schema() -> dict[str, Any]:
    """The document's schema alone (``backend`` a string): `guard config schema` prints it with
    the registered names filled in (guard/plan/schema.py)."""
    return GuardConfig.model_json_schema()
