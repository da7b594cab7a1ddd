"""Batched checking in the verifier (guard/verifier_process/batch.py, mirror.py): a batch of
mirrored samples gives each sample the verdict one-by-one checking gives it, its figures within
the reference's summation-order noise, in arrival order; with real ONNX Runtime and TorchScript
references (the seeded zoo CNN, an int8 ONNX Runtime primary: some samples pass, some fail tier
1 or tier 3), real torch fixture models for errors and timeouts, and a real verifier process
path (ring, reader, model, capture) for the order of the capture records."""

from __future__ import annotations

import math
import threading
import time

import fixture_models
import numpy as np
import pytest

from guard.backends import create_backend
from guard.config import BackendConfig, ChecksConfig, MirrorConfig, ModelConfig
from guard.observe.metrics import GuardMetrics
from guard.verifier_process.mirror import Mirror, MirrorResult, MirrorSample
from guard.verify.pipeline import Comparator
from guard.zoo.classifier import sample_inputs

MODEL = "cnn"
# About half the samples within tier 1 (int8 against fp32); tier 3 strict on top-1.
CHECKS = {"tensor": {"atol": 0.45, "rtol": 0.0},
          "task": {"classification": {"min_top1_agreement": 1.0, "top_k": 3,
                                      "min_topk_overlap": 1.0}}}


class Counted:
    """A backend whose calls are counted by rows (the test sees the stacking), running the
    real backend underneath."""

    def __init__(self, backend):
        self.backend = backend
        self.calls: list[int] = []

    def infer(self, inputs):
        self.calls.append(next(iter(inputs.values())).shape[0])
        return self.backend.infer(inputs)

    def describe(self):
        return self.backend.describe()


def run_mirror(reference, primary, comparator, samples: list[MirrorSample], max_batch: int,
               **mirror) -> tuple[list[MirrorResult], GuardMetrics, Counted]:
    """Every sample through a mirror (all queued before its worker starts, so that batches
    fill), the results in the order they were handed on."""
    metrics = GuardMetrics("test")
    metrics.declare_model(MODEL)
    results: list[MirrorResult] = []
    done = threading.Event()
    finished = []

    def on_finished(sample):
        finished.append(sample)
        if len(finished) == len(samples):
            done.set()

    counted = Counted(reference)
    config = MirrorConfig(sample_rate=1.0, queue_size=1000, max_batch=max_batch,
                          **{"timeout_s": 30.0, **mirror})
    m = Mirror(MODEL, config, counted, primary, comparator, metrics, results.append,
               on_finished=on_finished)
    assert m.accept_many(samples) == len(samples)
    m.start()
    try:
        assert done.wait(120), f"{len(finished)} of {len(samples)} samples finished"
    finally:
        m.stop()
    return results, metrics, counted


def outcome(metrics: GuardMetrics, name: str) -> float:
    return metrics.mirror.labels(MODEL, name)._value.get()


@pytest.fixture(scope="module")
def cnn_backends(zoo_classifier):
    onnx, script = str(zoo_classifier["onnx"]), str(zoo_classifier["torchscript"])
    built = {
        "primary": create_backend(BackendConfig(backend="onnxruntime", path=onnx,
                                                precision="int8"), "primary"),
        "onnxruntime": create_backend(BackendConfig(backend="onnxruntime", path=onnx),
                                      "reference"),
        "torch": create_backend(BackendConfig(backend="torch", path=script), "reference"),
    }
    for backend in built.values():
        backend.load()
    yield built
    for backend in built.values():
        backend.close()


def cnn_samples(primary, n: int, seed: int) -> list[MirrorSample]:
    """Requests of 1-3 rows as clients send them; every fifth answered by the fallback (its
    answer garbage: the probe of the primary is what gets checked)."""
    images = sample_inputs(2 * n, seed=seed)
    samples, start = [], 0
    for k in range(n):
        rows = 1 + k % 3
        inputs = {"image": images[start:start + rows]}
        start += rows
        route = "fallback" if k % 5 == 4 else "primary"
        outputs = (primary.infer(inputs) if route == "primary"
                   else {"logits": np.full((rows, 10), 7.0, np.float32)})
        samples.append(MirrorSample(inputs, outputs, route, 0, 0.0, tag=k))
    return samples


@pytest.mark.parametrize("reference", ["onnxruntime", "torch"])
def test_batched_verdicts_equal_one_by_one_within_summation_noise(cnn_backends, reference):
    ref, primary = cnn_backends[reference], cnn_backends["primary"]
    comparator = Comparator(ChecksConfig.model_validate(CHECKS), "classification")
    samples = cnn_samples(primary, 60, seed=11)
    copies = [MirrorSample(dict(s.inputs), dict(s.outputs), s.route, 0, 0.0, tag=s.tag)
              for s in samples]
    batched, b_metrics, b_calls = run_mirror(ref, primary, comparator, samples, max_batch=16)
    alone, a_metrics, a_calls = run_mirror(ref, primary, comparator, copies, max_batch=1)

    # Arrival order, every sample compared, in fewer reference calls than samples.
    assert [r.sample.tag for r in batched] == list(range(60))
    assert [r.sample.tag for r in alone] == list(range(60))
    assert outcome(b_metrics, "compared") == outcome(a_metrics, "compared") == 60
    assert len(a_calls.calls) == 60 and len(b_calls.calls) < 60
    assert max(b_calls.calls) > 3  # several samples' rows in one forward pass
    assert sum(b_calls.calls) == sum(a_calls.calls)

    verdicts, undecided = set(), 0
    for b, a in zip(batched, alone):
        assert b.probed == a.probed == (b.sample.route == "fallback")
        assert list(b.check.tiers) == list(a.check.tiers) == ["tensor", "task"]
        for ob, oa in zip(b.check.outputs, a.check.outputs):
            # The reference's answers differ by summation order at most: so do the figures.
            noise = 1e-5 * (1.0 + oa.ref_max_abs)
            assert ob.name == oa.name
            assert abs(ob.max_abs - oa.max_abs) <= noise, (b.sample.tag, ob, oa)
            assert abs(ob.ref_max_abs - oa.ref_max_abs) <= noise
            if abs(oa.max_abs - oa.allowed) <= noise:
                undecided += 1  # on the edge of the tolerance: either verdict is right
                continue
            assert ob.passed == oa.passed, (b.sample.tag, ob, oa)
        if b.check.task.passed != a.check.task.passed:  # a near-tie top-1 flip, at most
            margin = a.check.task.metrics.get("min_reference_margin_of_flips", 0.0)
            assert margin <= 1e-4, (b.sample.tag, b.check.task, a.check.task)
            undecided += 1
        np.testing.assert_allclose(b.reference["logits"], a.reference["logits"], rtol=1e-5,
                                   atol=1e-5)
        verdicts.add((b.check.tiers["tensor"].passed, b.check.tiers["task"].passed))
    assert undecided <= 2
    assert (True, True) in verdicts and (False, True) in verdicts  # both paths were taken


def test_a_sample_that_breaks_a_stacked_call_is_pinned_and_the_rest_compared():
    """The reference raises on one sample's rows: the stacked call fails, the batch runs one
    by one, and only that sample is counted as an error."""
    ref = backend("reference", fail_on_trigger=True)
    primary = backend("primary")
    samples = []
    for k in range(8):
        x = np.random.default_rng(k).standard_normal((2, 4)).astype(np.float32)
        if k == 5:
            x[:, 0] = fixture_models.FAIL_TRIGGER
        samples.append(MirrorSample({"x": x}, primary.infer({"x": x}), "primary", 0, 0.0,
                                    tag=k))
    results, metrics, calls = run_mirror(ref, primary, Comparator(ChecksConfig()), samples,
                                         max_batch=8)
    assert [r.sample.tag for r in results] == [0, 1, 2, 3, 4, 6, 7]
    assert all(r.check.passed for r in results)
    assert outcome(metrics, "error") == 1 and outcome(metrics, "compared") == 7
    assert calls.calls[0] == 16  # the stacked call, then one per sample
    assert len(calls.calls) == 9


def test_drift_in_one_sample_fails_that_sample_only():
    ref, primary = backend("reference"), backend("primary", drift_on_trigger=True)
    samples = []
    for k in range(12):
        x = np.random.default_rng(k).standard_normal((1 + k % 2, 4)).astype(np.float32)
        if k in (3, 8):
            x[:, 0] = fixture_models.DRIFT_TRIGGER
        samples.append(MirrorSample({"x": x}, primary.infer({"x": x}), "primary", 0, 0.0,
                                    tag=k))
    checks = ChecksConfig.model_validate({"tensor": {"atol": 1e-3, "rtol": 0.0}})
    results, _, calls = run_mirror(ref, primary, Comparator(checks), samples, max_batch=12)
    assert len(calls.calls) == 1
    assert [k for k, r in enumerate(results) if not r.check.passed] == [3, 8]
    failed = results[3].check
    assert failed.max_abs_error == pytest.approx(1.0, abs=1e-4)
    assert not math.isnan(failed.outputs[0].mean_abs)  # a failure gets the full statistics


def test_a_hung_stacked_call_counts_its_whole_batch_as_timeout():
    """The watchdog gives up on a stacked call: every sample of the batch is counted once,
    as a timeout, and a new worker checks what comes next."""
    ref = backend("reference", sleep_on_trigger=1.5)
    primary = backend("primary")
    metrics = GuardMetrics("test")
    metrics.declare_model(MODEL)
    results, finished = [], []
    m = Mirror(MODEL, MirrorConfig(sample_rate=1.0, queue_size=100, timeout_s=0.6, max_batch=8),
               ref, primary, Comparator(ChecksConfig()), metrics, results.append,
               on_finished=finished.append)
    samples = []
    for k in range(5):
        x = np.full((1, 4), fixture_models.SLEEP_TRIGGER if k == 2 else 0.5, np.float32)
        samples.append(MirrorSample({"x": x}, primary.infer({"x": x}), "primary", 0, 0.0,
                                    tag=k))
    m.accept_many(samples)
    first = m._thread
    m.start()
    try:
        assert wait_for(lambda: outcome(metrics, "timeout") == 5, timeout=10)
        assert m._thread is not first
        first.join(5)  # the abandoned worker leaves once its call returns, reporting nothing
        assert not first.is_alive()
        x = np.full((1, 4), 0.25, np.float32)
        m.accept(MirrorSample({"x": x}, primary.infer({"x": x}), "primary", 0, 0.0, tag=9))
        assert wait_for(lambda: outcome(metrics, "compared") == 1, timeout=10)
        assert [r.sample.tag for r in results] == [9]
        assert outcome(metrics, "timeout") == 5 and outcome(metrics, "error") == 0
        assert sorted(s.tag for s in finished) == [0, 1, 2, 3, 4, 9]  # each accounted once
    finally:
        m.stop()


def test_accept_many_queues_what_fits_and_drops_the_rest_in_order():
    metrics = GuardMetrics("test")
    metrics.declare_model(MODEL)
    told = []
    m = Mirror(MODEL, MirrorConfig(sample_rate=1.0, queue_size=3), backend("reference"),
               backend("primary"), Comparator(ChecksConfig()), metrics, lambda r: None,
               on_unchecked=lambda s, why: told.append((s.tag, why)))
    x = {"x": np.zeros((1, 4), np.float32)}
    samples = [MirrorSample(x, {}, "primary", 0, 0.0, tag=k) for k in range(5)]
    assert m.accept_many(samples) == 3
    assert told == [(3, "dropped"), (4, "dropped")]
    assert outcome(metrics, "dropped") == 2
    assert metrics.registry.get_sample_value("guard_mirror_queue_depth",
                                             {"model": MODEL}) == 3
    assert m.accept_many(samples[:1]) == 0  # full: nothing queued, one more dropped
    assert outcome(metrics, "dropped") == 3


# -- the verifier process's path: ring, reader, model, capture ----------------------------------
class NoServing:
    def use_primary(self, *args):
        return ""

    def transition(self, *args):
        pass

    def span(self, *args):
        pass


def verifier_process(config: ModelConfig, ring_bytes: int = 16 << 20):
    """The verifier's ring reader, model and mirror as ``python -m guard.verifier_process``
    builds them, on a real ring and route table (its threads not started)."""
    from guard.ipc import routes
    from guard.ipc.ring import SampleRing
    from guard.verifier_process.process import VerifierProcess

    table = routes.RouteTable(4)
    slot = table.assign([config.name])[config.name]
    ring = SampleRing(ring_bytes)
    verifier = VerifierProcess(None, table, [ring])
    verifier.link = NoServing()
    model = verifier._build(config, slot, "", None, [])
    verifier.models[config.name], verifier.by_slot[slot] = model, model
    return verifier, model, ring, slot


def test_samples_wait_in_the_ring_while_the_mirror_queue_is_full():
    """A mirror worker that loses the CPU for a while (here: its reference held) leaves the
    reader's samples in the ring, not dropped at its small queue; they are all checked once it
    runs again. A queue that stays full past the reader's hold drops at the queue as before,
    and samples that waited too long are dropped when taken."""
    from guard.ipc import wire
    from guard.verifier_process import process

    config = ModelConfig.model_validate({
        "name": MODEL, "primary": {"backend": "torch", "path": "fixture_models:affine"},
        "reference": {"backend": "torch", "path": "fixture_models:affine"},
        "mirror": {"sample_rate": 1.0, "queue_size": 4, "timeout_s": 30.0}})
    verifier, model, ring, slot = verifier_process(config)
    held = threading.Event()
    reference, infer = model.mirror.reference, model.mirror.reference.infer
    reference.infer = lambda inputs: (held.wait(30), infer(inputs))[1]
    outcome_of = lambda name: model.metrics.mirror.labels(MODEL, name)._value.get()

    def feed(n: int, first: int = 0, stamp: int | None = None) -> None:
        for k in range(first, first + n):
            x = np.full((1, 4), 0.01 * k, np.float32)
            assert ring.put(wire.encode(wire.Sample(
                MODEL, slot, "primary", 0, wire.MIRROR, f"r{k}", "", 0.001,
                wire.Tensors({"x": x}, {"y": infer({"x": x})["y"]}),
                time.time_ns() if stamp is None else stamp)))

    verifier._reader.start()
    try:
        feed(20)
        # The worker holds its first batch; the queue fills (4) and the rest wait in the ring.
        assert wait_for(lambda: model.mirror.room() == 0, timeout=10)
        time.sleep(0.3)  # several reader rounds (each 20 ms) while the queue is full
        assert outcome_of("dropped") == 0
        assert ring.used > 0  # what did not fit is still in the ring
        held.set()
        assert wait_for(lambda: outcome_of("compared") == 20, timeout=30)
        assert outcome_of("dropped") == 0
        # Stuck past the hold: the reader drains again and the full queue drops, counted.
        held.clear()
        feed(40, first=20)
        assert wait_for(lambda: outcome_of("dropped") > 0, timeout=process._HOLD_S + 20)
        held.set()
        assert wait_for(lambda: outcome_of("compared") + outcome_of("dropped") == 60,
                        timeout=30)
        # Samples handed off more than 2 s ago while the model was checking (a mirror far
        # behind): dropped when taken, not checked. (Older than the model: a restart's
        # backlog, checked.)
        compared = outcome_of("compared")
        stamp = model._born_ns + 1
        assert wait_for(lambda: time.time_ns() - stamp > 2.5e9, timeout=10)
        feed(3, first=60, stamp=stamp)
        assert wait_for(lambda: outcome_of("compared") + outcome_of("dropped") == 63,
                        timeout=30)
        assert outcome_of("compared") == compared
    finally:
        held.set()
        verifier.close()


def test_capture_records_keep_the_arrival_order(tmp_path, zoo_classifier):
    """Samples through a real ring into the verifier's reader and model, checked in batches:
    the capture records (every request, the mirrored ones with their verdicts) come in the
    order the serving process handed the samples off."""
    from guard.capture.reader import FileStats, expand_paths, read_records
    from guard.ipc import wire

    onnx = str(zoo_classifier["onnx"])
    config = ModelConfig.model_validate({
        "name": MODEL, "task": "classification",
        "primary": {"backend": "onnxruntime", "path": onnx, "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": onnx},
        "mirror": {"sample_rate": 1.0, "queue_size": 500, "max_batch": 16},
        "checks": CHECKS,
        "capture": {"dir": str(tmp_path), "mode": "all", "sample_rate": 1.0},
    })
    verifier, model, ring, slot = verifier_process(config)
    primary = create_backend(config.primary, "primary")
    primary.load()
    images = sample_inputs(80, seed=3)
    sent = []
    for k in range(80):
        inputs = {"image": images[k:k + 1]}
        flags = wire.CAPTURE | (wire.MIRROR if k % 4 else 0)  # some only recorded
        parts = wire.encode(wire.Sample(MODEL, slot, "primary", 0, flags, f"r{k:03d}", "",
                                        0.001, wire.Tensors(inputs, primary.infer(inputs)),
                                        time.time_ns()))
        assert ring.put(parts)
        sent.append(f"r{k:03d}")
    compared = lambda: model.metrics.mirror.labels(MODEL, "compared")._value.get()
    verifier._reader.start()
    try:
        assert wait_for(lambda: compared() == 60, timeout=60)
    finally:
        verifier.close()
        primary.close()
    stats = FileStats()
    records = [r for path in expand_paths([tmp_path]) for r in read_records(path, stats)]
    assert sorted(r.request_id for r in records) == sent
    mirrored = [r.request_id for r in records if r.mirrored]
    assert all(len(r.verdicts) and len(r.reference_outputs) for r in records if r.mirrored)
    # The mirrored samples' records in arrival order (checked in batches, handed on in order).
    assert mirrored == [rid for k, rid in enumerate(sent) if k % 4]


# -- helpers ---------------------------------------------------------------------------------------
def backend(role: str, **kwargs):
    spec = BackendConfig(backend="torch", path="fixture_models:affine", options={"kwargs": kwargs})
    b = create_backend(spec, role)
    b.load()
    return b


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
