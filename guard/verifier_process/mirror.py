"""Mirroring in the verifier process: a bounded queue per model, checked by a worker thread.

The verifier's ring reader calls ``accept()`` with each sample a serving process handed over (the
sampling decision was made there, guard/runtime/sampling.py): a ``put_nowait`` on a queue bounded
in items (``mirror.queue_size``) and in bytes (``mirror.queue_bytes``). It never waits: when the
queue is full the sample is dropped and counted. One worker thread per model takes samples from
the queue, runs the reference (and, while the model is on its fallback, the primary as a
background probe) and hands the result to a callback.

Timeouts: reference and probe calls run on a single helper thread and the worker waits at most
``timeout_s``. A hung call cannot be killed in Python; later calls then wait behind it, time
out in turn and are counted as ``timeout``, the queue fills, and further samples are counted as
``dropped``. The request path is never affected. The CPU budget of the reference is its own
thread pool (``mirror.threads``), and both mirror threads run ``mirror.nice`` steps below the
request path (guard/runtime/priority.py): on a busy machine they take the CPU it leaves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


class _BoundedCaller:
    """Runs calls on one helper thread and waits at most ``timeout`` for each."""

    def __init__(self, name: str, nice: int = 0):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=lower_current_thread, initargs=(nice,))

    def call(self, fn, arg, timeout: float):
        future = self._executor.submit(fn, arg)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            future.cancel()  # if it never started; a running call cannot be stopped
            raise TimeoutError from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Mirror:
    def __init__(
        self,
        model: str,
        config: MirrorConfig,
        reference: Backend,
        primary: Backend,
        verifier: Comparator,
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
        self.verifier = verifier
        self.metrics = metrics
        self.on_result = on_result
        # Told about samples that were taken but never compared ("error", "timeout", or
        # "dropped" at shutdown), so that capture can still record the request.
        self.on_unchecked = on_unchecked
        # A finished comparison's span (guard/observe/tracing.py RecordedSpan), for the serving
        # process to export; and every sample leaving the mirror (the verifier's loss count).
        self.on_span = on_span
        self.on_finished = on_finished
        self._queue: queue.Queue[MirrorSample | None] = queue.Queue(maxsize=config.queue_size)
        self._caller = _BoundedCaller(f"guard-ref-{model}", config.nice)
        self._thread = threading.Thread(target=self._run, name=f"guard-mirror-{model}",
                                        daemon=True)
        self._stopping = threading.Event()
        self._last_error_log = 0.0
        self._span = None  # the comparison's span while a sample is processed (worker thread)
        self._queued_bytes = 0
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
            room = (not self._stopping.is_set()
                    and self._queued_bytes + sample.size <= self.config.queue_bytes)
            if room:
                self._queued_bytes += sample.size
        if room:
            try:
                self._queue.put_nowait(sample)
                return True
            except queue.Full:
                self._release(sample)
        self._outcomes["dropped"].inc()
        self._unchecked(sample, "dropped")
        self._finished(sample)
        return False

    def _release(self, sample: MirrorSample) -> None:
        with self._bytes_lock:
            self._queued_bytes -= sample.size

    def queue_fill(self) -> float:
        """Queue depth over its size: how much room the mirror has for extra work."""
        return self._queue.qsize() / self.config.queue_size

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

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
        self._thread.join(timeout)
        self._caller.shutdown()

    # -- worker ------------------------------------------------------------------------------------
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
            self._span = (tracing.RecordedSpan("guard.mirror.compare", sample.trace_context,
                                               {"guard.model": self.model,
                                                "guard.route": sample.route})
                          if sample.trace_context and self.on_span is not None else None)
            try:
                self._process(sample)
            except Exception:  # a bug here must not kill the worker
                log.exception("mirror worker for %s failed on a sample", self.model)
                self._outcomes["error"].inc()
            finally:
                self._finished(sample)
            if self._span is not None:
                self.on_span(self._span.end())

    def _process(self, sample: MirrorSample) -> None:
        timeout = self.config.timeout_s
        stage = "reference"
        try:
            probed = sample.route != "primary"
            if probed:
                stage = "primary probe"
                sample.outputs = self._caller.call(self.primary.infer, sample.inputs, timeout)
                stage = "reference"
            started = time.perf_counter()
            reference = self._caller.call(self.reference.infer, sample.inputs, timeout)
            seconds = time.perf_counter() - started
        except TimeoutError:
            self._outcomes["timeout"].inc()
            tracing.set_attributes(self._span, {"guard.outcome": "timeout"})
            self._log_error(f"{stage} timed out after {timeout}s")
            self._unchecked(sample, "timeout")
            return
        except Exception as exc:
            self._outcomes["error"].inc()
            self._log_error(f"{stage} failed: {type(exc).__name__}: {exc}")
            self._unchecked(sample, "error")
            return
        self._reference_seconds.observe(seconds)
        if sample.only_outputs and not probed:
            # The answer holds only what the client asked for (upstream): compare just that.
            reference = {k: v for k, v in reference.items() if k in sample.only_outputs}
            sample.outputs = {k: v for k, v in sample.outputs.items() if k in sample.only_outputs}
        check = self.verifier.check(reference, sample.outputs, inputs=sample.inputs)
        self._outcomes["compared"].inc()
        tracing.set_attributes(self._span, {
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
