"""Every serving process of one ``guard serve``, as the first one sees them (``ServingPool``):
its own ``ServingWorker`` and, with ``server.processes: N``, N-1 more (``python -m
guard.serve.worker``, guard/serve/worker.py) on the same data-plane port (SO_REUSEPORT).

The first process keeps the admin API, /metrics, reload, the Tap service and the supervisors;
every process serves the data plane. Each extra one gets the route table (shared by all: a
route the verifier publishes, or an operator pins, is seen by every process at once), a sample
ring of its own (one producer per ring; the verifier reads them all) and a control channel, and
sends its events (logged here).

The pool reaches every serving process the same way, its own worker included: a reload's
``Prepare`` and ``Commit``, a repair's ``UsePrimary``, ``Stop`` are one message each, handled by
the same ``ServingWorker`` handlers in every process (the own one called directly, the others
over their channels). The pool is the one record of which primary each model serves
(``primaries``: a repair's variant, or none): a serving process started again is given it with
its ``Init``, and a restarted verifier resumes from it.

Start: ``guard serve`` waits for every process to load its models and bind the port, and stops
with the process's own message when one cannot. After that an extra process that dies is
counted (``guard_serving_process_restarts_total``, event ``serving_process_lost``) and started
again by its ``ChildSupervisor`` (guard/runtime/children.py: the one restart policy of guard's
children); the first process's readiness never depends on the others. The others stop with the
first: gracefully when it stops, and on their own when its control socket closes.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Callable

from guard.config import GuardConfig
from guard.errors import GuardError
from guard.ipc.channel import Channel, ChannelClosed
from guard.ipc.config import config_to_wire
from guard.ipc.messages import (Commit, Event, Exposition, Failed, Handlers, Init, LoadFailures,
                                Message, Metrics, Prepare, Stop, UsePrimary)
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe.metrics import GuardMetrics
from guard.runtime.children import (RESTART_POLICIES, ChildSupervisor, end_process,
                                    exit_reason)
from guard.serve.worker import ServingWorker

log = logging.getLogger("guard.processes")
_events = logging.getLogger("guard.events")


class ServingChild:
    """One extra serving process, as ``ChildSupervisor`` drives it (``Child``)."""

    kind = "serving_process"

    def __init__(self, index: int, ring: SampleRing, pool: "ServingPool"):
        self.index = index
        self.ring = ring
        self.pool = pool
        self.fields = {"index": index}
        self.channel: Channel | None = None
        self.ready = False
        self.supervisor = ChildSupervisor(self, RESTART_POLICIES[self.kind],
                                          pool.metrics.serving_process_restarts)

    @property
    def process(self) -> subprocess.Popen | None:
        return self.supervisor.process

    def launch(self) -> subprocess.Popen:
        process, channel, reply = self._spawn()
        error = self._settle(process, reply)
        if error:
            if process.poll() is None:
                process.kill()
            end_process(process, 5)
            channel.close()
            raise GuardError(error)
        self.ready = True
        self.pool.count()
        return process

    def _spawn(self) -> tuple[subprocess.Popen, Channel, Future]:
        pool = self.pool
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = (child.fileno(), pool.table.block.fd, self.ring.block.fd)
        command = [sys.executable, "-m", "guard.serve.worker", "--index", str(self.index),
                   "--control-fd", str(fds[0]), "--routes-fd", str(fds[1]),
                   "--routes-capacity", str(pool.table.capacity), "--ring-fd", str(fds[2]),
                   "--ring-bytes", str(self.ring.capacity)]
        process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
        child.close()
        self.channel = channel = Channel(parent, pool.handlers, f"serving-{self.index}").start()
        return process, channel, channel.call_async(pool.init_message())

    def _settle(self, process: subprocess.Popen, reply: Future) -> str:
        """Wait for the answer to ``Init``: "" once it serves, otherwise why not."""
        timeout = self.pool.config().server.verifier.start_timeout_s
        try:
            answer = reply.result(timeout)
        except ChannelClosed:
            end_process(process, 5)
            return (f"serving process {self.index} exited during start-up "
                    f"({exit_reason(process.returncode)})")
        except TimeoutError:
            return (f"serving process {self.index} did not load the models within "
                    f"server.verifier.start_timeout_s ({timeout}s)")
        return answer.error if isinstance(answer, Failed) else ""

    def hung(self, process: subprocess.Popen) -> str | None:
        return None  # its requests have their own deadlines; only its death is watched

    def lost(self, process: subprocess.Popen, how: str) -> dict:
        self.ready = False
        self.pool.count()
        if self.channel is not None:
            self.channel.close()
        return {"note": "the other serving processes answer its clients' new connections"}

    def end(self, process: subprocess.Popen | None, grace: float) -> None:
        self.ready = False
        if self.channel is not None:
            try:
                self.channel.send(Stop(grace))
            except ChannelClosed:
                pass
        end_process(process, grace + 10)
        if self.channel is not None:
            self.channel.close()

    def call_async(self, message: Message) -> Future | None:
        channel = self.channel
        if not self.ready or channel is None:
            return None
        return channel.call_async(message)


class ServingPool:
    def __init__(self, local: ServingWorker, rings: list[SampleRing], table: RouteTable,
                 metrics: GuardMetrics, config: Callable[[], GuardConfig]):
        """``local``: this process's worker; ``rings``: one per extra serving process;
        ``table``: the route table they share; ``config()``: the config in force (what a
        process started again is told)."""
        self.local = local
        self.table = table
        self.metrics = metrics
        self.config = config
        self.ports: dict[str, int] = {}  # what the extra ones bind: the first's, known at start
        # The one record of a repaired primary per model (guard/serve/worker.py UsePrimary).
        self.primaries: dict[str, UsePrimary] = {}
        self._lock = threading.Lock()  # use_primary vs a restart's Init
        self.handlers = Handlers("the first serving process",
                                 {Event: lambda m: _events.info(m.line)})
        self.others = [ServingChild(index, ring, self) for index, ring in enumerate(rings, 1)]
        self._stopping = threading.Event()

    # -- start / stop ----------------------------------------------------------------------------
    def start(self, ports: dict[str, int]) -> None:
        """Start every extra serving process on the first's ``ports`` and wait until each
        serves; GuardError (with the process's own message) when one cannot."""
        self.ports = ports
        errors: list[str] = []

        def start(other: ServingChild) -> None:
            try:
                other.supervisor.start()
            except GuardError as exc:
                errors.append(str(exc))

        starters = [threading.Thread(target=start, args=(other,), daemon=True)
                    for other in self.others if not self._stopping.is_set()]
        for starter in starters:
            starter.start()
        for starter in starters:
            starter.join()
        if errors:
            self.stop(grace=0)
            raise GuardError(errors[0])
        self.count()

    def init_message(self) -> Init:
        """What a starting extra process is told: the config in force, the route slots, the
        ports and the repaired primaries."""
        with self._lock:
            primaries = dict(self.primaries)
        return Init(config_to_wire(self.config()),
                    {name: model.slot for name, model in self.local.models.items()},
                    kept={name: p.kept for name, p in primaries.items()},
                    primaries={name: p.primary for name, p in primaries.items()},
                    ports=self.ports)

    def stop(self, grace: float) -> None:
        """Stop every extra process gracefully (in-flight requests get ``grace``); the own
        worker is stopped by its server (``ServingWorker.stop``)."""
        self._stopping.set()
        threads = [threading.Thread(target=other.supervisor.stop, args=(grace,), daemon=True)
                   for other in self.others]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.count()

    def count(self) -> None:
        self.metrics.serving_processes.set(1 + sum(other.ready for other in self.others))

    # -- every serving process alike ---------------------------------------------------------------
    def call_all(self, message: Message, timeout: float) -> list[Message | None]:
        """``message`` to every serving process that serves now, the own one included (handled
        by the same handlers); the replies (one that did not answer gives ``Failed``)."""
        pending = [(other, other.call_async(message)) for other in self.others]
        try:
            replies: list[Message | None] = [self.local.handlers()(message)]
        except Exception as exc:
            replies = [Failed(f"serving process 0: {type(exc).__name__}: {exc}")]
        for other, future in pending:
            if future is None:
                continue
            try:
                replies.append(future.result(timeout))
            except (ChannelClosed, TimeoutError) as exc:
                replies.append(Failed(f"serving process {other.index} did not answer: "
                                      f"{type(exc).__name__}: {exc}"))
        return replies

    def expositions(self) -> list[str]:
        """Each extra process's metrics in the text format (the own ones are this process's
        registry)."""
        pending = [other.call_async(Metrics()) for other in self.others]
        texts = []
        for future in pending:
            try:
                reply = future.result(2.0) if future is not None else None
            except (ChannelClosed, TimeoutError):
                continue
            if isinstance(reply, Exposition):
                texts.append(reply.text)
        return texts

    def use_primary(self, message: UsePrimary) -> str:
        """A repair's ``UsePrimary`` (from the verifier) in every serving process; "" when
        every one did it, otherwise why not (and every one is put back on the primary it
        served before)."""
        with self._lock:
            before = self.primaries.get(message.model) or UsePrimary(message.model, [])
            errors = [reply.error for reply in self.call_all(message, 600)
                      if isinstance(reply, Failed)]
            if errors:
                self.call_all(before, 600)
                return "; ".join(errors)
            if message.kept:
                self.primaries[message.model] = message
            else:
                self.primaries.pop(message.model, None)
        return ""

    def prepare(self, config: GuardConfig, slots: dict[str, int],
                changed: list[str]) -> dict[str, str]:
        """A reload's first step in every serving process: build the changed models beside the
        old ones; {model: error} for those that did not load somewhere."""
        if not changed:
            return {}
        failed: dict[str, str] = {}
        for reply in self.call_all(Prepare(config_to_wire(config), slots, changed),
                                   config.server.verifier.start_timeout_s):
            if isinstance(reply, Failed):
                failed.update((name, reply.error) for name in changed)
            elif isinstance(reply, LoadFailures):
                failed.update(reply.failed)
        return failed

    def commit(self, names: list[str], removed: list[str], retire_report_s: float) -> None:
        """A reload's second step in every serving process: swap in ``names`` (prepared
        everywhere), drop the rest of what was prepared, and the ``removed`` models (each
        retired once the requests inside it are done; reported after ``retire_report_s``).
        A model built again serves its primary as configured."""
        with self._lock:
            for name in (*names, *removed):
                self.primaries.pop(name, None)
            self.call_all(Commit(names, removed, retire_report_s), 30)
