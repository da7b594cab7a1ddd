"""A config held against the backends' declarations: what every serving process runs at load.

Each backend declares itself once (``KINDS`` in its module, guard/backends/kind.py); config/
knows none of them. Here a block is checked against its backend's declaration (the name is
registered, its precision derivable, its options its own, an artifact pinned where the loader
can unpickle, the backend's own ``check``), then each model (``check_model``) and the whole
config (``check_config``). Declarations are read, never built: no heavy library is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from guard.backends import BACKEND_NAMES, backend_kind
from guard.backends.artifact import pin_required
from guard.backends.options import validate_backend_options
from guard.config import BackendConfig, ConfigContext, GuardConfig, format_validation_error
from guard.config.document import read_document, resolve_document
from guard.errors import ConfigError

ROLES = ("primary", "reference", "fallback")

Check = Callable[[GuardConfig], list[str]]


def block_problems(spec: BackendConfig, where: str) -> list[str]:
    """One backend block against its backend's declaration, as ``where.key: message`` lines."""
    if spec.backend not in BACKEND_NAMES:
        return [f"{where}.backend: unknown backend '{spec.backend}' (registered: "
                f"{', '.join(BACKEND_NAMES)})"]
    kind = backend_kind(spec.backend)
    problems = []
    if not kind.artifact and spec.sha256 is not None:
        problems.append(f"{where}.sha256: backend '{spec.backend}' has no artifact to pin (the "
                        "remote server loads its own model): remove sha256")
    why = pin_required(spec.path)
    if why and spec.sha256 is None:
        problems.append(f"{where}.sha256: required: {why}; pin the file with sha256: <hex "
                        "digest> (sha256sum FILE)")
    try:
        _check_block(spec, kind)
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
    if spec.is_factory and "factory" not in kind.formats and kind.artifact:
        takes = sorted(n for n in BACKEND_NAMES if "factory" in backend_kind(n).formats)
        base = spec.context.base_dir or Path(".")
        problems.append(f"{where}.path: file not found: {(base / spec.artifact_path)} (a "
                        f"'module:function' factory is for backend {' or '.join(takes)} only)")
    problems += [f"{where}.options{line}"
                 for line in validate_backend_options(spec.backend, spec.options)]
    return problems


def _check_block(spec: BackendConfig, kind) -> None:
    if not kind.artifact:
        if kind.check is not None:
            kind.check(spec)
        return
    if spec.path is None:
        raise ValueError(f"backend '{spec.backend}' needs 'path'")
    if spec.target is not None or spec.model is not None:
        raise ValueError("'target' and 'model' are for backend 'upstream' only")
    if spec.precision not in kind.precisions:
        raise ValueError(
            f"precision '{spec.precision}' cannot be derived by backend '{spec.backend}' "
            f"(it can derive: {', '.join(sorted(kind.precisions))})")
    if kind.check is not None:
        kind.check(spec)  # may normalise the block (TensorRT's device)


# What each role of a model needs of its backend for a generative model (``BackendKind.llm``).
_LLM_ROLES = {"primary": "serve", "fallback": "serve", "reference": "score"}
_LLM_WORDS = {"serve": "served by an OpenAI-compatible server",
              "score": "scored by a teacher-forcing scorer"}


def llm_role_problems(model, where: str) -> list[str]:
    """A generative model's blocks against what their backends declare they do for an LLM
    (serve it, score it), and a tensor model against backends that only do that."""
    problems = []
    for role, needs in _LLM_ROLES.items():
        spec = getattr(model, role)
        if spec is None:
            continue
        does = backend_kind(spec.backend).llm
        if model.task != "generation":
            if does:
                problems.append(f"{where}.{role}.backend: '{spec.backend}' serves or scores an "
                                f"LLM: set task: generation (the model's task is "
                                f"'{model.task}')")
        elif needs not in does:
            able = sorted(n for n in BACKEND_NAMES if needs in backend_kind(n).llm)
            problems.append(f"{where}.{role}.backend: a generation model's {role} is "
                            f"{_LLM_WORDS[needs]} (backend {' or '.join(able)}), not "
                            f"'{spec.backend}'")
    return problems


def check_backends(config: GuardConfig) -> list[str]:
    """Every block, then each model whose blocks hold (``check_model``), then the whole config
    when everything else holds (``check_config``)."""
    problems: list[str] = []
    for i, model in enumerate(config.models):
        found = []
        for role in ROLES:
            spec = getattr(model, role)
            if spec is not None:
                found += block_problems(spec, f"models[{i}].{role}")
        found = found or llm_role_problems(model, f"models[{i}]")
        problems += found
        if found:
            continue
        # Once per check: one module may declare two backends with the same one (torch's).
        for check_model in dict.fromkeys(backend_kind(getattr(model, r).backend).check_model
                                         for r in ROLES if getattr(model, r) is not None):
            if check_model is not None:
                problems += _raised(check_model, model, f"models[{i}]")
    if problems:
        return problems
    named = {spec.backend for model in config.models for spec in
             (model.primary, model.reference, model.fallback) if spec}
    for check_config in dict.fromkeys(backend_kind(b).check_config for b in sorted(named)):
        if check_config is not None:
            problems += _raised(check_config, config, "(top level)")
    return problems


def _raised(check: Callable[[Any], None], block: Any, where: str) -> list[str]:
    try:
        check(block)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    return []


def planned(config: GuardConfig, problems: list[str], source: str | None,
            checks: tuple[Check, ...]) -> GuardConfig:
    """``config`` once ``checks`` hold, or ``ConfigError`` naming every problem found
    (``problems``: the schema step's, its paths). The first check (the backends') runs beside
    them, as it needs no file; each later one only on a config the ones before found nothing
    in, as it may rely on them (a registered backend name)."""
    for n, check in enumerate(checks):
        if n and problems:
            break
        problems = problems + check(config)
    if problems:
        raise ConfigError(problems, source)
    return config


def parse_config(data: Any, base_dir: Path | ConfigContext, source: str | None = None,
                 checks: tuple[Check, ...] = (check_backends,),
                 files: bool = True) -> GuardConfig:
    """A parsed YAML document validated (config/'s schema) and planned against ``checks``.
    ``files=False``: the files it names are not looked for (see ``load_config``)."""
    config, problems = resolve_document(data, base_dir, source, files)
    # A block naming no registered backend means nothing yet: its name is the one problem to
    # fix (its path is not reported missing beside it).
    unknown = [f"models[{i}].{role}." for i, model in enumerate(config.models) for role in ROLES
               if getattr(model, role) is not None
               and getattr(model, role).backend not in BACKEND_NAMES]
    problems = [line for line in problems if not line.startswith(tuple(unknown))]
    return planned(config, problems, source, checks)


def load_config(path: str | Path, checks: tuple[Check, ...] = (check_backends,),
                files: bool = True) -> GuardConfig:
    """A config file read, validated and planned: what a serving process loads.

    ``files=False`` for a command that prints a manifest from it (``guard deploy envoy``,
    ``istio``): the files the config names live in the Pod, not where manifests are built, and
    the manifest names them without reading them; everything else is validated as for serving."""
    data, context = read_document(path)
    return parse_config(data, context, str(path), checks, files)


def backend_block(data: dict, context: ConfigContext, source: str) -> BackendConfig:
    """One backend block on its own (a repair's rebuilt primary, a matrix cell): validated and
    checked against its backend's declaration; ``ConfigError`` naming the problems."""
    from pydantic import ValidationError

    try:
        spec = BackendConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), source) from None
    spec.context = context
    problems = block_problems(spec, "(block)")
    if problems:
        raise ConfigError(problems, source)
    return spec
