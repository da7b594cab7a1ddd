"""The serving side's link to the verifier: start it, talk to it, and (through the one
``ChildSupervisor``, guard/runtime/children.py) watch and restart it.

The verifier is a child process (``python -m guard.verifier_process``) that inherits its
descriptors: one end of a control socket pair, the route table and one sample ring per serving
process (guard/ipc/; ``server.processes``). At start-up the server waits for it to load every
model's reference and noise floor, so a broken reference still stops ``guard serve`` with a
clear error. After that its death or a hang never fails or slows a client:

- death is seen at once (a pidfd); a hang (heartbeat older than
  ``server.verifier.hang_timeout_s``) is ended with SIGKILL;
- the samples it held in memory are counted as dropped (``guard_mirror_total``), the loss is an
  event (``verifier_lost``) and ``guard_verifier_restarts_total`` counts it;
- serving goes on on the last route words; the ring keeps taking samples until it is full
  (then they are dropped and counted), and the next verifier reads them;
- the next verifier starts after the backoff of guard's children (``restart_backoff_s`` first,
  guard/runtime/children.py ``RESTART_POLICIES``) and goes on from the route words and the
  repaired primaries the serving pool records (guard/serve/processes.py ``primaries``).

What the verifier sends: events (logged here), spans (exported here), route transitions (for
the Tap service's WatchRoute) and a repair's ``UsePrimary``, which the serving pool hands to
every serving process alike. Metrics: guard/serve/merged_metrics.py.
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
from typing import Callable

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
from guard.observe.metrics import GuardMetrics
from guard.runtime.children import RESTART_POLICIES, ChildSupervisor, end_process

log = logging.getLogger("guard.verifier_link")
_events = logging.getLogger("guard.events")


class VerifierUnavailable(GuardError):
    """The verifier is not running right now (restarting)."""


class VerifierLink:
    """The verifier as a ``Child`` of ``ChildSupervisor``, and the calls this process makes."""

    kind = "verifier"
    fields: dict = {}

    def __init__(self, config: GuardConfig, metrics: GuardMetrics, table: routes.RouteTable,
                 rings: list[SampleRing], served: Callable[[], dict],
                 use_primary: Callable[[UsePrimary], str],
                 primaries: Callable[[], dict[str, UsePrimary]]):
        """``served()``: this process's models by name (ServedModel: their route slots, the
        samples they handed off); ``rings``: one per serving process; ``use_primary``: a
        repair's ``UsePrimary`` in every serving process ("" when done, otherwise why not);
        ``primaries()``: the repaired primaries serving now (a restarted verifier resumes
        them)."""
        self.config = config
        self.settings = config.server.verifier
        self.metrics = metrics
        self.table = table
        self.rings = rings
        self.served = served
        self.use_primary = use_primary
        self.primaries = primaries
        self.channel: Channel | None = None
        self.ready = threading.Event()  # a verifier is up and initialised
        self._lock = threading.Lock()
        self._resume = False  # a restart: the route words and repaired primaries go on
        self._starting: subprocess.Popen | None = None  # launched, not yet initialised
        self.up = metrics.verifier_up
        self.supervisor = ChildSupervisor(
            self, RESTART_POLICIES[self.kind].with_first(self.settings.restart_backoff_s),
            metrics.verifier_restarts)

    @property
    def process(self) -> subprocess.Popen | None:
        return self.supervisor.process

    # -- start / stop (ChildSupervisor) ---------------------------------------------------------
    def start(self) -> None:
        """Start the first verifier and wait until it has loaded every model; GuardError (with
        the verifier's own message) when it cannot."""
        self.supervisor.start()
        self._resume = True

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the verifier to stop (it flushes capture), wait for it, kill it past timeout."""
        self.supervisor.stop(timeout)

    def launch(self) -> subprocess.Popen:
        """Start a verifier and initialise it; GuardError (why not) when it does not come up."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (child.fileno(), self.table.block.fd, *(r.block.fd for r in self.rings))
        command = [sys.executable, "-m", "guard.verifier_process", "--control-fd", str(fds[0]),
                   "--routes-fd", str(fds[1]), "--routes-capacity", str(self.table.capacity),
                   "--ring-bytes", str(self.rings[0].capacity)]
        for fd in fds[2:]:
            command += ["--ring-fd", str(fd)]
        channel = Channel(parent, self._handlers(), "serving", on_close=self.ready.clear)
        with self._lock:  # a stop (a signal during start) starts no verifier after it
            if self.supervisor.stopping.is_set():
                child.close()
                parent.close()
                raise GuardError("stopped during start-up")
            self.table.clear_heartbeat()
            process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
            self.channel = channel
            self._starting = process
        child.close()
        channel.start()
        error = self._init(channel, process)
        if error:
            if process.poll() is None:
                process.kill()
            end_process(process, 5)
            channel.close()
            raise GuardError(error)
        self.ready.set()
        self.up.set(1)
        return process

    def _init(self, channel: Channel, process: subprocess.Popen) -> str:
        message = Init(config_to_wire(self.config), self._slots())
        if self._resume:
            served = self.served()
            message.resume = {name: self.table.get(m.slot, routes.ROUTE)
                              for name, m in served.items()}
            message.kept = {name: p.kept for name, p in self.primaries().items()}
        try:
            reply = channel.call(message, timeout=self.settings.start_timeout_s)
        except ChannelClosed:
            end_process(process, 5)
            return f"the verifier process exited during start-up (exit code {process.returncode})"
        except TimeoutError:
            return (f"the verifier did not load the models within "
                    f"server.verifier.start_timeout_s ({self.settings.start_timeout_s}s)")
        return reply.error if isinstance(reply, Failed) else ""

    def _slots(self) -> dict[str, int]:
        """The route slot of every model of the config in force (the first start loads the
        serving side meanwhile: the table, not the served models, says)."""
        slots = self.table.assign(m.name for m in self.config.models)
        return {m.name: slots[m.name] for m in self.config.models}

    def hung(self, process: subprocess.Popen) -> str | None:
        if not self.ready.is_set():
            return None
        beat, _ = self.table.heartbeat()
        stale = (time.monotonic_ns() - beat) / 1e9 if beat else 0.0
        if stale > self.settings.hang_timeout_s:
            return f"hung: no heartbeat for {stale:.1f}s; killed"
        return None

    def lost(self, process: subprocess.Popen, how: str) -> dict:
        """Count the samples it held (as mirror ``dropped``) and forget its channel."""
        self.ready.clear()
        self.up.set(0)
        if self.channel is not None:
            self.channel.close()
        lost = {}
        for name, model in self.served().items():
            held = self.table.get(model.slot, routes.IN_HAND)
            self.table.set(model.slot, routes.IN_HAND, 0)
            if held:
                lost[name] = held
                model.count_lost(held)
        return {"samples_lost": lost,
                "note": "serving goes on on the last routes; sampled requests wait in the ring"}

    def end(self, process: subprocess.Popen | None, timeout: float) -> None:
        """One that has not answered ``Init`` yet (a stop during start, or a restart) is
        killed: it may be waiting on a model (an upstream's ``ready_timeout_s``) and has no
        samples; one that serves is asked to stop (it flushes capture) and killed past
        ``timeout``."""
        with self._lock:
            channel = self.channel
            starting = self._starting
        if not self.ready.is_set():
            for each in {id(p): p for p in (process, starting) if p is not None}.values():
                if each.poll() is None:
                    each.kill()
            process = starting or process
        elif channel is not None:
            try:
                channel.call(Stop(), timeout=5)
            except (ChannelClosed, TimeoutError):
                pass
        end_process(process, timeout)
        if channel is not None:
            channel.close()
        self.up.set(0)

    # -- talking -----------------------------------------------------------------------------------
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
               removed: list[str], carried: list[str]) -> dict:
        """Tell the verifier about a new config (``slots``: every model's route slot, new ones
        included; ``carried``: changed models whose detector evidence carries over); {model:
        error} for models it could not load. A verifier that is down picks the new config up
        when it restarts."""
        if not self.ready.is_set():
            return {}
        try:
            reply = self.call(Reload(config_to_wire(config), slots, changed, removed, carried),
                              timeout=self.settings.start_timeout_s)
        except VerifierUnavailable:
            return {}
        if isinstance(reply, Failed):
            return {name: reply.error for name in changed}
        return reply.failed if isinstance(reply, LoadFailures) else {}

    def _handlers(self) -> Handlers:
        """What the verifier sends this process."""
        return Handlers("the first serving process", {
            Event: lambda m: _events.info(m.line),
            Span: lambda m: tracing.export_recorded(m.record),
            RouteChanged: self._route_changed, UsePrimary: self._use_primary})

    def _route_changed(self, message: RouteChanged) -> None:
        model = self.served().get(message.model)
        if model is not None:
            model.transition(dataclasses.asdict(message))

    def _use_primary(self, message: UsePrimary) -> Failed | None:
        """A repair's variant (or the configured primary back) in every serving process; the
        verifier moves the route only once every one answers with it."""
        error = self.use_primary(message)
        return Failed(error) if error else None
