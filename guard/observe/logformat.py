"""How guard's processes write their logs on stderr: ``server.log_format``.

- ``text`` (default): ``TIME LEVEL LOGGER [PROCESS]: MESSAGE``, for a person reading a terminal;
  an event is its JSON after the prefix.
- ``json``: one JSON object per line, every log record of every guard process (the serving
  process, the verifier, the extra serving processes): ``ts`` (Unix seconds), ``level``,
  ``logger``, ``process``, and ``message``; an event (logger ``guard.events``) is its own fields
  instead of ``message`` (``event``, its evidence), so ``jq 'select(.event ==
  "route_transition")'`` reads the log as it is. A traceback is in ``exc``.

The serving process reads the setting from the config and hands it to its children in the
environment (``GUARD_LOG_FORMAT``, read by ``configure`` at their start). What a library writes
to stderr itself, not through Python's logging (a C++ runtime's warnings, Envoy's own log), is
not covered; progress bars that Python libraries draw on stderr (transformers' "Loading
weights", the GGUF parser's tqdm) are turned off (``silence_library_progress``): a bar is a
carriage-return animation, not a log line, and in ``json`` it broke one-object-per-line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

ENV = "GUARD_LOG_FORMAT"
FORMATS = ("text", "json")
EVENTS_LOGGER = "guard.events"


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname,
               "logger": record.name, "process": self.process}
        message = record.getMessage()
        event = None
        if record.name == EVENTS_LOGGER and message.startswith("{"):
            try:
                event = json.loads(message)
            except ValueError:
                event = None
        if isinstance(event, dict):
            event.pop("ts", None)  # the record's own time stands for it
            out.update(event)
        else:
            out["message"] = message
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# The switches of those bars: huggingface_hub's (transformers reads it at import) and tqdm's own
# (TQDM_<ARG> overrides any tqdm argument's default since tqdm 4.66). Set in the environment, so
# that the children guard starts inherit them; a value the user set is kept.
PROGRESS_OFF = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}


def silence_library_progress() -> None:
    """Libraries' progress bars off in this process and its children (see the docstring)."""
    for name, value in PROGRESS_OFF.items():
        os.environ.setdefault(name, value)
    loaded = sys.modules.get("transformers.utils.logging")  # imported already: tell it too
    if loaded is not None and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        loaded.disable_progress_bar()


def text_formatter(process: str) -> logging.Formatter:
    where = f" [{process}]" if process != "guard" else ""
    return logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s"
                             if where else "%(asctime)s %(levelname)s %(name)s %(message)s")


def configure(log_format: str | None = None, process: str = "guard",
              level: int | None = None) -> str:
    """Format the root logger's stderr handler as ``log_format`` (default: ``GUARD_LOG_FORMAT``,
    else text), adding the handler where there is none; sets it for this process's children
    too. Returns the format in force."""
    silence_library_progress()
    log_format = log_format or os.environ.get(ENV) or "text"
    if log_format not in FORMATS:
        log_format = "text"
    os.environ[ENV] = log_format
    root = logging.getLogger()
    if level is not None:
        root.setLevel(level)
    handlers = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    if not handlers:
        handler = logging.StreamHandler(sys.stderr)
        root.addHandler(handler)
        handlers = [handler]
    formatter = JsonFormatter(process) if log_format == "json" else text_formatter(process)
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.captureWarnings(log_format == "json")  # warnings.warn through the log, as JSON
    return log_format
