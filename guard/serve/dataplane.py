"""The protocol-independent data plane (MLServer's split): route and answer, nothing else.

``infer()`` reads top to bottom as the request path: refuse what cannot be served (deadline
passed, too many in flight), find the model, check the inputs against its signature, read the
route word, run that backend (inline, on the inference thread pool, or forwarded upstream),
hand a sampled request to the verifier (a copy into shared memory, never a wait), filter the
requested outputs, count. The gRPC servicer is a thin translation layer over this class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from guard.backends.base import Forwarding, ForwardingError
from guard.observe.metrics import UNKNOWN_MODEL, GuardMetrics
from guard.protocol.inputs import check_inputs
from guard.protocol.codec import InferenceError, InferenceRequest, invalid
from guard.serve.model import ServedModel

log = logging.getLogger("guard.dataplane")


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
        started = time.perf_counter()
        model = self._admit(request.model_name, timeout)
        check_inputs(request.inputs, model.input_specs)
        unknown = [n for n in request.requested_outputs
                   if model.output_names and n not in model.output_names]
        if unknown:
            raise invalid(f"unknown output '{unknown[0]}' requested")

        route, epoch, probing, backend = model.route()
        self.in_flight += 1
        model.requests_in_flight += 1
        try:
            result = await self._run(backend, route, request, timeout,
                                     model.inline.get(route, False))
        except ForwardingError as exc:
            raise InferenceError(exc.status, f"model '{model.name}': {exc}") from None
        except Exception as exc:
            # The client learns which route failed and why; the log also gets the backend
            # (artifact paths stay out of what clients see).
            log.warning("model %s: %s backend (%s) failed: %s: %s", model.name, route,
                        backend.describe().summary(), type(exc).__name__, exc)
            raise InferenceError("INTERNAL", f"model '{model.name}': {route} backend failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.in_flight -= 1
            model.requests_in_flight -= 1

        seconds = time.perf_counter() - started
        outputs = result.outputs
        if outputs is not None:
            # A local backend computed every output: all are handed over and compared.
            model.after_response(request.id, route, epoch, probing, seconds,
                                 inputs=request.inputs, outputs=outputs)
            if request.requested_outputs:
                result.outputs = {n: outputs[n] for n in request.requested_outputs
                                  if n in outputs}
        else:  # an upstream's answer: decoded, if sampled, in the verifier
            model.after_response(request.id, route, epoch, probing, seconds,
                                 request_message=request.message,
                                 response_message=result.message)
        model.requests[route].inc()
        model.durations[route].observe(seconds)
        return result

    async def forward(self, model: ServedModel, data: bytes, request_id: str,
                      timeout: float | None, metadata) -> bytes:
        """The request path of a model whose every backend is an upstream: the client's bytes
        go on as they are and the upstream's answer comes back unparsed, with the route added
        (guard/protocol/raw.py). The upstream validates the request and its gRPC status comes
        back unchanged."""
        started = time.perf_counter()
        self._admit(model.name, timeout)
        route, epoch, probing, backend = model.route()
        self.in_flight += 1
        model.requests_in_flight += 1
        try:
            answer = await backend.forward_raw(data, timeout, metadata)
        except ForwardingError as exc:
            raise InferenceError(exc.status, f"model '{model.name}': {exc}") from None
        finally:
            self.in_flight -= 1
            model.requests_in_flight -= 1
        seconds = time.perf_counter() - started
        model.after_response(request_id, route, epoch, probing, seconds,
                             request_message=data, response_message=answer)
        model.requests[route].inc()
        model.durations[route].observe(seconds)
        return answer + model.route_suffix[route]

    def _admit(self, name: str, timeout: float | None) -> ServedModel:
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

    async def _run(self, backend, route: str, request: InferenceRequest,
                   timeout: float | None, inline: bool = False) -> InferenceResult:
        if isinstance(backend, Forwarding) and request.message is not None:
            return InferenceResult(route, message=await backend.forward(
                request.message, timeout, request.metadata))
        if inline or self.executor is None:  # cheaper than the hop (server.inline_below_ms)
            return InferenceResult(route, outputs=backend.infer(request.inputs))
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(self.executor, backend.infer, request.inputs)
        return InferenceResult(route, outputs=outputs)

    def count_error(self, model_name: str, status: str) -> None:
        label = model_name if model_name in self.models else UNKNOWN_MODEL
        self.metrics.request_errors.labels(label, status).inc()

    def close(self) -> None:
        self.live = False
        if self.executor is not None:
            self.executor.shutdown(wait=True)
