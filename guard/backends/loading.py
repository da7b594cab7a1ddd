"""Loading a model's backends (the serving process's primary and fallback, the verifier's
reference and primary): in parallel, since derivation and compilation take seconds each; the
first failure raises ``BackendError`` naming the model and the role."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from guard.errors import BackendError, install_hint

if TYPE_CHECKING:
    from guard.backends.base import Backend
    from guard.config import ModelConfig


def load_all(model: str, config: "ModelConfig", backends: dict[str, "Backend"]) -> None:
    """Load ``backends`` (role -> backend of ``config``) in parallel; the first failure raises
    ``BackendError`` naming the role."""
    with ThreadPoolExecutor(max_workers=max(1, len(backends))) as pool:
        futures = {role: pool.submit(b.load) for role, b in backends.items()}
    for role, future in futures.items():
        exc = future.exception()
        if exc is None:
            continue
        if isinstance(exc, BackendError):
            raise exc.at(f"models[{model}].{role}") from exc
        spec = getattr(config, role)
        raise BackendError(f"models[{model}].{role}: cannot load {spec.describe()}: "
                           f"{type(exc).__name__}: {exc}{_missing_extra(spec, exc)}") from exc


def _missing_extra(spec, exc: BaseException) -> str:
    """'; pip install ...' when a load failed on a module the backend's extra installs."""
    if not isinstance(exc, ModuleNotFoundError):
        return ""
    from guard.backends import backend_kind

    extra = backend_kind(spec.backend).extra
    return f"; {install_hint(extra)}" if extra else ""
