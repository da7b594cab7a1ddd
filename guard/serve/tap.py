"""The guard.v1.Tap service (tap mode): observe answered requests, tell the server the route.

A model server that cannot put guard in its request path calls ``Observe`` with each request and
the response it already gave; guard hands a sampled pair to the verifier exactly as if it had
answered itself (as protocol bytes: decoded only there) and returns at once. ``WatchRoute`` streams the route guard wants
(the current one first, then every change), so the server can switch to its own fallback.
Observed requests count in ``guard_requests_total`` under the route the server says answered.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as oip

from guard.serve.lookup import model_or_abort
from guard.serve.model import ServedModel
from guard.v1 import tap_pb2 as pb
from guard.v1 import tap_pb2_grpc as pb_grpc


class TapServicer(pb_grpc.TapServicer):
    def __init__(self, models: dict[str, ServedModel]):
        self.models = models

    async def Observe(self, request: pb.ObserveRequest, context) -> pb.ObserveResponse:
        served_by = request.served_by or "primary"
        if served_by not in ("primary", "fallback"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "served_by must be 'primary' or 'fallback'")
        try:
            infer_request = oip.ModelInferRequest.FromString(request.request)
            oip.ModelInferResponse.FromString(request.response)  # well-formed; decoded later
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request/response are not KServe v2 messages: {exc}")
        model = await model_or_abort(self.models, infer_request.model_name, context)
        route, epoch, probing, _ = model.route()
        model.requests[served_by].inc()
        queued = model.after_response(infer_request.id, served_by, epoch, probing, 0.0,
                                      request_message=request.request,
                                      response_message=request.response)
        return pb.ObserveResponse(sampled=queued, route=route)

    async def WatchRoute(self, request: pb.WatchRouteRequest, context):
        model = await model_or_abort(self.models, request.model, context)
        updates = model.watch_routes(asyncio.get_running_loop())
        try:
            last = model.last_transition
            yield pb.RouteUpdate(model=model.name, route=model.route()[0],
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
