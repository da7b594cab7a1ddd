"""The config as it crosses to a child process (the verifier, extra serving processes): the
validated document with its paths already resolved, the context it was read in, and the
parent's import path (module:factory backends import what the parent can import). The child
validates it again and plans it against the backends (guard/plan/serving.py; the verifier
process also against the checks); nothing is pickled.

One backend block crosses alone too: a repair's rebuilt primary (``messages.UsePrimary``,
``messages.Init.primaries``), built by the verifier's repair code and only instantiated by a
serving process, which knows nothing of how it was derived."""

from __future__ import annotations

import sys
from pathlib import Path

from guard.config import BackendConfig, ConfigContext, GuardConfig
from guard.plan.serving import backend_block, parse_config


def config_to_wire(config: GuardConfig) -> dict:
    """The config as a child re-validates it (paths already resolved)."""
    context = config.context
    return {"config": config.model_dump(mode="json", exclude_unset=True),
            "base_dir": str(context.base_dir), "source_hash": context.source_hash,
            "sys_path": [p for p in sys.path if p]}


def config_from_wire(wire: dict) -> GuardConfig:
    """The other side of ``config_to_wire``, in a child process."""
    sys.path.extend(p for p in wire.get("sys_path", ()) if p not in sys.path)
    return parse_config(wire["config"], ConfigContext(
        base_dir=Path(wire["base_dir"]), source_hash=wire.get("source_hash", "")))


def backend_to_wire(spec: BackendConfig) -> dict:
    """One backend block (its paths are already absolute: it came out of a parsed config)."""
    return spec.model_dump(mode="json", exclude_unset=True)


def backend_from_wire(wire: dict, context: ConfigContext) -> BackendConfig:
    """The other side of ``backend_to_wire``; ``context``: the config the block belongs to
    (a ``module:factory`` is imported from its folder). ``ConfigError`` when it does not
    validate or its backend's declaration does not hold it."""
    return backend_block(wire, context, "a rebuilt backend block")
