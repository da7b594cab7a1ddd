"""The primary serving process's side of the other serving processes (``server.processes``).

``guard serve`` is the primary: it keeps the admin API, /metrics, reload, tap and the verifier's
supervisor, and serves the data plane. With ``server.processes: N`` it starts N-1 more
(``python -m guard.serve.worker``, guard/serve/worker.py) that bind the same ``grpc_port`` with
SO_REUSEPORT and serve only the data plane and gRPC health. Each gets the route table (shared by
all: a route the verifier publishes, or an operator pins, is seen by every process at once), a
sample ring of its own (one producer per ring; the verifier reads them all) and a control
channel to the primary, over which it gets the config, reloads and a repair's ``use_primary``,
and answers for its metrics (merged into /metrics) and sends its events (logged here).

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
from typing import TYPE_CHECKING

from guard.errors import GuardError
from guard.ipc.channel import Channel, ChannelClosed
from guard.ipc.ring import SampleRing
from guard.observe.events import emit
from guard.ipc.config import config_message
from guard.serve.supervisor import _exit_reason

if TYPE_CHECKING:
    from guard.serve.app import GuardServer

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
    def __init__(self, server: "GuardServer", rings: list[SampleRing]):
        """``rings``: one per extra serving process (the primary's own is not among them)."""
        self.server = server
        self.others = [_Process(index, ring) for index, ring in enumerate(rings, start=1)]
        self.restarts = server.metrics.serving_process_restarts
        self.up = server.metrics.serving_processes
        self._stopping = threading.Event()
        self._keepers: list[threading.Thread] = []

    # -- start / stop ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start every other serving process and wait until each serves; GuardError (with the
        process's own message) when one cannot."""
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
        """Start the process and send it ``init``; the future holds its answer."""
        server = self.server
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (child.fileno(), server.table.block.fd, other.ring.block.fd)
        command = [sys.executable, "-m", "guard.serve.worker", "--index", str(other.index),
                   "--control-fd", str(fds[0]), "--routes-fd", str(fds[1]),
                   "--routes-capacity", str(server.table.capacity), "--ring-fd", str(fds[2]),
                   "--ring-bytes", str(other.ring.capacity)]
        process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
        child.close()
        other.process = process
        other.channel = Channel(parent, self._handle, f"serving-{other.index}").start()
        served = server.models
        return other.channel.call_async({
            "op": "init", **config_message(server.config), "port": server.grpc_port,
            "slots": {name: model.slot for name, model in served.items()},
            "kept": {name: model.kept for name, model in served.items() if model.kept}})

    def _settle(self, other: _Process, future: Future) -> str:
        """Wait for the answer to ``init``: "" once it serves, otherwise why not."""
        timeout = self.server.config.server.verifier.start_timeout_s
        try:
            reply = future.result(timeout)
        except ChannelClosed:
            other.process.wait(5)
            return (f"serving process {other.index} exited during start-up "
                    f"({_exit_reason(other.process.returncode)})")
        except TimeoutError:
            return (f"serving process {other.index} did not load the models within "
                    f"server.verifier.start_timeout_s ({timeout}s)")
        if reply.get("error"):
            return reply["error"]
        other.ready, other.started_at = True, time.monotonic()
        return ""

    def stop(self, grace: float) -> None:
        """Ask every other process to stop gracefully (in-flight requests get ``grace``),
        wait for them, kill one that takes more than ``grace`` + 10 s."""
        self._stopping.set()
        for other in self.others:
            other.ready = False
            if other.channel is not None:
                try:
                    other.channel.send({"op": "stop", "grace": grace})
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
                 how=f"exited with {_exit_reason(code)}", restart_in_s=round(other.backoff, 2),
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
    def _handle(self, message: dict) -> dict | None:
        if message.get("op") == "event":
            _events.info(message["line"])
        return None

    def _call_all(self, message: dict, timeout: float) -> list[dict]:
        """Send ``message`` to every process that serves now; their replies, in order (a
        process that did not answer gives ``{"error": ...}``)."""
        pending = [(other, other.channel.call_async(message)) for other in self.others
                   if other.ready and other.channel is not None]
        replies = []
        for other, future in pending:
            try:
                replies.append(future.result(timeout))
            except (ChannelClosed, TimeoutError) as exc:
                replies.append({"error": f"serving process {other.index} did not answer: "
                                         f"{type(exc).__name__}: {exc}"})
        return replies

    def expositions(self) -> list[str]:
        """Each other process's metrics in the text format (for the merged /metrics)."""
        return [reply.get("text", "") for reply in self._call_all({"op": "metrics"}, 2.0)]

    def use_primary(self, message: dict) -> str:
        """Relay a repair's ``use_primary`` (guard/serve/supervisor.py); "" when every process
        did it, otherwise why not."""
        replies = self._call_all({"op": "use_primary", "model": message["model"],
                                  "kept": message["kept"]}, 600)
        return "; ".join(reply["error"] for reply in replies if reply.get("error"))

    def prepare(self, config, slots: dict[str, int], changed: list[str]) -> dict[str, str]:
        """A reload's first step: every process builds the changed models beside the old ones;
        {model: error} for those that did not load somewhere."""
        if not changed:
            return {}
        failed: dict[str, str] = {}
        replies = self._call_all({"op": "prepare", **config_message(config), "slots": slots,
                                  "changed": changed},
                                 self.server.config.server.verifier.start_timeout_s)
        for reply in replies:
            if reply.get("error"):
                failed.update((name, reply["error"]) for name in changed)
            failed.update(reply.get("failed", {}))
        return failed

    def commit(self, names: list[str], removed: list[str]) -> None:
        """A reload's second step: swap in ``names`` (prepared everywhere), drop the rest of
        what was prepared, and the ``removed`` models."""
        self._call_all({"op": "commit", "names": names, "removed": removed}, 30)
