"""An Envoy that guard does not run, steered through its admin API: an Istio sidecar.

``server.envoy.attach_admin_port`` names the admin port (on 127.0.0.1: the Pod's loopback) of
an Envoy whose config already holds guard's pieces (``guard deploy istio`` prints them as an
EnvoyFilter). ``guard serve`` then starts no Envoy of its own; this class stands where
guard/envoy/process.py's ``EnvoyProcess`` stands for the rest of guard/envoy/ (the same
``admin_port``, ``envoys()``, ``serving``, ``on_started``), so the route watcher pushes the
routes, the stats reader merges the stats, and the tap reader (or ext_proc, by Envoy's own
connection) receives the copies, exactly as with guard's own Envoy.

What differs, and why:

- **Start** waits for the admin's ``/ready`` to say LIVE (within ``start_timeout_s``): guard
  is ready only once it can steer.
- **Watch**: the Envoy is someone else's child (the kubelet restarts istio-proxy), so guard
  cannot wait on its exit. At attach guard writes a mark of its own into the Envoy's admin
  runtime layer (``guard.attached``, a token of this guard process), and a thread reads
  ``/runtime`` every second: an Envoy that answers without the mark is a new one, whatever its
  uptime or however fast it came back (an uptime compare missed restarts quicker than the
  poll). Then the mark, the routes and the tap go again (``on_started``), and ``generation``
  moves on: ``envoys()`` names the new one apart, so that the stats reader carries the old
  counts over, as after a restart of guard's own Envoy. Counted in
  ``guard_envoy_restarts_total`` (a restart seen, not made).
- **Reload**: a config change that would change Envoy's pieces cannot be applied here (the
  EnvoyFilter is the cluster's, applied with kubectl): ``hot_restart`` raises, and the plane says
  so (event ``envoy_hot_restart_failed``): apply the new ``guard deploy istio`` output.
- **Stop** leaves the Envoy serving: it is not guard's.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
from typing import Callable

from guard.config.envoy import EnvoyConfig
from guard.envoy.process import admin_get, admin_post, envoy_series
from guard.errors import GuardError
from guard.observe.events import emit

_WATCH_S = 1.0
MARK_KEY = "guard.attached"  # in the attached Envoy's admin runtime layer: guard's token


class AttachedEnvoy:
    def __init__(self, settings: EnvoyConfig, metrics_registry=None,
                 on_started: Callable[["AttachedEnvoy"], None] | None = None):
        assert settings.attach_admin_port, "an attached Envoy needs its admin port"
        self.settings = settings
        self.on_started = on_started
        self.admin_port = settings.attach_admin_port
        self.listener_port = 0  # its listeners are the mesh's, not one guard knows
        self.listener_ports: dict[str, int] = {}
        self.generation = 0
        self.process = None  # no child process of guard's
        self.restarts, self.up = envoy_series(metrics_registry)
        self._token = f"{os.getpid()}-{time.time_ns()}"
        self._serving = False
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._serving

    def _marked(self) -> bool | None:
        """Whether the Envoy holds this guard's mark (False: a new Envoy); None when its admin
        does not answer, or not LIVE."""
        try:
            if admin_get(self.admin_port, "/ready", 1.0).strip() != "LIVE":
                return None
            runtime = json.loads(admin_get(self.admin_port, "/runtime?format=json", 1.0))
        except (OSError, urllib.error.URLError, ValueError):
            return None
        entry = runtime.get("entries", {}).get(MARK_KEY) or {}
        return entry.get("final_value") == self._token

    def _mark(self) -> bool:
        try:
            admin_post(self.admin_port, f"/runtime_modify?{MARK_KEY}={self._token}", 1.0)
        except (OSError, urllib.error.URLError):
            return False
        return True

    def start(self, _listener_ports: dict[str, int] | None = None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while self._marked() is None or not self._mark():
            if time.monotonic() > deadline:
                raise GuardError(
                    f"server.envoy.attach_admin_port: no Envoy admin answers LIVE on "
                    f"127.0.0.1:{self.admin_port} within server.envoy.start_timeout_s "
                    f"({self.settings.start_timeout_s}s)")
            time.sleep(0.1)
        self._started()
        self._watcher = threading.Thread(target=self._watch, name="guard-envoy-attached",
                                         daemon=True)
        self._watcher.start()

    def _started(self) -> None:
        self.generation += 1
        self._serving = True
        self.up.set(1)
        if self.on_started is not None:
            self.on_started(self)

    def _watch(self) -> None:
        lost = False
        while not self._stopping.wait(_WATCH_S):
            marked = self._marked()
            if marked is None:
                if not lost:
                    lost = True
                    self._serving = False
                    self.up.set(0)
                    emit("envoy_lost", admin=f"127.0.0.1:{self.admin_port}", how="its admin "
                         "API does not answer LIVE", note="an attached Envoy: guard waits for "
                         "it to come back")
                continue
            if marked:  # the same Envoy (its admin only stalled, if it was lost)
                if lost:
                    lost = False
                    self._serving = True
                    self.up.set(1)
                continue
            if not marked and not self._mark():
                continue  # gone again between the two calls: the next look decides
            lost = False
            self.restarts.inc()
            self._started()
            emit("envoy_restarted", admin=f"127.0.0.1:{self.admin_port}",
                 note="an attached Envoy came back: routes pushed and the tap attached again")

    def hot_restart(self) -> None:
        raise GuardError("server.envoy.attach_admin_port: the attached Envoy's config is not "
                         "guard's to replace; apply the new `guard deploy istio` output")

    def envoys(self) -> dict[int, int]:
        """The one Envoy, key -> admin port, as ``EnvoyProcess.envoys`` (its pid unknown: a
        key of its own per incarnation, below any pid)."""
        return {-1 - self.generation: self.admin_port}

    def stop(self, grace: float = 0.0) -> None:
        """Stop watching (``grace``: the attached Envoy's requests are not guard's to wait
        for: its own Pod's shutdown drains it)."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(_WATCH_S + 2)
        self._serving = False
        self.up.set(0)
