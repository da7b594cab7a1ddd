"""The serving process's side of the verifier: start it, talk to it, watch it, restart it.

The verifier is a child process (``python -m guard.verifier_process``) that inherits its descriptors:
one end of a control socket pair, the route table and one sample ring per serving process
(guard/ipc/; ``server.processes``). At start-up
the server waits for it to load every model's reference and noise floor, so a broken reference
still stops ``guard serve`` with a clear error. After that its death or a hang never fails or
slows a client:

- death is seen at once (the control socket closes); a hang (heartbeat older than
  ``server.verifier.hang_timeout_s``) is ended with SIGKILL;
- the samples it held in memory are counted as dropped (``guard_mirror_total``), the loss is an
  event (``verifier_lost``) and ``guard_verifier_restarts_total`` counts it;
- serving goes on on the last route words; the ring keeps taking samples until it is full
  (then they are dropped and counted), and the next verifier reads them;
- the next verifier starts after a backoff (``restart_backoff_s``, doubling up to 30 s, reset
  after a minute of good health) and goes on from the route words and any repaired primary.

Metrics: the verifier keeps its own registry; ``MergedMetrics`` asks it (and any other serving
process, guard/serve/worker.py) for its exposition at each scrape and merges it into this
process's /metrics (same-named series are summed: the
request path counts the samples the ring refused under ``guard_mirror_total{outcome="dropped"}``,
the verifier those its queues refused). Why a forward and not prometheus_client's multiprocess
mode: that mode is switched on by an environment variable read at import and keeps one set of
files per process, which does not fit several servers in one process (tests, embedding) nor a
child that restarts (its gauges would have to be reaped by hand); a forward keeps one registry
per process and a dead verifier's gauges simply vanish with it.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable

from prometheus_client.registry import Collector

from guard.config import GuardConfig
from guard.errors import GuardError
from guard.ipc import routes
from guard.ipc.channel import Channel, ChannelClosed
from guard.ipc.config import config_to_wire
from guard.ipc.messages import (Event, Exposition, Failed, Handlers, Init, LoadFailures, Message,
                                Metrics, Reload, RouteChanged, Span, Status, StatusReport, Stop,
                                UsePrimary)
from guard.ipc.ring import SampleRing
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.exposition import merge
from guard.observe.metrics import GuardMetrics
from guard.runtime.children import exit_reason, wait_exit

log = logging.getLogger("guard.supervisor")
_events = logging.getLogger("guard.events")
_MAX_BACKOFF_S = 30.0
_HEALTHY_AFTER_S = 60.0
_WATCH_S = 0.5  # the hang check's tick (hang_timeout_s is seconds); an exit wakes the watcher at once


class VerifierUnavailable(GuardError):
    """The verifier is not running right now (restarting)."""


class VerifierSupervisor:
    def __init__(self, config: GuardConfig, metrics: GuardMetrics, table: routes.RouteTable,
                 rings: list[SampleRing], served: Callable[[], dict],
                 relay: Callable[[UsePrimary], str] | None = None):
        """``served()``: the serving process's current models by name (ServedModel); ``rings``:
        one per serving process; ``relay``: passes a ``UsePrimary`` on to the other serving
        processes ("" when all did it, otherwise why not)."""
        self.config = config
        self.settings = config.server.verifier
        self.metrics = metrics
        self.table = table
        self.rings = rings
        self.relay = relay
        self.served = served
        self.process: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.ready = threading.Event()  # a verifier is up and initialised
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._backoff = self.settings.restart_backoff_s
        self._started_at = 0.0
        self._watcher: threading.Thread | None = None
        self.restarts = metrics.verifier_restarts
        self.up = metrics.verifier_up

    # -- start / stop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the first verifier and wait until it has loaded every model; GuardError (with
        the verifier's own message) when it cannot."""
        error = self._spawn(resume=False)
        if error:
            self._terminate()
            raise GuardError(error)
        self._watcher = threading.Thread(target=self._watch, name="guard-verifier-watch",
                                         daemon=True)
        self._watcher.start()

    def _spawn(self, resume: bool) -> str:
        """Start a verifier and initialise it; "" on success, otherwise why it failed."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (child.fileno(), self.table.block.fd, *(r.block.fd for r in self.rings))
        command = [sys.executable, "-m", "guard.verifier_process", "--control-fd", str(fds[0]),
                   "--routes-fd", str(fds[1]), "--routes-capacity", str(self.table.capacity),
                   "--ring-bytes", str(self.rings[0].capacity)]
        for fd in fds[2:]:
            command += ["--ring-fd", str(fd)]
        channel = Channel(parent, self._handlers(), "serving", on_close=self._on_close)
        with self._lock:  # a stop (a signal during start) starts no verifier after it
            if self._stopping.is_set():
                child.close()
                parent.close()
                return "stopped during start-up"
            self.table.clear_heartbeat()
            process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
            self.process, self.channel = process, channel
        child.close()
        channel.start()
        message = Init(config_to_wire(self.config), self._slots())
        if resume:
            served = self.served()
            message.resume = {name: self.table.get(m.slot, routes.ROUTE)
                              for name, m in served.items()}
            message.kept = {name: m.kept for name, m in served.items() if m.kept}
        try:
            reply = channel.call(message, timeout=self.settings.start_timeout_s)
        except ChannelClosed:
            process.wait(5)
            return f"the verifier process exited during start-up (exit code {process.returncode})"
        except TimeoutError:
            return (f"the verifier did not load the models within "
                    f"server.verifier.start_timeout_s ({self.settings.start_timeout_s}s)")
        if isinstance(reply, Failed):
            return reply.error
        self._started_at = time.monotonic()
        self.ready.set()
        self.up.set(1)
        return ""

    def _slots(self) -> dict[str, int]:
        return {name: model.slot for name, model in self.served().items()}

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the verifier to stop (it flushes capture), wait for it, kill it past timeout.
        One that has not answered ``Init`` yet (a stop during start, or a restart) is killed:
        it may be waiting on a model (an upstream's ``ready_timeout_s``) and has no samples."""
        self._stopping.set()
        with self._lock:
            channel, process = self.channel, self.process
        if not self.ready.is_set():
            self._terminate_current()
        elif channel is not None:
            try:
                channel.call(Stop(), timeout=5)
            except (ChannelClosed, TimeoutError):
                pass
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        if channel is not None:
            channel.close()
        if self._watcher is not None:
            self._watcher.join(5)
        self.up.set(0)

    def _terminate(self) -> None:
        self._stopping.set()
        self._terminate_current()

    # -- watching ----------------------------------------------------------------------------------
    def _on_close(self) -> None:
        self.ready.clear()

    def _watch(self) -> None:
        """Restart a verifier that died or hung, with backoff; count what it took with it."""
        while not self._stopping.is_set():
            with self._lock:
                process = self.process
            if process is None:
                self._stopping.wait(_WATCH_S)
                continue
            code = wait_exit(process, _WATCH_S)  # wakes at the exit, else after the tick
            if self._stopping.is_set():
                return
            with self._lock:
                if process is not self.process:
                    continue
            if code is None and self.ready.is_set():
                beat, _ = self.table.heartbeat()
                stale = (time.monotonic_ns() - beat) / 1e9 if beat else 0.0
                if stale > self.settings.hang_timeout_s:
                    self._lost(f"hung: no heartbeat for {stale:.1f}s; killed")
                    process.kill()
                    process.wait(5)
                    self._restart()
                continue
            if code is None:
                continue  # the control socket closed but the process lingers: give it a tick
            if self._stopping.is_set():
                return
            self._lost(f"exited with {exit_reason(code)}")
            self._restart()

    def _lost(self, how: str) -> None:
        self.ready.clear()
        self.up.set(0)
        self.restarts.inc()
        lost = {}
        for name, model in self.served().items():
            held = self.table.get(model.slot, routes.IN_HAND)
            self.table.set(model.slot, routes.IN_HAND, 0)
            if held:
                lost[name] = held
                model.count_lost(held)
        if time.monotonic() - self._started_at > _HEALTHY_AFTER_S:
            self._backoff = self.settings.restart_backoff_s
        emit("verifier_lost", how=how, samples_lost=lost, restart_in_s=round(self._backoff, 2),
             note="serving goes on on the last routes; sampled requests wait in the ring")

    def _restart(self) -> None:
        with self._lock:
            channel = self.channel
        if channel is not None:
            channel.close()
        while not self._stopping.is_set():
            if self._stopping.wait(self._backoff):
                return
            self._backoff = min(_MAX_BACKOFF_S, self._backoff * 2)
            error = self._spawn(resume=True)
            if not error:
                emit("verifier_restarted", pid=self.process.pid)
                return
            emit("verifier_restart_failed", error=error, retry_in_s=round(self._backoff, 2))
            self._terminate_current()

    def _terminate_current(self) -> None:
        """Kill the current verifier (if it runs) and close its channel."""
        with self._lock:
            channel, process = self.channel, self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(5)
        if channel is not None:
            channel.close()

    # -- talking -------------------------------------------------------------------------------------
    def call(self, message: Message, timeout: float = 30.0) -> Message:
        """A request to the verifier; ``VerifierUnavailable`` while it is down or restarting."""
        with self._lock:
            channel = self.channel
        if channel is None or not self.ready.is_set():
            raise VerifierUnavailable("the verifier process is restarting")
        try:
            return channel.call(message, timeout=timeout)
        except (ChannelClosed, TimeoutError) as exc:
            raise VerifierUnavailable(f"the verifier process did not answer: {exc}") from None

    def exposition(self) -> str:
        """The verifier's metrics in the text format; "" while it is down."""
        try:
            reply = self.call(Metrics(), timeout=2.0)
        except VerifierUnavailable:
            return ""
        return reply.text if isinstance(reply, Exposition) else ""

    def status(self, model: str = "") -> dict[str, bytes]:
        reply = self.call(Status(model), timeout=10)
        if not isinstance(reply, StatusReport):
            raise VerifierUnavailable(f"the verifier did not report: {reply}")
        return {name: base64.b64decode(data) for name, data in reply.models.items()}

    def reload(self, config: GuardConfig, slots: dict[str, int], changed: list[str],
               removed: list[str]) -> dict:
        """Tell the verifier about a new config (``slots``: every model's route slot, new ones
        included); {model: error} for models it could not load. A verifier that is down picks
        the new config up when it restarts."""
        if not self.ready.is_set():
            return {}
        try:
            reply = self.call(Reload(config_to_wire(config), slots, changed, removed),
                              timeout=self.settings.start_timeout_s)
        except VerifierUnavailable:
            return {}
        if isinstance(reply, Failed):
            return {name: reply.error for name in changed}
        return reply.failed if isinstance(reply, LoadFailures) else {}

    def _handlers(self) -> Handlers:
        """What the verifier sends this process."""
        return Handlers("the primary serving process", {
            Event: lambda m: _events.info(m.line),
            Span: lambda m: tracing.export_recorded(m.record),
            RouteChanged: self._route_changed, UsePrimary: self._use_primary})

    def _route_changed(self, message: RouteChanged) -> None:
        model = self.served().get(message.model)
        if model is not None:
            model.transition(dataclasses.asdict(message))

    def _use_primary(self, message: UsePrimary) -> Failed | None:
        """A repair's variant (or the configured primary back): here first, then in the other
        serving processes; the verifier moves the route only once every one answers with it."""
        model = self.served().get(message.model)
        if model is None:
            return Failed(f"unknown model '{message.model}'")
        model.use_primary(message.kept, message.primary)
        error = self.relay(message) if self.relay is not None else ""
        return Failed(error) if error else None




class MergedMetrics(Collector):
    """This process's registry plus the expositions of the verifier and of the other serving
    processes (``others()``: their texts), same-named series summed."""

    def __init__(self, metrics: GuardMetrics, others: Callable[[], Iterable[str]]):
        self.metrics = metrics
        self.others = others

    def collect(self):
        yield from merge(self.metrics.registry.collect(), self.others())
