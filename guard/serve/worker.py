"""``ServingWorker``: one serving process's serving (its models, its data plane, its edges), the
same class in every serving process. ``guard serve`` runs one in-process (the first serving
process, guard/serve/app.py, which also keeps the admin API, /metrics, reload, the Tap service
and the supervisors); with ``server.processes`` > 1 each extra serving process runs one as
``python -m guard.serve.worker`` (started and restarted by guard/serve/processes.py) on the same
port (SO_REUSEPORT: the kernel spreads client connections over the processes).

A worker is changed only through its control messages (guard/ipc/messages.py), handled the same
in every process: the first process's pool (guard/serve/processes.py) hands them to its own
worker directly and sends them to the others over their control channels.

- ``Init``: the config (its wire form, guard/ipc/config.py), the route slots, the ports the
  first process bound and the primaries a repair put in (an extra process: its models load
  first and it binds after, so it never answers "not ready" on the shared port; the first
  process listens before it loads, and calls ``listen``, ``registry.load`` and ``set_ready``
  itself in that order);
- ``Prepare`` / ``Commit``: a reload in two steps (guard/serve/registry.py): the changed models
  are built beside the old ones, then swapped in only if they loaded in every process; a
  replaced model is closed once the requests inside it are done, never under one;
- ``UsePrimary``: a repair's variant (or the configured primary back), sent by the pool to
  every serving process alike;
- ``Metrics``: the process's registry, merged into /metrics (same-named series summed; an extra
  process's registry leaves out the first-only series such as ``guard_build_info``);
- ``Stop``: graceful (readiness NOT_SERVING, in-flight requests get the grace, then exit).

An extra process's ``guard.events`` go to the first, which logs them. When the first goes away
(the control socket closes, whatever killed it) the extra stops gracefully too. SIGTERM, SIGINT
and SIGHUP are the first process's to act on (guard/runtime/children.py
``leave_signals_to_the_parent``): a signal to the whole process group stops the extras only
through the first, once it has drained.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from typing import Mapping

from prometheus_client import generate_latest

from guard import __version__
from guard.config import GuardConfig
from guard.ipc.channel import Channel, ForwardEvents
from guard.ipc.config import config_from_wire
from guard.ipc.messages import (Commit, Exposition, Failed, Handlers, Init, LoadFailures,
                                Metrics, Prepare, Ready, Stop, UsePrimary)
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe import logformat, tracing
from guard.observe.metrics import GuardMetrics
from guard.runtime.children import exit_at_once, leave_signals_to_the_parent
from guard.serve import event_loop
from guard.serve.dataplane import DataPlane
from guard.serve.edges import Edge, build_edges
from guard.serve.registry import ModelRegistry

log = logging.getLogger("guard.worker")


def init_primaries(message: Init) -> dict[str, UsePrimary]:
    """The repaired primaries an ``Init`` carries, as the ``UsePrimary`` each came with."""
    return {name: UsePrimary(name, kept, message.primaries.get(name))
            for name, kept in message.kept.items() if kept}


class ServingWorker:
    def __init__(self, table: RouteTable, ring: SampleRing, metrics: GuardMetrics,
                 index: int = 0, loop: asyncio.AbstractEventLoop | None = None):
        """``index``: 0 for the first serving process, 1.. for the extra ones; ``metrics``:
        the process's registry (the first process's holds the first-only series too);
        ``loop``: the event loop it serves on (else the one ``listen`` runs on)."""
        self.loop = loop
        self.index = index
        self.metrics = metrics
        self.registry = ModelRegistry(metrics, table, ring, f"serving process {index}")
        self.models = self.registry.models  # one dict for the process's life
        self.config: GuardConfig | None = None
        self.dataplane: DataPlane | None = None
        self.edges: list[Edge] = []
        self.stopping = asyncio.Event()
        self.grace: float | None = None  # a Stop's grace (None: server.shutdown_grace_s)

    # -- control (from a channel thread, or the first process's pool) ---------------------------
    def handlers(self) -> Handlers:
        return Handlers(f"serving process {self.index}", {
            Metrics: self._metrics, Init: self._init, Prepare: self._prepare,
            Commit: self._commit, UsePrimary: self._use_primary, Stop: self._stop})

    def _metrics(self, _: Metrics) -> Exposition:
        return Exposition(generate_latest(self.metrics.registry).decode())

    def _stop(self, message: Stop) -> None:
        self.grace = message.grace
        self._serving_loop().call_soon_threadsafe(self.stopping.set)

    def _use_primary(self, message: UsePrimary) -> Failed | None:
        error = self.registry.use_primary(message)
        return Failed(error) if error else None

    def _run(self, coroutine):
        """Run a coroutine on the worker's event loop and wait for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._serving_loop()).result()

    def _serving_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the worker serves on (``listen`` sets it; handlers run after)."""
        assert self.loop is not None, "the serving worker is not listening yet"
        return self.loop

    def _init(self, message: Init) -> Ready | Failed:
        self.config = config = config_from_wire(message.config)
        try:
            self.registry.load(config, message.slots, init_primaries(message))
            self._run(self.registry.connect())
            self._run(self.listen(config, message.ports))
            self._run(self.set_ready())
        except Exception as exc:
            return Failed(f"serving process {self.index}: {exc}")
        return Ready(sorted(self.models), os.getpid())

    def _prepare(self, message: Prepare) -> LoadFailures:
        """Build the changed models beside the old ones; swapped in by ``Commit``."""
        failed = self.registry.prepare(config_from_wire(message.config), message.slots,
                                       message.changed)
        self._run(self.registry.connect(prepared=True))
        return LoadFailures(failed)

    def _commit(self, message: Commit) -> None:
        self._run(self.commit(message))

    async def commit(self, message: Commit) -> None:
        await self.registry.commit(message.names, message.removed, message.retire_report_s)
        if self.dataplane is not None:
            self.dataplane.models_changed()

    # -- serving ---------------------------------------------------------------------------------
    async def listen(self, config: GuardConfig, ports: Mapping[str, int] | None = None,
                     edges: list[Edge] | None = None) -> None:
        """Start the data plane and the edges (``edges``: those of ``EDGES`` the config asks
        for, on ``ports`` where given): live from here, not ready until ``set_ready``."""
        self.config = config
        self.loop = asyncio.get_running_loop()
        settings = config.server
        self.dataplane = DataPlane(self.models, self.metrics, settings.workers,
                                   settings.max_concurrent_requests)
        self.edges = build_edges(self.dataplane, settings, ports) if edges is None else edges
        for edge in self.edges:
            await edge.start()

    @property
    def ports(self) -> dict[str, int]:
        """The bound port of each edge, by name (what an extra serving process binds too)."""
        return {edge.name: edge.port for edge in self.edges}

    async def set_ready(self) -> None:
        """Every model is loaded: requests are routed to them, and the edges say ready."""
        assert self.dataplane is not None, "listen() comes first"
        self.dataplane.models_changed()
        self.dataplane.loading = False
        for edge in self.edges:
            await edge.set_ready(True)

    async def end_serving(self) -> None:
        """Not ready from now on, no new request (the first step of a stop, at once)."""
        if self.dataplane is not None:
            self.dataplane.live = False
        for model in self.models.values():
            model.end_watches()  # WatchRoute streams end now, not after the grace
        for edge in self.edges:
            await edge.set_ready(False)

    async def stop(self, grace: float | None = None, close_models: bool = True) -> None:
        """Stop gracefully: no new requests, the ones in flight get ``grace`` seconds (None:
        the Stop's, else ``server.shutdown_grace_s``), then the data plane and (unless
        ``close_models`` is False: the first process closes them after the verifier) the
        models close."""
        if grace is None:
            grace = self.grace
        if grace is None:
            grace = self.config.server.shutdown_grace_s if self.config is not None else 0.0
        await self.end_serving()
        await asyncio.gather(*(edge.stop(grace) for edge in self.edges))
        loop = asyncio.get_running_loop()
        if self.dataplane is not None:
            await loop.run_in_executor(None, self.dataplane.close)
        if close_models:
            await loop.run_in_executor(None, self.registry.close)


async def _serve(args) -> int:
    loop = asyncio.get_running_loop()
    table = RouteTable.attach(args.routes_fd, args.routes_capacity)
    ring = SampleRing.attach(args.ring_fd, args.ring_bytes)
    worker = ServingWorker(table, ring, GuardMetrics(__version__, serving=False), args.index,
                           loop)

    def first_gone() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(worker.stopping.set)

    channel = Channel(socket.socket(fileno=args.control_fd), worker.handlers(),
                      f"serving-{args.index}", on_close=first_gone)
    ForwardEvents.install(channel)
    channel.start()
    await worker.stopping.wait()
    await worker.stop()
    channel.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from guard.malloc import tune_for_inference

    tune_for_inference()  # before backends allocate: see guard/malloc.py
    parser = argparse.ArgumentParser(prog="python -m guard.serve.worker",
                                     description="one of guard's extra serving processes "
                                     "(started by guard serve; not meant to be run by hand).")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--routes-fd", type=int, required=True)
    parser.add_argument("--routes-capacity", type=int, required=True)
    parser.add_argument("--ring-fd", type=int, required=True)
    parser.add_argument("--ring-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    leave_signals_to_the_parent()  # stopped over its channel (guard/runtime/children.py)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logformat.configure(process=f"serving {args.index}")  # server.log_format, from the parent
    tracing.configure_from_env()
    # The first process's loop (uvloop where installed); its threads are not waited for.
    return event_loop.run(_serve(args), wait_for_threads=False)


if __name__ == "__main__":
    # Exit at once once stopped: a control request still running on the channel's threads
    # (an Init waiting on an upstream when the first process stops or dies) must not keep this
    # process alive past it; the server and the models are closed by then.
    exit_at_once(main())
