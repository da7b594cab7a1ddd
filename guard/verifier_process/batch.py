"""A batch of mirrored samples through the probes, the reference and the checks: the mirror
worker's work (guard/verifier_process/mirror.py keeps the queue, the watchdog and the outcome
counts).

The worker takes what waits in its queue, up to ``mirror.max_batch`` samples, and:

1. probes the primary for the samples the fallback answered (their route is not ``primary``),
   one sample at a time: a probe must answer as the request was answered, and a primary's
   answer may depend on the rest of its batch (dynamic int8 quantisation scales activations
   over the whole batch);
2. runs the reference: same-signature samples stacked along the first axis into one forward
   pass (guard/backends/batching.py) where the backend declares a dynamic first dimension on
   every input, is not int8 (same reason) and the answers each sample carries have one row
   per input row; else one call per sample. A stacked call that raises, or answers with
   outputs that are not one row per input row, is run again one sample at a time, so that an
   error is pinned on the sample that caused it;
3. checks: tiers 1 and 3 over each group of same-shaped answers at once (from
   ``STACKED_CHECKS_FROM`` samples on)
   (guard/verify/batched.py: a sample that passes there gets the figures ``Comparator.check``
   gives it alone against the same reference answer, bit for bit); every other sample (a
   failure, which gets the full statistics and the fp64 arbiter; tier 2; adapters) goes
   through ``Comparator.check`` alone, as before.

The mirror then hands each sample's outcome on in arrival order, so that the detectors and
capture see the samples in the order they came. What batching changes is the reference's
answer itself: a stacked forward may sum in another order than one sample's (another kernel
for another batch size), so a sample's figures agree with one-by-one checking within that
noise, which a tolerance above float noise never notices (tests/unit/test_mirror_batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from guard.backends import batching
from guard.verify.batched import check_stacked_results
from guard.verify.pipeline import CheckResult, Comparator

if TYPE_CHECKING:  # (mirror.py imports this module)
    from guard.observe.tracing import RecordedSpan
    from guard.verifier_process.mirror import MirrorSample

# Tiers 1 and 3 at once pay a few dozen numpy calls per group, one sample alone a pure-Python
# fast path (~20 us for 10 logits): measured, the group wins from about 8 samples on.
STACKED_CHECKS_FROM = 8

# ``call(fn, inputs, stage)``: the mirror's watched backend call (TimeoutError when a hung call
# still holds the backend; the mirror's _Abandoned when the watchdog gave up on this one).
Call = Callable[[Callable, dict, str], dict]


@dataclass
class Held:
    """One sample on its way through a batch, and what became of it."""

    sample: MirrorSample
    span: RecordedSpan | None = None  # when traced
    probed: bool = False  # the primary ran for it (the fallback answered the client)
    reference: dict | None = None  # the reference's answer
    seconds: float = 0.0  # the reference call's wall time (a stacked call's, for each)
    failed: tuple[str, Exception] | None = None  # (stage, error): no verdict
    timed_out: str = ""  # the stage that could not get the backend in time
    check: CheckResult | None = None

    @property
    def pending(self) -> bool:
        return self.failed is None and not self.timed_out

    @property
    def answer(self) -> dict:
        """The reference's answer of a sample still pending after ``reference()``."""
        assert self.reference is not None, "a pending sample without a reference answer"
        return self.reference


def probe(call: Call, primary, held: list[Held]) -> None:
    """Run the primary for the samples the fallback answered; its answer is the one checked."""
    wanted = [h for h in held if h.pending and h.sample.route != "primary"]
    for h in wanted:
        h.probed = True

    def store(h: Held, outputs: dict, seconds: float) -> None:
        h.sample.outputs = outputs

    infer(call, primary, wanted, "primary probe", store, stack=False)


def reference(call: Call, backend, held: list[Held], observe: Callable[[float], None],
              stack: bool) -> None:
    """Run the reference for every sample still pending, stacked where ``stack`` (``stacks``
    of it) allows; ``observe`` gets each call's time."""

    def store(h: Held, outputs: dict, seconds: float) -> None:
        h.reference, h.seconds = outputs, seconds

    infer(call, backend, [h for h in held if h.pending], "reference", store, observe, stack)


def stacks(backend) -> bool:
    """Can this backend take several samples stacked along the first axis? (See the module
    docstring: a dynamic first dimension on every input, and not int8.)"""
    info = backend.describe()
    return info.precision != "int8" and batching.dynamic_batch(info)


def infer(call: Call, backend, held: list[Held], stage: str,
          store: Callable[[Held, dict, float], None],
          observe: Callable[[float], None] | None = None, stack: bool = True) -> None:
    """``backend`` on each held sample's inputs: stacked per signature where it can and
    ``stack`` allows (see the module docstring), else one by one; ``store(held, outputs,
    seconds)`` per sample. A call
    that times out marks its samples ``timed_out``; once the backend is busy (a hung call holds
    it), every sample not yet run is."""
    if not held:
        return
    groups = _groups(held) if stack and len(held) > 1 else [[h] for h in held]
    done: set[int] = set()
    try:
        for group in groups:
            if len(group) > 1 and _stacked(call, backend, group, stage, store, observe):
                done.update(id(h) for h in group)
                continue
            for h in group:
                try:
                    outputs, seconds = _timed(call, backend, h.sample.inputs, stage, observe)
                except BackendBusy:
                    raise
                except TimeoutError:  # the backend's own (an upstream's deadline)
                    h.timed_out = stage
                except Exception as exc:  # noqa: BLE001  (the sample's error, counted)
                    h.failed = (stage, exc)
                else:
                    store(h, outputs, seconds)
                done.add(id(h))
    except BackendBusy:
        for h in held:
            if id(h) not in done:
                h.timed_out = stage


class BackendBusy(TimeoutError):
    """The backend is still held by a call the watchdog gave up on, past ``timeout_s``."""


def _stacked(call: Call, backend, group: list[Held], stage: str, store, observe) -> bool:
    """One call for the group; False when it raised or its outputs do not split by rows (the
    group then runs one by one)."""
    counts = [batching.rows(h.sample.inputs) for h in group]
    try:
        outputs, seconds = _timed(call, backend, batching.stack([h.sample.inputs for h in group]),
                                  stage, None)
    except BackendBusy:
        raise
    except Exception:  # noqa: BLE001  (its own TimeoutError too: one by one says which)
        return False
    parts = batching.split_rows(outputs, counts)
    if parts is None:
        return False
    # The time per sample is the stacked call's share (guard_reference_duration_seconds is per
    # mirrored sample: its count stays the compared samples', its sum the reference's time).
    share = seconds / len(group)
    for h, part in zip(group, parts):
        if observe is not None:
            observe(share)
        store(h, part, share)
    return True


def _timed(call: Call, backend, inputs: dict, stage: str, observe):
    started = time.perf_counter()
    outputs = call(backend.infer, inputs, stage)
    seconds = time.perf_counter() - started
    if observe is not None:
        observe(seconds)
    return outputs, seconds


def _groups(held: list[Held]) -> list[list[Held]]:
    """Samples that can share a stacked call: equal input layouts, and answers of one row per
    input row (what a per-row model gives; a detector's boxes are not, and run alone)."""
    groups: dict[tuple, list[Held]] = {}
    alone: list[list[Held]] = []
    for h in held:
        inputs = h.sample.inputs
        n = batching.rows(inputs) if inputs else 0
        key = _layout(inputs, n) if n else None
        if key is not None and _layout(h.sample.outputs, n) is not None:
            groups.setdefault(key, []).append(h)
        else:
            alone.append([h])
    return list(groups.values()) + alone


def _layout(arrays: Mapping, n: int) -> tuple | None:
    """Names, dtypes and trailing shapes of ``arrays`` (what must agree for them to stack);
    None unless each has one row per input row (``n``)."""
    key = []
    for name, a in arrays.items():
        if not (isinstance(a, np.ndarray) and a.ndim and a.shape[0] == n):
            return None
        key.append((name, a.dtype, a.shape[1:]))
    return tuple(key)


def check(comparator: Comparator, held: list[Held]) -> None:
    """Each pending sample's ``CheckResult``: tiers 1 and 3 at once per group of same-shaped
    answers where the comparator allows it, ``Comparator.check`` alone for the rest."""
    ready = [h for h in held if h.pending]
    for h in ready:
        sample = h.sample
        if sample.only_outputs and not h.probed:
            # The answer holds only what the client asked for (upstream): compare just that.
            h.reference = {k: v for k, v in h.answer.items() if k in sample.only_outputs}
            sample.outputs = {k: v for k, v in sample.outputs.items()
                              if k in sample.only_outputs}
    groups: dict[tuple, list[Held]] = {}
    for h in ready if len(ready) >= STACKED_CHECKS_FROM else ():
        n = batching.rows(h.sample.inputs) if h.sample.inputs else 0
        ref = _layout(h.answer, n) if n else None
        out = _layout(h.sample.outputs, n) if ref is not None else None
        if out is not None:
            groups.setdefault((ref, out), []).append(h)
    for group in groups.values():
        if len(group) < STACKED_CHECKS_FROM:
            continue
        results = check_stacked_results(
            comparator, batching.stack([h.answer for h in group]),
            batching.stack([h.sample.outputs for h in group]),
            [batching.rows(h.sample.inputs) for h in group])
        for h, result in zip(group, results):
            h.check = result
    for h in ready:
        if h.check is None:
            h.check = comparator.check(h.answer, h.sample.outputs, inputs=h.sample.inputs)
