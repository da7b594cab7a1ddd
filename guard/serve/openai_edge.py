"""The OpenAI-compatible HTTP edge (``server.http_port``): guard in the path of generative models
served by OpenAI-compatible servers (backend ``openai``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/responses``
(the Responses API, checked as the chat it renders; Server-Sent Events when the body says
``"stream": true``), ``GET /v1/models`` (the generative models guard serves, under
the names clients send), ``GET /health`` (live) and ``GET /health/ready`` (models loaded).
Any other ``POST`` whose JSON body names a served model (embeddings, vLLM's ``/tokenize``,
``/v1/messages`` ...) is forwarded unchecked to the model's route (``_PassThrough``): never
sampled, counted as a request and as not comparable (``endpoint``).

A call: the body is read and parsed (guard/protocol/openai/: 400 for what is not an OpenAI
body, 404 in OpenAI's error shape for a model guard does not serve), the route word picks the
primary or the fallback (guard/ipc/routes.py, as on the OIP path), and the client's body and
headers go to that upstream: hop-by-hop headers left out, the upstream's Authorization from
``options.api_key_env``, ``model`` re-addressed to the upstream's name by splicing the value's
bytes. The answer comes back as the upstream wrote it, with the header ``guard-route:
primary|fallback`` and ``model`` set back to the client's name (in every streamed event too).
A streamed answer is written to the client event by event as each event completes (events are
reassembled across the connection's chunks), never buffered; a client that disconnects
closes the upstream connection, which stops the upstream's generation.

Sampling: the keyed sampler (guard/runtime/sampling.py, ``mirror.sample_rate``) decides on the
request id (``x-request-id``, else a random one). A sampled call's events are kept as they pass
and, once the client has its whole answer, turned into a ``GenerationSample`` and put into the
sample ring for the verifier (``wire.GENERATION``). With ``options.sample_logprobs`` the edge
asks the upstream for logprobs on sampled calls whose clients did not, and sets each
``choices[i].logprobs`` back to ``null`` in what the client gets; with
``options.sample_token_ids`` it asks vLLM for the token ids of the prompt and the completion
(``return_token_ids``: the reference then scores the prompt as the server rendered it) and
sets them back to ``null`` likewise. An upstream that refuses a call so amended (400, 422:
a vLLM whose --max-logprobs is lower; 500, or a stream that ends without a byte:
llama-cpp-python's server started without --logits_all) gets the client's own call instead,
whose answer the client receives, and calls of that shape are not amended again. Calls that
cannot be compared (best_of > 1, tool calls without the ids, an answer that is an error or was cut
short) are forwarded and counted (``guard_generation_not_comparable_total{model,reason}``), never
sampled. A prompt longer than the reference's context is the verifier's to count.

Outcomes: every call ends in ``guard_requests_total`` / ``guard_request_duration_seconds`` (a
2xx answer that completed) or ``guard_request_errors_total{code}``, whose code is the HTTP
status mapped to its gRPC status name as google.rpc.Code maps them (400 INVALID_ARGUMENT, 404
NOT_FOUND, 429 RESOURCE_EXHAUSTED, 502/503 UNAVAILABLE, 504 DEADLINE_EXCEEDED...), so that one
vocabulary serves the OIP and the HTTP data planes; a client that went away is CANCELLED, an
upstream that died mid-stream UNAVAILABLE, an error event inside a 200 stream INTERNAL. Time to
first token and the gaps between tokens are histograms per model and route.

The HTTP server is aiohttp's (the ``llm-remote`` extra, part of ``llm``: an asyncio server
with streamed responses, on the serving process's own event loop beside grpc.aio); the upstream
exchange is guard's lean HTTP/1.1 client (guard/backends/http1.py, the backend's pool), the one
part of guard on the path of time to first token. This module is imported only when
``server.http_port`` is set.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid
from typing import Callable, Mapping, TypeVar, cast

from guard.errors import GuardError, install_hint

try:
    from aiohttp import web
    from aiohttp.http_exceptions import HttpProcessingError
    from aiohttp.web_protocol import RequestPayloadError
    from multidict import CIMultiDict
except ImportError as exc:  # said as a config error where the edge is built: a missing extra
    raise GuardError(f"server.http_port: the OpenAI-compatible edge needs aiohttp: "
                     f"{install_hint('llm-remote', 'aiohttp')} ({exc})") from None

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp's own dependency there
    from async_timeout import timeout

from guard.backends.base import SKIP_S
from guard.backends.http1 import AnswerTooLarge, Response, Unreachable, UpstreamError
from guard.backends.openai import REFUSALS, OpenAIBackend, end_to_end
from guard.ipc import wire
from guard.observe.events import emit
from guard.observe.metrics import UNKNOWN_MODEL, GuardMetrics
from guard.protocol import openai as api
from guard.serve.model import ServedModel

log = logging.getLogger("guard.serve.openai")
ROUTE_HEADER = "guard-route"
RESPONSE_MODEL_PATH = ("response", "model")
# After the shutdown's grace, how long aiohttp waits for the handlers it then cancels to end.
_CUT_S = 1.0
_Call = TypeVar("_Call")  # what the edge makes of a call's body: a ParsedCall, or its model


def request_id(headers: Mapping[str, str]) -> str:
    """The call's ``x-request-id``, a random one where it sends none. Header bytes that are
    not UTF-8 reach aiohttp's headers as surrogates; they become U+FFFD here, so that the id
    can be hashed, handed to the verifier and captured (the upstream gets the header as the
    client sent it)."""
    given = headers.get("x-request-id")
    if not given:
        return uuid.uuid4().hex
    if given.isascii():
        return given
    return given.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class _ServerLog:
    """aiohttp's server log, as the edge keeps it: a request aiohttp could not parse (bad
    HTTP) is one WARNING line without a traceback and counted as an error (model unknown,
    INVALID_ARGUMENT: aiohttp answered it 400), a body it could not decode one line too (the
    edge answered and counted it); anything else goes to aiohttp's own logger as it would
    have. A client sending malformed HTTP in a loop fills no disk with tracebacks."""

    def __init__(self, metrics: "EdgeMetrics"):
        self.metrics = metrics
        self.log = logging.getLogger("aiohttp.server")

    def exception(self, message: str, *args, exc_info=None, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError):  # aiohttp answered it 400 itself
            self.metrics.error(UNKNOWN_MODEL, "INVALID_ARGUMENT")
        elif not isinstance(exc_info, RequestPayloadError):
            self.log.exception(message, *args, exc_info=exc_info, **kwargs)
            return
        # (RequestPayloadError: a body the edge could not read, answered and counted there;
        # aiohttp meets it again reading the rest of the body after the answer.)
        self.log.warning("%s: %s", message % args, " ".join(str(exc_info).split()))

    def __getattr__(self, name: str):
        return getattr(self.log, name)


class EdgeMetrics:
    """The edge's series (``GuardMetrics``' generation_* ones), by the names the edge uses."""

    def __init__(self, metrics: GuardMetrics):
        self.base = metrics
        self.ttft = metrics.generation_ttft
        self.gaps = metrics.generation_inter_token
        self.tokens = metrics.generation_tokens
        self.not_comparable = metrics.generation_not_comparable

    def error(self, model: str, code: str) -> None:
        self.base.request_errors.labels(model, code).inc()


class OpenAIEdge:
    """The HTTP listener; ``models()`` gives the serving process's models (a reload swaps
    them), ``start``/``stop`` are the serving process's hooks."""

    name = "openai-http"

    def __init__(self, models: Callable[[], Mapping[str, ServedModel]], metrics: GuardMetrics,
                 server_config, port: int | None = None, *, forwarding: bool = True,
                 host: str | None = None, key: str = "server.http_port"):
        """``port``: the port the first serving process bound (an extra serving process binds
        it too, with SO_REUSEPORT); default ``server.http_port``. ``forwarding=False``: health
        and the model list only, on ``host`` (Envoy mode: Envoy forwards the calls and routes
        those paths here; ``key`` names the port's config key in errors)."""
        self.forwarding = forwarding
        if not forwarding:
            self.name = "http-health"
        self.host = server_config.host if host is None else host
        self.key = key
        self.models = models
        self.metrics = EdgeMetrics(metrics)
        self.config = server_config
        self.ready = False
        self.live = True
        self.cutting = False  # the shutdown's grace is over: calls still running are cut
        self.port = 0
        self._bind_port = server_config.http_port if port is None else port
        self.in_flight = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle (guard/serve/edges.py's Edge) ---------------------------------------------
    async def start(self) -> None:
        """Listen on server.http_port (liveness answers at once, readiness once ready)."""
        app = web.Application(client_max_size=self.config.max_message_bytes)
        if self.forwarding:
            app.router.add_post("/v1/completions", self._generate)
            app.router.add_post("/v1/chat/completions", self._generate)
            app.router.add_post("/v1/responses", self._generate)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health/live", self._health)
        app.router.add_get("/health/ready", self._health_ready)
        if self.forwarding:  # last: aiohttp tries the routes in the order they were added
            app.router.add_route("*", "/{path:.*}", self._pass_through)
        # handler_cancellation: a client that disconnects cancels its handler, which closes
        # the upstream connection (the upstream stops generating).
        # keepalive_timeout: an idle connection's life, and how long a new connection may take
        # to send a whole request head (aiohttp's timer runs from the connection's start or
        # its last answer until a head is read): a client trickling its head is cut then.
        # shutdown_timeout: the cut's, not the grace's. ``stop`` waits the grace itself; aiohttp
        # waits its timeout for the handlers, then cancels them and waits it again, so the
        # grace there stopped guard only after three graces (90 s at the default 30 s, past
        # Kubernetes' 30 s before SIGKILL).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=_CUT_S,
                                     keepalive_timeout=self.config.http_client_timeout_s,
                                     logger=_ServerLog(self.metrics))
        await self._runner.setup()
        # Several serving processes share the port (server.processes): the kernel spreads
        # connections over them, as on the gRPC port.
        self._site = web.TCPSite(self._runner, self.host, self._bind_port,
                                 reuse_port=self.config.processes > 1 or None)
        try:
            await self._site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise GuardError(f"{self.key}: cannot listen on {self.host}:"
                             f"{self._bind_port}: {exc.strerror or exc}") from None
        self.port = self._runner.addresses[0][1]

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready

    async def stop(self, grace: float) -> None:
        """Stop accepting; calls in flight get ``grace`` seconds, then are cut."""
        self.live = self.ready = False
        if self._runner is None:
            return
        if self._site is not None:
            await self._site.stop()
        deadline = time.monotonic() + grace
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.cutting = True  # what is still in flight now is cut (counted UNAVAILABLE)
        await self._runner.cleanup()
        self._runner = None
        for model in self._generative().values():
            for backend in model.backends.values():
                if isinstance(backend, OpenAIBackend):
                    await backend.aclose()

    # -- health and listing ------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.live else "stopping"},
                                 status=200 if self.live else 503)

    async def _health_ready(self, request: web.Request) -> web.Response:
        ready = self.ready and self.live
        return web.json_response({"status": "ready" if ready else "not ready"},
                                 status=200 if ready else 503)

    def _generative(self) -> dict[str, ServedModel]:
        return {name: m for name, m in self.models().items()
                if m.config.primary.backend == "openai"}

    async def _list_models(self, request: web.Request) -> web.Response:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "guard"}
                for name in sorted(self._generative())]
        return web.json_response({"object": "list", "data": data})

    # -- a call ----------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str, model: str, code: str | None = None,
                param: str | None = None, kind: str = "invalid_request_error") -> web.Response:
        self.metrics.error(model, api.status_code_name(status))
        return web.Response(status=status, body=api.error_body(message, kind, code, param),
                            content_type="application/json")

    async def _admit(self, request: web.Request, parse: Callable[[bytes], _Call],
                     model_name: Callable[[_Call], str]
                     ) -> tuple[bytes, _Call, ServedModel] | web.Response:
        """A call's body, what ``parse`` made of it and the model it names (``model_name``),
        or the refusal (413, 408, 400, 503 while loading or stopping, 404, 429 past
        server.max_concurrent_requests)."""
        try:
            if request.content.is_eof():  # it came whole with the head: no timer to arm
                data = await request.read()
            else:
                async with timeout(self.config.http_client_timeout_s):
                    data = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            return self._refuse(413, exc.text or "request too large", UNKNOWN_MODEL)
        except (TimeoutError, asyncio.TimeoutError):  # (one class from Python 3.11)
            return self._refuse(408, "the request's body did not arrive in "
                                f"{self.config.http_client_timeout_s:g}s "
                                "(server.http_client_timeout_s)", UNKNOWN_MODEL)
        except (RequestPayloadError, HttpProcessingError) as exc:  # a Content-Encoding that
            return self._refuse(400, f"the body cannot be read: {exc}",  # is not, bad chunks
                                UNKNOWN_MODEL)
        except asyncio.CancelledError:  # the client went away before its body's end
            self.metrics.error(UNKNOWN_MODEL, "CANCELLED")
            raise
        try:
            call = parse(data)
        except api.BadRequest as exc:
            return self._refuse(400, str(exc), UNKNOWN_MODEL, param=exc.param)
        if not (self.live and self.ready):  # (loading: the model it names may be one)
            return self._refuse(503, "guard is not ready" if self.live else "guard is stopping",
                                UNKNOWN_MODEL, kind="server_error")
        served = self._generative()
        name = api.served_model(model_name(call), served)
        if name is None:
            return self._refuse(400, "'model' is required: guard serves several models ("
                                f"{', '.join(sorted(served))})", UNKNOWN_MODEL, param="model")
        model = served.get(name)
        if model is None:
            return self._refuse(404, f"The model '{name}' does not exist",
                                UNKNOWN_MODEL, code="model_not_found", param="model")
        if not (self.live and model.ready):
            return self._refuse(503, "guard is not ready", model.name, kind="server_error")
        if self.in_flight >= self.config.max_concurrent_requests:
            return self._refuse(429, "too many requests in guard at once "
                                "(server.max_concurrent_requests)", model.name,
                                kind="rate_limit_error")
        return data, call, model

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        endpoint = api.PATHS[request.path]
        admitted = await self._admit(request, lambda data: api.parse_request(endpoint, data),
                                     lambda call: call.model)
        if isinstance(admitted, web.Response):
            return admitted
        data, call, model = admitted
        if call.model != model.name:  # it named none: the model guard serves is its name
            call = dataclasses.replace(call, model=model.name)
        route, epoch, probing, backend = model.route()
        call_id = request_id(request.headers)
        flags = model.sample_flags(call_id, route, probing) if model.samples else 0
        if call.not_comparable:
            self.metrics.not_comparable.labels(model.name, call.not_comparable).inc()
            flags = 0

        # (flags are the route's: on the fallback, mirrored only while probing; a call the
        # primary answers standing in for a fallback that is down is then a probe as it came)
        def forward(on: str, upstream: OpenAIBackend, spills: bool) -> _Forward:
            return _Forward(self, request, call, model, on, upstream, call_id, flags, epoch,
                            started, data, spills)

        self.in_flight += 1
        model.requests_in_flight += 1
        try:
            # (a generation model is served by openai backends: the plan's llm roles)
            return await self._on_route(model, route, cast(OpenAIBackend, backend), forward)
        finally:
            self.in_flight -= 1
            model.requests_in_flight -= 1

    async def _pass_through(self, request: web.Request) -> web.StreamResponse:
        """Any other POST whose JSON body names a served model: embeddings, vLLM's
        ``/tokenize``, llama.cpp's ``/infill``, ``/v1/messages`` ... A client in front of
        which guard stands keeps every endpoint its server has. Forwarded to the model's route
        as it came (``model`` re-addressed), never sampled: guard checks completions, chats and
        Responses calls only, and counts these calls as not comparable (``endpoint``)."""
        started = time.perf_counter()
        if request.method != "POST":  # (GET /v1/responses/{id} ...: no body names a model)
            return self._refuse(404, f"guard forwards calls whose body names a model: "
                                f"{request.method} {request.path} is not one", UNKNOWN_MODEL,
                                code="not_found")
        admitted = await self._admit(request, api.model_of, str)
        if isinstance(admitted, web.Response):
            return admitted
        data, _, model = admitted
        route, _, _, backend = model.route()
        self.metrics.not_comparable.labels(model.name, "endpoint").inc()
        call_id = request_id(request.headers)

        def forward(on: str, upstream: OpenAIBackend, spills: bool) -> _PassThrough:
            return _PassThrough(self, request, model, on, upstream, call_id, started, data,
                                spills)

        self.in_flight += 1
        model.requests_in_flight += 1
        try:
            return await self._on_route(model, route, cast(OpenAIBackend, backend), forward)
        finally:
            self.in_flight -= 1
            model.requests_in_flight -= 1

    async def _on_route(self, model: ServedModel, route: str, backend: OpenAIBackend,
                        call: Callable[[str, OpenAIBackend, bool], "_Upstream"]
                        ) -> web.StreamResponse:
        """``call(route, backend, spills)``, run on the model's route. A fallback that no
        connection can be made to (refused, unreachable: the call never reached it) is
        skipped for ``SKIP_S``, and its calls are answered by the primary meanwhile
        (``guard-route: primary``, counted there; while the route probes, sampled as probes of
        the primary as it answered; event ``openai_fallback_unreachable``), then the next call
        tries it again. A drifting answer beats none: after a trip to a fallback that is down,
        every call was a 502 and no probe could ever run (probes ride on the fallback's
        answers). Envoy mode does the same with the fallback cluster's second priority
        (guard/envoy/bootstrap.py ``serving_cluster``)."""
        if route != "fallback":
            return await call(route, backend, False).run()
        primary = cast(OpenAIBackend, model.backends["primary"])
        if backend.skipped:
            return await call("primary", primary, False).run()
        try:
            return await call(route, backend, True).run()
        except _Spill as exc:
            backend.skip(SKIP_S)
            emit("openai_fallback_unreachable", model=model.name, target=backend.base,
                 error=str(exc), skipped_s=SKIP_S,
                 note="its calls are answered by the primary until it is tried again")
            return await call("primary", primary, False).run()


class _Spill(Exception):
    """A fallback no connection could be made to: the call goes to the primary
    (``OpenAIEdge._on_route``)."""


class _Upstream(abc.ABC):
    """What every call guard forwards does with its upstream: the exchange, the answer's
    headers, the refusals when the upstream fails, the error counts."""

    def __init__(self, edge: OpenAIEdge, request: web.Request, model: ServedModel,
                 route: str, backend: OpenAIBackend, request_id: str, started: float,
                 spills: bool = False):
        """``spills``: where no connection can be made to ``backend``, raise ``_Spill``
        (another upstream answers) instead of answering 502."""
        self.edge, self.request, self.model, self.route = edge, request, model, route
        self.backend, self.request_id, self.started = backend, request_id, started
        self.spills = spills
        self.accounted = False  # the call is counted: answered, or an error code
        self.edits: dict[tuple[str, ...], bytes] = {}  # what the answer's JSON gets (below)

    def _headers(self, upstream: Response) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict(end_to_end(upstream.headers))
        headers[ROUTE_HEADER] = self.route
        return headers

    async def run(self) -> web.StreamResponse:
        try:
            return await self._run()
        except _Spill:
            raise  # (nothing was sent or counted: another upstream answers the call)
        except asyncio.CancelledError:
            # The client went away before the call was counted: while guard waited for the
            # upstream's answer (a call closed right after it was sent, a whole answer still
            # generating). Cancelling closes the upstream's connection, which stops its
            # generation; the call is counted as a stream cut short is.
            if not self.accounted:
                self._left_early()
            raise
        except Exception:
            # A fault of guard's own (a bug): the call is counted all the same (INTERNAL), and
            # answered 500 in OpenAI's shape where nothing was written yet; else aiohttp logs
            # it and cuts the connection.
            if not self.accounted:
                self._error("INTERNAL")
            if self.request.writer is not None and self.request.writer.output_size:
                raise
            log.exception("guard failed a call to %s", self.model.name)
            return web.Response(status=500, body=api.error_body(
                "guard failed this call (its log says why)", "server_error", None, None),
                content_type="application/json", headers={ROUTE_HEADER: self.route})

    @abc.abstractmethod
    async def _run(self) -> web.StreamResponse:
        """The call's exchange with the upstream and its answer to the client."""

    def _left_early(self, tokens: int = 0) -> None:
        """The handler was cancelled before the call's end: the client went away (CANCELLED),
        or the shutdown's grace ran out and guard cut the call (UNAVAILABLE, as a gRPC server
        that stops answers the calls it drops: the client did not leave)."""
        name = self.model.name
        if self.edge.cutting:
            self._error("UNAVAILABLE")
            emit("openai_cut_at_shutdown", model=name, route=self.route, tokens=tokens)
        else:
            self._error("CANCELLED")
            emit("openai_client_disconnected", model=name, route=self.route, tokens=tokens)

    def _error(self, code: str) -> None:
        self.accounted = True
        self.edge.metrics.error(self.model.name, code)

    def _served(self, seconds: float) -> None:
        self.accounted = True
        self.model.answered(self.route, seconds)

    def _upstream_failed(self, status: int, message: str) -> web.Response:
        emit("openai_upstream_failed", model=self.model.name, route=self.route,
             status=status, error=message, path=self.request.path)
        response = self.edge._refuse(status, f"guard: {message}", self.model.name,
                                     kind="server_error")
        response.headers[ROUTE_HEADER] = self.route
        return response

    async def _exchange(self, path: str, payload: bytes) -> Response | web.Response:
        """The upstream's answer (its head read), or the 502/504 the client gets instead."""
        pool = self.backend.pool
        if pool is None:  # connect() runs at start; a reload's new backend connects here
            await self.backend.connect()
            pool = self.backend.pool
            assert pool is not None, "connect() opens the pool"
        try:
            return await pool.post(path, payload,
                                   self.backend.headers(self.request.headers, self.request_id))
        except Unreachable as exc:
            if self.spills:
                raise _Spill(str(exc)) from None
            return self._upstream_failed(502, f"the upstream is unreachable: {exc}")
        except TimeoutError:
            return self._upstream_failed(504, "the upstream did not answer in time")
        except UpstreamError as exc:
            return self._upstream_failed(502, f"the upstream is unreachable: {exc}")

    async def _write_whole(self, upstream: Response, body: bytes,
                           edits: dict[tuple[str, ...], bytes]) -> web.Response:
        """A whole answer to the client: a 2xx one with ``edits`` applied (where it is JSON),
        any other as the upstream wrote it."""
        if edits and 200 <= upstream.status < 300:
            try:
                body = api.replace_values(body, edits)
            except ValueError:  # not JSON: forwarded as it came
                pass
        response = web.Response(status=upstream.status, body=body,
                                headers=self._headers(upstream))
        await response.prepare(self.request)
        await response.write_eof()
        return response

    async def _broke_off(self, response: web.StreamResponse, splitter: api.EventSplitter,
                         exc: Exception, **event) -> web.StreamResponse:
        """The upstream died or fell silent mid-stream: the client gets what had arrived, then
        a cut connection (no end of the chunked body), as it would have from the upstream;
        counted (UNAVAILABLE, or DEADLINE_EXCEEDED) and said (``event``: the event's fields
        beside the model, the route and the error)."""
        rest = splitter.rest()
        try:
            if rest:
                await response.write(api.edit_event(rest, self.edits) if self.edits else rest)
        except ConnectionResetError:
            pass
        self._error("DEADLINE_EXCEEDED" if isinstance(exc, TimeoutError) else "UNAVAILABLE")
        emit("openai_upstream_broke_off", model=self.model.name, route=self.route,
             error=f"{type(exc).__name__}: {exc}", **event)
        if self.request.transport is not None:
            self.request.transport.close()
        return response

    async def _body(self, upstream: Response) -> bytes | web.Response:
        """A whole answer's body, or the 502/504 the client gets instead."""
        try:
            return await upstream.read(self.edge.config.max_message_bytes)
        except AnswerTooLarge as exc:
            return self._upstream_failed(502, str(exc))
        except TimeoutError:
            return self._upstream_failed(504, "the upstream did not finish its answer in time")
        except UpstreamError as exc:
            return self._upstream_failed(502, f"the upstream broke off its answer: {exc}")


def _streams(upstream: Response) -> bool:
    """The server's answer says whether it streams: a ``stream`` guard does not read (not a
    boolean) is the server's to take as it does (parse_request)."""
    return upstream.status == 200 and upstream.headers.get(
        "Content-Type", "").startswith("text/event-stream")


class _Forward(_Upstream):
    """One forwarded call, from the upstream request to the hand-off."""

    def __init__(self, edge: OpenAIEdge, request: web.Request, call: api.ParsedCall,
                 model: ServedModel, route: str, backend: OpenAIBackend, request_id: str,
                 flags: int, epoch: int, started: float, data: bytes, spills: bool = False):
        super().__init__(edge, request, model, route, backend, request_id, started, spills)
        self.call, self.flags, self.epoch = call, flags, epoch
        # Ask for logprobs and token ids on a sampled call whose client did not
        # (options.sample_logprobs, options.sample_token_ids).
        # Not on a Responses API call: its answers and events carry logprobs in several
        # places whose unasked spelling differs from server to server; it is compared with
        # the logprobs its client asked for, else by the sampled or greedy check.
        # (Nor where this upstream refused them before: see _as_the_client_asked.)
        adds = bool(flags & wire.MIRROR) and call.endpoint != "responses" and \
            call.shape not in backend.refused_additions
        top = backend.options.sample_logprobs
        self.guard_logprobs = bool(adds and top and not call.asked_logprobs) and \
            not backend.options.refuses_logprobs(call.shape)
        # (Not on an echo call: vLLM then leaves the echoed prompt out of the answer's text.)
        self.guard_token_ids = (adds and backend.options.sample_token_ids
                                and not call.asked_token_ids and not call.echo)
        self.data = data
        self._set_payload()
        self.first_token: float | None = None
        # One reason per call: one the request already gave (counted at admission) stands.
        self._unusable_counted = bool(call.not_comparable)

    def _unusable(self, reason: str) -> None:
        """Count the call not comparable for ``reason``, unless it already was."""
        if not self._unusable_counted:
            self._unusable_counted = True
            self.edge.metrics.not_comparable.labels(self.model.name, reason).inc()

    @property
    def amended(self) -> bool:
        """guard added logprobs or token ids the client had not asked for."""
        return self.guard_logprobs or self.guard_token_ids

    def _set_payload(self) -> None:
        """The body that goes upstream (guard's additions, the upstream's model name) and the
        edits its answer gets back on the way to the client."""
        call, backend = self.call, self.backend
        if self.amended:
            body = api.sampled_body(call, backend.options.sample_logprobs
                                    if self.guard_logprobs else 0, self.guard_token_ids)
            body["model"] = backend.model
            self.payload = json.dumps(body, ensure_ascii=False).encode()
        elif call.body.get("model") != backend.model:  # another name, or none
            self.payload = api.set_model(self.data, backend.model)
        else:
            self.payload = self.data  # the client's bytes, as they came
        self.edits = api.answer_edits(call.model, self.guard_logprobs, self.guard_token_ids,
                                      backend.options.unasked_logprobs(call.endpoint))
        if self.edits and call.endpoint == "responses":  # also in its events' response
            self.edits[RESPONSE_MODEL_PATH] = self.edits[api.MODEL_PATH]

    async def _run(self) -> web.StreamResponse:
        upstream = await self._exchange(self.request.path, self.payload)
        if isinstance(upstream, web.Response):
            return upstream
        if self.amended and upstream.status in REFUSALS:
            upstream = await self._as_the_client_asked(upstream)
            if isinstance(upstream, web.Response):
                return upstream
        try:
            if _streams(upstream):
                return await self._stream(upstream)
            return await self._whole(upstream)
        finally:
            upstream.close()  # a whole answer's connection is already back in the pool

    async def _as_the_client_asked(self, refused: Response,
                                   why: str | None = None) -> Response | web.Response:
        """The upstream refused the call as guard sent it, with logprobs or token ids the
        client had not asked for (a vLLM whose --max-logprobs is below
        options.sample_logprobs, a server that takes no return_token_ids): the client's own
        call goes out instead, and its answer is the client's. Where that one is answered,
        guard's additions were what the server refused: calls of this shape (ParsedCall.shape:
        the endpoint, streamed or not, tools or not) to this upstream are not amended again
        (until a reload builds it anew), said once per shape by the event
        ``openai_additions_refused``; they are still sampled and compared, without them. Per
        shape, because servers refuse per shape: llama-server refuses logprobs on a streamed
        chat that lists tools alone ("logprobs is not supported with tools + stream"), and an
        upstream whose engine is not declared (options.engine, which would have added none
        there: OpenAIOptions.refuses_logprobs) must not lose them on its other calls. A server
        that refuses them everywhere costs one refused round trip per shape it is sent.
        ``why``: the refusal in words where its body does not say it (an empty stream)."""
        try:
            said = (await refused.read())[:500].decode("utf-8", "replace")
        except (TimeoutError, UpstreamError) as exc:
            said = f"{type(exc).__name__}: {exc}"
        finally:
            refused.close()
        why = why or said
        added = [name for name, on in (("sample_logprobs", self.guard_logprobs),
                                       ("sample_token_ids", self.guard_token_ids)) if on]
        self.guard_logprobs = self.guard_token_ids = False
        self._set_payload()
        upstream = await self._exchange(self.request.path, self.payload)
        shape, refusals = self.call.shape, self.backend.refused_additions
        if not isinstance(upstream, web.Response) and 200 <= upstream.status < 300 and \
                shape not in refusals:
            refusals[shape] = f"HTTP {refused.status}: {why}"
            emit("openai_additions_refused", model=self.model.name, route=self.route,
                 target=self.backend.base, status=refused.status, error=why,
                 options=[f"options.{name}" for name in added], shape=shape.describe(),
                 note="the client's own call was forwarded instead and answered; guard no "
                 "longer adds them to this upstream's calls of this shape (until a reload). "
                 "Lower or unset the options (vLLM: --max-logprobs must be at least "
                 "sample_logprobs)")
        return upstream

    def _upstream_failed(self, status: int, message: str) -> web.Response:
        self._unusable("upstream_error")
        return super()._upstream_failed(status, message)

    def _left_early(self, tokens: int = 0) -> None:
        self._unusable("incomplete")
        super()._left_early(tokens)

    # -- a whole answer ----------------------------------------------------------------------
    async def _whole(self, upstream: Response) -> web.StreamResponse:
        body = await self._body(upstream)
        if isinstance(body, web.Response):
            return body
        ok = 200 <= upstream.status < 300
        response = await self._write_whole(upstream, body, self.edits)
        # The client has its answer: the accounting and the hand-off come after.
        seconds = time.perf_counter() - self.started
        if not ok:
            self._error(api.status_code_name(upstream.status))
            self._unusable("upstream_error")
            return response
        self._served(seconds)
        completion = api.gather_answer(self.call.endpoint, body, streamed=False)
        if completion.completion_tokens:
            self.edge.metrics.tokens.labels(self.model.name, self.route).inc(
                completion.completion_tokens)
        self._hand_off(completion, seconds, streamed=False)
        return response

    # -- a streamed answer -------------------------------------------------------------------
    async def _stream(self, upstream: Response,
                      response: web.StreamResponse | None = None) -> web.StreamResponse:
        """Relay a streamed answer event by event, as it comes. ``response``: the client's,
        already opened, where this is the client's own call going again (_amended_stream_empty)."""
        metrics, name, route = self.edge.metrics, self.model.name, self.route
        ttft, gaps = metrics.ttft.labels(name, route), metrics.gaps.labels(name, route)
        if response is None:
            response = web.StreamResponse(status=200, headers=self._headers(upstream))
            await response.prepare(self.request)
        splitter = api.EventSplitter(self.edge.config.max_message_bytes)
        received = False  # a byte of the stream came
        edits, endpoint = self.edits, self.call.endpoint
        sampled = bool(self.flags)  # a sampled call's chunks are gathered into its sample
        completion = api.Completion()
        tokens, last = 0, None
        # The gaps are one completion's: a stream of several interleaves theirs (its time to
        # first token is still the first of any).
        timed_gaps = not self.call.several_completions
        done = False  # the client has every event: "[DONE]" went out
        finished = False  # the stream's own end came: [DONE], the Responses API's last event

        def account(events: list[bytes], arrived: float) -> None:
            """Bookkeeping of events the client has, for the metrics and the sample. Tokens
            are told from the event's bytes; only a sampled call's events are parsed (and an
            unsampled one's that may carry an error or the usage)."""
            nonlocal tokens, last, done, finished
            for event in events:
                data = api.event_data(event)
                if data is None:
                    continue
                if data == api.DONE:
                    done = finished = True
                    continue
                if api.data_has_content(data, endpoint):
                    tokens += 1
                    if last is None:
                        self.first_token = arrived - self.started
                        ttft.observe(self.first_token)
                    elif timed_gaps:
                        gaps.observe(arrived - last)
                    last = arrived
                if sampled or api.data_needs_parse(data, endpoint):
                    api.gather_event(completion, endpoint, data, whole=sampled)
                    if completion.ended:  # the Responses API's last event
                        done = finished = True

        try:
            async for chunk in upstream.iter_any():
                arrived = time.perf_counter()
                received = True  # (iter_any yields no empty piece)
                events = splitter.feed(chunk)
                if not events:
                    continue
                await response.write(b"".join([api.edit_event(e, edits) for e in events])
                                     if edits else b"".join(events))
                account(events, arrived)
            if not received and self.amended:
                return await self._amended_stream_empty(upstream, response)
            # A last event without its blank line (the stream's end ends it for a client
            # that reads it): edited and counted as the others.
            rest = splitter.rest()
            if rest:
                await response.write(api.edit_event(rest, edits) if edits else rest)
                account([rest], time.perf_counter())
            done = True
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            if done:  # the client left after the last event (clients close at [DONE])
                self._streamed(completion, tokens, sampled, finished)
                if isinstance(exc, ConnectionResetError):
                    # Only the chunked body's end found the socket closed: the client has
                    # every event, nothing failed (aiohttp would log it as an error).
                    return response
                raise
            # The client went away (or the shutdown cut the call): closing the upstream
            # connection (``run``'s finally) stops the upstream's generation.
            self._left_early(tokens)
            raise
        except (UpstreamError, TimeoutError, api.EventTooLarge) as exc:
            if done:  # the upstream broke off after [DONE]: the client has its answer
                self._streamed(completion, tokens, sampled, finished)
                return response
            self._unusable("incomplete")
            return await self._broke_off(response, splitter, exc, tokens=tokens)
        self._streamed(completion, tokens, sampled, finished)
        return response

    async def _amended_stream_empty(self, upstream: Response,
                                    response: web.StreamResponse) -> web.StreamResponse:
        """The upstream ended a stream guard had amended without a byte: llama-cpp-python's
        server, started without --logits_all, opens the stream and then fails any call that
        asks logprobs (its log says so; the client would get an empty answer). Nothing has
        reached the client but the headers, so the client's own call goes again
        (_as_the_client_asked, the refusal remembered per shape) and its stream is relayed
        into the response already open. A retry that is not a stream cannot be told through
        a 200 already sent: the connection is cut, as for an upstream that broke off."""
        upstream.discard()
        retry = await self._as_the_client_asked(
            upstream, why="the stream ended without a byte (llama-cpp-python's server does so "
            "to a call asking logprobs when started without --logits_all)")
        if isinstance(retry, web.Response):  # the upstream failed outright: said and counted
            if self.request.transport is not None:
                self.request.transport.close()
            return response
        try:
            if _streams(retry):
                return await self._stream(retry, response)
            self._unusable("upstream_error")
            return await self._broke_off(response, api.EventSplitter(), UpstreamError(
                f"the client's own call was answered HTTP {retry.status}, not a stream"))
        finally:
            retry.close()

    def _streamed(self, completion: api.Completion, tokens: int, sampled: bool,
                  finished: bool) -> None:
        """The accounting of a stream the upstream closed, and its hand-off. ``finished``:
        its own end came ([DONE], or a Responses stream's last event); a stream closed
        cleanly before it is answered as it came but its completion is not comparable
        (incomplete), as the Envoy observer counts it: its end is missing."""
        metrics, name, route = self.edge.metrics, self.model.name, self.route
        seconds = time.perf_counter() - self.started
        tokens = completion.completion_tokens or tokens
        if tokens:
            metrics.tokens.labels(name, route).inc(tokens)
        if completion.error:
            self._error("INTERNAL")
            self._unusable("upstream_error")
            return
        self._served(seconds)
        if sampled:
            self._hand_off(completion, seconds, streamed=True, finished=finished)

    # -- the hand-off ------------------------------------------------------------------------
    def _hand_off(self, completion: api.Completion, seconds: float, streamed: bool,
                  finished: bool = True) -> None:
        if not self.flags:
            return
        # (A tool chat's prompt ids may be the verifier's to ask of the primary's server, a
        # streamed one the verifier's to probe.)
        options = cast(OpenAIBackend, self.model.backends["primary"]).options
        unusable = api.unusable(completion, self.call, options.asks_prompt_ids,
                                options.probes_streamed_tool_chats) or (
            "" if finished else "incomplete")
        if unusable:
            self._unusable(unusable)
            return
        try:
            sample = api.build_sample(
                self.call, completion, route=self.route, request_id=self.request_id,
                streamed=streamed, unix_nanos=time.time_ns(), request_seconds=seconds,
                first_token_seconds=self.first_token, guard_logprobs=self.guard_logprobs)
        except (TypeError, ValueError, KeyError, AttributeError):
            # A request field of a shape the sample's reading missed (the client has its
            # answer): counted and logged, never a lost sample nor a failed handler.
            log.exception("a sampled call of %s made no sample", self.model.name)
            self._unusable("input")
            return
        self.model.hand_off(self.flags, self.request_id, self.route, self.epoch, seconds,
                            wire.Generation(sample))



class _PassThrough(_Upstream):
    """One call to an endpoint guard does not check, forwarded: the answer goes back as the
    upstream writes it, chunk by chunk (a stream stays a stream), with the client's model name
    set back where the upstream serves another. Counted as every call is
    (``guard_requests_total`` for a 2xx answer the client got whole, else
    ``guard_request_errors_total{code}``)."""

    def __init__(self, edge: OpenAIEdge, request: web.Request, model: ServedModel,
                 route: str, backend: OpenAIBackend, request_id: str, started: float,
                 data: bytes, spills: bool = False):
        super().__init__(edge, request, model, route, backend, request_id, started, spills)
        # The upstream's name in the body (put in where the client named none), guard's in
        # the answer: at its top level, and in the response object the Responses API's
        # events carry.
        self.edits = api.answer_edits(model.name, False)
        self.edits[RESPONSE_MODEL_PATH] = self.edits[api.MODEL_PATH]
        self.payload = api.set_model(data, backend.model)

    async def _run(self) -> web.StreamResponse:
        upstream = await self._exchange(self.request.raw_path, self.payload)  # as sent
        if isinstance(upstream, web.Response):
            return upstream
        try:
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                return await self._relay(upstream)
            return await self._whole(upstream)
        finally:
            upstream.close()

    async def _whole(self, upstream: Response) -> web.StreamResponse:
        """One document (JSON, or whatever the upstream sent), edited whole."""
        body = await self._body(upstream)
        if isinstance(body, web.Response):
            return body
        response = await self._write_whole(upstream, body, self.edits)
        self._answered(upstream.status)
        return response

    async def _relay(self, upstream: Response) -> web.StreamResponse:
        """Events, written as they arrive (edited one by one where the names differ)."""
        stream = web.StreamResponse(status=upstream.status, headers=self._headers(upstream))
        await stream.prepare(self.request)
        splitter = api.EventSplitter(self.edge.config.max_message_bytes)
        done = False  # the client has every byte
        try:
            async for chunk in upstream.iter_any():
                if self.edits:
                    chunk = b"".join(api.edit_event(e, self.edits) for e in splitter.feed(chunk))
                if chunk:
                    await stream.write(chunk)
            rest = splitter.rest()
            if rest:
                await stream.write(api.edit_event(rest, self.edits) if self.edits else rest)
            done = True
            await stream.write_eof()
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            if done:  # the client left after the last byte (only the body's end found it gone)
                self._answered(upstream.status)
                if isinstance(exc, ConnectionResetError):
                    return stream
                raise
            self._left_early()  # (the upstream's connection closes)
            raise
        except (UpstreamError, TimeoutError, api.EventTooLarge) as exc:
            return await self._broke_off(stream, splitter, exc, path=self.request.path)
        self._answered(upstream.status)
        return stream

    def _answered(self, status: int) -> None:
        if 200 <= status < 300:
            self._served(time.perf_counter() - self.started)
        else:
            self._error(api.status_code_name(status))
