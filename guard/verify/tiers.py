"""The checks' one protocol and one registry: a tier is one module plus one registration line.

A tier judges one sample (a mirrored request, a replayed record, a swept cell) from what it is
handed: both sides' answers, the inputs, and the results of the tiers that ran before it on the
same sample. It returns a result with ``passed`` and ``summary()`` (and ``as_dict()`` for the
capture record and the replay report), or None when it does not run on this sample (tier 2 runs
on a sub-sample). A result may carry ``statistic``, a continuous per-sample figure (a
per-completion KLD, a z-score) for the detector beside the pass/fail.

What a tier *is* its module declares once, as ``TIER = TierKind(...)`` (no heavy imports at
module level); ``TIER_MODULES`` below is the one registration (name -> module), read lazily, in
the order the tiers run. Whatever iterates tiers reads this table: the ``Comparator``
(guard/verify/pipeline.py), the verifier's metrics labels and detectors
(guard/verifier_process/model.py), the replay report's sections (guard/replay/), the matrix
(guard/matrix/). The ``name`` is the ``tier`` label of the metrics and the key of the report's
``tiers`` (CONTRACT.md): ``tensor``, ``task``, ``activation``, ``generation``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol

if TYPE_CHECKING:
    from guard.config import ChecksConfig, ModelConfig


# What a sample is: a tensor model's named outputs, or a generative model's sampled call
# (guard/protocol/generation.py: ``GenerationSample`` and the reference's per-token scores).
SampleKind = Literal["tensors", "generation"]


def sample_kind(task: str) -> SampleKind:
    """The kind of sample a model's tiers judge, from its ``task``."""
    return "generation" if task == "generation" else "tensors"


class TierResult(Protocol):
    @property
    def passed(self) -> bool: ...

    # A line, or evidence its kind's ``TierKind.summary`` turns into one (tier 2's dict).
    def summary(self) -> object: ...


@dataclass
class Compared:
    """What a tier is handed for one sample. ``reference``/``primary``: both sides' answers
    (for a tensor model the named output arrays after the adapters; for a generative model the
    sampled call, guard/protocol/generation.py); ``inputs``: the request's inputs when known;
    ``results``: the tiers already run on this sample, by name; ``notes``: lines a tier adds to
    the sample's result (why it did not run)."""

    reference: Any
    primary: Any
    inputs: Any = None
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # why a tier did not run (the result's notes)


class TierFigures(Protocol):
    """A tier's per-model replay figures (``TierKind.figures``)."""

    def add(self, report: Any, where: Mapping[str, Any] | None = None) -> None: ...

    def as_dict(self) -> dict[str, Any]: ...


class Tier(Protocol):
    """One model's instance of a tier (built by its kind's ``build``)."""

    name: str

    def check(self, sample: Compared) -> TierResult | None: ...


@dataclass
class TierSetup:
    """What a tier is built from: a model's checks and task, the whole model block when the
    caller has one (the verifier, replay; a bare comparator of a sweep has none) and its built
    backends (tier 2 builds capture sessions beside them)."""

    checks: "ChecksConfig"
    task: str = "generic"
    model: "ModelConfig | None" = None
    backends: dict | None = None


@dataclass(frozen=True)
class TierKind:
    """One tier, declared in its own module as ``TIER``.

    - ``name``: the ``tier`` label value and the report's key.
    - ``takes``: the kind of sample it judges (``tensors``; ``generation``: a sampled LLM
      call), or a tuple of kinds; a model runs the registered tiers that take its kind of
      sample.
    - ``build``: ``(TierSetup) -> Tier | None``; None: this model does not run the tier.
    - ``detector``: its per-sample failures feed the route detectors (False: evidence only, as
      tier 2's, which runs on a biased sub-sample: failures).
    - ``details``: ``(result) -> dict``, what the capture record and the replay report keep of
      one result (default: its ``as_dict()``); ``summary``: ``(result, details) -> str`` when the
      result's own ``summary()`` is not a line.
    - ``figures``: ``() -> figures``, the per-model replay figures of this tier: ``add(report,
      where)`` for each sample's ``TierReport`` in record order (``where``: the record's
      ``index``, ``request_id``, ``source``, ``unix_nanos``), ``as_dict()`` merged into the
      report's section (e.g. the generation tier's mean_kld, kld_p99); None: counts only.
    """

    name: str
    build: Callable[[TierSetup], Tier | None]
    takes: SampleKind | tuple[SampleKind, ...] = "tensors"
    detector: bool = True
    details: Callable[[Any], dict] | None = None
    summary: Callable[[Any, dict], str] | None = None
    figures: Callable[[], TierFigures] | None = None

    def judges(self, samples: SampleKind) -> bool:
        """Whether it takes this kind of sample."""
        takes = (self.takes,) if isinstance(self.takes, str) else self.takes
        return samples in takes


# The one registration, in the order the tiers run on a sample (a later tier reads the earlier
# ones' results: task reads tier 1's allowed errors, activation whether they, or a completion's
# generation check, failed).
TIER_MODULES: dict[str, str] = {
    "tensor": "guard.verify.tensor",
    "task": "guard.verify.task",
    "generation": "guard.verify.generation",
    "activation": "guard.verify.activation.tier",
}


def register_tier(name: str, module: str) -> None:
    """Add a tier from outside the tree (a plug-in, a test): ``module`` declares ``TIER``."""
    TIER_MODULES[name] = module


def tier_kind(name: str) -> TierKind:
    """The declaration of tier ``name`` (KeyError for a name nobody registered)."""
    return importlib.import_module(TIER_MODULES[name]).TIER


def tier_names() -> tuple[str, ...]:
    """Every registered tier, in run order (imports nothing)."""
    return tuple(TIER_MODULES)


def tier_kinds() -> list[TierKind]:
    return [tier_kind(name) for name in TIER_MODULES]


def detector_tiers(tiers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``tiers`` whose failures feed the detectors."""
    return tuple(t for t in tiers if tier_kind(t).detector)
