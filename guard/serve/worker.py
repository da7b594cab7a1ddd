"""Another serving process (``server.processes`` > 1): the Open Inference Protocol data plane and
gRPC health on the same port as ``guard serve`` (SO_REUSEPORT: the kernel spreads client
connections over the processes), nothing else.

Started by the primary serving process (guard/serve/processes.py) as ``python -m
guard.serve.worker`` with inherited descriptors: one end of a control socket pair (guard/ipc/
channel.py), the route table every process shares (read-only here) and a sample ring of its own
(this process is its only producer; the verifier reads every ring). Over the control socket
(guard/ipc/messages.py):

- ``Init``: the config (its wire form, guard/ipc/config.py), the route slots, the port and a
  repaired primary's block; the models load first and the port is bound after, so this process
  never answers "not ready" on the shared port;
- ``Prepare`` / ``Commit``: a reload in two steps: the changed models are built beside the old
  ones, then swapped in only if they loaded in every process (the primary decides); a replaced
  model is closed once the requests inside it are done, never under one (``reload.retire``);
- ``UsePrimary``: a repair's variant, relayed from the verifier by the primary;
- ``Metrics``: this process's registry, merged into the primary's /metrics (same-named series
  summed; the registry leaves out the primary-only series such as ``guard_build_info``);
- ``Stop``: graceful (health NOT_SERVING, in-flight requests get the grace, then exit).

Its ``guard.events`` go to the primary, which logs them. When the primary goes away (the control
socket closes, whatever killed it) this process stops gracefully too; SIGTERM/SIGINT do the same.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import generate_latest

from guard import __version__
from guard.ipc.channel import Channel, ForwardEvents
from guard.ipc.config import config_from_wire
from guard.ipc.messages import (Commit, Exposition, Failed, Handlers, Init, LoadFailures,
                                Metrics, Prepare, Ready, Stop, UsePrimary)
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe import logformat, tracing
from guard.observe.metrics import GuardMetrics
from guard.serve.dataplane import DataPlane
from guard.serve.listen import data_plane_server
from guard.serve.model import ServedModel
from guard.serve.reload import retire

log = logging.getLogger("guard.worker")
_SERVING = health_pb2.HealthCheckResponse.SERVING


class WorkerServer:
    def __init__(self, loop: asyncio.AbstractEventLoop, table: RouteTable, ring: SampleRing,
                 index: int):
        self.loop = loop
        self.table = table
        self.ring = ring
        self.index = index
        self.metrics = GuardMetrics(__version__, serving=False)
        self.models: dict[str, ServedModel] = {}
        self.prepared: dict[str, ServedModel] = {}
        self.config = None
        self.dataplane: DataPlane | None = None
        self.stopping = asyncio.Event()
        self.grace: float | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None

    # -- control (channel threads) ---------------------------------------------------------------
    def handlers(self) -> Handlers:
        return Handlers(f"serving process {self.index}", {
            Metrics: self._metrics, Init: self._init, Prepare: self._prepare,
            Commit: self._commit, UsePrimary: self._use_primary, Stop: self._stop})

    def _metrics(self, _: Metrics) -> Exposition:
        return Exposition(generate_latest(self.metrics.registry).decode())

    def _stop(self, message: Stop) -> None:
        self.grace = message.grace
        self.loop.call_soon_threadsafe(self.stopping.set)

    def _use_primary(self, message: UsePrimary) -> Failed | None:
        model = self.models.get(message.model)
        if model is None:
            return Failed(f"serving process {self.index}: unknown model '{message.model}'")
        model.use_primary(message.kept, message.primary)
        return None

    def _run(self, coroutine):
        """Run a coroutine on the server's event loop and wait for it (from a channel thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _init(self, message: Init) -> Ready | Failed:
        self.config = config = config_from_wire(message.config)
        try:
            for model_config in config.models:
                name = model_config.name
                self.models[name] = self._build(model_config, message.slots[name],
                                                message.kept.get(name),
                                                message.primaries.get(name))
            self._run(self._listen(message.port))
        except Exception as exc:
            return Failed(f"serving process {self.index}: {exc}")
        return Ready(sorted(self.models), os.getpid())

    def _build(self, model_config, slot: int, kept: list[str] | None = None,
               primary: dict | None = None) -> ServedModel:
        model = ServedModel(model_config, self.metrics, self.table, slot, self.ring)
        try:
            model.load(self.config.server.inline_below_ms)
            if kept:
                model.use_primary(kept, primary)
            self._run(model.connect())
        except BaseException:
            model.close()
            raise
        return model

    def _prepare(self, message: Prepare) -> LoadFailures:
        """Build the changed models beside the old ones; swapped in by ``Commit``."""
        config = config_from_wire(message.config)
        failed: dict[str, str] = {}
        for name in message.changed:
            try:
                self.prepared[name] = self._build(config.model(name), message.slots[name])
            except Exception as exc:
                failed[name] = f"serving process {self.index}: {exc}"
        return LoadFailures(failed)

    def _commit(self, message: Commit) -> None:
        self._run(self._swap(set(message.names), message.removed, message.retire_report_s))

    async def _swap(self, names: set[str], removed: list[str], report_s: float) -> None:
        """Swap in the prepared models that loaded everywhere, drop the others and the removed
        ones; a replaced model is closed once the requests inside it are done (``retire``)."""
        prepared, self.prepared = self.prepared, {}
        retired = []
        for name, model in prepared.items():
            if name in names:
                retired.append(self.models.get(name))
                self.models[name] = model
            else:
                retired.append(model)
        retired.extend(self.models.pop(name, None) for name in removed)
        for model in retired:
            if model is not None:
                asyncio.create_task(retire(model, report_s))
        self.dataplane.models_changed()

    # -- the data plane ------------------------------------------------------------------------------
    async def _listen(self, port: int) -> None:
        """Bind the primary's port (SO_REUSEPORT) and serve: every model is loaded by now."""
        server_config = self.config.server
        self.dataplane = DataPlane(self.models, self.metrics, server_config.workers,
                                   server_config.max_concurrent_requests)
        self.dataplane.models_changed()
        self.dataplane.loading = False
        built = data_plane_server(self.dataplane, server_config, port)
        self._grpc, self._health = built.server, built.health
        await self._grpc.start()
        for service in ("", "readiness", "inference.GRPCInferenceService"):
            await self._health.set(service, _SERVING)

    async def stop(self) -> None:
        grace = self.grace
        if grace is None:
            grace = self.config.server.shutdown_grace_s if self.config is not None else 0.0
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self.dataplane is not None:
            self.dataplane.live = False
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self.dataplane is not None:
            await self.loop.run_in_executor(None, self.dataplane.close)
        for model in [*self.models.values(), *self.prepared.values()]:
            await self.loop.run_in_executor(None, model.close)


async def _serve(args) -> int:
    loop = asyncio.get_running_loop()
    table = RouteTable.attach(args.routes_fd, args.routes_capacity)
    ring = SampleRing.attach(args.ring_fd, args.ring_bytes)
    worker = WorkerServer(loop, table, ring, args.index)

    def primary_gone() -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(worker.stopping.set)

    channel = Channel(socket.socket(fileno=args.control_fd), worker.handlers(),
                      f"serving-{args.index}", on_close=primary_gone)
    ForwardEvents.install(channel)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stopping.set)
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
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logformat.configure(process=f"serving {args.index}")  # server.log_format, from the parent
    tracing.configure_from_env()
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    # Exit at once once stopped: a control request still running on the channel's threads
    # (an Init waiting on an upstream when the primary stops or dies) must not keep this
    # process alive past the primary; the server and the models are closed by then.
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
