"""The JSON schema `guard config schema` prints: config/'s document schema, with what only the
layers above config/ know filled in (the registered backend names as the ``backend`` enum)."""

from __future__ import annotations

from typing import Any

from guard.backends import BACKEND_NAMES
from guard.config import document_json_schema


def config_json_schema() -> dict[str, Any]:
    schema = document_json_schema()
    schema["$defs"]["BackendConfig"]["properties"]["backend"]["enum"] = list(BACKEND_NAMES)
    return schema
