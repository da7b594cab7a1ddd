"""The guard.v1.Tap service (tap mode): observe answered requests, tell the server the route.

A model server that cannot put guard in its request path calls ``Observe`` with each request and
the response it already gave; guard decodes them, offers them to the model's mirror exactly as
if it had answered itself, and returns at once. ``WatchRoute`` streams the route guard wants
(the current one first, then every change), so the server can switch to its own fallback.
Observed requests count in ``guard_requests_total`` under the route the server says answered.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as oip

from guard.serve.codec import InferenceError, decode_request, decode_response
from guard.serve.lookup import model_or_abort
from guard.serve.model import GuardedModel
from guard.v1 import tap_pb2 as pb
from guard.v1 import tap_pb2_grpc as pb_grpc


class TapServicer(pb_grpc.TapServicer):
    def __init__(self, models: dict[str, GuardedModel]):
        self.models = models

    async def Observe(self, request: pb.ObserveRequest, context) -> pb.ObserveResponse:
        served_by = request.served_by or "primary"
        if served_by not in ("primary", "fallback"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "served_by must be 'primary' or 'fallback'")
        try:
            infer_request = oip.ModelInferRequest.FromString(request.request)
            infer_response = oip.ModelInferResponse.FromString(request.response)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request/response are not KServe v2 messages: {exc}")
        model = await model_or_abort(self.models, infer_request.model_name, context)
        try:
            decoded = decode_request(infer_request)
            outputs = decode_response(infer_response)
        except InferenceError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        epoch = model.policy.epoch
        model.metrics.requests.labels(model.name, served_by).inc()
        queued = model.after_response(decoded.id, decoded.inputs, outputs, served_by, epoch,
                                      decoded.requested_outputs)
        return pb.ObserveResponse(sampled=queued, route=model.policy.route)

    async def WatchRoute(self, request: pb.WatchRouteRequest, context):
        model = await model_or_abort(self.models, request.model, context)
        updates = model.watch_routes(asyncio.get_running_loop())
        try:
            last = model.policy.last_transition
            yield pb.RouteUpdate(model=model.name, route=model.policy.route,
                                 reason=last.reason if last else "current route",
                                 unix_time=last.unix_time if last else 0.0)
            while True:
                transition = await updates.get()
                if transition is None:  # the server is stopping
                    return
                yield pb.RouteUpdate(model=model.name, route=transition.to_route,
                                     reason=transition.reason, unix_time=transition.unix_time)
        finally:
            model.unwatch_routes(updates)
