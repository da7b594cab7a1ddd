"""Bodies that are not the method's message: INVALID_ARGUMENT, not UNKNOWN and a traceback.

grpc.aio answers a request whose bytes do not parse as the method's message with UNKNOWN and
logs the DecodeError with a traceback (found by the fuzzer, tests/fuzz_messages.py). ``guarded``
registers a service through the generated ``add_..._to_server`` function with each method's
deserializer wrapped: a body that does not parse becomes a marker, and the method answers
INVALID_ARGUMENT before the servicer sees it. Cost per call: one Python call around the
parser and one coroutine frame; no interceptor.
"""

from __future__ import annotations

import inspect
from typing import Callable

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _deserializer(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))
    return deserialize


async def _refuse(request: _Undecodable, context) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request body is not this method's message: {request.error}")


def _unary(behavior):
    async def guarded(request, context):
        if type(request) is _Undecodable:
            await _refuse(request, context)
        return await behavior(request, context)
    return guarded


def _stream(behavior):
    async def guarded(request, context):
        if type(request) is _Undecodable:
            await _refuse(request, context)
        async for item in behavior(request, context):
            yield item
    return guarded


def _wrapped(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    deserializer = _deserializer(handler.request_deserializer)
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return grpc.unary_unary_rpc_method_handler(
            _unary(handler.unary_unary), deserializer, handler.response_serializer)
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        return grpc.unary_stream_rpc_method_handler(
            _stream(handler.unary_stream), deserializer, handler.response_serializer)
    return handler


class _Registrar:
    """Stands in for the server while the generated function registers a service."""

    def __init__(self, server: grpc.aio.Server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # rebuilt from the method handlers below

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        wrapped = {name: _wrapped(h) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, wrapped),))
        self.server.add_registered_method_handlers(service, wrapped)


def guarded(add_to_server: Callable, servicer, server: grpc.aio.Server) -> None:
    """``add_X_to_server(servicer, server)`` with undecodable bodies refused."""
    add_to_server(servicer, _Registrar(server))
