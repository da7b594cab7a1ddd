"""Running batches of replay items through a model's reference and primary, and the checks.

``ModelRunner`` holds one model's backends as configured now (reference and primary, built the
way the sidecar builds them: the reference pins determinism with ``mirror.threads``) and a
``Verifier`` set up as the sidecar's ``GuardedModel`` sets up its own: ``Verifier.for_model``
with the fp64 arbiter, tier 2 when ``load_activation_tier`` finds it, and the reference's
noise floor measured at load when ``checks.tensor.noise_floor`` is on. For each batch it:

1. checks every item's inputs against the primary's signature (the data plane's own check): an
   item that does not fit is an ``input_error`` outcome;
2. stacks the items along the first axis when every input of both backends declares a dynamic
   first dimension (-1), runs the reference and the primary at the same time (the primary on a
   helper thread: both release the GIL), and splits the outputs back per item; when a stacked
   call fails, or its outputs do not split by rows, the items run one by one, so that an error
   is pinned on the item that caused it;
3. calls ``Verifier.check`` per item with its inputs (a record is one sample, as in the
   sidecar) and keeps ``Verifier.tier_reports``.

The two halves are separate methods (``infer``, then ``check``) so that an engine can overlap
them: the local engine checks batch k while batch k+1 is inferred (inference releases the GIL,
the checks mostly hold it). Whether items are stacked depends only on the batch and the
backends' signatures, so the local and the Ray engine, which run the same batches, compute the
same numbers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from guard.backends import Backend, create_backend
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.replay.items import (
    CHECKED,
    INPUT_ERROR,
    PRIMARY_ERROR,
    REFERENCE_ERROR,
    Batch,
    ReplayItem,
    SampleOutcome,
)
from guard.serve.codec import InferenceError
from guard.serve.dataplane import check_inputs
from guard.verify.arbitrate import build_arbiter
from guard.verify.noise import NoiseFloor, measure_noise_floor
from guard.verify.pipeline import Verifier, load_activation_tier


@dataclass
class Inferred:
    """A batch after inference: final outcomes (errors) and the answers still to be checked."""

    batch: Batch
    done: dict[int, SampleOutcome] = field(default_factory=dict)
    answers: list[tuple[ReplayItem, dict, dict]] = field(default_factory=list)


def _dynamic_batch(backend: Backend) -> bool:
    specs = backend.describe().inputs
    return bool(specs) and all(s.shape and s.shape[0] == -1 for s in specs)


class ModelRunner:
    def __init__(self, config: ModelConfig):
        if config.reference is None:
            raise BackendError(f"models[{config.name}]: replay needs a 'reference' backend to "
                               "check against; this model has none")
        self.name = config.name
        self.config = config
        self.verifier = Verifier.for_model(config, arbiter=build_arbiter(config))
        self.reference = create_backend(config.reference, "reference", config.mirror.threads)
        self.primary = create_backend(config.primary, "primary")
        activation = load_activation_tier(config, {"primary": self.primary,
                                                   "reference": self.reference})
        if activation is not None:
            self.verifier.add_tier(activation)
        self.noise_floor: NoiseFloor | None = None
        self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replay-{self.name}")

    def load(self) -> "ModelRunner":
        for role, backend in (("reference", self.reference), ("primary", self.primary)):
            try:
                backend.load()
            except BackendError as exc:
                raise exc.at(f"models[{self.name}].{role}") from exc
            except Exception as exc:
                spec = getattr(self.config, role)
                raise BackendError(f"models[{self.name}].{role}: cannot load "
                                   f"{spec.describe()}: {type(exc).__name__}: {exc}") from exc
        self.input_specs = {s.name: s for s in self.primary.describe().inputs}
        self.stackable = _dynamic_batch(self.primary) and _dynamic_batch(self.reference)
        if self.config.checks.tensor.noise_floor.enabled:
            try:
                floor = measure_noise_floor(self.reference, self.config.reference,
                                            self.config.checks.tensor.noise_floor)
            except Exception as exc:  # as in the sidecar: a floor that cannot be measured
                floor = NoiseFloor(skipped=f"measurement failed: {type(exc).__name__}: {exc}")
            self.noise_floor = floor
            if not floor.skipped:
                self.verifier.set_noise_floor(floor.per_output)
        return self

    def describe(self) -> dict:
        """Backends, tiers and noise floor, for the report."""
        return {"reference": self.reference.describe().summary(),
                "primary": self.primary.describe().summary(),
                "tiers": list(self.verifier.tiers),
                "noise_floor": self.noise_floor.as_dict() if self.noise_floor else None}

    def close(self) -> None:
        self._helper.shutdown(wait=True)
        self.reference.close()
        self.primary.close()

    # -- one batch ---------------------------------------------------------------------------
    def run(self, batch: Batch) -> list[SampleOutcome]:
        return self.check(self.infer(batch))

    def infer(self, batch: Batch) -> Inferred:
        result = Inferred(batch)
        valid: list[ReplayItem] = []
        for item in batch.items:
            try:
                check_inputs(item.inputs, self.input_specs)
            except InferenceError as exc:
                result.done[item.index] = self._outcome(item, INPUT_ERROR, error=str(exc))
                continue
            valid.append(item)
        if len(valid) > 1 and self.stackable:
            stacked = self._infer_stacked(valid)
            if stacked is not None:
                result.answers += stacked
                valid = []
        for item in valid:
            reference, primary = self._infer_both(item.inputs)
            if isinstance(reference, Exception):
                result.done[item.index] = self._outcome(item, REFERENCE_ERROR,
                                                        error=_describe(reference))
            elif isinstance(primary, Exception):
                result.done[item.index] = self._outcome(item, PRIMARY_ERROR,
                                                        error=_describe(primary))
            else:
                result.answers.append((item, reference, primary))
        return result

    def check(self, inferred: Inferred) -> list[SampleOutcome]:
        outcomes = dict(inferred.done)
        for item, reference, primary in inferred.answers:
            check = self.verifier.check(reference, primary, inputs=item.inputs)
            outcomes[item.index] = self._outcome(item, CHECKED,
                                                 tiers=self.verifier.tier_reports(check))
        return [outcomes[item.index] for item in inferred.batch.items]

    def _infer_both(self, inputs: dict[str, np.ndarray]):
        """(reference outputs or exception, primary outputs or exception), run concurrently."""
        primary_future = self._helper.submit(self.primary.infer, inputs)
        try:
            reference = self.reference.infer(inputs)
        except Exception as exc:  # noqa: BLE001 - reported per item
            reference = exc
        try:
            primary = primary_future.result()
        except Exception as exc:  # noqa: BLE001
            primary = exc
        return reference, primary

    def _infer_stacked(self, items: list[ReplayItem]) -> list[tuple] | None:
        names = list(items[0].inputs)
        stacked = {n: np.concatenate([it.inputs[n] for it in items], axis=0) for n in names}
        reference, primary = self._infer_both(stacked)
        if isinstance(reference, Exception) or isinstance(primary, Exception):
            return None
        rows = [it.rows for it in items]
        total = sum(rows)
        outputs = list(reference.values()) + list(primary.values())
        if any(np.ndim(a) == 0 or np.shape(a)[0] != total for a in outputs):
            return None  # outputs not per row: cannot split, run one by one
        bounds = np.cumsum([0, *rows])
        return [
            (item, {n: a[bounds[k]:bounds[k + 1]] for n, a in reference.items()},
             {n: a[bounds[k]:bounds[k + 1]] for n, a in primary.items()})
            for k, item in enumerate(items)
        ]

    @staticmethod
    def _outcome(item: ReplayItem, status: str, error: str = "", tiers=None) -> SampleOutcome:
        return SampleOutcome(
            index=item.index, model=item.model, status=status, unix_nanos=item.unix_nanos,
            request_id=item.request_id, source=item.source, error=error,
            tiers=tiers or {}, live_passed=item.live_passed, progress=item.progress,
        )


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class Runners:
    """One ``ModelRunner`` per model, built and loaded on first use."""

    def __init__(self, models: dict[str, ModelConfig]):
        self.models = models
        self._runners: dict[str, ModelRunner] = {}

    def get(self, name: str) -> ModelRunner:
        runner = self._runners.get(name)
        if runner is None:
            runner = ModelRunner(self.models[name]).load()
            self._runners[name] = runner
        return runner

    def run(self, batch: Batch) -> list[SampleOutcome]:
        return self.get(batch.model).run(batch)

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
