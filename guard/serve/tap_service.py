"""The guard.v1.Tap service (tap mode): observe answered requests, tell the server the route.
(Not Envoy's tap filter, through which Envoy mode observes calls: guard/envoy/tap_filter.py.)

Opt-in and authenticated: the service listens on its own listener (``server.tap``: loopback by
default, or mutual TLS with an allow-list of client identities) and knows only the models
declared ``tap: true``. A model guard answers in the path is never tapped: Observe or
WatchRoute for it is FAILED_PRECONDITION, so a tap sample can never feed the detectors of a
model whose route guard switches for its own clients (and guard never answers a tap model:
ModelInfer for it is FAILED_PRECONDITION too, see ServedModel.route). A caller outside the
allow-list gets PERMISSION_DENIED.

A model server that cannot put guard in its request path calls ``Observe`` with each request and the
response it already gave; guard hands a sampled pair to the verifier exactly as if it had answered
itself (as protocol bytes: decoded only there) and returns at once. ``WatchRoute`` streams the route
guard wants (the current one first, then every change), so the server can switch to its own
fallback. Observed requests count in ``guard_requests_total`` under the route the server says
answered.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as oip

from guard.ipc import wire
from guard.protocol.codec import InferenceError, decode_request, decode_response
from guard.serve.lookup import model_or_abort
from guard.serve.model import ServedModel
from guard.serve.tls import CallerCheck
from guard.v1 import tap_pb2 as pb
from guard.v1 import tap_pb2_grpc as pb_grpc


async def tapped_or_abort(models: dict[str, ServedModel], name: str, context) -> ServedModel:
    model = await model_or_abort(models, name, context)
    if not model.tap:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"model '{name}' is served by guard in the request path, not "
                            "tapped: the Tap service takes only models declared 'tap: true'")
    return model


class TapService(pb_grpc.TapServicer):
    def __init__(self, models: dict[str, ServedModel], callers: CallerCheck | None = None):
        self.models = models
        self.callers = callers or CallerCheck("tap")  # server.tap.tls's allow-list

    async def Observe(self, request: pb.ObserveRequest, context) -> pb.ObserveResponse:
        await self.callers.check(context, "Observe")
        served_by = request.served_by or "primary"
        if served_by not in ("primary", "fallback"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "served_by must be 'primary' or 'fallback'")
        try:
            infer_request = oip.ModelInferRequest.FromString(request.request)
            response = oip.ModelInferResponse.FromString(request.response)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request/response are not KServe v2 messages: {exc}")
        try:  # consistent tensors (raw contents per output, sizes); decoded again if sampled
            decode_request(infer_request)
            decode_response(response)
        except InferenceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"observed pair: {exc}")
        model = await tapped_or_abort(self.models, infer_request.model_name, context)
        route, epoch, probing = model.route_word()
        model.requests[served_by].inc()
        flags = model.sample_flags(infer_request.id, served_by, probing)
        queued = bool(flags) and model.hand_off(flags, infer_request.id, served_by, epoch, 0.0,
                                                wire.Messages(request.request, request.response))
        return pb.ObserveResponse(sampled=queued, route=route)

    async def WatchRoute(self, request: pb.WatchRouteRequest, context):
        await self.callers.check(context, "WatchRoute")
        model = await tapped_or_abort(self.models, request.model, context)
        updates = model.watch_routes(asyncio.get_running_loop())
        try:
            last = model.last_transition
            yield pb.RouteUpdate(model=model.name, route=model.route_word()[0],
                                 reason=last["reason"] if last else "current route",
                                 unix_time=last["unix_time"] if last else 0.0)
            while True:
                transition = await updates.get()
                if transition is None:  # the server is stopping
                    return
                yield pb.RouteUpdate(model=model.name, route=transition["to_route"],
                                     reason=transition["reason"],
                                     unix_time=transition["unix_time"])
        finally:
            model.unwatch_routes(updates)
