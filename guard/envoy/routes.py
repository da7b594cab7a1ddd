"""Routes from the verifier to Envoy: a small watcher in the serving process reads each model's
route word (guard/ipc/routes.py: what the verifier publishes, and what an operator's pin
through the admin API becomes, since a pin goes through the verifier) and, when one changes,
sets the weights of the model's clusters in Envoy's runtime (admin ``POST /runtime_modify``, one
call for every change, applied by Envoy as one snapshot). The next call Envoy routes takes the
new weights.

Why the admin runtime layer and not RTDS served by guard: the switch is one loopback HTTP call
(about 1 ms measured, the next call already on the new route), it needs no gRPC management
server in guard with its versions and acks, and Envoy's admin API is on loopback only. What
it loses on an Envoy restart (the admin layer is in memory) the new Envoy gets at once: its
bootstrap is built from the current routes (the runtime's static layer), and ``push_all``
runs again when it is ready.

Why a poll (every 100 ms) and not a message per transition: the route words are the one truth
every process reads (a restarted verifier, a pin, a repair all end there), while a message path
would have to be kept in step with all of them. The period is a trade: each wake of a Python
thread costs ~0.1 ms of CPU on a 2-core VM (measured: 50 wakes a second were 6 ms of CPU a
second, a third of guard's whole idle cost in Envoy mode), and a switch that a detector took
seconds of samples to decide reaches Envoy at most 0.1 s later.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
from typing import Callable, Mapping, Protocol
from urllib.parse import urlencode

from guard.config import ModelConfig
from guard.envoy.bootstrap import ROLES, route_values, sample_rate
from guard.envoy.process import admin_post

log = logging.getLogger("guard.envoy.routes")
POLL_S = 0.1


class Routed(Protocol):
    """What the watcher needs of a served model (guard/serve/model.py's ServedModel)."""

    backends: Mapping[str, object]

    @property
    def config(self) -> ModelConfig: ...

    def route_word(self) -> tuple[str, int, bool]: ...


class RouteSync:
    def __init__(self, models: Callable[[], Mapping[str, Routed]],
                 admin_port: Callable[[], int]):
        self.models = models
        self.admin_port = admin_port
        self.applied: dict[str, str] = {}  # model -> the route Envoy was last told
        self.pushes = 0
        self.last_push_ms = 0.0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> dict[str, str]:
        """model -> the route its word says now."""
        return {name: model.route_word()[0] for name, model in list(self.models().items())}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guard-envoy-routes",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(2)

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            try:
                self.sync()
            except Exception:  # never let the watcher die: the next poll tries again
                log.exception("route sync failed")

    def sync(self, everything: bool = False) -> bool:
        """Tell Envoy the routes that changed (``everything``: all of them); True when Envoy
        took them (or there was nothing to tell)."""
        with self._lock:
            models = dict(self.models())
            now = {name: model.route_word()[0] for name, model in models.items()}
            changed = {name: route for name, route in now.items()
                       if everything or self.applied.get(name) != route}
            if not changed:
                return True
            values: dict[str, int] = {}
            for name, route in changed.items():
                model = models[name]
                values.update(route_values(name, route,
                                           [r for r in ROLES if r in model.backends],
                                           sample_rate(model.config)))
            port = self.admin_port()
            if not port:
                return False
            started = time.perf_counter()
            try:
                admin_post(port, "/runtime_modify?" + urlencode(values), timeout=1.0)
            except (OSError, urllib.error.URLError) as exc:  # restarting: pushed again when up
                log.debug("runtime_modify failed: %s", exc)
                return False
            self.last_push_ms = (time.perf_counter() - started) * 1e3
            self.pushes += 1
            self.applied.update(changed)
            for name in [n for n in self.applied if n not in now]:
                del self.applied[name]
            return True

    def push_all(self, *_ignored) -> None:
        """After an Envoy (re)start: every route again (the process's ``on_started``)."""
        self.sync(everything=True)
