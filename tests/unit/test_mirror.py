"""guard/runtime/sampling.py (which requests are taken) and guard/verifier_process/mirror.py (the bounded
queue, timeouts and errors), with real torch backends (tests/fixture_models.py's ``affine``
through the ``module:factory`` path)."""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
import pytest
from prometheus_client import generate_latest

import fixture_models
from guard.backends import create_backend
from guard.config import BackendConfig, ChecksConfig, MirrorConfig
from guard.observe.metrics import GuardMetrics
from guard.runtime.priority import thread_niceness
from guard.runtime.sampling import sampled
from guard.verifier_process.mirror import Mirror, MirrorSample, MirrorResult
from guard.verify.pipeline import Comparator

MODEL = "affine"
# The drift trigger scales outputs to ~1e3, where the default rtol would excuse the +1.0 drift.
TIGHT = {"tensor": {"atol": 1e-3, "rtol": 0.0}}


# -- sampled() ------------------------------------------------------------------------------------
def test_sampled_is_deterministic_per_id():
    for i in range(200):
        rid = f"request-{i}"
        first = sampled(rid, 0.37)
        assert all(sampled(rid, 0.37) == first for _ in range(3))


def test_sampled_rate_zero_never_rate_one_always():
    ids = [f"id-{i}" for i in range(500)] + [""]
    assert not any(sampled(rid, 0.0) for rid in ids)
    assert all(sampled(rid, 1.0) for rid in ids)
    assert not any(sampled(rid, -0.5) for rid in ids)
    assert all(sampled(rid, 1.5) for rid in ids)


@pytest.mark.parametrize("rate", [0.01, 0.05, 0.3, 0.5, 0.9])
def test_sampled_share_of_ids_close_to_rate(rate):
    n = 10_000
    share = sum(sampled(f"req-{i:06d}", rate) for i in range(n)) / n
    assert abs(share - rate) < 0.02 + 0.05 * rate


def test_sampled_higher_rate_is_a_superset():
    """Hash threshold: an id mirrored at a low rate is mirrored at any higher rate."""
    ids = [f"r{i}" for i in range(3000)]
    low = {rid for rid in ids if sampled(rid, 0.1)}
    high = {rid for rid in ids if sampled(rid, 0.4)}
    assert low and low <= high and len(high) > len(low)


def test_sampled_depends_on_the_id():
    picks = [sampled(f"x{i}", 0.5) for i in range(100)]
    assert any(picks) and not all(picks)


def test_sampled_without_id_roughly_the_rate():
    random.seed(12345)
    n = 10_000
    share = sum(sampled("", 0.25) for _ in range(n)) / n
    assert abs(share - 0.25) < 0.03


# -- Mirror with real backends ---------------------------------------------------------------------
def backend(role: str, **kwargs):
    spec = BackendConfig(backend="torch", path="fixture_models:affine", options={"kwargs": kwargs})
    b = create_backend(spec, role)
    b.load()
    return b


def count(metrics: GuardMetrics, outcome: str) -> float:
    return metrics.mirror.labels(MODEL, outcome)._value.get()


def scraped(metrics: GuardMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": MODEL, **labels})


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def rows(first: float, n: int = 2) -> dict[str, np.ndarray]:
    x = np.random.default_rng(int(abs(first))).standard_normal((n, 4)).astype(np.float32)
    x[:, 0] = first
    return {"x": x}


class Harness:
    def __init__(self, reference_kwargs=None, primary_kwargs=None, checks=None, **mirror):
        self.reference = backend("reference", **(reference_kwargs or {}))
        self.primary = backend("primary", **(primary_kwargs or {}))
        self.metrics = GuardMetrics("test")
        self.metrics.declare_model(MODEL)
        self.results: list[MirrorResult] = []
        self.result_event = threading.Event()
        config = MirrorConfig(**{"sample_rate": 1.0, "queue_size": 8, "timeout_s": 5.0, **mirror})
        self.mirror = Mirror(MODEL, config, self.reference, self.primary,
                             Comparator(ChecksConfig.model_validate(checks or {})), self.metrics,
                             self._on_result)
        self.started = self.stopped = False

    def start(self):
        self.mirror.start()
        self.started = True

    def _on_result(self, result: MirrorResult) -> None:
        self.results.append(result)
        self.result_event.set()

    def offer(self, inputs, outputs=None, route="primary", epoch=0, request_id=""):
        if outputs is None:
            outputs = self.primary.infer(inputs)
        if sampled(request_id, self.mirror.config.sample_rate):  # as the serving process does
            self.mirror.accept(MirrorSample(inputs, outputs, route, epoch, time.monotonic()))

    def depth(self) -> float:
        return scraped(self.metrics, "guard_mirror_queue_depth")

    def stop(self):
        if self.started and not self.stopped:
            self.stopped = True
            self.mirror.stop(timeout=5.0)


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(**kwargs) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.stop()


def test_good_sample_is_compared_and_passes(harness):
    h = harness()
    h.start()
    inputs = rows(0.5)
    h.offer(inputs, epoch=3)
    assert wait_for(lambda: count(h.metrics, "compared") == 1)
    assert wait_for(lambda: len(h.results) == 1)
    (result,) = h.results
    assert result.check.passed, result.check.summary()
    assert [o.name for o in result.check.outputs] == ["y"]
    assert result.probed is False
    assert result.sample.route == "primary" and result.sample.epoch == 3
    np.testing.assert_array_equal(result.sample.inputs["x"], inputs["x"])
    # The reference really ran: its call was timed once.
    assert scraped(h.metrics, "guard_reference_duration_seconds_count") == 1.0
    for outcome in ("dropped", "error", "timeout"):
        assert count(h.metrics, outcome) == 0


def test_drifting_primary_fails_the_check(harness):
    h = harness(primary_kwargs={"drift_on_trigger": True}, checks=TIGHT)
    h.start()
    h.offer(rows(fixture_models.DRIFT_TRIGGER))
    assert wait_for(lambda: len(h.results) == 1)
    check = h.results[0].check
    assert not check.passed
    assert check.max_abs_error == pytest.approx(1.0, abs=1e-4)
    assert check.failures[0].name == "y"
    assert count(h.metrics, "compared") == 1  # a failing check is still a compared sample


def test_fallback_route_probes_primary(harness):
    h = harness()
    h.start()
    inputs = rows(0.25)
    # The client got the fallback's answer; the mirror must run the primary itself to judge it.
    h.offer(inputs, outputs={"y": np.full((2, 3), 99.0, np.float32)}, route="fallback")
    assert wait_for(lambda: len(h.results) == 1)
    result = h.results[0]
    assert result.probed is True
    assert result.check.passed, result.check.summary()
    np.testing.assert_allclose(result.sample.outputs["y"], h.primary.infer(inputs)["y"])


def test_probe_of_drifting_primary_fails(harness):
    h = harness(primary_kwargs={"drift_on_trigger": True}, checks=TIGHT)
    h.start()
    h.offer(rows(fixture_models.DRIFT_TRIGGER), outputs={"y": np.zeros((2, 3), np.float32)},
            route="fallback")
    assert wait_for(lambda: len(h.results) == 1)
    assert h.results[0].probed and not h.results[0].check.passed


def test_sample_rate_zero_offers_nothing(harness):
    h = harness(sample_rate=0.0)
    for i in range(20):
        h.offer(rows(0.1), request_id=f"r{i}")
    assert h.depth() == 0
    assert count(h.metrics, "dropped") == 0


def test_full_queue_drops_without_blocking_when_worker_not_started(harness):
    h = harness(queue_size=1)
    inputs = rows(0.1)
    outputs = h.primary.infer(inputs)
    for _ in range(5):
        h.offer(inputs, outputs)
    assert h.depth() == 1
    assert count(h.metrics, "dropped") == 4


def test_queue_bytes_bound_drops_past_the_budget(harness):
    """The queue is bounded in bytes too: samples past ``queue_bytes`` are dropped and counted
    even while there is room in items."""
    h = harness(queue_size=100, queue_bytes=1000)
    inputs = rows(0.1)
    outputs = h.primary.infer(inputs)
    accepted = [h.mirror.accept(MirrorSample(inputs, outputs, "primary", 0, 0.0, size=400))
                for _ in range(5)]
    assert accepted == [True, True, False, False, False]
    assert h.depth() == 2
    assert count(h.metrics, "dropped") == 3


def test_queue_of_one_with_slow_reference_drops_and_counts(harness):
    # The reference holds the worker long enough for three offers on a loaded machine (0.6 s
    # was not, under two test workers on two busy cores).
    h = harness(reference_kwargs={"sleep_on_trigger": 2.0}, queue_size=1, timeout_s=8.0)
    h.start()
    h.offer(rows(fixture_models.SLEEP_TRIGGER))  # the worker takes it and waits on the reference
    assert wait_for(lambda: h.depth() == 0)
    h.offer(rows(0.1))  # waits in the queue (size 1)
    h.offer(rows(0.2))  # queue full: dropped
    h.offer(rows(0.3))  # dropped
    assert count(h.metrics, "dropped") == 2
    assert h.depth() == 1
    assert wait_for(lambda: count(h.metrics, "compared") == 2)
    assert len(h.results) == 2 and all(r.check.passed for r in h.results)
    assert count(h.metrics, "dropped") == 2
    text = generate_latest(h.metrics.registry).decode()
    assert f'guard_mirror_total{{model="{MODEL}",outcome="dropped"}} 2.0' in text
    assert f'guard_mirror_total{{model="{MODEL}",outcome="compared"}} 2.0' in text


class Gate:
    """The reference's calls held until ``open()``: what the tests below see happen while the
    reference is still inside its call is so by cause, on any machine at any load."""

    def __init__(self, backend):
        self.entered = threading.Event()
        self.finished = threading.Event()
        self._open = threading.Event()
        infer = backend.infer

        def held(inputs):
            self.entered.set()
            self._open.wait(30)
            try:
                return infer(inputs)
            finally:
                self.finished.set()

        backend.infer = held

    def open(self) -> None:
        self._open.set()


def test_reference_slower_than_timeout_counts_timeout(harness):
    h = harness(timeout_s=0.2)
    gate = Gate(h.reference)
    h.start()
    inputs = rows(0.5)
    h.offer(inputs, h.primary.infer(inputs))
    # offer never waits for the reference: it has returned with the reference's call not done.
    assert not gate.finished.is_set() and h.results == []
    assert wait_for(lambda: count(h.metrics, "timeout") == 1, timeout=10)
    # The timeout was counted while the reference was still inside its call.
    assert gate.entered.is_set() and not gate.finished.is_set()
    gate.open()
    assert count(h.metrics, "compared") == 0
    assert count(h.metrics, "error") == 0
    assert h.results == []


def test_offer_does_not_block_while_reference_hangs(harness):
    h = harness(timeout_s=30.0, queue_size=2)
    gate = Gate(h.reference)
    h.start()
    inputs = rows(0.5)
    outputs = h.primary.infer(inputs)
    for _ in range(10):
        h.offer(inputs, outputs)
    # All ten offers returned with the reference still held in its first call.
    assert not gate.finished.is_set()
    # At most 2 in hand (the worker takes what waits, and at most 2 ever wait) + 2 queued.
    assert count(h.metrics, "dropped") >= 6
    gate.open()


def test_a_hung_call_is_given_up_and_a_new_worker_checks_the_next_samples(harness):
    """The watchdog counts the hung sample as timeout and hands the queue to a new worker;
    the next sample waits behind the hung call (one backend call at a time) and is compared
    once it returns; the abandoned worker's late answer is dropped, never counted."""
    h = harness(reference_kwargs={"sleep_on_trigger": 1.0}, timeout_s=0.6)
    h.start()
    first = h.mirror._thread
    h.offer(rows(fixture_models.SLEEP_TRIGGER))
    assert wait_for(lambda: count(h.metrics, "timeout") == 1, timeout=5)
    assert h.mirror._thread is not first
    h.offer(rows(0.5))
    assert wait_for(lambda: count(h.metrics, "compared") == 1, timeout=5)
    assert h.results[0].check.passed and len(h.results) == 1
    first.join(5)
    assert not first.is_alive()  # the abandoned worker left once its call returned
    assert count(h.metrics, "timeout") == 1 and count(h.metrics, "error") == 0


def test_failing_reference_counts_error_and_worker_survives(harness):
    h = harness(reference_kwargs={"fail_on_trigger": True})
    h.start()
    bad = rows(fixture_models.FAIL_TRIGGER)
    h.offer(bad, outputs=h.primary.infer(bad))
    assert wait_for(lambda: count(h.metrics, "error") == 1)
    assert h.results == []
    h.offer(rows(0.5))
    assert wait_for(lambda: count(h.metrics, "compared") == 1)
    assert h.results[0].check.passed
    assert count(h.metrics, "error") == 1


def test_failing_primary_probe_counts_error(harness):
    h = harness(primary_kwargs={"fail_on_trigger": True})
    h.start()
    h.offer(rows(fixture_models.FAIL_TRIGGER), outputs={"y": np.zeros((2, 3), np.float32)},
            route="fallback")
    assert wait_for(lambda: count(h.metrics, "error") == 1)
    assert h.results == []
    assert count(h.metrics, "compared") == 0


def test_stop_counts_queued_samples_as_dropped(harness):
    h = harness(reference_kwargs={"sleep_on_trigger": 0.5}, queue_size=8, timeout_s=5.0)
    h.start()
    h.offer(rows(fixture_models.SLEEP_TRIGGER))
    assert wait_for(lambda: h.depth() == 0)  # in hand
    for v in (0.1, 0.2, 0.3):
        h.offer(rows(v))
    assert h.depth() == 3
    h.stop()
    assert count(h.metrics, "dropped") == 3
    assert h.depth() == 0
    # The sample in hand was finished, the queued ones were not.
    assert count(h.metrics, "compared") == 1
    assert len(h.results) == 1
    # After stop, offers are dropped and counted, never queued.
    h.offer(rows(0.4))
    assert count(h.metrics, "dropped") == 4
    assert h.depth() == 0


def test_stop_without_samples_drops_nothing(harness):
    h = harness()
    h.start()
    h.stop()
    assert count(h.metrics, "dropped") == 0
    assert not h.mirror._thread.is_alive()


# -- priority --------------------------------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux")
@pytest.mark.parametrize("nice", [10, 0])
def test_mirror_threads_run_below_the_request_path(harness, nice):
    """The worker (reference and checks) and its watchdog run ``mirror.nice`` steps below the
    thread that serves; the serving thread keeps its niceness."""
    h = harness(nice=nice)
    base = thread_niceness()
    h.start()
    h.offer(rows(1.0))
    assert h.result_event.wait(10)
    worker = h.mirror._thread.native_id
    watchdog = h.mirror._watchdog.native_id
    for tid in (worker, watchdog):
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base + nice)
    assert thread_niceness() == base
