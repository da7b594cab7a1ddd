"""A remote Open Inference Protocol server as a backend (Triton, KServe, MLServer, another guard).

Two ways in:
- ``forward_raw()`` (async, the request path when every serving backend of a model is
  upstream): the client's serialized ``ModelInferRequest`` is sent on as it came (id,
  parameters, requested outputs, raw or typed contents), re-addressed to the upstream's model
  name by appending that field (guard/protocol/raw.py); the client's deadline goes with it, the
  upstream's gRPC status comes back unchanged, and its serialized answer is returned unparsed.
  ``forward()`` does the same for a parsed message (a model whose other route is local).
- ``infer()`` (sync, for the mirror worker: reference runs and background probes): numpy in,
  numpy out, over a blocking channel with ``options.timeout_s``.

Channels are opened once and reused for every call. At start-up ``load()`` waits up to
``options.ready_timeout_s`` for the upstream model to be ready, because in a Pod the sidecar
may start before the model server.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from guard.backends.base import (
    Backend,
    BackendInfo,
    Forwarding,
    ForwardingError,
    ForwardingUnreachable,
    Role,
    TensorSpec,
)
from guard.backends.kind import BackendKind
from guard.backends.options import UpstreamOptions
from guard.errors import BackendError
from guard.observe import tracing
from guard.protocol import raw


class UpstreamError(ForwardingError):
    """The upstream answered with a gRPC error: ``status`` is its StatusCode name."""


def _credentials(options: UpstreamOptions):
    if not options.tls:
        return None
    roots = None
    if options.root_ca_file:
        with open(options.root_ca_file, "rb") as handle:
            roots = handle.read()
    return grpc.ssl_channel_credentials(root_certificates=roots)


class UpstreamBackend(Forwarding, Backend):
    def __init__(self, spec, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = UpstreamOptions.model_validate(spec.options)
        self.target = spec.target
        self.model = spec.model
        self._channel_options = [
            ("grpc.max_receive_message_length", self.options.max_message_bytes),
            ("grpc.max_send_message_length", self.options.max_message_bytes),
            # A server that went away is tried again at least every 5 s (gRPC's default backoff
            # grows to 120 s): a fallback that is back serves within seconds (SKIP_S).
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._aio_channel: grpc.aio.Channel | None = None
        self._aio_stub: pb_grpc.GRPCInferenceServiceStub | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._aio_raw = None
        self._readdress = (raw.string_field(raw.MODEL_NAME, self.model)
                           + raw.string_field(raw.MODEL_VERSION, self.options.model_version))
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()

    # -- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        credentials = _credentials(self.options)
        if credentials is None:
            self._channel = grpc.insecure_channel(self.target, self._channel_options)
        else:
            self._channel = grpc.secure_channel(self.target, credentials, self._channel_options)
        stub = self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._wait_ready(stub)
        try:
            meta = stub.ModelMetadata(
                pb.ModelMetadataRequest(name=self.model, version=self.options.model_version),
                timeout=self.options.timeout_s)
        except grpc.RpcError as exc:
            raise BackendError(f"upstream {self.model}@{self.target}: metadata: "
                               f"{exc.code().name}: {exc.details()}") from None
        self._inputs = tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in meta.inputs)
        self._outputs = tuple(TensorSpec(t.name, t.datatype, tuple(t.shape))
                              for t in meta.outputs)

    def _wait_ready(self, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        deadline = time.monotonic() + self.options.ready_timeout_s
        last = "no answer"
        while True:
            try:
                ready = stub.ModelReady(
                    pb.ModelReadyRequest(name=self.model, version=self.options.model_version),
                    timeout=2.0)
                if ready.ready:
                    return
                last = "model not ready"
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            if time.monotonic() >= deadline:
                raise BackendError(f"upstream {self.model}@{self.target} not ready after "
                                   f"{self.options.ready_timeout_s:g}s ({last})")
            time.sleep(0.2)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        # The aio channel belongs to the server's event loop: close it there (a reload calls
        # this from a worker thread while the loop keeps serving).
        channel, loop = self._aio_channel, self._aio_loop
        self._aio_channel = self._aio_stub = self._aio_raw = None
        if channel is not None and loop is not None and not loop.is_closed():
            asyncio.run_coroutine_threadsafe(channel.close(), loop)

    def describe(self) -> BackendInfo:
        return BackendInfo(backend="upstream", artifact=f"{self.model}@{self.target}",
                           precision="as served", device="remote", inputs=self._inputs,
                           outputs=self._outputs)

    # -- request path --------------------------------------------------------------------------
    def _async_stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        # Created on first use, inside the server's running event loop (grpc.aio needs that).
        if self._aio_stub is None:
            self._aio_loop = asyncio.get_running_loop()
            credentials = _credentials(self.options)
            if credentials is None:
                self._aio_channel = grpc.aio.insecure_channel(self.target, self._channel_options)
            else:
                self._aio_channel = grpc.aio.secure_channel(self.target, credentials,
                                                            self._channel_options)
            self._aio_stub = pb_grpc.GRPCInferenceServiceStub(self._aio_channel)
            self._aio_raw = self._aio_channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        return self._aio_stub

    async def connect(self, timeout: float = 5.0) -> bool:
        """Open the request path's channel now, on the server's event loop, and wait (at most
        ``timeout``) until it is connected, so that the first client request does not pay
        for the TCP (and TLS) handshake. False when it did not connect in time: the channel
        keeps trying on its own and requests still go through it (gRPC waits for it)."""
        self._async_stub()
        channel = self._aio_channel
        assert channel is not None, "opened by _async_stub"
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def connected(self) -> bool:
        """Is the request path's channel open and connected (READY)?"""
        channel = self._aio_channel
        return channel is not None and (
            channel.get_state() == grpc.ChannelConnectivity.READY)

    async def forward(self, request: pb.ModelInferRequest, timeout: float | None,
                      metadata: tuple[tuple[str, str], ...] = ()) -> pb.ModelInferResponse:
        """Send the client's request on, unchanged but for the model it is addressed to, with
        the client's metadata (auth headers...) and, when tracing, guard's span as parent."""
        asked_for, asked_version = request.model_name, request.model_version
        request.model_name = self.model
        request.model_version = self.options.model_version
        try:
            response = await self._async_stub().ModelInfer(
                request, timeout=timeout if timeout is not None else self.options.timeout_s,
                metadata=tracing.inject(metadata))
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc) from None
        finally:
            request.model_name, request.model_version = asked_for, asked_version
        response.model_name = asked_for
        return response

    async def forward_raw(self, data: bytes, timeout: float | None,
                          metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
        """``forward`` on the client's serialized request: re-addressed by appending the
        upstream's model name and version (the last occurrence of a field wins), sent without a
        parse, and the upstream's serialized answer returned as it came."""
        self._async_stub()
        send = self._aio_raw
        assert send is not None, "opened by _async_stub"
        try:
            return await send(
                data + self._readdress,
                timeout=timeout if timeout is not None else self.options.timeout_s,
                metadata=tracing.inject(metadata))
        except grpc.aio.AioRpcError as exc:
            raise self._failed(exc) from None

    def _failed(self, exc: grpc.aio.AioRpcError) -> ForwardingError:
        """The request path's error for a failed call: ``ForwardingUnreachable`` where gRPC
        could not connect (UNAVAILABLE on a channel that is not READY: a refused or failed
        connection, where the call was not sent; a connection lost mid-call too, which is
        harmless to send again: an inference changes nothing on the server), else the
        server's own status (``UpstreamError``)."""
        message = f"upstream {self.model}@{self.target}: {exc.details()}"
        if exc.code() == grpc.StatusCode.UNAVAILABLE and not self.connected:
            return ForwardingUnreachable(message)
        return UpstreamError(exc.code().name, message)

    # -- mirror worker ---------------------------------------------------------------------------
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from guard.protocol.codec import decode_response, encode_request

        if self._stub is None:
            raise BackendError(f"upstream {self.model}@{self.target}: not loaded")
        request = encode_request(self.model, inputs, model_version=self.options.model_version)
        try:
            response = self._stub.ModelInfer(request, timeout=self.options.timeout_s)
        except grpc.RpcError as exc:
            raise UpstreamError(exc.code().name, f"upstream {self.model}@{self.target}: "
                                f"{exc.details()}") from None
        return decode_response(response)


def _check(spec) -> None:
    if not spec.target or not spec.model:
        raise ValueError("backend 'upstream' needs 'target' (host:port) and 'model'")
    if spec.path is not None:
        raise ValueError("backend 'upstream' takes 'target' and 'model', not 'path'")
    if spec.precision != "fp32":
        raise ValueError("backend 'upstream' cannot derive a precision: the remote "
                         "server runs what it serves")
    if spec.device != "cpu":
        raise ValueError("backend 'upstream' takes no device: the remote server runs where it "
                         "runs (guard sends it requests)")
    if not re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[\w.\-]+):\d{1,5}", spec.target):
        raise ValueError(f"target '{spec.target}' must be host:port")


KINDS = {
    "upstream": BackendKind(
        name="upstream", backend=UpstreamBackend, options=UpstreamOptions,
        precisions=frozenset({"fp32"}),  # the remote server runs what it runs
        artifact=False, forwards=True, check=_check,
    ),
}
