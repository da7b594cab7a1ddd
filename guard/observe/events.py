"""Structured events: one JSON object each on the ``guard.events`` logger (the log prefix before
it, or none with ``server.log_format: json``: guard/observe/logformat.py).

Every route transition, drop burst, load and shutdown is an event with its evidence, so that an
SRE can grep the log for what the guard did and why, and so that tools can parse it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

logger = logging.getLogger("guard.events")


def emit(event: str, **fields: Any) -> dict[str, Any]:
    record = {"ts": round(time.time(), 3), "event": event, **fields}
    logger.info(json.dumps(record, default=str, sort_keys=False))
    return record
