"""The primary serving process's side of the other serving processes (``server.processes``).

``guard serve`` is the primary: it keeps the admin API, /metrics, reload, tap and the verifier's
supervisor, and serves the data plane. With ``server.processes: N`` it starts N-1 more
(``python -m guard.serve.worker``, guard/serve/worker.py) that bind the same ``grpc_port`` with
SO_REUSEPORT and serve only the data plane and gRPC health. Each gets the route table (shared by
all: a route the verifier publishes, or an operator pins, is seen by every process at once), a
sample ring of its own (one producer per ring; the verifier reads them all) and a control
channel to the primary, over which it gets the config (``Init``), reloads (``Prepare``,
``Commit``) and a repair's ``UsePrimary`` (guard/ipc/messages.py), and answers for its metrics
(merged into /metrics) and sends its events (logged here).

Start: ``guard serve`` waits for every process to load its models and bind the port, and stops
with the process's own message when one cannot. After that a process that dies is counted
(``guard_serving_process_restarts_total``, event ``serving_process_lost``) and started again
after a backoff (1 s, doubling up to 30 s, reset after a minute of good health); the primary's
readiness never depends on the others. The others stop with the primary: gracefully when it
stops, and on their own when its control socket closes (whatever ended the primary).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from guard.config import GuardConfig
from guard.errors import GuardError
from guard.ipc.channel import Channel, ChannelClosed
from guard.ipc.config import config_to_wire
from guard.ipc.messages import (Commit, Event, Exposition, Failed, Handlers, Init, LoadFailures,
                                Message, Metrics, Prepare, Stop, UsePrimary)
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.runtime.children import exit_reason

log = logging.getLogger("guard.processes")
_events = logging.getLogger("guard.events")
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
_HEALTHY_AFTER_S = 60.0
_WATCH_S = 0.1


@dataclass
class _Process:
    index: int
    ring: SampleRing
    process: subprocess.Popen | None = None
    channel: Channel | None = None
    ready: bool = False
    started_at: float = 0.0
    backoff: float = _FIRST_BACKOFF_S


class ServingProcesses:
    def __init__(self, rings: list[SampleRing], table: RouteTable, metrics: GuardMetrics,
                 config: Callable[[], GuardConfig], served: Callable[[], dict]):
        """``rings``: one per extra serving process (the primary's own is not among them);
        ``table``: the route table they share; ``config()``: the config in force (what a
        restarted process is told); ``served()``: the primary's models by name (their route
        slots, a repaired primary to serve the same way)."""
        self.table = table
        self.config = config
        self.served = served
        self.port = 0  # the data-plane port they bind: the primary's, known at start
        self.others = [_Process(index, ring) for index, ring in enumerate(rings, start=1)]
        self.restarts = metrics.serving_process_restarts
        self.up = metrics.serving_processes
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # launches vs stop
        self._keepers: list[threading.Thread] = []
        self._handlers = Handlers("the primary serving process",
                                  {Event: lambda m: _events.info(m.line)})

    # -- start / stop ----------------------------------------------------------------------------
    def start(self, port: int) -> None:
        """Start every other serving process on the primary's data-plane ``port`` and wait
        until each serves; GuardError (with the process's own message) when one cannot."""
        self.port = port
        with self._lock:  # a stop during start (a signal) launches nothing more
            if self._stopping.is_set():
                return
            pending = [(other, self._launch(other)) for other in self.others]
        errors = [error for other, future in pending if (error := self._settle(other, future))]
        if errors:
            self.stop(grace=0)
            raise GuardError(errors[0])
        for other in self.others:
            keeper = threading.Thread(target=self._keep, args=(other,), daemon=True,
                                      name=f"guard-serving-{other.index}-watch")
            keeper.start()
            self._keepers.append(keeper)
        self._count()

    def _launch(self, other: _Process) -> Future:
        """Start the process and send it ``Init``; the future holds its answer."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (child.fileno(), self.table.block.fd, other.ring.block.fd)
        command = [sys.executable, "-m", "guard.serve.worker", "--index", str(other.index),
                   "--control-fd", str(fds[0]), "--routes-fd", str(fds[1]),
                   "--routes-capacity", str(self.table.capacity), "--ring-fd", str(fds[2]),
                   "--ring-bytes", str(other.ring.capacity)]
        process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
        child.close()
        other.process = process
        other.channel = Channel(parent, self._handlers, f"serving-{other.index}").start()
        served = self.served()
        repaired = {name: model for name, model in served.items() if model.kept}
        return other.channel.call_async(Init(
            config_to_wire(self.config()), {name: model.slot for name, model in served.items()},
            kept={name: model.kept for name, model in repaired.items()},
            primaries={name: model.kept_primary for name, model in repaired.items()},
            port=self.port))

    def _settle(self, other: _Process, future: Future) -> str:
        """Wait for the answer to ``Init``: "" once it serves, otherwise why not."""
        timeout = self.config().server.verifier.start_timeout_s
        try:
            reply = future.result(timeout)
        except ChannelClosed:
            other.process.wait(5)
            return (f"serving process {other.index} exited during start-up "
                    f"({exit_reason(other.process.returncode)})")
        except TimeoutError:
            return (f"serving process {other.index} did not load the models within "
                    f"server.verifier.start_timeout_s ({timeout}s)")
        if isinstance(reply, Failed):
            return reply.error
        other.ready, other.started_at = True, time.monotonic()
        return ""

    def stop(self, grace: float) -> None:
        """Ask every other process to stop gracefully (in-flight requests get ``grace``),
        wait for them, kill one that takes more than ``grace`` + 10 s."""
        with self._lock:
            self._stopping.set()
        for other in self.others:
            other.ready = False
            if other.channel is not None:
                try:
                    other.channel.send(Stop(grace))
                except ChannelClosed:
                    pass
        for other in self.others:
            self._end(other, grace + 10)
        for keeper in self._keepers:
            keeper.join(5)
        self._count()

    def _end(self, other: _Process, timeout: float) -> None:
        if other.process is not None:
            try:
                other.process.wait(timeout)
            except subprocess.TimeoutExpired:
                other.process.kill()
                other.process.wait(5)
        if other.channel is not None:
            other.channel.close()

    def _count(self) -> None:
        self.up.set(1 + sum(other.ready for other in self.others))

    # -- watching ----------------------------------------------------------------------------------
    def _keep(self, other: _Process) -> None:
        """Restart the process when it dies, with backoff; count it."""
        while not self._stopping.wait(_WATCH_S):
            code = other.process.poll()
            if code is None or self._stopping.is_set():
                continue
            other.ready = False
            self._count()
            self.restarts.inc()
            if time.monotonic() - other.started_at > _HEALTHY_AFTER_S:
                other.backoff = _FIRST_BACKOFF_S
            emit("serving_process_lost", index=other.index, pid=other.process.pid,
                 how=f"exited with {exit_reason(code)}", restart_in_s=round(other.backoff, 2),
                 note="the other serving processes answer its clients' new connections")
            other.channel.close()
            while not self._stopping.wait(other.backoff):
                other.backoff = min(_MAX_BACKOFF_S, other.backoff * 2)
                error = self._settle(other, self._launch(other))
                if not error:
                    self._count()
                    emit("serving_process_restarted", index=other.index, pid=other.process.pid)
                    break
                emit("serving_process_restart_failed", index=other.index, error=error,
                     retry_in_s=round(other.backoff, 2))
                if other.process.poll() is None:
                    other.process.kill()
                self._end(other, 5)

    # -- talking -------------------------------------------------------------------------------------
    def _call_all(self, message: Message, timeout: float) -> list[Message]:
        """Send ``message`` to every process that serves now; their replies, in order (a
        process that did not answer gives ``Failed``)."""
        pending = [(other, other.channel.call_async(message)) for other in self.others
                   if other.ready and other.channel is not None]
        replies: list[Message] = []
        for other, future in pending:
            try:
                replies.append(future.result(timeout))
            except (ChannelClosed, TimeoutError) as exc:
                replies.append(Failed(f"serving process {other.index} did not answer: "
                                      f"{type(exc).__name__}: {exc}"))
        return replies

    def expositions(self) -> list[str]:
        """Each other process's metrics in the text format (for the merged /metrics)."""
        return [reply.text for reply in self._call_all(Metrics(), 2.0)
                if isinstance(reply, Exposition)]

    def use_primary(self, message: UsePrimary) -> str:
        """Relay a repair's ``UsePrimary`` (guard/serve/supervisor.py); "" when every process
        did it, otherwise why not."""
        replies = self._call_all(message, 600)
        return "; ".join(reply.error for reply in replies if isinstance(reply, Failed))

    def prepare(self, config: GuardConfig, slots: dict[str, int],
                changed: list[str]) -> dict[str, str]:
        """A reload's first step: every process builds the changed models beside the old ones;
        {model: error} for those that did not load somewhere."""
        if not changed:
            return {}
        failed: dict[str, str] = {}
        replies = self._call_all(Prepare(config_to_wire(config), slots, changed),
                                 self.config().server.verifier.start_timeout_s)
        for reply in replies:
            if isinstance(reply, Failed):
                failed.update((name, reply.error) for name in changed)
            elif isinstance(reply, LoadFailures):
                failed.update(reply.failed)
        return failed

    def commit(self, names: list[str], removed: list[str], retire_report_s: float) -> None:
        """A reload's second step: swap in ``names`` (prepared everywhere), drop the rest of
        what was prepared, and the ``removed`` models (each retired once the requests inside it
        are done; reported after ``retire_report_s``)."""
        self._call_all(Commit(names, removed, retire_report_s), 30)
