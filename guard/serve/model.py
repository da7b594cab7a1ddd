"""One served model, in a serving process: the backends that answer (primary, fallback), the
route word that says which one, and the hand-off of sampled requests to the verifier.

The request path touches three things only: ``route()`` (one shared-memory load), ``sample_flags()``
(a sampling decision) and, for a sampled request, ``hand_off()`` (one copy of its ``wire.Sample``
into the sample ring) and the pre-resolved metric children. The reference, the checks, the
detectors, capture and the repair live in the verifier process (guard/verifier_process/model.py);
what they decide comes back as the route word and, for a repair, as ``use_primary``.
"""

from __future__ import annotations

import asyncio
import threading
import time

from guard.backends import Backend, BackendInfo, Forwarding, TensorSpec, create_backend
from guard.backends.loading import load_all
from guard.backends.signatures import check_fallback
from guard.config import ModelConfig
from guard.ipc import routes, wire
from guard.ipc.ring import SampleRing
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.protocol.codec import InferenceError, stamp_route
from guard.runtime.sampling import sampled


class ServedModel:
    def __init__(self, config: ModelConfig, metrics: GuardMetrics, table: routes.RouteTable,
                 slot: int, ring: SampleRing):
        self.name = config.name
        self.config = config
        self.tap = config.tap  # answered by its own server; observed over guard.v1.Tap only
        self.metrics = metrics
        self.table = table
        self.slot = slot
        self.ring = ring
        self.backends: dict[str, Backend] = {"primary": create_backend(config.primary, "primary")}
        if config.fallback is not None:
            self.backends["fallback"] = create_backend(config.fallback, "fallback")
        self.kept: list[str] = []  # ops the serving primary keeps back (a repair's variant)
        self._configured_primary: Backend | None = None  # while a repaired variant serves
        # What the request path samples: mirror (only with a reference) and capture mode "all".
        # Capture mode "failures" is decided on mirrored samples, in the verifier.
        self.mirror_rate = config.mirror.sample_rate if config.reference is not None else 0.0
        capture = config.capture
        self.capture_rate = capture.sample_rate if capture and capture.mode == "all" else 0.0
        # Whether the request path samples at all: when not, a request skips the hand-off call.
        self.samples = bool(self.mirror_rate or self.capture_rate)
        self._word_index = table.index(slot, routes.ROUTE)
        self.forwards_only = False
        self.inline: dict[str, bool] = {}  # role -> run on the event loop (measured at load)
        # Appended to an upstream's serialized answer: the client's model name and guard_route
        # (a parse of the answer would merge them the same way; guard/protocol/raw.py).
        self.route_suffix = {route: _route_suffix(self.name, route)
                             for route in ("primary", "fallback")}
        self.signature: BackendInfo | None = None
        self.input_specs: dict[str, TensorSpec] = {}
        self.output_names: frozenset[str] = frozenset()
        self.ready = False
        self.requests_in_flight = 0  # touched on the event loop thread only
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._watchers_lock = threading.Lock()
        self.last_transition: dict | None = None
        metrics.declare_served_model(self.name)
        # Metric children resolved once: no label lookup per request.
        self.requests = {r: metrics.requests.labels(self.name, r) for r in ("primary", "fallback")}
        self.durations = {r: metrics.request_duration.labels(self.name, r)
                          for r in ("primary", "fallback")}
        self._mirror_dropped = metrics.mirror.labels(self.name, "dropped")
        self._capture_dropped = (metrics.capture_records.labels(self.name, "dropped")
                                 if capture is not None else None)

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self, inline_below_ms: float = 0.0) -> None:
        """Load the serving backends; ``inline_below_ms`` (server.inline_below_ms): which of
        them answer fast enough to run inline on the event loop (measured here)."""
        load_all(self.name, self.config, self.backends)
        self._check_signatures()
        # The request path checks inputs against this; computed once, never per request.
        self.signature = self.backends["primary"].describe()
        self.input_specs = {spec.name: spec for spec in self.signature.inputs}
        self.output_names = frozenset(spec.name for spec in self.signature.outputs)
        # Every backend that can answer forwards (base.Forwarding): requests go through as bytes.
        self.forwards_only = all(isinstance(b, Forwarding) for b in self.backends.values())
        latency = {role: _median_ms(b) for role, b in self.backends.items()
                   if not isinstance(b, Forwarding)}
        self.inline = {role: ms is not None and ms < inline_below_ms
                       for role, ms in latency.items()}
        self.ready = True
        emit("model_loaded", model=self.name,
             backends={role: b.describe().summary() for role, b in self.backends.items()},
             mirror_rate=self.mirror_rate, action=self.config.policy.action,
             inline={role: {"inline": self.inline[role],
                            "median_ms": None if ms is None else round(ms, 4)}
                     for role, ms in latency.items()})

    async def connect(self) -> None:
        """On the server's event loop, after ``load``: open the request path's channels of
        upstream backends so the first request does not pay for the connection. One that does
        not connect in time is reported, not fatal."""
        for role, backend in self.backends.items():
            if isinstance(backend, Forwarding) and not await backend.connect():
                emit("upstream_not_connected", model=self.name, role=role,
                     note="the channel keeps connecting; requests wait for it")

    def _check_signatures(self) -> None:
        """A fallback must take the primary's inputs and give its outputs."""
        fallback = self.backends.get("fallback")
        if fallback is not None:
            check_fallback(self.name, self.backends["primary"].describe(), fallback.describe())

    def close(self) -> None:
        self.ready = False
        for backend in {id(b): b for b in (*self.backends.values(),
                                           self._configured_primary) if b}.values():
            backend.close()

    def describe(self) -> BackendInfo:
        return self.signature or self.backends["primary"].describe()

    # -- request path ------------------------------------------------------------------------------
    def route(self) -> tuple[str, int, bool, Backend]:
        """(route, epoch, probing, backend) for the next request, from the route word. A tap
        model is answered by its own server, never by guard: FAILED_PRECONDITION."""
        if self.tap:
            raise InferenceError("FAILED_PRECONDITION", f"model '{self.name}' is tapped "
                                 "('tap: true'): its own server answers it, guard does not")
        route, probing, epoch = routes.unpack(self.table.words[self._word_index])
        if route == "fallback":
            fallback = self.backends.get("fallback")
            if fallback is not None:
                return route, epoch, probing, fallback
        return "primary", epoch, False, self.backends["primary"]

    def route_word(self) -> tuple[str, int, bool]:
        """(route, epoch, probing) the route word says (tap mode: what the server should use)."""
        route, probing, epoch = routes.unpack(self.table.words[self._word_index])
        if route == "fallback" and "fallback" in self.backends:
            return route, epoch, probing
        return "primary", epoch, False

    def answered(self, route: str, seconds: float) -> None:
        """Count one answered request (``guard_requests_total``, its duration)."""
        self.requests[route].inc()
        self.durations[route].observe(seconds)

    def count_lost(self, samples: int) -> None:
        """Samples handed off but never checked (a verifier that died holding them): counted
        as mirror ``dropped``, like those the full ring refused."""
        self._mirror_dropped.inc(samples)

    def sample_flags(self, request_id: str, route: str, probing: bool) -> int:
        """Whether a request is sampled, and for what (``wire.MIRROR``, ``wire.CAPTURE``); 0
        when not. Within the dwell time on the fallback nothing is mirrored."""
        flags = 0
        if self.mirror_rate and (route != "fallback" or probing) and sampled(
                request_id, self.mirror_rate):
            flags |= wire.MIRROR
        if self.capture_rate and sampled(request_id, self.capture_rate):
            flags |= wire.CAPTURE
        return flags

    def hand_off(self, flags: int, request_id: str, route: str, epoch: int, seconds: float,
                 payload: wire.Payload) -> bool:
        """A sampled request to the verifier (``flags`` from ``sample_flags``); True when it
        went into the ring. Local answers go as ``wire.Tensors``; an upstream's or a tap's as
        ``wire.Messages`` (serialized bytes, or message objects serialized only here), decoded
        only in the verifier."""
        return wire.hand_off(self.ring, wire.Sample(
            self.name, self.slot, route, epoch, flags, request_id, tracing.traceparent(),
            seconds, payload), self._mirror_dropped, self._capture_dropped)

    # -- from the verifier (through ModelRegistry.use_primary) ---------------------------------
    def use_primary(self, kept: list[str], primary: dict | None = None) -> None:
        """Serve the primary with ``kept`` ops held back at full precision, built from
        ``primary`` (the rebuilt backend block's wire form: a repair's winner, derived by the
        verifier), or as configured (``[]``). Requests in flight keep the backend object they
        were given."""
        if not kept:
            if self._configured_primary is not None:
                repaired = self.backends["primary"]
                self.backends["primary"] = self._configured_primary
                self._configured_primary, self.kept = None, []
                repaired.close()
            return
        if primary is None:
            raise ValueError(f"model '{self.name}': ops kept back without the rebuilt primary")
        from guard.ipc.config import backend_from_wire

        spec = backend_from_wire(primary, self.config.primary.context)
        backend = create_backend(spec, "primary")
        backend.load()
        if self._configured_primary is None:
            self._configured_primary = self.backends["primary"]
        self.backends["primary"] = backend
        self.kept = list(kept)

    def transition(self, message: dict) -> None:
        """A route transition the verifier made: for WatchRoute streams (tap mode)."""
        self.last_transition = message
        self._notify_watchers(message)

    # -- route watchers (tap mode) --------------------------------------------------------------
    def watch_routes(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """A queue that receives every route transition from now on (from any thread)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._watchers_lock:
            self._watchers.append((loop, queue))
        return queue

    def unwatch_routes(self, queue: asyncio.Queue) -> None:
        with self._watchers_lock:
            self._watchers = [(loop, q) for loop, q in self._watchers if q is not queue]

    def end_watches(self) -> None:
        """Ends every WatchRoute stream (at shutdown, so that it does not wait out the grace)."""
        self._notify_watchers(None)

    def _notify_watchers(self, transition: dict | None) -> None:
        with self._watchers_lock:
            watchers = list(self._watchers)
        for loop, queue in watchers:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, transition)


def _median_ms(backend: Backend, calls: int = 7) -> float | None:
    """Median milliseconds of a batch-1 inference on inputs generated from the signature
    (after one warm-up call); None when no inputs can be generated or the call fails."""
    from guard.protocol.synthetic import generate_inputs

    try:
        inputs = generate_inputs(backend.describe().inputs, rows=1)
        backend.infer(inputs)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            backend.infer(inputs)
            times.append(time.perf_counter() - started)
    except Exception:  # a signature guard cannot fill, a model that wants other inputs
        return None
    return sorted(times)[len(times) // 2] * 1e3


def _route_suffix(model: str, route: str) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    response = pb.ModelInferResponse(model_name=model)
    stamp_route(response, route)
    return response.SerializeToString()

