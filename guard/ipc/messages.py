"""Every message that crosses a process boundary, one small dataclass each, and how an endpoint
finds the handler for one.

Three kinds of process talk over the control channel (guard/ipc/channel.py): the primary serving
process (``guard serve``), the verifier process (guard/verifier_process/process.py) and the extra
serving processes (guard/serve/worker.py). What each sends:

| message | from -> to | reply |
| --- | --- | --- |
| ``Init`` | primary -> verifier, extra serving process | ``Ready`` |
| ``Reload`` | primary -> verifier | ``LoadFailures`` |
| ``Prepare`` / ``Commit`` | primary -> extra serving process | ``LoadFailures`` / ``Done`` |
| ``Status`` | primary (admin API) -> verifier | ``StatusReport`` |
| ``SetRoute`` | primary (admin API) -> verifier | ``RouteSet`` |
| ``Metrics`` | primary -> verifier, extra serving process | ``Exposition`` |
| ``Stop`` | primary -> verifier, extra serving process | ``Done`` (or one-way) |
| ``UsePrimary`` | verifier -> primary -> extra serving process | ``Done`` |
| ``Event``, ``Span``, ``RouteChanged`` | verifier, extra serving process -> primary | none |

Any request may be answered with ``Failed`` (its ``error`` says why, a message type the
endpoint does not know included). On the wire a message is one JSON object: ``type`` (the class
name) and the fields; the channel adds ``id`` (a request) or ``re`` (a reply). Fields are plain
JSON values: a config travels in its wire form (guard/ipc/config.py), a protobuf as base64.

A new message: a dataclass here with ``@message``, a row above, and a handler in the ``Handlers``
of the endpoint that receives it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

ENVELOPE = ("id", "re")  # the channel's keys beside a message's own
_REGISTRY: dict[str, type["Message"]] = {}


class UnknownMessage(ValueError):
    """A wire object that names no registered message, or does not fit the one it names."""


@dataclass
class Message:
    """Base of every message (each a dataclass, so is this one, of no field); ``type`` on the
    wire is the class name."""


M = TypeVar("M", bound=type[Message])


def message(cls: M) -> M:
    """Register a message dataclass under its class name."""
    if cls.__name__ in _REGISTRY:
        raise ValueError(f"message type {cls.__name__} registered twice")
    _REGISTRY[cls.__name__] = cls
    return cls


def message_types() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


def to_wire(msg: Message) -> dict:
    """The JSON object for ``msg``: ``type`` and its fields."""
    return {"type": type(msg).__name__,
            **{f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}}


def from_wire(data: dict) -> Message:
    """The message a wire object stands for (envelope keys ignored); ``UnknownMessage`` when
    its type is not registered or its fields do not fit."""
    name = data.get("type")
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnknownMessage(f"unknown message type {name!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(k for k in data if k not in names and k != "type" and k not in ENVELOPE)
    if extra:
        raise UnknownMessage(f"message {name}: unknown fields {extra}")
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise UnknownMessage(f"message {name}: {exc}") from None


class Handlers:
    """One endpoint's handlers, found by the message's class: ``{Init: self.init, ...}``. A
    handler returns the reply (``None``: ``Done``); a message it has no handler for gets
    ``Failed`` naming it."""

    def __init__(self, endpoint: str, handlers: Mapping[type[Message],
                                                         Callable[[Any], Message | None]]):
        self.endpoint = endpoint
        self.handlers = dict(handlers)

    def __call__(self, msg: Message) -> Message | None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            return Failed(f"{self.endpoint}: no handler for message type {type(msg).__name__}")
        return handler(msg)


# -- replies ------------------------------------------------------------------------------------
@message
@dataclass
class Done(Message):
    """A request did what it asked; nothing to say."""


@message
@dataclass
class Failed(Message):
    """A request could not be done: ``error`` says why."""

    error: str


@message
@dataclass
class Ready(Message):
    """``Init`` done: the models the process loaded, its pid."""

    models: list[str] = field(default_factory=list)
    pid: int = 0


@message
@dataclass
class LoadFailures(Message):
    """{model: error} for the models of a ``Reload`` or ``Prepare`` that did not load."""

    failed: dict[str, str] = field(default_factory=dict)


@message
@dataclass
class StatusReport(Message):
    """{model: serialized guard.v1 ModelStatus, base64}: the verifier's half of GetStatus."""

    models: dict[str, str] = field(default_factory=dict)


@message
@dataclass
class RouteSet(Message):
    """``SetRoute`` done: the model's status after it (serialized ModelStatus, base64)."""

    status: str


@message
@dataclass
class Exposition(Message):
    """A process's metrics in the Prometheus text format."""

    text: str


# -- primary -> verifier and extra serving processes ---------------------------------------------
@message
@dataclass
class Init(Message):
    """Load the models of ``config`` (its wire form) on their route ``slots``.

    ``kept``: the ops a repaired primary keeps back, per model, with ``primaries``: that
    primary's rebuilt backend block (wire form), so a serving process builds it without the
    repair code. ``resume``: the route words a previous verifier left (a restart). ``ports``:
    the ports the first serving process bound, by edge name (guard/serve/edges.py), which an
    extra serving process binds too (SO_REUSEPORT)."""

    config: dict
    slots: dict[str, int]
    kept: dict[str, list[str]] = field(default_factory=dict)
    primaries: dict[str, dict | None] = field(default_factory=dict)
    resume: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)


@message
@dataclass
class Reload(Message):
    """The verifier builds the ``changed`` models of ``config`` and drops the ``removed``;
    those of ``carried`` (changed in their mirroring or capture alone) take over their old
    version's detector evidence."""

    config: dict
    slots: dict[str, int]
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    carried: list[str] = field(default_factory=list)


@message
@dataclass
class Prepare(Message):
    """A reload's first step in an extra serving process: build the ``changed`` models beside
    the old ones."""

    config: dict
    slots: dict[str, int]
    changed: list[str] = field(default_factory=list)


@message
@dataclass
class Commit(Message):
    """A reload's second step: swap in ``names`` (prepared everywhere), drop the rest of what
    was prepared and the ``removed`` models; a replaced model still busy after
    ``retire_report_s`` is reported (and waited for)."""

    names: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    retire_report_s: float = 30.0


@message
@dataclass
class Status(Message):
    """The verifier's status of one model (``""``: all)."""

    model: str = ""


@message
@dataclass
class SetRoute(Message):
    """An operator's route override (``auto``, ``primary``, ``fallback``)."""

    model: str
    override: str
    reason: str = ""


@message
@dataclass
class Metrics(Message):
    """Ask for the process's metrics (``Exposition``)."""


@message
@dataclass
class Stop(Message):
    """Stop gracefully; an extra serving process gives in-flight requests ``grace`` seconds
    (``None``: ``server.shutdown_grace_s``)."""

    grace: float | None = None


# -- verifier -> serving processes -----------------------------------------------------------------
@message
@dataclass
class UsePrimary(Message):
    """Serve ``model``'s primary with ``kept`` ops held back, built from ``primary`` (the
    rebuilt backend block's wire form, computed by the verifier); ``kept == []``: the primary
    as configured."""

    model: str
    kept: list[str] = field(default_factory=list)
    primary: dict | None = None


@message
@dataclass
class Event(Message):
    """One ``guard.events`` line (JSON) of a child process, logged by the primary."""

    line: str


@message
@dataclass
class Span(Message):
    """A finished span of a mirrored comparison, exported by the primary."""

    record: dict


@message
@dataclass
class RouteChanged(Message):
    """A route transition the verifier made (for tap's WatchRoute streams)."""

    model: str
    to_route: str
    reason: str = ""
    unix_time: float = 0.0
