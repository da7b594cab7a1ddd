"""Envoy's tap filter as guard's observer: each sampled call as one trace on one stream. (Not
the guard.v1.Tap service, which model servers call: guard/serve/tap_service.py.)

``server.envoy.observer: tap`` (the default; ``ext_proc`` is guard/envoy/observer.py). The
bootstrap puts Envoy's HTTP tap filter (``admin_config``, config id ``guard``) on the sampled
clusters only, like ext_proc, and has their answers marked (``guard-sampled``, taken out before
the client sees it: guard/envoy/bootstrap.py ``Chain``); this reader POSTs the tap's match (the
mark) and output to Envoy's admin ``/tap`` and keeps the answer open: Envoy streams every tapped
call there once it has ended, as one JSON ``HttpBufferedTrace`` (request headers and body,
answer headers, body and trailers). The gRPC listener's calls go on as ``ObservedCall``; the
OpenAI-compatible listener's (generation models, a path under ``/v1/``) as ``ObservedHttpCall``,
whose event stream the hand-off reassembles (guard/envoy/llm_calls.py).

Why tap rather than ext_proc, measured (benchmarks/upstream_hop.py, cells g5 and g5x): ext_proc
opens one gRPC stream per observed call and sends it five messages, and grpcio's server spends
~1 ms of CPU on each stream on a 2-core EPYC whatever the handler does (an empty handler
costs the same, aio or threads), which alone is more than the budget of guard's share of a call.
A tap trace is one read and one ``json.loads`` on a connection held open: ~0.2 ms of CPU a
call. The costs on Envoy's side are alike (both copy the call's bytes as they pass; neither
waits for guard).

What the trade is:

- A trace comes when the call has ended, complete: no chunks to reassemble, no deferred-close
  race. A body over ``max_buffered_*_bytes`` comes truncated (``truncated: true``) and counts
  as ``too_large``.
- Envoy's admin writes the traces from its main thread, never from the worker that serves the
  call, and a reader that stops reading slows no client (the admin connection's buffer grows
  instead); this reader reads at once and hands each call to ``on_call`` (which must not block:
  the sample ring's put), so it never falls behind by more than the parse.
- The tap is attached per Envoy: after an Envoy start, restart or hot restart this reader
  attaches again (``reattach``, from the process's ``on_started``); calls sampled in between
  (the few milliseconds of an attach) are forwarded as always but not observed.
- Traces carry no timing: ``seconds`` is Envoy's ``x-envoy-upstream-service-time`` (the
  upstream's time, in ms).

Every trace ends in one outcome of ``guard_observer_calls_total{outcome}`` (the ext_proc
observer's, minus ``incomplete``, which a trace cannot be).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import threading
from collections.abc import Callable

from guard.envoy.bootstrap import SAMPLED_HEADER
from guard.envoy.llm_calls import ObservedHttpCall
from guard.envoy.observer import ROUTE_HEADER, ObservedCall, Outcomes, hand_on

log = logging.getLogger("guard.envoy.tap")

TAP_FILTER = "envoy.filters.http.tap"
CONFIG_ID = "guard"
_READ = 1 << 20  # bytes asked of the socket at a time
_TICK_S = 0.5  # how often a waiting reader looks at the stop flag
_RETRY_S = (0.05, 1.0)  # first and longest wait before attaching again after a failure


def tap_request(max_call_bytes: int) -> dict:
    """The body of ``POST /tap``: the calls whose answer a sampled twin marked (the header
    ``guard-sampled``, which Lua takes out before the client sees it: guard/envoy/bootstrap.py
    ``Chain``), streamed as JSON with the bodies as base64 (the one format Envoy's streaming
    admin sink writes), bodies buffered up to ``max_call_bytes`` each way (Envoy's default is
    1 KiB: an LLM call's prompt and events need far more)."""
    return {"config_id": CONFIG_ID, "tap_config": {
        "match": {"http_response_headers_match": {"headers": [
            {"name": SAMPLED_HEADER, "present_match": True}]}},
        "output_config": {"sinks": [{"format": "JSON_BODY_AS_BYTES", "streaming_admin": {}}],
                          "max_buffered_rx_bytes": max_call_bytes,
                          "max_buffered_tx_bytes": max_call_bytes}}}


def _headers(entries: list[dict]) -> dict[str, str]:
    out = {}
    for h in entries or ():
        value = h.get("value", "")
        if not value and h.get("raw_value"):
            value = base64.b64decode(h["raw_value"]).decode("utf-8", "replace")
        out[h.get("key", "")] = value
    return out


def _status(headers: dict[str, str]) -> int | None:
    try:
        return int(headers["grpc-status"])
    except (KeyError, ValueError):
        return None


def observe_trace(trace: dict, on_call: Callable[[ObservedCall | ObservedHttpCall], None]
                  ) -> str:
    """One decoded tap trace handed to ``on_call``; returns its outcome. A gRPC call goes as
    an ``ObservedCall`` (its messages unframed), a generation model's OpenAI-compatible call
    (a path under ``/v1/``) as an ``ObservedHttpCall`` (its bodies as they came)."""
    try:
        buffered = trace["http_buffered_trace"]
        request, response = buffered["request"], buffered.get("response") or {}
        bodies = []
        for side in (request, response):
            body = side.get("body") or {}
            if body.get("truncated"):
                return "too_large"
            bodies.append(base64.b64decode(body["as_bytes"]) if body.get("as_bytes") else b"")
        headers = _headers(request.get("headers"))
        answer = _headers(response.get("headers"))
        trailers = _headers(response.get("trailers"))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        log.warning("a tap trace guard cannot read: %s: %s", type(exc).__name__, exc)
        return "error"
    path = headers.get(":path", "")
    if path.startswith("/v1/"):
        return _hand_on_http(path, headers, answer, bodies, on_call)
    status = _status(trailers)
    if status is None:
        status = _status(answer)  # a trailers-only answer
    return hand_on(path=path, request_id=headers.get("x-request-id", ""),
                   traceparent=headers.get("traceparent", ""),
                   route=answer.get(ROUTE_HEADER, ""),
                   request_chunks=[bodies[0]] if bodies[0] else [],
                   response_chunks=[bodies[1]] if bodies[1] else [],
                   grpc_status=status, seconds=_upstream_seconds(answer), on_call=on_call)


def _upstream_seconds(answer: dict[str, str]) -> float:
    """The upstream's time to its answer's headers, as Envoy says it (a trace has no timing)."""
    try:
        return float(answer.get("x-envoy-upstream-service-time", 0)) / 1e3
    except ValueError:
        return 0.0


def _hand_on_http(path: str, headers: dict[str, str], answer: dict[str, str],
                  bodies: list[bytes], on_call: Callable) -> str:
    """A traced OpenAI-compatible call handed to ``on_call`` whole (its events are reassembled
    from the answer's body by the hand-off, guard/envoy/llm_calls.py)."""
    try:
        status = int(answer.get(":status", 0))
    except ValueError:
        status = 0
    call = ObservedHttpCall(
        path=path.partition("?")[0], request_id=headers.get("x-request-id", ""),
        traceparent=headers.get("traceparent", ""), route=answer.get(ROUTE_HEADER, ""),
        status=status, content_type=answer.get("content-type", ""), request=bodies[0],
        response=bodies[1], seconds=_upstream_seconds(answer))
    try:
        on_call(call)
    except Exception:
        log.exception("on_call failed for an observed call of %s", path)
        return "error"
    return "complete"


class TraceStream:
    """Envoy's streaming admin output cut into traces. Envoy writes each trace as indented
    JSON, so a trace ends at the first ``}`` that starts a line (nested objects are indented,
    and JSON strings hold no raw newline). ``limit``: the most bytes one trace may take (its
    bodies in base64 and its headers); more without an end is not Envoy's trace format, and
    raises ``ValueError`` rather than buffer without bound."""

    def __init__(self, limit: int):
        self.limit = limit
        self._buffer = bytearray()
        self._scan = 0  # where to look for the next end: bytes before it hold none

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        traces = []
        start = 0
        while True:
            end = self._buffer.find(b"\n}", max(self._scan, start))
            if end < 0:
                break
            traces.append(bytes(self._buffer[start:end + 2]))
            start = end + 2
        del self._buffer[:start]
        self._scan = max(len(self._buffer) - 1, 0)
        if len(self._buffer) > self.limit:
            self._buffer.clear()
            self._scan = 0
            raise ValueError(f"more than {self.limit} bytes of tap output without a trace's end")
        return traces


class TapFilterReader:
    """Holds a tap on the current Envoy and hands every trace on; a thread of its own.

    ``admin_port()``: the current Envoy's admin port (0 while none serves)."""

    def __init__(self, on_call: Callable[[ObservedCall], None],
                 admin_port: Callable[[], int], outcomes: Outcomes, max_call_bytes: int):
        self.on_call = on_call
        self.admin_port = admin_port
        self.outcomes = outcomes
        self.max_call_bytes = max_call_bytes
        self.attached = threading.Event()  # set while a tap is held
        self.attaches = 0
        self._stopping = threading.Event()
        self._reattach = threading.Event()
        self._wanted = False  # whether the current Envoy has a tap filter to attach to
        self._connection: http.client.HTTPConnection | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guard-envoy-tap", daemon=True)
        self._thread.start()

    def reattach(self, wanted: bool = True) -> None:
        """A new Envoy serves (a start, restart or hot restart): drop the tap on the old one and
        attach to the new one, if its bootstrap has the tap filter (``wanted``: it has none
        when no model samples)."""
        self._wanted = wanted
        self._reattach.set()
        self._close()

    def stop(self) -> None:
        self._stopping.set()
        self._reattach.set()
        self._close()
        if self._thread is not None:
            self._thread.join(2)

    def _close(self) -> None:
        # shutdown, not close: it wakes a read blocked in the reader's thread.
        connection = self._connection
        sock = connection.sock if connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        retry = _RETRY_S[0]
        while not self._stopping.is_set():
            if not self._wanted:  # nothing to attach to: sleep until a new Envoy serves
                self._reattach.wait()
            self._reattach.clear()
            port = self.admin_port() if self._wanted else 0
            if port:
                try:
                    self._hold(port)
                    retry = _RETRY_S[0]
                except (OSError, http.client.HTTPException) as exc:
                    if not (self._stopping.is_set() or self._reattach.is_set()):
                        log.debug("tap on Envoy's admin port %d: %s", port, exc)
                finally:
                    self.attached.clear()
                    self._connection = None
            if self._reattach.is_set():  # a new Envoy: attach at once, and soon again if it fails
                retry = _RETRY_S[0]
                continue
            self._stopping.wait(retry)
            retry = min(retry * 2, _RETRY_S[1])

    def _hold(self, port: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
        self._connection = connection
        connection.request("POST", "/tap", body=json.dumps(tap_request(self.max_call_bytes)),
                           headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        if answer.status != 200:
            detail = answer.read(500).decode("utf-8", "replace").strip()
            raise http.client.HTTPException(f"POST /tap answered {answer.status}: {detail}")
        # Traces come whenever a sampled call ends: no read timeout (stop() closes the socket).
        connection.sock.settimeout(None)
        self.attached.set()
        self.attaches += 1
        # A trace holds both bodies in base64 (4/3 of their bytes) and the headers.
        stream = TraceStream(limit=3 * self.max_call_bytes + (1 << 20))
        while not self._stopping.is_set():
            data = answer.read1(_READ)
            if not data:
                return  # Envoy went away (exit, restart): attach again
            try:
                traces = stream.feed(data)
            except ValueError as exc:  # not a trace stream: count it, attach afresh
                log.warning("tap output from Envoy's admin port %d: %s", port, exc)
                self.outcomes.count("error")
                return
            for text in traces:
                self._observe(text)

    def _observe(self, text: bytes) -> None:
        try:
            trace = json.loads(text)
        except ValueError as exc:
            log.warning("a tap trace that is not JSON: %s", exc)
            self.outcomes.count("error")
            return
        self.outcomes.count(observe_trace(trace, self.on_call))

