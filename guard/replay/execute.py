"""Running batches of replay items through a model's reference and primary, and the checks.

``ModelRunner`` holds one model's ``CheckedPair`` (guard/verify/pair.py: reference and primary
as configured now, the ``Comparator`` with its arbiter, tier 2 and noise floor), assembled exactly
as the sidecar's verifier process assembles its own. For each batch it:

1. checks every item's inputs against the primary's signature (the data plane's own check): an
   item that does not fit is an ``input_error`` outcome;
2. stacks the items along the first axis when every input of both backends declares a dynamic
   first dimension (-1), hands the batch to the reference's thread and to the primary's (one
   each: both release the GIL, and each runs its queue of batches back to back, so the
   reference, which bounds replay, never waits for the primary), and splits the outputs back per
   item; when a stacked call fails, or its outputs do not split by rows, the items run one by
   one, so that an error is pinned on the item that caused it;
3. checks every item as one sample, as the sidecar does: the items of a stacked batch that
   pass tiers 1 and 3 are found with the batch's figures computed at once
   (guard/verify/batched.py: the same numbers, bit for bit), every other item goes through
   ``Comparator.check`` alone with its inputs; ``Comparator.tier_reports`` of each is kept.

The steps are separate methods (``submit``, which returns at once; ``collect``, which waits for
both sides; ``check``) so that an engine can overlap them: the local engine submits a few
batches ahead and checks batch k while later ones are inferred (inference releases the GIL,
the checks mostly hold it). Whether items are stacked depends only on the batch and the
backends' signatures, so the local and the Ray engine, which run the same batches, compute the
same numbers.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from guard.backends import Backend
from guard.backends.batching import dynamic_batch, split_rows, stack
from guard.collector import freeze_loaded, thaw
from guard.config import ModelConfig
from guard.protocol.codec import InferenceError
from guard.protocol.inputs import check_inputs
from guard.replay.generation import GenerationRunner
from guard.replay.items import (
    CHECKED,
    INPUT_ERROR,
    PRIMARY_ERROR,
    REFERENCE_ERROR,
    Batch,
    ReplayItem,
    RecordOutcome,
    outcome_of,
)
from guard.verify.batched import check_stacked
from guard.verify.noise import NoiseFloor
from guard.verify.pair import CheckedPair
from guard.verify.tiers import sample_kind


@dataclass
class Stacked:
    """Items inferred in one stacked call: the outputs of both sides, rows in item order."""

    items: list[ReplayItem]
    reference: dict[str, np.ndarray]
    primary: dict[str, np.ndarray]

    def split(self) -> list[tuple[ReplayItem, dict, dict]]:
        counts = [it.rows for it in self.items]
        return list(zip(self.items, split_rows(self.reference, counts),
                        split_rows(self.primary, counts)))


@dataclass
class Inferred:
    """A batch after inference: final outcomes (errors) and the answers still to be checked."""

    batch: Batch
    done: dict[int, RecordOutcome] = field(default_factory=dict)
    answers: list[tuple[ReplayItem, dict, dict]] = field(default_factory=list)
    stacked: Stacked | None = None


@dataclass
class Submitted:
    """A batch handed to the two sides' threads: input errors, and futures of their answers
    (one pair for the stacked items, or one pair per item)."""

    inferred: Inferred
    items: list[ReplayItem]
    stacked: tuple[Future, Future] | None = None
    each: list[tuple[Future, Future]] = field(default_factory=list)


def _answer(backend: Backend, inputs: dict[str, np.ndarray]):
    """The backend's outputs, or the exception it raised (reported per item)."""
    try:
        return backend.infer(inputs)
    except Exception as exc:  # noqa: BLE001
        return exc


class ModelRunner:
    def __init__(self, config: ModelConfig):
        self.name = config.name
        self.config = config
        self.pair = CheckedPair(config)  # the verifier process builds its pairs the same way
        self.comparator = self.pair.comparator
        self.reference = self.pair.reference
        self.primary = self.pair.primary
        # One thread per side: each runs its batches in order, back to back.
        self._sides = {
            role: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replay-{self.name}-{role}")
            for role in ("reference", "primary")}

    @property
    def noise_floor(self) -> NoiseFloor | None:
        return self.pair.noise_floor

    def load(self) -> "ModelRunner":
        self.pair.load()
        self.input_specs = {s.name: s for s in self.primary.describe().inputs}
        self.stackable = (dynamic_batch(self.primary.describe())
                          and dynamic_batch(self.reference.describe()))
        return self

    def npz_inputs(self):
        """The inputs an ``.npz`` set must fit (the primary's)."""
        return self.primary.describe().inputs

    def describe(self) -> dict:
        """Backends, tiers and noise floor, for the report."""
        return {"reference": self.reference.describe().summary(),
                "primary": self.primary.describe().summary(),
                "tiers": list(self.comparator.tiers),
                "noise_floor": self.noise_floor.as_dict() if self.noise_floor else None}

    def close(self) -> None:
        for pool in self._sides.values():
            pool.shutdown(wait=True)
        self.pair.close()

    # -- one batch ---------------------------------------------------------------------------
    def run(self, batch: Batch) -> list[RecordOutcome]:
        return self.check(self.infer(batch))

    def infer(self, batch: Batch) -> Inferred:
        return self.collect(self.submit(batch))

    def submit(self, batch: Batch) -> Submitted:
        """Check the items' inputs and hand the rest to both sides' threads; returns at once."""
        inferred = Inferred(batch)
        valid: list[ReplayItem] = []
        for item in batch.items:
            try:
                check_inputs(item.inputs, self.input_specs)
            except InferenceError as exc:
                inferred.done[item.index] = self._outcome(item, INPUT_ERROR, error=str(exc))
                continue
            valid.append(item)
        submitted = Submitted(inferred, valid)
        if len(valid) > 1 and self.stackable:
            submitted.stacked = self._both(stack([item.inputs for item in valid]))
        else:
            submitted.each = [self._both(item.inputs) for item in valid]
        return submitted

    def collect(self, submitted: Submitted) -> Inferred:
        """Wait for both sides' answers to a submitted batch."""
        result = submitted.inferred
        each = submitted.each
        if submitted.stacked is not None:
            reference, primary = (f.result() for f in submitted.stacked)
            result.stacked = self._split_stacked(submitted.items, reference, primary)
            if result.stacked is None:  # one by one, to pin an error on its item
                each = [self._both(item.inputs) for item in submitted.items]
        for item, (reference, primary) in zip(submitted.items, each):
            reference, primary = reference.result(), primary.result()
            if isinstance(reference, Exception):
                result.done[item.index] = self._outcome(item, REFERENCE_ERROR,
                                                        error=_describe(reference))
            elif isinstance(primary, Exception):
                result.done[item.index] = self._outcome(item, PRIMARY_ERROR,
                                                        error=_describe(primary))
            else:
                result.answers.append((item, reference, primary))
        return result

    def check(self, inferred: Inferred) -> list[RecordOutcome]:
        outcomes = dict(inferred.done)
        alone = list(inferred.answers)
        stacked = inferred.stacked
        if stacked is not None:
            batched = check_stacked(self.comparator, stacked.reference, stacked.primary,
                                    [it.rows for it in stacked.items])
            if all(tiers is None for tiers in batched):
                alone += stacked.split()
            else:
                answers = stacked.split() if None in batched else None
                for k, (item, tiers) in enumerate(zip(stacked.items, batched)):
                    if tiers is None:
                        alone.append(answers[k])
                    else:
                        outcomes[item.index] = self._outcome(item, CHECKED, tiers=tiers)
        for item, reference, primary in alone:
            check = self.comparator.check(reference, primary, inputs=item.inputs)
            outcomes[item.index] = self._outcome(item, CHECKED,
                                                 tiers=self.comparator.tier_reports(check))
        return [outcomes[item.index] for item in inferred.batch.items]

    def _both(self, inputs: dict[str, np.ndarray]) -> tuple[Future, Future]:
        """Futures of (reference outputs or exception, primary outputs or exception)."""
        return (self._sides["reference"].submit(_answer, self.reference, inputs),
                self._sides["primary"].submit(_answer, self.primary, inputs))

    @staticmethod
    def _split_stacked(items: list[ReplayItem], reference, primary) -> Stacked | None:
        """The stacked answers, or None when a side raised or its outputs are not per row."""
        if isinstance(reference, Exception) or isinstance(primary, Exception):
            return None
        counts = [it.rows for it in items]
        if split_rows(reference, counts) is None or split_rows(primary, counts) is None:
            return None  # outputs not per row: cannot split, run one by one
        return Stacked(items, reference, primary)

    _outcome = staticmethod(outcome_of)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class Runners:
    """One runner per model (``ModelRunner``; a generative model's ``GenerationRunner``,
    guard/replay/generation.py), built and loaded on first use. What a load leaves alive
    is frozen out of the cyclic collector until the runners close (guard/collector.py: a full
    collection over torch's objects held the interpreter lock for 300+ ms, and the reference's
    forward waits for that lock)."""

    def __init__(self, models: dict[str, ModelConfig]):
        self.models = models
        self._runners: dict[str, ModelRunner] = {}

    def get(self, name: str) -> "ModelRunner | GenerationRunner":
        runner = self._runners.get(name)
        if runner is None:
            config = self.models[name]
            kind = GenerationRunner if sample_kind(config.task) == "generation" else ModelRunner
            runner = kind(config).load()
            self._runners[name] = runner
            freeze_loaded()
        return runner

    def run(self, batch: Batch) -> list[RecordOutcome]:
        return self.get(batch.model).run(batch)

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
        thaw()
