"""The sidecar process: loads the models, serves OIP + health + admin + metrics, stops gracefully.

Ports: the data plane and ``grpc.health.v1`` share ``server.grpc_port`` (Kubernetes gRPC probes
point there: service ``""`` = live, ``readiness`` = ready; built by guard/serve/listen.py, as in
every serving process); the admin API listens on its own port on loopback (or under mutual TLS,
``server.admin_tls``); the guard.v1.Tap service, when ``server.tap`` is set, on a listener of
its own (loopback or mutual TLS); Prometheus scrapes ``/metrics`` on ``server.metrics_port``. A
port of 0 picks a free one (tests, demo); the bound ports are on the server object after
``start()``.

Every serving process runs the same ``ServingWorker`` (guard/serve/worker.py); this one runs it
in-process, and with ``server.processes`` > 1 it is the first of several serving processes on
the data-plane port (guard/serve/processes.py).

Shutdown (SIGTERM/SIGINT): health turns NOT_SERVING, the gRPC server stops accepting and gives
in-flight requests ``shutdown_grace_s`` to finish (in every serving process), then the verifier
process stops (its queued samples are counted as dropped, capture is flushed), backends close,
and the metrics endpoint goes last. The signals are handled from the first moment of ``guard
serve``: one that comes while it is still starting cancels the start, and what had started
stops, the verifier and the other serving processes included (``serve_until_signalled``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any, Sequence

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from guard import __version__
from guard.config import GuardConfig
from guard.envoy.plane import EnvoyPlane
from guard.errors import GuardError
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.malloc import tune_for_inference
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.exposition import counter_by_label
from guard.observe.metrics import GuardMetrics
from guard.runtime import sampling
from guard.serve.admin import AdminServicer, Seen
from guard.serve.decoding import guarded
from guard.serve.edges import Edge, health_only, http_health_only
from guard.serve.listen import bind, server_options
from guard.serve.merged_metrics import MergedMetrics
from guard.serve.processes import ServingPool
from guard.serve.reload import ConfigReloader
from guard.serve.tap_service import TapService
from guard.serve.tls import CallerCheck, server_credentials
from guard.serve.verifier_link import VerifierLink
from guard.serve.worker import ServingWorker
from guard.v1 import admin_pb2_grpc, tap_pb2_grpc

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("guard.server")


class GuardServer:
    """``guard serve``: the first serving process. Its own serving is a ``ServingWorker`` (the
    class every serving process runs); beside it, what only the first process has: the admin
    API, the Tap service, /metrics, reload, the serving pool (guard/serve/processes.py), the
    verifier's link and Envoy (each a supervised child: guard/runtime/children.py)."""

    def __init__(self, config: GuardConfig):
        self.config = config
        # The key of the sampling hash (file, environment or random), handed to the verifier
        # through the environment before it starts.
        self.sampling_key = sampling.configure(config.server.sampling_key_file)
        self.metrics = GuardMetrics(__version__)
        # What this process shares with the verifier process (guard/ipc/).
        self.table = RouteTable()
        # One sample ring per serving process (server.processes), this one's first.
        rings = [SampleRing(config.server.verifier.ring_bytes)
                 for _ in range(config.server.processes)]
        self.ring = rings[0]
        self.rings = rings
        # This process's serving: the class every serving process runs.
        self.worker = ServingWorker(self.table, self.ring, self.metrics, 0)
        self.models = self.worker.models
        self.serving = ServingPool(self.worker, rings[1:], self.table, self.metrics,
                                   lambda: self.config)
        self.verifier = VerifierLink(config, self.metrics, self.table, rings,
                                     lambda: self.models, self.serving.use_primary,
                                     lambda: self.serving.primaries)
        # How full the rings are: a verifier that falls behind shows here before it drops.
        self.metrics.ring_used_bytes.set_function(lambda: sum(r.used for r in rings))
        self.metrics.ring_capacity_bytes.set(sum(r.capacity for r in rings))
        # Envoy mode (server.data_plane: envoy; guard/envoy/): None in the Python data plane,
        # or where no envoy binary is found (then the Python data plane serves, and says so).
        self.envoy = EnvoyPlane.create(config, self.metrics, self.ring)
        self.exposition = CollectorRegistry(auto_describe=False)
        self.exposition.register(MergedMetrics(self.metrics, lambda: [
            self.verifier.exposition(), *self.serving.expositions(),
            *([self.envoy.exposition()] if self.envoy is not None else [])]))
        self.grpc_port = self.admin_port = self.metrics_port = 0
        self.health_port = 0  # Envoy mode: guard's own gRPC health server, on loopback
        self._admin: grpc.aio.Server | None = None
        self._tap: grpc.aio.Server | None = None  # server.tap's listener
        self.tap_port = 0
        self._metrics_httpd: WSGIServer | None = None
        self.reloader: ConfigReloader | None = None
        self._started_reloader: ConfigReloader | None = None  # once the first load is done
        self._watch_task: asyncio.Task | None = None
        self._loaded = False

    @property
    def dataplane(self):
        return self.worker.dataplane

    @property
    def http_port(self) -> int:
        """The OpenAI-compatible edge's bound port (0 without ``server.http_port``); in Envoy
        mode, Envoy's HTTP listener's."""
        if self.envoy is not None:
            return self.envoy.http_listener_port
        return self.worker.ports.get("openai-http", 0)

    # -- start ---------------------------------------------------------------------------------
    def load_models(self) -> None:
        """Load every model's serving backends here while the verifier process loads the
        references (both at once: each takes seconds); on any failure stop both."""
        slots = self.table.assign(m.name for m in self.config.models)
        verifier_error: list[BaseException] = []

        def start_verifier():
            try:
                self.verifier.start()
            except BaseException as exc:
                verifier_error.append(exc)

        starter = threading.Thread(target=start_verifier, name="guard-verifier-start",
                                   daemon=True)
        starter.start()
        try:
            self.worker.registry.load(self.config, slots)
        except Exception:
            starter.join()
            self.close_models()
            raise
        starter.join()
        if verifier_error:
            self.close_models()
            raise verifier_error[0]
        self._loaded = True

    async def start(self) -> None:
        """Listen first (liveness answers, readiness NOT_SERVING), then load the models, then
        turn ready. Listening first fails fast on a taken port, and keeps a Kubernetes liveness
        probe happy while an upstream model server is still starting."""
        try:
            await self._start_servers()
            if not self._loaded:
                await _on_own_thread(self.load_models)
            await self.worker.registry.connect()
            await _on_own_thread(self.serving.start, self.worker.ports)
            if self.envoy is not None:  # Envoy answers grpc_port; guard's server is its health
                await self.envoy.start(lambda: self.models, self.grpc_port,
                                       self.worker.ports.get("http-health", 0))
                if not self.envoy.attached:  # an attached Envoy's listeners are the mesh's
                    self.health_port, self.grpc_port = self.grpc_port, self.envoy.listener_port
            await self.worker.set_ready()
            # The config watcher (and the admin API's Reload) start after the first load,
            # never during it.
            self._started_reloader = self.reloader
            if self.reloader is not None and self.config.server.reload_interval_s > 0:
                self._watch_task = asyncio.create_task(
                    self.reloader.watch(self.config.server.reload_interval_s))
        except BaseException:
            await self.stop(grace=0)
            raise
        tap = self.config.server.tap if self._tap is not None else None
        emit("server_started", version=__version__, grpc_port=self.grpc_port,
             admin=f"{self.config.server.admin_host}:{self.admin_port}",
             metrics=f"http://{self.config.server.host}:{self.metrics_port}/metrics",
             models=sorted(self.models),
             tap=f"{tap.host}:{self.tap_port}" if tap is not None else None,
             http_port=self.http_port or None,
             sampling_key=self.sampling_key, malloc=tune_for_inference(),
             data_plane="envoy" if self.envoy is not None else "python",
             event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])

    async def _start_servers(self) -> None:
        server_config = self.config.server
        edges: list[Edge] | None = None  # the Python data plane: every edge the config asks for
        if self.envoy is not None and self.envoy.attached:  # health: guard's container probes
            edges = [health_only(server_config.grpc_port, "server.grpc_port")]
        elif self.envoy is not None:  # Envoy listens on grpc_port, routes gRPC health here
            edges = [health_only(server_config.envoy.health_port, "server.envoy.health_port")]
            if self.envoy.generates:  # and on http_port, routes HTTP health and /v1/models here
                edges.append(http_health_only(lambda: self.models, self.metrics, server_config))
        # Bound before anything starts: a taken port fails before the admin API listens.
        await self.worker.listen(self.config, edges=edges)
        self.grpc_port = self.worker.edges[0].port

        # The admin API: loopback, or mutual TLS with an allow-list (server.admin_tls).
        self._admin = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        guarded(admin_pb2_grpc.add_AdminServicer_to_server,
                AdminServicer(self.models, self.verifier,
                              CallerCheck("admin API", server_config.admin_tls),
                              seen=self._seen, reloader=lambda: self._started_reloader),
                self._admin)
        self.admin_port = bind(self._admin, server_config.admin_host,
                               server_config.admin_port, "server.admin_port",
                               server_credentials(server_config.admin_tls))
        tap = server_config.tap
        if tap is not None:  # the Tap service, on a listener of its own
            self._tap = grpc.aio.server(options=server_options(server_config))
            guarded(tap_pb2_grpc.add_TapServicer_to_server,
                    TapService(self.models, CallerCheck("tap", tap.tls)), self._tap)
            self.tap_port = bind(self._tap, tap.host, tap.port, "server.tap.port",
                                 server_credentials(tap.tls))
            await self._tap.start()
        try:
            httpd, _ = start_http_server(
                server_config.metrics_port, addr=server_config.host, registry=self.exposition
            )
        except OSError as exc:
            raise GuardError(f"server.metrics_port: cannot listen on {server_config.host}:"
                             f"{server_config.metrics_port}: {exc.strerror or exc}") from None
        self._metrics_httpd = httpd
        self.metrics_port = httpd.server_port
        await self._admin.start()
        if self.config.context.source_path is not None:
            self.reloader = ConfigReloader(
                self.config.context.source_path, config=lambda: self.config,
                applied=self._reloaded, table=self.table, serving=self.serving,
                verifier=self.verifier, reloads=self.metrics.config_reloads)

    def _seen(self) -> Seen:
        """What the admin status shows as /metrics counts it: requests per model and route,
        generation calls never compared per model and reason."""
        families = list(self.exposition.collect())
        return Seen(requests=counter_by_label(families, "guard_requests", "route"),
                    not_comparable=counter_by_label(
                        families, "guard_generation_not_comparable", "reason"))

    def _reloaded(self, config: GuardConfig):
        """A reload put ``config`` in force (a restarted child is told this one). In Envoy
        mode, an awaitable: Envoy hot-restarts when its bootstrap changed."""
        self.config = config
        self.verifier.config = config
        return self.envoy.apply(config) if self.envoy is not None else None

    # -- stop ----------------------------------------------------------------------------------
    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.server.shutdown_grace_s if grace is None else grace
        emit("server_stopping", grace_s=grace)
        self._started_reloader = None  # the admin API's Reload is refused from here on
        if self._watch_task is not None:
            self._watch_task.cancel()
        loop = asyncio.get_running_loop()
        await self.worker.end_serving()
        if self.envoy is not None:  # drains, then exits: the request path ends first
            await self.envoy.stop(grace)
        others = loop.run_in_executor(None, self.serving.stop, grace)
        await self.worker.stop(grace, close_models=False)  # as every serving process stops
        await others
        if self._admin is not None:
            await self._admin.stop(0)
        if self._tap is not None:
            await self._tap.stop(0)
        # The verifier stops after the last request: queued samples count as dropped, capture
        # is flushed, and it exits.
        await loop.run_in_executor(None, self.close_models)
        for ring in self.rings:
            ring.close()
        self.table.close()
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
        emit("server_stopped")

    def close_models(self) -> None:
        """Stop the verifier process (it flushes capture), then close the serving backends."""
        self.verifier.stop()
        self.worker.registry.close()


def _on_own_thread(function, *args) -> asyncio.Future:
    """``function(*args)`` on a daemon thread of its own, awaited. For the steps of start that
    can block for minutes (loading models: an upstream's ``ready_timeout_s``; the other serving
    processes' start): a start cancelled by a signal stops waiting at once, and the thread,
    which ends with the models that ``stop`` closes under it, never holds up the exit (the
    event loop's default executor would be joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result=None, error=None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (function(*args), None)
        except BaseException as exc:
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    threading.Thread(target=run, name=f"guard-{function.__name__}", daemon=True).start()
    return future


async def serve_until_signalled(config: GuardConfig, signalled: Sequence[int] = ()) -> None:
    """``guard serve``: run until SIGTERM or SIGINT, then stop gracefully.

    The handlers are installed before anything starts: a signal while the server is still
    starting (loading models, waiting for an upstream, the verifier loading the references)
    cancels the start, and ``start`` stops what had started, the verifier and the other serving
    processes included; then this returns as after a graceful stop. ``signalled``: signals that
    came before this ran (the command line's own handlers, while it read the config): nothing
    is started then. A SIGHUP during start reloads once the start is done."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hangups: list[int] = []
    loop.add_signal_handler(signal.SIGHUP, hangups.append, signal.SIGHUP)
    if signalled:
        return
    tracing.configure_from_env()
    server = GuardServer(config)
    starting = asyncio.ensure_future(server.start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()  # start's own handler stops what it had started
        try:
            await starting
        except asyncio.CancelledError:
            pass
        return
    stopped.cancel()
    starting.result()  # a start that failed raises its error here
    if server.reloader is not None:
        reloader = server.reloader
        loop.add_signal_handler(
            signal.SIGHUP, lambda: asyncio.ensure_future(reloader.reload("SIGHUP")))
        if hangups:
            asyncio.ensure_future(reloader.reload("SIGHUP"))
    await stop.wait()
    await server.stop()


class BackgroundServer:
    """A GuardServer on its own event loop thread: for embedding, tests, the demo, benchmarks."""

    def __init__(self, config: GuardConfig):
        self.server = GuardServer(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="guard-server",
                                        daemon=True)

    def __enter__(self) -> GuardServer:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        except BaseException:
            self._shutdown_loop()
            raise
        return self.server

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(grace=5), self._loop).result()
        self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
