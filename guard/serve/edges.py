"""A serving process's edges: the listeners that take clients' requests and turn them into calls
of the data plane (guard/serve/dataplane.py). ``ServingWorker`` (guard/serve/worker.py) starts
every edge ``EDGES`` builds for the config, turns them ready together, and stops them together.

An edge is one object with a ``port`` and three coroutines (``Edge``): ``start`` (listening;
liveness answers, readiness not yet), ``set_ready`` and ``stop(grace)`` (no new calls; those in
flight get ``grace`` seconds). A new protocol is one module with an edge and its factory, and
one line in ``EDGES``: ``(dataplane, settings, ports) -> Edge | None`` (None: the config does
not ask for it; ``ports``: the ports the first serving process bound, by edge name, which an
extra serving process binds too (SO_REUSEPORT); empty in the first). The Open Inference Protocol over gRPC is the first one, the OpenAI-compatible HTTP edge
(guard/serve/openai_edge.py) the second.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

from grpc_health.v1 import health_pb2

from guard.config.server import ServerConfig
from guard.serve.dataplane import DataPlane
from guard.serve.listen import DataPlaneServer, data_plane_server, health_server

READINESS_SERVICE = "readiness"
_READY_SERVICES = (READINESS_SERVICE, "inference.GRPCInferenceService")


class Edge(Protocol):
    name: str
    port: int  # the bound port (a port of 0 in the config picks a free one)

    async def start(self) -> None: ...

    async def set_ready(self, ready: bool) -> None: ...

    async def stop(self, grace: float) -> None: ...


class GrpcEdge:
    """A gRPC server with ``grpc.health.v1`` (service ``""`` = live, ``readiness`` and the
    inference service = ready): the Open Inference Protocol data plane, or gRPC health alone
    (Envoy mode: Envoy answers the data plane and routes health here)."""

    def __init__(self, name: str, built: DataPlaneServer):
        self.name = name
        self.server, self.health, self.port = built.server, built.health, built.port

    async def start(self) -> None:
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)

    async def set_ready(self, ready: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in _READY_SERVICES:
            await self.health.set(service, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)  # stops accepting; waits for in-flight RPCs


def oip_grpc(dataplane: DataPlane, settings: ServerConfig,
             ports: Mapping[str, int]) -> GrpcEdge:
    """The Open Inference Protocol over gRPC on ``settings.grpc_port`` (an extra serving
    process: the port the first one bound)."""
    return GrpcEdge("oip-grpc", data_plane_server(dataplane, settings, ports.get("oip-grpc")))


def health_only(port: int, key: str) -> GrpcEdge:
    """gRPC health alone on 127.0.0.1:``port`` (``key``: the config key that names it)."""
    return GrpcEdge("health", health_server(port, key))


def openai_http(dataplane: DataPlane, settings: ServerConfig,
                ports: Mapping[str, int]) -> "Edge | None":
    """The OpenAI-compatible HTTP edge on ``settings.http_port`` (guard/serve/openai_edge.py;
    aiohttp is imported only when the config sets the port)."""
    if settings.http_port is None:
        return None
    from guard.serve.openai_edge import OpenAIEdge

    return OpenAIEdge(lambda: dataplane.models, dataplane.metrics, settings,
                      ports.get("openai-http"))


def http_health_only(models: Callable[[], Mapping], metrics, settings: ServerConfig) -> "Edge":
    """HTTP health and the model list alone on 127.0.0.1:``server.envoy.http_health_port``
    (Envoy mode with generation models: Envoy forwards their calls on ``server.http_port`` and
    routes ``/health*`` and ``/v1/models`` here)."""
    from guard.serve.openai_edge import OpenAIEdge

    return OpenAIEdge(models, metrics, settings,
                      settings.envoy.http_health_port, forwarding=False, host="127.0.0.1",
                      key="server.envoy.http_health_port")


# The edges of a serving process, in start order; each factory returns None when its config is
# not set. A new protocol: one line here.
EDGES: list[Callable[[DataPlane, ServerConfig, Mapping[str, int]], "Edge | None"]] = [
    oip_grpc,
    openai_http,
]


def build_edges(dataplane: DataPlane, settings: ServerConfig,
                ports: Mapping[str, int] | None = None) -> list[Edge]:
    """Every edge the config asks for, built and bound, not started."""
    return [edge for make in EDGES if (edge := make(dataplane, settings, ports or {}))
            is not None]
