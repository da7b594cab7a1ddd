"""The Open Inference Protocol gRPC servicer: translation only, over ``DataPlane``."""

from __future__ import annotations

import logging

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from guard import __version__
from guard.observe import tracing
from guard.serve.codec import InferenceError, decode_request, encode_response
from guard.serve.dataplane import DataPlane

log = logging.getLogger("guard.servicer")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, dataplane: DataPlane):
        self.dataplane = dataplane

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.dataplane.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.dataplane.ready)

    async def ModelReady(self, request, context):
        model = self.dataplane.models.get(request.name)
        return pb.ModelReadyResponse(ready=bool(model and model.ready))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="guard", version=__version__, extensions=[])

    async def ModelMetadata(self, request, context):
        try:
            model = self.dataplane.model(request.name)
        except InferenceError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        info = model.describe()
        response = pb.ModelMetadataResponse(
            name=model.name, versions=["1"], platform=f"guard/{info.backend}"
        )
        for spec, target in ((info.inputs, response.inputs), (info.outputs, response.outputs)):
            for s in spec:
                target.add(name=s.name, datatype=s.datatype, shape=list(s.shape))
        return response

    async def ModelInfer(self, request, context):
        if not tracing.enabled():  # no span work at all when tracing is off
            return await self._infer(request, context, None)
        with tracing.server_span("ModelInfer", context.invocation_metadata(),
                                 {"guard.model": request.model_name}) as span:
            return await self._infer(request, context, span)

    async def _infer(self, request, context, span):
        try:
            decoded = decode_request(request)
            if self.dataplane.forwards:  # only an upstream needs the client's metadata
                decoded.metadata = tuple(
                    (k, v) for k, v in (context.invocation_metadata() or ())
                    if isinstance(v, str) and not k.startswith(("grpc-", ":")))
            result = await self.dataplane.infer(decoded, context.time_remaining())
            if span is not None:
                tracing.set_attributes(span, {"guard.route": result.route})
            if result.message is not None:  # an upstream's answer, passed through
                result.message.parameters["guard_route"].string_param = result.route
                return result.message
            return encode_response(decoded, result.outputs, result.route)
        except InferenceError as exc:
            self.dataplane.count_error(request.model_name, exc.status)
            await context.abort(getattr(grpc.StatusCode, exc.status), str(exc))
        except Exception as exc:  # never let a bug take the server down with it
            log.exception("ModelInfer failed for model %s", request.model_name)
            self.dataplane.count_error(request.model_name, "INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"model '{request.model_name}': {type(exc).__name__}: {exc}")
