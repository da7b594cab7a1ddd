"""The values that flow through a replay: items in, batches across, outcomes out.

They are plain picklable dataclasses on purpose: the Ray engine ships batches to worker actors
and outcomes back, and the local engine uses the very same ones, so both feed one aggregator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from guard.backends import batching
from guard.protocol.generation import GenerationSample
from guard.verify.pipeline import TierReport

# RecordOutcome.status values.
CHECKED = "checked"  # both sides answered; the tiers ran
PRIMARY_ERROR = "primary_error"  # the primary raised: counts as a failed tensor check
REFERENCE_ERROR = "reference_error"  # no truth to check against: not a check
INPUT_ERROR = "input_error"  # the record does not fit the model's inputs as configured now


@dataclass
class ReplayItem:
    """One recorded request (or one .npz sample) to replay."""

    index: int  # position in the replay, over all inputs: outcomes are merged in this order
    model: str
    inputs: dict[str, np.ndarray]
    unix_nanos: int = 0  # 0: no timestamp (.npz)
    request_id: str = ""
    source: str = ""  # file it came from
    live_passed: bool | None = None  # the sidecar's verdict when it was mirrored live
    progress: float = 0.0  # share of all input bytes read when this item was read (ETA)
    # A generative model's item (``inputs`` empty): the call, with the primary's completion to
    # score (a capture), or without one for the primary to generate first (``generate``: a
    # JSONL prompt set).
    generation: GenerationSample | None = None
    generate: bool = False

    def signature(self) -> tuple:
        """Items with equal signatures can be stacked along the first axis."""
        return batching.signature(self.inputs)

    @property
    def rows(self) -> int:
        return batching.rows(self.inputs)


@dataclass
class Batch:
    """Items of one model with one input signature, run together where the backends allow."""

    model: str
    items: list[ReplayItem]


@dataclass
class RecordOutcome:
    index: int
    model: str
    status: str
    unix_nanos: int = 0
    request_id: str = ""
    source: str = ""
    error: str = ""
    tiers: dict[str, TierReport] = field(default_factory=dict)
    live_passed: bool | None = None
    progress: float = 0.0


def outcome_of(item: ReplayItem, status: str, error: str = "", tiers=None) -> RecordOutcome:
    """The outcome of ``item`` (what an engine sends back of it)."""
    return RecordOutcome(
        index=item.index, model=item.model, status=status, unix_nanos=item.unix_nanos,
        request_id=item.request_id, source=item.source, error=error,
        tiers=tiers or {}, live_passed=item.live_passed, progress=item.progress,
    )
