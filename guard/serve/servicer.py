"""The Open Inference Protocol gRPC servicer: translation only, over ``DataPlane``.

ModelInfer is registered on bytes (``add_to_server``): a model whose every backend is an
upstream gets the client's bytes forwarded without a parse (``DataPlane.forward``); any other
request is parsed here, as gRPC would have, and answered through ``DataPlane.infer``. The other
RPCs are registered from the service descriptor as usual."""

from __future__ import annotations

import logging

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from guard import __version__
from guard.observe import tracing
from guard.protocol import raw
from guard.protocol.codec import InferenceError, decode_request, encode_response, stamp_route
from guard.serve.dataplane import SERVED_VERSIONS, DataPlane, served_version
from guard.serve.lookup import abort
from guard.serve.model import ServedModel

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
        return pb.ModelReadyResponse(ready=bool(model and model.ready
                                                and request.version in SERVED_VERSIONS))

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="guard", version=__version__, extensions=[])

    async def ModelMetadata(self, request, context):
        try:
            model = self.dataplane.model(request.name)
            served_version(model.name, request.version)
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

    async def ModelInferBytes(self, data: bytes, context) -> bytes:
        """ModelInfer as registered: peek at the model name and id; forward the bytes, or parse
        and answer."""
        model: ServedModel | None = None
        name = request_id = version = ""
        if self.dataplane.forwards:  # only then can a request skip the parse
            try:
                name, version, request_id = raw.peek(data)
            except raw.MalformedMessage as exc:
                self.dataplane.count_error("", "INVALID_ARGUMENT")
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                            f"not a ModelInferRequest: {exc}")
            model = self.dataplane.models.get(name)
        if model is None or not model.forwards_only:
            try:
                request = pb.ModelInferRequest.FromString(data)
            except DecodeError as exc:
                self.dataplane.count_error(name or "", "INVALID_ARGUMENT")
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                            f"not a ModelInferRequest: {exc}")
            if not tracing.enabled():  # the common case: one coroutine, no span work
                return (await self._infer(request, context, None)).SerializeToString()
            return (await self.ModelInfer(request, context)).SerializeToString()
        if not tracing.enabled():
            return await self._forward(model, data, request_id, version, context, None)
        with tracing.server_span("ModelInfer", context.invocation_metadata(),
                                 {"guard.model": name}) as span:
            return await self._forward(model, data, request_id, version, context, span)

    async def _forward(self, model, data: bytes, request_id: str, version: str, context,
                       span) -> bytes:
        try:
            answer = await self.dataplane.forward(model, data, request_id,
                                                  context.time_remaining(),
                                                  _client_metadata(context), version)
        except Exception as exc:  # counted by the data plane, where it was raised
            await _abort(context, model.name, exc)
        if span is not None:
            tracing.set_attributes(span, {"guard.route": "forwarded"})
        return answer

    async def ModelInfer(self, request, context):
        if not tracing.enabled():  # no span work at all when tracing is off
            return await self._infer(request, context, None)
        with tracing.server_span("ModelInfer", context.invocation_metadata(),
                                 {"guard.model": request.model_name}) as span:
            return await self._infer(request, context, span)

    async def _infer(self, request, context, span):
        """Parse, answer through the data plane, encode. An error is counted where it is
        raised: the data plane counts its own, this servicer what it parses and encodes."""
        name = request.model_name
        try:
            decoded = decode_request(request)
        except Exception as exc:
            await self._failed(context, name, exc)
        if self.dataplane.forwards:  # only an upstream needs the client's metadata
            decoded.metadata = _client_metadata(context)
        try:
            result = await self.dataplane.infer(decoded, context.time_remaining())
        except Exception as exc:  # counted by the data plane
            await _abort(context, name, exc)
        if span is not None:
            tracing.set_attributes(span, {"guard.route": result.route})
        if result.message is not None:  # an upstream's answer, passed through
            stamp_route(result.message, result.route)
            return result.message
        assert result.outputs is not None  # (no message: guard's own answer)
        try:
            return encode_response(decoded, result.outputs, result.route)
        except Exception as exc:
            await self._failed(context, name, exc)

    async def _failed(self, context, model_name: str, exc: Exception) -> None:
        """A request that failed here, in the servicer: counted, then ended."""
        self.dataplane.count_error(
            model_name, exc.status if isinstance(exc, InferenceError) else "INTERNAL")
        await _abort(context, model_name, exc)


async def _abort(context, model_name: str, exc: Exception) -> None:
    """End the call with ``exc``'s status (``context.abort`` raises). Anything but an
    ``InferenceError`` is a fault of guard's: logged, INTERNAL (never let a bug take the server
    down with it)."""
    if isinstance(exc, InferenceError):
        await context.abort(getattr(grpc.StatusCode, exc.status), str(exc))
    else:
        log.error("ModelInfer failed for model %s", model_name, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"model '{model_name}': {type(exc).__name__}: {exc}")


def _client_metadata(context) -> tuple[tuple[str, str], ...]:
    """The client's gRPC metadata to forward upstream (auth headers, trace context...)."""
    return tuple((k, v) for k, v in (context.invocation_metadata() or ())
                 if isinstance(v, str) and not k.startswith(("grpc-", ":")))


_HANDLER = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}


def add_to_server(servicer: InferenceServicer, server) -> None:
    """Register the inference service like the generated ``add_..._to_server``, from the same
    descriptor, except ModelInfer, which takes and returns bytes (``ModelInferBytes``)."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for method in service.methods:
        if method.name == "ModelInfer":
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(servicer.ModelInferBytes)
            continue
        make = _HANDLER[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=GetMessageClass(method.output_type).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
