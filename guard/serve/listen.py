"""The data-plane gRPC server as every serving process builds it (``guard serve`` in
guard/serve/app.py, each extra one in guard/serve/worker.py): the Open Inference Protocol and
``grpc.health.v1`` on ``server.grpc_port``, with the message size limits, TLS, and
SO_REUSEPORT when several processes share the port (``server.processes``)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from guard.config.server import ServerConfig
from guard.errors import GuardError
from guard.serve.dataplane import DataPlane
from guard.serve.decoding import guarded
from guard.serve.servicer import InferenceServicer
from guard.serve.servicer import add_to_server as add_inference_service
from guard.serve.tls import server_credentials


@dataclass
class DataPlaneServer:
    """Built and bound, not started: ``await server.start()``."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    port: int  # the bound port (a port of 0 picks a free one)


def data_plane_server(dataplane: DataPlane, settings: ServerConfig,
                      port: int | None = None) -> DataPlaneServer:
    """The data-plane server on ``settings.host`` and ``port`` (default ``settings.grpc_port``;
    an extra serving process passes the primary's bound port)."""
    server = grpc.aio.server(options=server_options(settings))
    guarded(add_inference_service,  # ModelInfer on bytes; the rest with decoders guarded
            InferenceServicer(dataplane), server)
    health = health_aio.HealthServicer()
    guarded(health_pb2_grpc.add_HealthServicer_to_server, health, server)
    bound = bind(server, settings.host, settings.grpc_port if port is None else port,
                 "server.grpc_port", server_credentials(settings.tls))
    return DataPlaneServer(server, health, bound)


def server_options(settings: ServerConfig) -> list[tuple[str, int]]:
    """Message size limits; SO_REUSEPORT only when several serving processes share the port
    (otherwise a second guard on the same port must fail, not share it)."""
    size = settings.max_message_bytes
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", int(settings.processes > 1))]


def bind(server: grpc.aio.Server, host: str, port: int, key: str,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Add the listening port (TLS when ``credentials``); the bound port. ``GuardError``
    naming the config ``key`` when it cannot listen there."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise GuardError(f"{key}: cannot listen on {address}: {exc}") from None
    if not bound:
        raise GuardError(f"{key}: cannot listen on {address}")
    return bound
