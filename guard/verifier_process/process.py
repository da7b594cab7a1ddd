"""The verifier process: everything guard does besides answering requests.

Started by the serving process (guard/serve/supervisor.py) as ``python -m guard.verifier_process``
with inherited descriptors: the control socket, the route table and one sample ring per serving
process (memfds; ``server.processes``).
It is told the config over the control socket (``Init``; every message: guard/ipc/messages.py),
loads one ``VerifiedModel`` per model (reference, checks, detectors, capture, repair), then:

- the ring reader takes each sampled request a serving process handed off (one record from
  each ring in turn), decodes it (an
  upstream's protocol messages only here, never on the request path) and gives it to its
  model's mirror and capture;
- the heartbeat thread stamps the route table every 100 ms and re-publishes every route word
  (``probing`` turns on by the clock);
- control requests: ``Status``, ``SetRoute`` (admin), ``Reload`` (changed models), ``Metrics``
  (its registry's exposition, merged into the serving process's /metrics), ``Stop``;
- to the serving process: ``Event`` (one JSON line each, logged there on ``guard.events``),
  ``Span`` (mirrored comparisons, exported there), ``RouteChanged`` (for tap's WatchRoute), and
  ``UsePrimary`` when a repair found a variant to serve (with the rebuilt backend block: the
  serving processes build it without the repair code).

If the serving process goes away (the control socket closes) the verifier flushes capture and
exits. Its own death is the serving process's business: it counts the loss and restarts it.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import socket
import sys
import threading
import time
from typing import cast

from prometheus_client import generate_latest

from guard import __version__
from guard.config import BackendConfig
from guard.ipc import routes, wire
from guard.ipc.channel import Channel, ChannelClosed, ForwardEvents
from guard.ipc.config import backend_to_wire, config_from_wire
from guard.plan.complete import require_checks
from guard.ipc.messages import (Exposition, Failed, Handlers, Init, LoadFailures, Metrics, Ready,
                                Reload, RouteChanged, RouteSet, SetRoute, Span, Status,
                                StatusReport, Stop, UsePrimary)
from guard.ipc.ring import SampleRing
from guard.observe import logformat
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.policy.route import Override, Transition
from guard.runtime.children import exit_at_once, leave_signals_to_the_parent
from guard.verifier_process.generation_model import VerifiedGenerationModel
from guard.verifier_process.model import VerifiedModel
from guard.verifier_process.status import model_status
from guard.v1 import admin_pb2 as admin_pb

log = logging.getLogger("guard.verifier_process")
# Rings empty: look again after 20 ms. A check's latency does not matter, the ring holds the
# samples meanwhile, and a look costs a sleep and a wake-up (~30 us of CPU on a VM): a 2 ms
# cadence costs 1.2% of a core idle and several looks per sample at 100 samples/s.
_IDLE_S = 0.02
_IDLE_MAX_S = 0.2
# Records taken in one round at most: a round's samples are checked as a batch.
_DRAIN = 256
# While samples come, a batch gathers in the ring for up to 200 ms between rounds (40 samples
# at 200/s), the reader looking every 50 ms and starting the round early once a ring is a
# quarter full (large samples must not overflow it). The batch is what pays: the mirror thread
# wakes with cold caches, and its per-sample CPU on a small model was ~4x at batches of 10
# (200/s, 50 ms) what it is at 50 (docs/benchmarks.md#mirror-batching). Checks run up to
# 200 ms later, which no detector's minutes notice; the ring holds the samples meanwhile and
# the reader never lets a queue overflow from it (_read_ring).
_GATHER_S = 0.2
_GATHER_LOOK_S = 0.05
_GATHER_FILL = 0.25
# Longest the reader leaves samples in the ring while a mirror queue is full (see _read_ring).
_HOLD_S = 1.0
_HEARTBEAT_S = 0.1
# Longest a stop waits for the ring reader's round in hand before taking the rings' rest.
_READER_STOP_S = 5.0
_ERROR_LOG_INTERVAL_S = 10.0
_OVERRIDES = {"auto", "primary", "fallback"}


class ServingLink:
    """What the verifier's models may ask of the serving process."""

    def __init__(self, channel: Channel):
        self.channel = channel

    def use_primary(self, model: str, kept: list[str],
                    primary: BackendConfig | None = None) -> str:
        """Serve the primary with these ops kept back, built from ``primary`` (the rebuilt
        backend block; [] and None = as configured); "" when done, otherwise why not."""
        message = UsePrimary(model, list(kept),
                             backend_to_wire(primary) if primary is not None else None)
        try:
            reply = self.channel.call(message, timeout=600)
        except (ChannelClosed, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return reply.error if isinstance(reply, Failed) else ""

    def transition(self, model: str, transition: Transition) -> None:
        self._send(RouteChanged(model, transition.to_route, transition.reason,
                                transition.unix_time))

    def span(self, record: dict) -> None:
        self._send(Span(record))

    def _send(self, message) -> None:
        try:
            self.channel.send(message)
        except ChannelClosed:
            pass


class VerifierProcess:
    def __init__(self, channel: Channel, table: routes.RouteTable, rings: list[SampleRing]):
        self.channel = channel
        self.table = table
        self.rings = rings
        self.link = ServingLink(channel)
        self.metrics = GuardMetrics(__version__, serving=False)
        self.models: dict[str, VerifiedModel] = {}
        self.by_slot: dict[int, VerifiedModel] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # models/by_slot swaps (reload) vs readers
        self._last_error_log = 0.0
        self._reader = threading.Thread(target=self._read_ring, name="guard-ring-reader",
                                        daemon=True)
        self._beat = threading.Thread(target=self._heartbeat, name="guard-heartbeat",
                                      daemon=True)

    # -- control -------------------------------------------------------------------------------
    def handlers(self) -> Handlers:
        return Handlers("verifier", {
            Init: self._init, Reload: self._reload, Status: self._status,
            SetRoute: self._set_route, Metrics: self._metrics, Stop: self._stop})

    def _metrics(self, _: Metrics) -> Exposition:
        return Exposition(generate_latest(self.metrics.registry).decode())

    def _stop(self, _: Stop) -> None:
        self.stopping.set()

    def _build(self, model_config, slot: int, source_hash: str, resume: int | None,
               kept: list[str], start_capture: bool = True) -> VerifiedModel:
        kind = VerifiedGenerationModel if model_config.task == "generation" else VerifiedModel
        model = kind(model_config, self.metrics, self.table, slot, self.link, source_hash)
        try:
            model.load(resume, kept, start_capture)
        except BaseException:
            model.close()
            raise
        return model

    def _init(self, message: Init) -> Ready | Failed:
        config = require_checks(config_from_wire(message.config), "the verifier's config")
        slots = message.slots
        self.table.adopt(slots)
        # The repaired primaries' blocks are for the serving processes: the verifier rebuilds
        # its copy from the kept ops itself (guard/verifier_process/ops_fallback.py ``resume``).
        resume, kept = message.resume, message.kept
        try:
            for model_config in config.models:
                name = model_config.name
                model = self._build(model_config, slots[name], config.context.source_hash,
                                    resume.get(name), kept.get(name) or [])
                with self._lock:
                    self.models[name] = model
                    self.by_slot[model.slot] = model
        except Exception as exc:
            return Failed(str(exc))
        if not self._reader.is_alive():
            self._reader.start()
            self._beat.start()
        return Ready(sorted(self.models), os.getpid())

    def _reload(self, message: Reload) -> LoadFailures:
        """Build the changed models beside the old ones, swap the ones that loaded, close the
        old ones and the removed ones; a model that fails keeps its old version. A new
        version's capture writer starts only after the old one's has closed.

        A reload changes what a model is, not where its traffic goes: its route (on the
        fallback after a trip, probing), the route's epoch and an operator's pin carry over,
        as a restarted verifier's do (its windows and detectors start afresh, as there). A
        model whose new config has no fallback starts on the primary. A model in ``carried``
        (its mirroring or capture changed, nothing its detectors judge by) goes on with its
        old version's windows and detectors too, taken over at the swap, so that no result is
        counted twice (the old version's last results in flight are not counted)."""
        config = require_checks(config_from_wire(message.config), "the verifier's config")
        slots = message.slots
        self.table.adopt(slots)
        failed: dict[str, str] = {}
        for name in message.changed:
            model_config = config.model(name)
            carried = (self.table.get(slots[name], routes.ROUTE)
                       if name in self.models and model_config.fallback is not None else None)
            try:
                model = self._build(model_config, slots[name], config.context.source_hash,
                                    carried, [], start_capture=False)
            except Exception as exc:
                failed[name] = str(exc)
                continue
            with self._lock:
                old = self.models.get(name)
                self.models[name] = model
                self.by_slot[model.slot] = model
                if old is not None and name in message.carried:
                    model.carry_on(old)
            if old is not None:
                old.close()
            model.start_capture()
        for name in message.removed:
            with self._lock:
                old = self.models.pop(name, None)
                if old is not None and self.by_slot.get(old.slot) is old:
                    del self.by_slot[old.slot]
            if old is not None:
                old.close()
        return LoadFailures(failed)

    def _status(self, message: Status) -> StatusReport:
        name = message.model
        models = [self.models[name]] if name in self.models else (
            [] if name else list(self.models.values()))
        return StatusReport({m.name: base64.b64encode(model_status(m).SerializeToString())
                             .decode() for m in models})

    def _set_route(self, message: SetRoute) -> RouteSet | Failed:
        model = self.models.get(message.model)
        if model is None:
            return Failed(f"unknown model '{message.model}'")
        override = message.override
        if override not in _OVERRIDES:
            return Failed(f"route must be one of {sorted(_OVERRIDES)}")
        model.set_override(cast(Override, override), message.reason)  # (checked above)
        status = admin_pb.ModelStatus()
        status.CopyFrom(model_status(model))
        return RouteSet(base64.b64encode(status.SerializeToString()).decode())

    # -- the ring --------------------------------------------------------------------------------
    def _read_ring(self) -> None:
        """Drain the serving processes' rings (up to ``_DRAIN`` records a round, each ring in turn)
        and hand each model what it got in one go, so that its mirror checks them as a batch, then
        let the next batch gather (``_gather``); a pause when all are empty, from ``_IDLE_S``
        doubling up to ``_IDLE_MAX_S`` while they stay empty (an idle verifier wakes a few times a
        second, not 50; the first sample after a lull waits at most ``_IDLE_MAX_S``, well inside any
        mirror timeout).

        A round takes no more records than the fullest mirror queue has room for: while a
        queue is full the samples wait in the ring (bounded in bytes, and the request path
        never waits on it: a full ring drops and counts) instead of being dropped at the queue,
        so a mirror worker that lost the CPU for a while (it runs ``mirror.nice`` below the
        request path) catches up on them. For at most ``_HOLD_S`` in a row: a mirror that stays
        full (a hung call) then drops at its queue as before, and the other models' samples,
        which share the ring, move on; a sample that waited too long is dropped when it is
        taken (guard/verifier_process/model.py ``_STALE_NS``: a reference slower than the
        samples checks recent traffic, not a backlog)."""
        idle, held_since = _IDLE_S, None
        while not self.stopping.is_set():
            room = self._room()
            if room == 0:
                now = time.monotonic()
                held_since = held_since if held_since is not None else now
                if now - held_since < _HOLD_S:
                    time.sleep(_IDLE_S)
                    continue
                room = _DRAIN  # held long enough: drain, the full queue drops (counted)
            else:
                held_since = None
            limit = min(room, _DRAIN)
            records = self._take(limit)
            if records:
                idle = _IDLE_S
                self._hand_over(records)
                if len(records) < limit:  # the rings are empty: let the next batch gather
                    self._gather()
            else:
                time.sleep(idle)
                idle = min(idle * 2, _IDLE_MAX_S)

    def _gather(self) -> None:
        """Let the next batch gather in the rings: ``_GATHER_S``, or until one is
        ``_GATHER_FILL`` full, or until the verifier stops."""
        deadline = time.monotonic() + _GATHER_S
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(_GATHER_LOOK_S, left))
            if any(ring.used >= _GATHER_FILL * ring.capacity for ring in self.rings):
                return

    def _take(self, limit: int) -> list[bytes]:
        """Up to ``limit`` records, a record from each ring in turn (no serving process's
        samples wait behind another's)."""
        records: list[bytes] = []
        active = list(self.rings)
        while active and len(records) < limit:
            for ring in list(active):
                if len(records) >= limit:
                    break
                try:
                    record = ring.take()
                except ValueError as exc:  # the ring dropped what it held: counted there
                    self._log_error(str(exc))
                    record = None
                if record is None:
                    active.remove(ring)
                else:
                    records.append(record)
        return records

    def _room(self) -> int:
        """Samples the fullest mirror queue can take now (``_DRAIN`` with no mirror)."""
        with self._lock:
            models = list(self.models.values())
        return min((m.mirror.room() for m in models if m.mirror is not None), default=_DRAIN)

    def _deliver(self, record: bytes) -> None:
        """One record (a test's, or a tool's): as the ring reader delivers them."""
        self._deliver_all([record])

    def _deliver_all(self, records: list[bytes]) -> None:
        """Decode the records and hand each model its samples, in order, at once."""
        batches: dict[int, tuple[VerifiedModel, list]] = {}
        for record in records:
            taken = self._decode(record)
            if taken is not None:
                model, item = taken
                batches.setdefault(id(model), (model, []))[1].append(item)
        for model, items in batches.values():
            if isinstance(model, VerifiedGenerationModel):
                for sample in items:
                    model.accept(sample)
            else:
                model.accept_many(items)

    def _decode(self, record: bytes):
        """(model, what its accept takes) for one record; None when it is skipped (counted)."""
        try:
            sample = wire.decode(record)
        except Exception as exc:
            self._log_error(f"undecodable sample record: {type(exc).__name__}: {exc}")
            return None
        with self._lock:
            model = self.by_slot.get(sample.slot)
        if model is None or model.name != sample.model:
            model = self.models.get(sample.model)
        if model is None:
            return None  # a model removed by a reload while its samples were in the ring
        if sample.payload.kind == wire.GENERATION:  # a sampled LLM call: no tensors to decode
            return (model, sample) if isinstance(model, VerifiedGenerationModel) else None
        if isinstance(model, VerifiedGenerationModel):
            self._log_error(f"model {model.name}: a tensor sample for a generation model")
            return None
        try:
            request = sample.payload.request()
        except Exception as exc:  # a request guard cannot decode: the mirror's error, no more
            if sample.flags & wire.MIRROR:
                self.metrics.mirror.labels(model.name, "error").inc()
            self._log_error(f"model {model.name}: cannot decode a sampled request: "
                            f"{type(exc).__name__}: {exc}")
            return None
        return model, (sample, request)

    def _heartbeat(self) -> None:
        pid = os.getpid()
        while not self.stopping.is_set():
            # No pulse without a ring reader: a verifier that cannot take samples any more
            # is hung as far as the serving process is concerned, and gets restarted.
            if not self._reader.is_alive() and self._reader.ident is not None:
                return
            self.table.beat(time.monotonic_ns(), pid)
            with self._lock:
                models = list(self.models.values())
            for model in models:
                model.publish()
            time.sleep(_HEARTBEAT_S)

    def _log_error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            emit("verifier_error", error=message,
                 note=f"further errors within {_ERROR_LOG_INTERVAL_S:.0f}s are only counted")

    def close(self) -> None:
        """Stop. The samples still in the rings (calls answered while the serving processes
        finished theirs, in the shutdown's grace) go to their models first, so that each reaches
        capture: checked where its mirror gets to it, else recorded and counted dropped, as a
        queue's last samples are when a mirror stops. Then the models close, flushing capture."""
        self.stopping.set()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(_READER_STOP_S)  # (its round ends at the next look)
        if not self._reader.is_alive():  # (else it still holds a round: left to it)
            self._drain_rings()
        with self._lock:
            models = list(self.models.values())
        for model in models:
            model.close()

    def _drain_rings(self) -> None:
        while (records := self._take(_DRAIN)) and self._hand_over(records):
            pass

    def _hand_over(self, records: list[bytes]) -> bool:
        """``_deliver_all``; False where it failed (a bug: these samples are lost, never the
        reader or the stop; logged and said)."""
        try:
            self._deliver_all(records)
        except Exception as exc:
            log.exception("handing samples over failed")
            self._log_error(f"samples could not be delivered: {type(exc).__name__}: {exc}")
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    from guard.malloc import tune_for_inference

    tune_for_inference()  # before backends allocate: see guard/malloc.py
    parser = argparse.ArgumentParser(prog="python -m guard.verifier_process",
                                     description="guard's verifier process (started by guard "
                                     "serve; not meant to be run by hand).")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--routes-fd", type=int, required=True)
    parser.add_argument("--routes-capacity", type=int, required=True)
    parser.add_argument("--ring-fd", type=int, action="append", required=True,
                        help="one per serving process")
    parser.add_argument("--ring-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    leave_signals_to_the_parent()  # stopped over its channel (guard/runtime/children.py)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logformat.configure(process="verifier")  # server.log_format, from the serving process
    sock = socket.socket(fileno=args.control_fd)
    table = routes.RouteTable.attach(args.routes_fd, args.routes_capacity)
    rings = [SampleRing.attach(fd, args.ring_bytes) for fd in args.ring_fd]
    holder: dict = {}
    closed = threading.Event()
    channel = Channel(sock, lambda m: holder["handlers"](m), "verifier", on_close=closed.set)
    ForwardEvents.install(channel)
    verifier = VerifierProcess(channel, table, rings)
    holder["handlers"] = verifier.handlers()
    channel.start()
    while not (verifier.stopping.is_set() or closed.is_set()):
        closed.wait(0.2)
    verifier.close()
    channel.close()
    return 0


def run() -> None:
    """``python -m guard.verifier_process``: ``main``, then exit at once. A control request still
    running on the channel's threads (an ``Init`` waiting on an upstream's ``ready_timeout_s``
    when the serving process stops or dies) must not keep this process alive past its parent;
    the models and capture are closed by then."""
    exit_at_once(main())
