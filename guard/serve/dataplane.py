"""The protocol-independent data plane (MLServer's split): route and answer, nothing else.

``infer()`` reads top to bottom as the request path: refuse what cannot be served (deadline
passed, too many in flight), find the model, check the inputs against its signature, read the
route word, run that backend (inline, on the inference thread pool, or forwarded upstream),
count, hand a sampled request to the verifier (a copy into shared memory, never a wait), filter
the requested outputs. ``forward()`` is the same path for bytes that go upstream unparsed. Both
account through one ``Call`` (admission, in flight, timing, metrics, hand-off, errors). The gRPC
servicer is a thin translation layer over this class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from guard.backends.base import SKIP_S, Backend, Forwarding, ForwardingError, \
    ForwardingUnreachable
from guard.ipc import wire
from guard.observe.events import emit
from guard.observe.metrics import UNKNOWN_MODEL, GuardMetrics
from guard.protocol.codec import InferenceError, InferenceRequest, invalid
from guard.protocol.inputs import check_inputs
from guard.serve.model import ServedModel

log = logging.getLogger("guard.dataplane")
# The one version guard serves of each model: its metadata lists "1", and "" asks for the
# latest (KServe v2). Another is NOT_FOUND, as Triton answers a version it does not have; the
# upstream's own version is the backend's ``options.model_version``, never the client's.
SERVED_VERSIONS = ("", "1")
# gRPC cancels a call at its deadline; ``Call.started`` is taken a few microseconds after the
# remaining time was read, so a cancellation this close to the deadline is the deadline's.
_DEADLINE_SLACK_S = 0.002


def served_version(model: str, version: str) -> None:
    """NOT_FOUND for a version of ``model`` guard does not serve (``SERVED_VERSIONS``)."""
    if version not in SERVED_VERSIONS:
        raise InferenceError("NOT_FOUND", f"model '{model}' has no version '{version}' (guard "
                             "serves version 1 of each model)")


@dataclass
class InferenceResult:
    """What answered and how: local outputs to encode, or an upstream's response as it came."""

    route: str
    outputs: dict[str, np.ndarray] | None = None
    message: pb.ModelInferResponse | None = None


class DataPlane:
    def __init__(self, models: dict[str, ServedModel], metrics: GuardMetrics, workers: int,
                 max_concurrent: int = 256):
        self.models = models
        self.metrics = metrics
        # workers == 0: inference inline on the event loop (see ServerConfig.workers).
        self.executor = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="guard-infer")
                         if workers else None)
        self.max_concurrent = max_concurrent
        self.in_flight = 0  # requests inside a backend; the event loop thread only
        self.forwards = False
        self.live = True
        self.loading = True  # until the server has loaded every model of its config

    def models_changed(self) -> None:
        """After a load or reload: does any model forward to an upstream (which needs the
        client's metadata, read per request only then)?"""
        self.forwards = any(isinstance(b, Forwarding)
                            for m in self.models.values() for b in m.backends.values())

    @property
    def ready(self) -> bool:
        return self.live and not self.loading and all(m.ready for m in self.models.values())

    def model(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None and self.loading:
            raise InferenceError("UNAVAILABLE", "models are still loading")
        if model is None:
            raise InferenceError("NOT_FOUND", f"unknown model '{name}' (this guard serves: "
                                 f"{', '.join(sorted(self.models))})")
        return model

    async def infer(self, request: InferenceRequest,
                    timeout: float | None = None) -> InferenceResult:
        """The request path. ``timeout``: the client's remaining deadline, if it sent one."""
        with Call(self, request.model_name, timeout) as call:
            model = call.model
            served_version(model.name, request.model_version)
            check_inputs(request.inputs, model.input_specs)
            if request.requested_outputs and model.output_names:
                unknown = [n for n in request.requested_outputs if n not in model.output_names]
                if unknown:
                    raise invalid(f"unknown output '{unknown[0]}' requested (the model "
                                  f"gives: {', '.join(sorted(model.output_names))})")
            backend = call.route()
            if model.inline.get(call.routed, False):  # no coroutine for what runs inline
                result = InferenceResult(call.routed, outputs=backend.infer(request.inputs))
            else:
                result = await self._run(call, backend, request, timeout)
            call.answered()
            outputs = result.outputs
            if outputs is not None:
                # A local backend computed every output: all are handed off and compared.
                call.hand_off(request.id, wire.Tensors, request.inputs, outputs)
                if request.requested_outputs:
                    result.outputs = {n: outputs[n] for n in request.requested_outputs
                                      if n in outputs}
            else:  # an upstream's answer: decoded, if sampled, in the verifier
                call.hand_off(request.id, wire.Messages, request.message, result.message)
            return result

    async def forward(self, model: ServedModel, data: bytes, request_id: str,
                      timeout: float | None, metadata, version: str = "") -> bytes:
        """The request path of a model whose every backend is an upstream: the client's bytes
        go on as they are and the upstream's answer comes back unparsed, with the route added
        (guard/protocol/raw.py). The upstream validates the request and its gRPC status comes
        back unchanged."""
        with Call(self, model.name, timeout) as call:
            served_version(model.name, version)
            # (forward() serves the models whose every backend forwards: ``forwards``)
            backend = cast(Forwarding, call.route())
            try:
                answer = await backend.forward_raw(data, timeout, metadata)
            except ForwardingUnreachable as exc:  # a fallback that is down: the primary's
                answer = await cast(Forwarding, call.spill(exc)).forward_raw(
                    data, timeout, metadata)
            call.answered()
            call.hand_off(request_id, wire.Messages, data, answer)
            return answer + model.route_suffix[call.routed]

    def admit(self, name: str, timeout: float | None) -> ServedModel:
        """Refuse what must not run: a passed deadline, one request too many, an unknown or
        unready model."""
        if timeout is not None and timeout <= 0:
            raise InferenceError("DEADLINE_EXCEEDED", "the deadline passed before the request "
                                 "was run")
        if self.in_flight >= self.max_concurrent:
            raise InferenceError("RESOURCE_EXHAUSTED", f"{self.in_flight} requests in flight "
                                 f"(server.max_concurrent_requests); retry later")
        model = self.model(name)
        if not model.ready:
            raise InferenceError("UNAVAILABLE", f"model '{model.name}' is not ready")
        return model

    async def _run(self, call: "Call", backend: Backend, request: InferenceRequest,
                   timeout: float | None) -> InferenceResult:
        """A backend that does not run inline (``ServedModel.inline``, measured at load
        against server.inline_below_ms): an upstream, or a hop to the inference threads. A
        fallback upstream that is down: the primary answers (``Call.spill``)."""
        if isinstance(backend, Forwarding) and request.message is not None:
            try:
                message = await backend.forward(request.message, timeout, request.metadata)
            except ForwardingUnreachable as exc:
                return await self._run(call, call.spill(exc), request, timeout)
            return InferenceResult(call.routed, message=message)
        if self.executor is None:  # server.workers 0: everything inline
            return InferenceResult(call.routed, outputs=backend.infer(request.inputs))
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, backend.infer, request.inputs)
        return InferenceResult(call.routed, outputs=outputs)

    def count_error(self, model_name: str, status: str) -> None:
        """One failed request (``guard_request_errors_total``): by the data plane for what it
        raises (``Call``), by the servicer for what it cannot parse."""
        label = model_name if model_name in self.models else UNKNOWN_MODEL
        self.metrics.request_errors.labels(label, status).inc()

    def close(self) -> None:
        self.live = False
        if self.executor is not None:
            self.executor.shutdown(wait=True)


class Call:
    """One request's accounting, the same for ``infer`` and ``forward`` (MLServer keeps timing,
    counting and errors in one context manager too): admission on entry, the in-flight counts
    while a backend has it (``route``), the duration and ``guard_requests_total`` once it
    answered (``answered``), the hand-off to the verifier (``hand_off``), and every error
    counted where it is raised (``guard_request_errors_total``, on exit). A backend's failure
    reaches the client as the route that failed and why: an upstream's own status, or INTERNAL
    (the log also gets the backend; artifact paths stay out of what clients see).

    A model on its fallback whose fallback server no connection can be made to is answered
    by its primary (``spill``): a drifting answer beats none, and probes ride on answered
    calls, so a fallback that is down and answered UNAVAILABLE would have stayed the route
    for good. The OpenAI edge does the same (``OpenAIEdge._on_route``).

    One small object per request, no label lookups: the metric children are the model's,
    resolved when it was loaded."""

    __slots__ = ("plane", "name", "timeout", "model", "started", "seconds", "routed", "epoch",
                 "probing", "backend", "spilled")

    def __init__(self, plane: DataPlane, name: str, timeout: float | None):
        self.plane = plane
        self.name = name
        self.timeout = timeout
        self.backend: Backend | None = None  # while a backend has the request

    def __enter__(self) -> "Call":
        self.started = time.perf_counter()
        try:
            self.model = self.plane.admit(self.name, self.timeout)
        except InferenceError as exc:
            self.plane.count_error(self.name, exc.status)
            raise
        return self

    def route(self) -> Backend:
        """The backend the route word names; the request is in flight from here."""
        model = self.model
        self.routed, self.epoch, self.probing, backend = model.route()
        self.spilled = False
        if self.routed == "fallback" and isinstance(backend, Forwarding) and backend.skipped:
            backend = self._to_primary()
        self.backend = backend
        self.plane.in_flight += 1
        model.requests_in_flight += 1
        return backend

    def spill(self, unreachable: ForwardingUnreachable) -> Backend:
        """The fallback server could not be reached (the call was not sent): it is skipped
        for ``SKIP_S`` and the call goes to the primary, counted there (``guard-route``
        primary), sampled as a probe while the route probes (``hand_off``; event
        ``fallback_unreachable``). Raises ``unreachable`` where the call was not on the
        fallback: the primary has no other."""
        if self.routed != "fallback" or self.spilled:
            raise unreachable
        fallback = cast(Forwarding, self.backend)
        fallback.skip(SKIP_S)
        emit("fallback_unreachable", model=self.model.name, error=str(unreachable),
             skipped_s=SKIP_S, note="its calls are answered by the primary until it is "
             "tried again")
        return self._to_primary()

    def _to_primary(self) -> Backend:
        self.routed, self.spilled = "primary", True
        self.backend = self.model.backends["primary"]
        return self.backend

    def answered(self) -> None:
        """The backend answered: out of flight, timed and counted; an answer that came after
        the client's deadline (a backend run inline holds the event loop, so gRPC could not
        cancel the call) reached no one: DEADLINE_EXCEEDED, as the client saw it."""
        self._leave()
        self.seconds = time.perf_counter() - self.started
        if self.timeout is not None and self.seconds >= self.timeout:
            self.plane.count_error(self.name, "DEADLINE_EXCEEDED")
            return
        self.model.answered(self.routed, self.seconds)

    def hand_off(self, request_id: str, payload: type, first, second) -> None:
        """A sampled request to the verifier: ``payload(first, second)`` (``wire.Tensors``
        with inputs and outputs, ``wire.Messages`` with the request and the answer), built only
        when the request is sampled; nothing at all when the model samples nothing."""
        model = self.model
        if not model.samples:
            return
        # The primary standing in for the fallback (``spill``) is sampled as the fallback's
        # calls are, mirrored only while probing: its answer is then a probe of the primary
        # as it came, the only probes there are while the fallback is down.
        flags = model.sample_flags(request_id, "fallback" if self.spilled else self.routed,
                                   self.probing)
        if flags:
            model.hand_off(flags, request_id, self.routed, self.epoch, self.seconds,
                           payload(first, second))

    def _leave(self) -> None:
        if self.backend is not None:
            self.backend = None
            self.plane.in_flight -= 1
            self.model.requests_in_flight -= 1

    def __exit__(self, kind, exc, traceback) -> None:
        if exc is None:
            return
        backend, model = self.backend, self.model
        self._leave()
        if not isinstance(exc, Exception):  # a cancelled call: the client's deadline, or the
            # client went away (no error: nothing failed that guard could tell)
            if self.timeout is not None and time.perf_counter() - self.started >= \
                    self.timeout - _DEADLINE_SLACK_S:
                self.plane.count_error(self.name, "DEADLINE_EXCEEDED")
            return
        if isinstance(exc, InferenceError):
            self.plane.count_error(self.name, exc.status)
            return
        if isinstance(exc, ForwardingError):
            self.plane.count_error(self.name, exc.status)
            raise InferenceError(exc.status, f"model '{model.name}': {exc}") from None
        self.plane.count_error(self.name, "INTERNAL")
        if backend is None:  # not the backend's failure: a fault of guard's, the servicer logs it
            return
        log.warning("model %s: %s backend (%s) failed: %s: %s", model.name, self.routed,
                    backend.describe().summary(), type(exc).__name__, exc)
        raise InferenceError("INTERNAL", f"model '{model.name}': {self.routed} backend failed: "
                             f"{type(exc).__name__}: {exc}") from exc
