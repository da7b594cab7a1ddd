"""Mirroring in the verifier process: a bounded queue per model, checked by a worker thread.

The verifier's ring reader calls ``accept()`` with each sample a serving process handed off (the
sampling decision was made there, guard/runtime/sampling.py): a ``put_nowait`` on a queue bounded
in items (``mirror.queue_size``) and in bytes (``mirror.queue_bytes``). It never waits: when the
queue is full the sample is dropped and counted. One worker thread per model takes samples from
the queue, runs the reference (and, while the model is on its fallback, the primary as a
background probe) and hands the result to a callback.

Timeouts: the worker runs the reference and probe calls itself, one at a time, and a watchdog
thread gives up on a call that has run ``timeout_s`` (it looks every ``timeout_s / 2``, at most
every second): it counts the sample as ``timeout`` and hands the queue to a new worker. A hung
call cannot be killed in Python; later calls then wait behind it, time out in turn and are
counted as ``timeout``, the queue fills, and further samples are counted as ``dropped``. The
request path is never affected. Why the calls are not handed to a helper thread that the worker
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
from typing import Callable

import numpy as np

from guard.backends.base import Backend
from guard.config import MirrorConfig
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.runtime.priority import lower_current_thread
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
    """The reference or probe call a worker is in, for the watchdog."""

    __slots__ = ("deadline", "sample", "stage", "span")

    def __init__(self, deadline: float, sample: "MirrorSample", stage: str, span):
        self.deadline, self.sample, self.stage, self.span = deadline, sample, stage, span


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
        self._queue: queue.SimpleQueue[MirrorSample | None] = queue.SimpleQueue()
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
        metrics.mirror_queue_depth.labels(model).set_function(self._queue.qsize)
        # Children resolved once: labels() is a dict lookup under a lock on every call.
        self._outcomes = {o: metrics.mirror.labels(model, o)
                          for o in ("compared", "dropped", "error", "timeout")}
        self._reference_seconds = metrics.reference_duration.labels(model)

    # -- fed by the ring reader -------------------------------------------------------------------
    def accept(self, sample: MirrorSample) -> bool:
        """Non-blocking; True when queued. Drops (and counts) when the queue is full in items or
        bytes, or the mirror is stopping."""
        with self._bytes_lock:
            room = (not self._stopping.is_set() and self._queued < self.config.queue_size
                    and self._queued_bytes + sample.size <= self.config.queue_bytes)
            if room:
                self._queued += 1
                self._queued_bytes += sample.size
        if room:
            self._queue.put(sample)
            return True
        self._outcomes["dropped"].inc()
        self._unchecked(sample, "dropped")
        self._finished(sample)
        return False

    def _release(self, sample: MirrorSample) -> None:
        with self._bytes_lock:
            self._queued -= 1
            self._queued_bytes -= sample.size

    def queue_fill(self) -> float:
        """Queue depth over its size: how much room the mirror has for extra work."""
        return self._queue.qsize() / self.config.queue_size

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking samples; finish the one in hand; count the rest as dropped."""
        self._stopping.set()
        dropped = 0
        while True:
            try:
                sample = self._queue.get_nowait()
            except queue.Empty:
                break
            if sample is not None:
                self._release(sample)
                dropped += 1
                self._unchecked(sample, "dropped")
                self._finished(sample)
        if dropped:
            self._outcomes["dropped"].inc(dropped)
        self._queue.put(None)
        with self._state_lock:
            worker = self._thread
        worker.join(timeout)
        self._watchdog.join(timeout)

    # -- worker ------------------------------------------------------------------------------------
    def _worker(self) -> threading.Thread:
        return threading.Thread(target=self._run, name=f"guard-mirror-{self.model}", daemon=True)

    def _run(self) -> None:
        lower_current_thread(self.config.nice)  # the checks yield the CPU to the request path
        while True:
            sample = self._queue.get()
            if sample is None:
                return
            self._release(sample)
            if self._stopping.is_set():  # taken while stop() was draining: still accounted for
                self._outcomes["dropped"].inc()
                self._unchecked(sample, "dropped")
                self._finished(sample)
                return
            span = (tracing.RecordedSpan("guard.mirror.compare", sample.trace_context,
                                         {"guard.model": self.model, "guard.route": sample.route})
                    if sample.trace_context and self.on_span is not None else None)
            try:
                self._process(sample, span)
            except _Abandoned:
                return  # the watchdog counted this sample; a new worker has the queue
            except Exception:  # a bug here must not kill the worker
                log.exception("mirror worker for %s failed on a sample", self.model)
                self._outcomes["error"].inc()
            self._finished(sample)
            if span is not None:
                self.on_span(span.end())

    def _call(self, fn, sample: MirrorSample, stage: str, span):
        """``fn(sample.inputs)`` on this thread, watched: TimeoutError when a call the watchdog
        gave up on still holds the backend after ``timeout_s``; ``_Abandoned`` when the
        watchdog gave up on this one."""
        timeout = self.config.timeout_s
        if not self._call_lock.acquire(timeout=timeout):
            raise TimeoutError
        flight = _InFlight(time.monotonic() + timeout, sample, stage, span)
        with self._state_lock:
            self._inflight = flight
        try:
            result = fn(sample.inputs)
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
            self._timed_out(flight.sample, flight.stage, flight.span)
            self._finished(flight.sample)
            if flight.span is not None:
                self.on_span(flight.span.end())

    def _timed_out(self, sample: MirrorSample, stage: str, span) -> None:
        self._outcomes["timeout"].inc()
        tracing.set_attributes(span, {"guard.outcome": "timeout"})
        self._log_error(f"{stage} timed out after {self.config.timeout_s}s")
        self._unchecked(sample, "timeout")

    def _process(self, sample: MirrorSample, span) -> None:
        stage = "reference"
        try:
            probed = sample.route != "primary"
            if probed:
                stage = "primary probe"
                sample.outputs = self._call(self.primary.infer, sample, stage, span)
                stage = "reference"
            started = time.perf_counter()
            reference = self._call(self.reference.infer, sample, stage, span)
            seconds = time.perf_counter() - started
        except TimeoutError:
            self._timed_out(sample, stage, span)
            return
        except Exception as exc:
            self._failed(sample, stage, exc)
            return
        self._reference_seconds.observe(seconds)
        if sample.only_outputs and not probed:
            # The answer holds only what the client asked for (upstream): compare just that.
            reference = {k: v for k, v in reference.items() if k in sample.only_outputs}
            sample.outputs = {k: v for k, v in sample.outputs.items() if k in sample.only_outputs}
        check = self.comparator.check(reference, sample.outputs, inputs=sample.inputs)
        if check.unmatched:  # names, not numbers: an error of the pairing, never drift
            self._outcomes["error"].inc()
            self._log_error(f"outputs only the reference gives: {check.unmatched['reference']}, "
                            f"only the primary: {check.unmatched['primary']}; name them alike")
            self._unchecked(sample, "error")
            return
        self._outcomes["compared"].inc()
        if span is not None:  # (its attributes are not built for untraced samples)
            tracing.set_attributes(span, {
                "guard.verdict": "pass" if check.passed else "fail",
                "guard.tier.tensor.max_abs_error": check.max_abs_error,
                "guard.probed": probed, "guard.reference_seconds": seconds})
        try:
            self.on_result(MirrorResult(sample, check, seconds, probed, reference))
        except Exception:  # a bug downstream; the sample was compared, count it once
            log.exception("handling a check result for %s failed", self.model)

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
