"""The config as it crosses to a child process (the verifier, extra serving processes): the
validated document with its paths already resolved, the context it was read in, and the
parent's import path (module:factory backends import what the parent can import). The child
validates it again; nothing is pickled."""

from __future__ import annotations

import sys
from pathlib import Path

from guard.config import ConfigContext, GuardConfig, parse_config


def config_message(config: GuardConfig) -> dict:
    """The config as the verifier re-validates it (paths already resolved)."""
    context = config.context
    return {"config": config.model_dump(mode="json", exclude_unset=True),
            "base_dir": str(context.base_dir), "source_hash": context.source_hash,
            "sys_path": [p for p in sys.path if p]}


def config_from_message(message: dict) -> GuardConfig:
    """The other side of ``config_message``, in a child process."""
    sys.path.extend(p for p in message.get("sys_path", ()) if p not in sys.path)
    return parse_config(message["config"], ConfigContext(
        base_dir=Path(message["base_dir"]), source_hash=message.get("source_hash", "")))
