"""Mirroring in the verifier process: a bounded queue per model, checked by a worker thread.

The verifier's ring reader calls ``accept()`` with each sample a serving process handed off (the
sampling decision was made there, guard/runtime/sampling.py), or ``accept_many()`` with all it
drained from the ring for this model at once (one hand-off, one wake-up of the worker): a put
on a queue bounded in items (``mirror.queue_size``) and in bytes (``mirror.queue_bytes``). It
never waits: a sample that finds the queue full is dropped and counted. One worker thread per
model takes what waits in the queue, up to ``mirror.max_batch`` samples, runs the reference
(and, while the model is on its fallback, the primary as a background probe) and the checks
over them as a batch (guard/verifier_process/batch.py: stacked forward passes, tiers 1 and 3
at once), and hands each result to a callback in arrival order.

Timeouts: the worker runs the reference and probe calls itself, one at a time, and a watchdog
thread gives up on a call that has run ``timeout_s`` (it looks every ``timeout_s / 2``, at most
every second): it counts the samples the worker holds (its batch) as ``timeout`` and hands the
queue to a new worker. A hung call cannot be killed in Python; later calls then wait behind it,
time out in turn and are counted as ``timeout``, the queue fills, and further samples are
counted as ``dropped``. The request path is never affected. Why the calls are not handed to a helper thread that the worker
waits on: each sample would then wake two more threads, and on a VM a wake-up costs ~30 us of
CPU, a third of a small reference's forward pass. The CPU budget of the reference is its own
thread pool (``mirror.threads``), and both mirror threads run ``mirror.nice`` steps below the
request path (guard/runtime/priority.py): on a busy machine they take the CPU it leaves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from guard.backends.base import Backend
from guard.config import MirrorConfig
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.runtime.priority import lower_current_thread
from guard.verifier_process import batch
from guard.verifier_process.batch import BackendBusy, Held
from guard.verify.pipeline import CheckResult, Comparator

log = logging.getLogger("guard.mirror")
_ERROR_LOG_INTERVAL_S = 10.0


@dataclass
class MirrorSample:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]  # what the route answered; the probe replaces it if needed
    route: str  # "primary" or "fallback": who answered the client
    epoch: int  # the policy epoch when the request was routed
    enqueued_at: float
    only_outputs: tuple[str, ...] = ()  # compare just these ("" = all): the client's request
    trace_context: str = ""  # the request's W3C traceparent, when tracing is on
    tag: object = None  # opaque to the mirror, handed back with the result (capture uses it)
    size: int = 0  # bytes of the record it came in (the queue's byte budget)


@dataclass
class MirrorResult:
    sample: MirrorSample
    check: CheckResult  # one result per tier
    reference_seconds: float
    probed: bool  # True when the primary ran in the background for this sample
    reference: dict[str, np.ndarray] | None = None  # the reference's answer


class _Abandoned(BaseException):
    """The watchdog gave up on this worker's call: the thread leaves without a word (the
    watchdog counted its sample). A BaseException, so that no ``except Exception`` takes it."""


class _InFlight:
    """The reference or probe call a worker is in, for the watchdog: ``held``, the samples the
    worker holds (its batch), which the watchdog accounts for when it gives up."""

    __slots__ = ("deadline", "held", "stage")

    def __init__(self, deadline: float, held: list[Held], stage: str):
        self.deadline, self.held, self.stage = deadline, held, stage


class Mirror:
    def __init__(
        self,
        model: str,
        config: MirrorConfig,
        reference: Backend,
        primary: Backend,
        comparator: Comparator,
        metrics: GuardMetrics,
        on_result: Callable[[MirrorResult], None],
        on_unchecked: Callable[[MirrorSample, str], None] | None = None,
        on_span: Callable[[dict], None] | None = None,
        on_finished: Callable[[MirrorSample], None] | None = None,
    ):
        self.model = model
        self.config = config
        self.reference = reference
        self.primary = primary
        self.comparator = comparator
        self.metrics = metrics
        self.on_result = on_result
        # Told about samples that were taken but never compared ("error", "timeout", or
        # "dropped" at shutdown), so that capture can still record the request.
        self.on_unchecked = on_unchecked
        # A finished comparison's span (guard/observe/tracing.py RecordedSpan), for the serving
        # process to export; and every sample leaving the mirror (the verifier's loss count).
        self.on_span = on_span
        self.on_finished = on_finished
        # A SimpleQueue (in C) and the bounds kept here, under _bytes_lock: a queue.Queue's
        # condition variables cost ~10 us of Python per sample on each side.
        # An item is a sample (accept) or a list of them (accept_many); None stops the worker.
        self._queue: queue.SimpleQueue[MirrorSample | list[MirrorSample] | None] = \
            queue.SimpleQueue()
        self._carry: list[MirrorSample] = []  # taken past max_batch: the worker's next batch
        self._stacks: bool | None = None  # does the reference take stacked samples?
        self._thread = self._worker()
        self._watchdog = threading.Thread(target=self._watch, name=f"guard-watch-{model}",
                                          daemon=True)
        self._call_lock = threading.Lock()  # one backend call at a time, hung ones included
        self._state_lock = threading.Lock()  # _inflight and _thread, worker vs watchdog
        self._inflight: _InFlight | None = None
        self._stopping = threading.Event()
        self._last_error_log = 0.0
        self._queued = self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        metrics.mirror_queue_depth.labels(model).set_function(lambda: self._queued)
        # Children resolved once: labels() is a dict lookup under a lock on every call.
        self._outcomes = {o: metrics.mirror.labels(model, o)
                          for o in ("compared", "dropped", "error", "timeout")}
        self._reference_seconds = metrics.reference_duration.labels(model)

    # -- fed by the ring reader -------------------------------------------------------------------
    def accept(self, sample: MirrorSample) -> bool:
        """Non-blocking; True when queued. Drops (and counts) when the queue is full in items or
        bytes, or the mirror is stopping."""
        return self.accept_many([sample]) == 1

    def accept_many(self, samples: list[MirrorSample]) -> int:
        """``accept`` for several samples in one hand-off (one wake-up of the worker); returns
        how many were queued, in order: the first that finds no room and every later one is
        dropped and counted."""
        room = 0
        with self._bytes_lock:
            if not self._stopping.is_set():
                limit, budget = self.config.queue_size, self.config.queue_bytes
                queued, size = self._queued, self._queued_bytes
                for sample in samples:
                    if queued >= limit or size + sample.size > budget:
                        break
                    queued, size, room = queued + 1, size + sample.size, room + 1
                self._queued, self._queued_bytes = queued, size
        if room:
            self._queue.put(samples[0] if len(samples) == 1 else samples[:room])
        if room < len(samples):
            self._outcomes["dropped"].inc(len(samples) - room)
            for sample in samples[room:]:
                self._unchecked(sample, "dropped")
                self._finished(sample)
        return room

    def _release(self, samples: list[MirrorSample]) -> None:
        with self._bytes_lock:
            self._queued -= len(samples)
            self._queued_bytes -= sum(s.size for s in samples)

    def room(self) -> int:
        """Samples the queue can take now (in items; the byte bound aside)."""
        return max(0, self.config.queue_size - self._queued)

    def queue_fill(self) -> float:
        """Queue depth over its size: how much room the mirror has for extra work."""
        return self._queued / self.config.queue_size

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking samples; finish the batch in hand; count the rest as dropped."""
        self._stopping.set()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.drop(self._taken(item))
        self._queue.put(None)
        with self._state_lock:
            worker = self._thread
        worker.join(timeout)
        self._watchdog.join(timeout)
        carried, self._carry = self._carry, []
        self.drop(carried)

    def drop(self, samples: list[MirrorSample]) -> None:
        """Samples the mirror will not check (it stops; they waited too long to be worth it):
        dropped, counted, told."""
        if samples:
            self._outcomes["dropped"].inc(len(samples))
        for sample in samples:
            self._unchecked(sample, "dropped")
            self._finished(sample)

    # -- worker ------------------------------------------------------------------------------------
    def _worker(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"guard-mirror-{self.model}", daemon=True)

    def _run(self) -> None:
        lower_current_thread(self.config.nice)  # the checks yield the CPU to the request path
        while True:
            samples, last = self._take()
            if samples and self._stopping.is_set():  # taken while stop() was draining
                self.drop(samples + self._carry)
                self._carry = []
                return
            if samples:
                hand = [self._held(sample) for sample in samples]
                try:
                    self._handle(hand)
                except _Abandoned:
                    return  # the watchdog counted these samples; a new worker has the queue
            if last:
                return

    def _take(self) -> tuple[list[MirrorSample], bool]:
        """The next batch: what the last one left over, else the next hand-off (waited for),
        then every hand-off waiting, up to the batch limit (the rest is carried over); and
        whether the mirror is stopping."""
        limit = self._limit()
        samples, self._carry, last = self._carry, [], False
        if not samples:
            item = self._queue.get()
            if item is None:
                return [], True
            samples = self._taken(item)
        while len(samples) < limit:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                last = True
                break
            samples += self._taken(item)
        samples, self._carry = samples[:limit], samples[limit:]
        return samples, last

    def _taken(self, item: MirrorSample | list[MirrorSample]) -> list[MirrorSample]:
        samples = item if isinstance(item, list) else [item]
        self._release(samples)
        return samples

    def _limit(self) -> int:
        """Most samples in one batch."""
        return self.config.max_batch

    def _held(self, sample: MirrorSample) -> Held:
        span = (tracing.RecordedSpan("guard.mirror.compare", sample.trace_context,
                                     {"guard.model": self.model, "guard.route": sample.route})
                if sample.trace_context and self.on_span is not None else None)
        return Held(sample, span)

    def _handle(self, hand: list[Held]) -> None:
        """Probe, reference and checks over the batch (guard/verifier_process/batch.py), then
        each sample's outcome in arrival order."""
        call = partial(self._watched, hand=hand)
        try:
            batch.probe(call, self.primary, hand)
            if self._stacks is None:  # (the backend's signature is known once it is loaded)
                self._stacks = batch.stacks(self.reference)
            batch.reference(call, self.reference, hand, self._reference_seconds.observe,
                            self._stacks)
            batch.check(self.comparator, hand)
        except Exception as exc:  # a bug here must not kill the worker, nor lose the batch
            log.exception("mirror worker for %s failed on a batch", self.model)
            for h in hand:
                if h.pending and h.check is None:
                    h.failed = ("checks", exc)
        compared = 0
        for h in hand:
            try:
                compared += self._deliver(h)
            except Exception:  # a bug downstream; the sample is still accounted for below
                log.exception("handing a check result for %s on failed", self.model)
            self._finished(h.sample)
            if h.span is not None:
                self.on_span(h.span.end())
        if compared:
            self._outcomes["compared"].inc(compared)

    def _deliver(self, h: Held) -> bool:
        """One sample's outcome: its result to ``on_result`` (True: compared), or counted as a
        timeout or an error and told to ``on_unchecked``."""
        sample, span = h.sample, h.span
        if h.timed_out:
            self._timed_out(sample, h.timed_out, span)
            return False
        if h.failed is not None:
            self._failed(sample, *h.failed)
            return False
        check = h.check
        if check.unmatched:  # names, not numbers: an error of the pairing, never drift
            self._outcomes["error"].inc()
            self._log_error(f"outputs only the reference gives: {check.unmatched['reference']}, "
                            f"only the primary: {check.unmatched['primary']}; name them alike")
            self._unchecked(sample, "error")
            return False
        if span is not None:  # (its attributes are not built for untraced samples)
            tracing.set_attributes(span, {
                "guard.verdict": "pass" if check.passed else "fail",
                "guard.tier.tensor.max_abs_error": check.max_abs_error,
                "guard.probed": h.probed, "guard.reference_seconds": h.seconds})
        try:
            self.on_result(MirrorResult(sample, check, h.seconds, h.probed, h.reference))
        except Exception:  # a bug downstream; the sample was compared, count it once
            log.exception("handling a check result for %s failed", self.model)
        return True

    def _call(self, fn, sample: MirrorSample, stage: str, span):
        """``fn(sample.inputs)`` on this thread, watched (a subclass's one-sample path)."""
        return self._watched(fn, sample.inputs, stage, [Held(sample, span)])

    def _watched(self, fn, inputs: dict, stage: str, hand: list[Held]):
        """``fn(inputs)`` on this thread, watched: ``BackendBusy`` when a call the watchdog
        gave up on still holds the backend after ``timeout_s``; ``_Abandoned`` when the
        watchdog gave up on this one (and accounted for ``hand``)."""
        timeout = self.config.timeout_s
        if not self._call_lock.acquire(timeout=timeout):
            raise BackendBusy
        flight = _InFlight(time.monotonic() + timeout, hand, stage)
        with self._state_lock:
            self._inflight = flight
        try:
            result = fn(inputs)
        except BaseException:
            if self._end_call(flight):
                raise _Abandoned from None
            raise
        if self._end_call(flight):
            raise _Abandoned
        return result

    def _end_call(self, flight: _InFlight) -> bool:
        """Release the backend; True when the watchdog gave up on ``flight`` meanwhile."""
        with self._state_lock:
            abandoned = self._inflight is not flight
            if not abandoned:
                self._inflight = None
        self._call_lock.release()
        return abandoned

    def _watch(self) -> None:
        """Give up on a call past its deadline: count its sample, start a new worker."""
        lower_current_thread(self.config.nice)
        interval = min(max(self.config.timeout_s / 2, 0.05), 1.0)
        while not self._stopping.wait(interval):
            with self._state_lock:
                flight = self._inflight
                if flight is None or time.monotonic() < flight.deadline:
                    continue
                self._inflight = None  # its worker leaves when (if ever) the call returns
                self._thread = self._worker()
                self._thread.start()
            for h in flight.held:  # the batch the abandoned worker held: none of it is checked
                self._timed_out(h.sample, flight.stage, h.span)
                self._finished(h.sample)
                if h.span is not None:
                    self.on_span(h.span.end())

    def _timed_out(self, sample: MirrorSample, stage: str, span) -> None:
        self._outcomes["timeout"].inc()
        tracing.set_attributes(span, {"guard.outcome": "timeout"})
        self._log_error(f"{stage} timed out after {self.config.timeout_s}s")
        self._unchecked(sample, "timeout")

    def _finished(self, sample: MirrorSample) -> None:
        if self.on_finished is not None:
            self.on_finished(sample)

    def _failed(self, sample: MirrorSample, stage: str, exc: Exception) -> None:
        """A stage (probe, reference) raised: counted as an error, logged, never checked."""
        self._outcomes["error"].inc()
        self._log_error(f"{stage} failed: {type(exc).__name__}: {exc}")
        self._unchecked(sample, "error")

    def _unchecked(self, sample: MirrorSample, outcome: str) -> None:
        if self.on_unchecked is not None:
            try:
                self.on_unchecked(sample, outcome)
            except Exception:  # a bug in the listener must not kill the worker
                log.exception("on_unchecked listener for %s failed", self.model)

    def _log_error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            emit("mirror_error", model=self.model, error=message,
                 note=f"further errors within {_ERROR_LOG_INTERVAL_S:.0f}s are only counted")
