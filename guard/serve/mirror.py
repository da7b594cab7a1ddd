"""Mirroring: sample requests, queue them (bounded), and check them off the request path.

The request path calls ``offer()`` only: a sampling decision and a ``put_nowait`` on a bounded
queue. It never waits: when the queue is full the sample is dropped and counted. One worker
thread per model takes samples from the queue, runs the reference (and, while the model is on
its fallback, the primary as a background probe) and hands the result to a callback.

Sampling: with a request id the decision is a hash of the id (blake2b), so every replica
mirrors the same requests; without one it is a random draw.

Timeouts: reference and probe calls run on a single helper thread and the worker waits at most
``timeout_s``. A hung call cannot be killed in Python; later calls then wait behind it, time
out in turn and are counted as ``timeout``, the queue fills, and further samples are counted as
``dropped``. The request path is never affected. The CPU budget of the reference is its own
thread pool (``mirror.threads``), and both mirror threads run ``mirror.nice`` steps below the
request path (guard/serve/priority.py): on a busy machine they take the CPU it leaves.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import random
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
from guard.serve.priority import lower_current_thread
from guard.verify.pipeline import CheckResult, Verifier

log = logging.getLogger("guard.mirror")
_ERROR_LOG_INTERVAL_S = 10.0


def sampled(request_id: str, rate: float) -> bool:
    """Should this request be mirrored? Deterministic in ``request_id`` when one is given."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    if request_id:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < rate
    return random.random() < rate


@dataclass
class Sample:
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]  # what the route answered; the probe replaces it if needed
    route: str  # "primary" or "fallback": who answered the client
    epoch: int  # the policy epoch when the request was routed
    enqueued_at: float
    only_outputs: tuple[str, ...] = ()  # compare just these ("" = all): the client's request
    trace_context: object = None  # the request's trace, when tracing is on
    tag: object = None  # opaque to the mirror, handed back with the result (capture uses it)


@dataclass
class SampleResult:
    sample: Sample
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
        verifier: Verifier,
        metrics: GuardMetrics,
        on_result: Callable[[SampleResult], None],
        on_unchecked: Callable[[Sample, str], None] | None = None,
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
        self._queue: queue.Queue[Sample | None] = queue.Queue(maxsize=config.queue_size)
        self._caller = _BoundedCaller(f"guard-ref-{model}", config.nice)
        self._thread = threading.Thread(target=self._run, name=f"guard-mirror-{model}",
                                        daemon=True)
        self._stopping = threading.Event()
        self._last_error_log = 0.0
        self._span = None  # the comparison's span while a sample is processed (worker thread)
        metrics.mirror_queue_depth.labels(model).set_function(self._queue.qsize)

    # -- request path --------------------------------------------------------------------------
    def offer(self, request_id: str, inputs, outputs, route: str, epoch: int,
              requested_outputs: list[str] | None = None, tag: object = None) -> bool:
        """Non-blocking; True when the sample was queued. Drops (and counts) when the queue is full or the mirror is stopping.

        ``outputs`` may be a callable returning them (decoded only if the request is sampled).
        ``requested_outputs``: when the client asked for some outputs only, the answer holds
        only those, and only those are compared. ``tag`` comes back in the result."""
        if not sampled(request_id, self.config.sample_rate):
            return False
        if self._stopping.is_set():
            self.metrics.mirror.labels(self.model, "dropped").inc()
            return False
        if callable(outputs):
            outputs = outputs()
        sample = Sample(inputs, outputs, route, epoch, time.monotonic(),
                        tuple(requested_outputs or ()), tracing.current_context(), tag)
        try:
            self._queue.put_nowait(sample)
        except queue.Full:
            self.metrics.mirror.labels(self.model, "dropped").inc()
            return False
        return True

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
                dropped += 1
                self._unchecked(sample, "dropped")
        if dropped:
            self.metrics.mirror.labels(self.model, "dropped").inc(dropped)
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
            if self._stopping.is_set():  # taken while stop() was draining: still accounted for
                self.metrics.mirror.labels(self.model, "dropped").inc()
                self._unchecked(sample, "dropped")
                return
            try:
                with tracing.child_span("guard.mirror.compare", sample.trace_context,
                                        {"guard.model": self.model,
                                         "guard.route": sample.route}) as span:
                    self._span = span
                    self._process(sample)
            except Exception:  # a bug here must not kill the worker
                log.exception("mirror worker for %s failed on a sample", self.model)
                self.metrics.mirror.labels(self.model, "error").inc()

    def _process(self, sample: Sample) -> None:
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
            self.metrics.mirror.labels(self.model, "timeout").inc()
            tracing.set_attributes(self._span, {"guard.outcome": "timeout"})
            self._log_error(f"{stage} timed out after {timeout}s")
            self._unchecked(sample, "timeout")
            return
        except Exception as exc:
            self.metrics.mirror.labels(self.model, "error").inc()
            self._log_error(f"{stage} failed: {type(exc).__name__}: {exc}")
            self._unchecked(sample, "error")
            return
        self.metrics.reference_duration.labels(self.model).observe(seconds)
        if sample.only_outputs and not probed:
            # The answer holds only what the client asked for (upstream): compare just that.
            reference = {k: v for k, v in reference.items() if k in sample.only_outputs}
            sample.outputs = {k: v for k, v in sample.outputs.items() if k in sample.only_outputs}
        check = self.verifier.check(reference, sample.outputs, inputs=sample.inputs)
        self.metrics.mirror.labels(self.model, "compared").inc()
        tracing.set_attributes(self._span, {
            "guard.verdict": "pass" if check.passed else "fail",
            "guard.tier.tensor.max_abs_error": check.max_abs_error,
            "guard.probed": probed, "guard.reference_seconds": seconds})
        try:
            self.on_result(SampleResult(sample, check, seconds, probed, reference))
        except Exception:  # a bug downstream; the sample was compared, count it once
            log.exception("handling a check result for %s failed", self.model)

    def _unchecked(self, sample: Sample, outcome: str) -> None:
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
