"""The ext_proc observer: Envoy's copies of sampled calls, reassembled into request and answer.

In Envoy mode Envoy forwards every call in C++; for the calls it samples, its ``ext_proc`` filter
runs in *observability mode* and streams a copy of the call to this gRPC service (one
``Process`` stream per call): request headers, request body chunks, response headers, response
body chunks, response trailers. Envoy does not wait for us: it ignores any answer ("send and go"),
so this service sends none, and a slow or dead observer delays no client (with
``failure_mode_allow: true``; without it a dead observer fails clients with UNKNOWN).

What this module does with a stream, and why:

- It reads each message as soon as it arrives and only appends the body bytes to a list. Envoy
  resets the stream ``deferred_close_timeout`` (5 s by default) after the call ends, and what was
  not read by then is lost: nothing slow may run inside the stream. Decoding the tensors happens
  in the verifier, never here.
- Bodies come in chunks (16 KiB for large ones) whose boundaries say nothing about gRPC messages:
  only the first chunk starts with the 5-byte length prefix, a message may span chunks, and one
  body may carry several messages. The chunks are joined once and the prefixes parsed over the
  whole body, so the bytes handed on are exactly the serialized ``ModelInferRequest`` and
  ``ModelInferResponse``.
- As soon as the answer has ended (its trailers, or headers that end the stream for a
  trailers-only answer) the call is handed to ``on_call`` and the stream is closed from this side
  (allowed in observability mode: "no more messages are needed"), so streams are not held open
  for the 5 s Envoy would wait.
- Memory is bounded per call: a call whose bodies exceed ``max_call_bytes`` is dropped at once
  (its buffers freed, its stream closed) and counted as ``too_large``.

Every stream ends in exactly one outcome of ``guard_observer_calls_total{outcome}``:

- ``complete``: request and answer reassembled and handed to ``on_call``;
- ``incomplete``: the stream ended or was reset before the answer ended (a slow observer losing
  calls to Envoy's deferred close, an aborted client call, Envoy restarting);
- ``too_large``: over ``max_call_bytes``, dropped;
- ``unsupported``: compressed messages (``grpc-encoding``) or a streaming call (more than one
  message a way), which the verifier does not compare;
- ``error``: a body whose gRPC framing does not parse, or ``on_call`` raised.

The counter has no model label: the model name is inside the request body, which this service
does not parse (the verifier decodes it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from guard.xds import ext_proc_pb2_grpc as ext_proc_grpc

if TYPE_CHECKING:
    from guard.observe.metrics import GuardMetrics

log = logging.getLogger("guard.envoy.observer")

OUTCOMES = ("complete", "incomplete", "too_large", "unsupported", "error")
DEFAULT_MAX_CALL_BYTES = 64 * 1024 * 1024  # request + answer bodies; server.max_message_bytes's
ROUTE_HEADER = "guard-route"
_PREFIX = 5  # gRPC message prefix: 1 byte compressed flag, 4 bytes big-endian length


@dataclass(frozen=True)
class ObservedCall:
    path: str  # ":path" header
    request_id: str  # x-request-id
    traceparent: str  # "" if none
    route: str  # response header `guard-route` ("" if absent)
    request: bytes  # serialized ModelInferRequest: gRPC length prefixes stripped, chunks joined
    response: bytes  # serialized ModelInferResponse, likewise (b"" if none)
    grpc_status: int | None  # from response trailers (or headers, for trailers-only answers)
    seconds: float  # first request header to end of stream, as seen by the observer


class FramingError(ValueError):
    """A body that is not a sequence of whole gRPC length-prefixed messages."""


class UnsupportedMessage(ValueError):
    """Well-formed, but not something the verifier compares (compressed, or streaming)."""


def grpc_messages(chunks: list[bytes]) -> list[bytes]:
    """The messages of a gRPC body given as chunks cut anywhere, their prefixes stripped.

    Raises ``FramingError`` for a prefix or message cut short and ``UnsupportedMessage`` for a
    compressed message. One copy per message (a single chunk is not copied to be joined)."""
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    view = memoryview(data)
    messages: list[bytes] = []
    pos, size = 0, len(data)
    while pos < size:
        if size - pos < _PREFIX:
            raise FramingError(f"a message prefix cut short at byte {pos} of {size}")
        if data[pos]:
            raise UnsupportedMessage("a compressed gRPC message")
        end = pos + _PREFIX + int.from_bytes(view[pos + 1:pos + _PREFIX], "big")
        if end > size:
            raise FramingError(f"a message of {end - pos - _PREFIX} bytes at byte {pos} "
                               f"but the body ends at {size}")
        messages.append(bytes(view[pos + _PREFIX:end]))
        pos = end
    return messages


def _headers(header_map) -> dict[str, str]:
    """A ``config.core.v3.HeaderMap`` as a dict (Envoy sends values in ``raw_value`` bytes)."""
    out = {}
    for h in header_map.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


class Outcomes:
    """``guard_observer_calls_total{outcome}``, and the same figures without a registry
    (``counts``), for either observer (ext_proc here, tap in guard/envoy/tap_filter.py)."""

    def __init__(self, metrics: GuardMetrics | None = None):
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self._series = ({o: metrics.observer_calls.labels(o) for o in OUTCOMES}
                        if metrics is not None else None)

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._series is not None:
            self._series[outcome].inc()


def hand_on(*, path: str, request_id: str, traceparent: str, route: str,
            request_chunks: list[bytes], response_chunks: list[bytes],
            grpc_status: int | None, seconds: float,
            on_call: Callable[[ObservedCall], None]) -> str:
    """An observed call's bodies unframed and handed to ``on_call``; returns the outcome."""
    try:
        requests = grpc_messages(request_chunks) if request_chunks else []
        responses = grpc_messages(response_chunks) if response_chunks else []
    except UnsupportedMessage:
        return "unsupported"
    except FramingError as e:
        log.warning("observed call %s: %s", path or "?", e)
        return "error"
    if len(requests) > 1 or len(responses) > 1:
        return "unsupported"
    if not requests:
        log.warning("observed call %s: no request message", path or "?")
        return "error"
    observed = ObservedCall(path=path, request_id=request_id, traceparent=traceparent,
                            route=route, request=requests[0],
                            response=responses[0] if responses else b"",
                            grpc_status=grpc_status, seconds=seconds)
    try:
        on_call(observed)
    except Exception:
        log.exception("on_call failed for an observed call of %s", path)
        return "error"
    return "complete"


class _Call:
    """One stream's state, from the first request header to the end of the answer."""

    __slots__ = ("started", "headers", "route", "status", "request", "response", "size",
                 "ended")

    def __init__(self):
        self.started = time.monotonic()
        self.headers: dict[str, str] = {}
        self.route = ""
        self.status: int | None = None
        self.request: list[bytes] = []
        self.response: list[bytes] = []
        self.size = 0
        self.ended = False

    def answer_headers(self, headers: dict[str, str]) -> None:
        self.route = headers.get(ROUTE_HEADER, self.route)
        self.answer_trailers(headers)

    def answer_trailers(self, trailers: dict[str, str]) -> None:
        status = trailers.get("grpc-status")
        if status is not None:
            try:
                self.status = int(status)
            except ValueError:
                self.status = None


class Observer(ext_proc_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc service in observability mode: each observed call goes to ``on_call``.

    ``on_call`` runs on the observer's event loop, once per complete call, and must not block
    (queue the call, e.g. into the sample ring): while it runs no stream is read, and Envoy drops
    what is unread ``deferred_close_timeout`` after each call ends."""

    def __init__(self, on_call: Callable[[ObservedCall], None],
                 metrics: GuardMetrics | None = None,
                 max_call_bytes: int = DEFAULT_MAX_CALL_BYTES):
        if max_call_bytes <= 0:
            raise ValueError(f"max_call_bytes must be positive, got {max_call_bytes}")
        self.on_call = on_call
        self.max_call_bytes = max_call_bytes
        self.outcomes = Outcomes(metrics)

    async def Process(self, request_iterator, context) -> None:  # noqa: N802 (the gRPC name)
        call: _Call | None = None
        outcome = "incomplete"
        try:
            async for message in request_iterator:
                if call is None:
                    call = _Call()
                kind = message.WhichOneof("request")
                if kind == "request_body" or kind == "response_body":
                    chunk = message.request_body if kind == "request_body" \
                        else message.response_body
                    body = chunk.body
                    if body:
                        call.size += len(body)
                        if call.size > self.max_call_bytes:
                            call.request.clear()
                            call.response.clear()
                            outcome = "too_large"
                            return
                        (call.request if kind == "request_body" else call.response).append(body)
                    if kind == "response_body" and chunk.end_of_stream:
                        call.ended = True  # an answer without trailers: not gRPC, but ended
                elif kind == "request_headers":
                    call.headers = _headers(message.request_headers.headers)
                elif kind == "response_headers":
                    call.answer_headers(_headers(message.response_headers.headers))
                    call.ended = message.response_headers.end_of_stream
                elif kind == "response_trailers":
                    call.answer_trailers(_headers(message.response_trailers.trailers))
                    call.ended = True
                if call.ended:
                    outcome = self._hand_on(call)
                    return
        finally:
            # Reached on every exit: the answer's end, the stream ending early, or a reset
            # (the handler is cancelled), so that each stream counts exactly once.
            self.outcomes.count(outcome)

    def _hand_on(self, call: _Call) -> str:
        h = call.headers
        return hand_on(path=h.get(":path", ""), request_id=h.get("x-request-id", ""),
                       traceparent=h.get("traceparent", ""), route=call.route,
                       request_chunks=call.request, response_chunks=call.response,
                       grpc_status=call.status, seconds=time.monotonic() - call.started,
                       on_call=self.on_call)

    @property
    def counts(self) -> dict[str, int]:
        return self.outcomes.counts


async def start_observer(observer: Observer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve ``observer`` on ``host:port`` (0: a free port) on the running loop; returns the
    started server (stop it with ``await server.stop(grace)``) and the bound port."""
    # Chunks are small (Envoy streams bodies as they arrive), but nothing a call could carry
    # within the per-call bound may be refused by gRPC before the observer counts it.
    size = observer.max_call_bytes + (1 << 20)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(observer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"the ext_proc observer cannot listen on {address}")
    await server.start()
    return server, bound
