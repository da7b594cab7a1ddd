"""``capture:``: recording sampled traffic for ``guard replay``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from guard.config.base import Fraction, PositiveFloat, PositiveInt, Strict


class CaptureConfig(Strict):
    """Recording of sampled traffic to segment files for ``guard replay`` (guard/capture/)."""

    dir: str = Field(
        description="Folder for segment files (relative to the config file); each model writes "
        "into its own subfolder '<dir>/<model name>/', so models may share a dir."
    )
    mode: Literal["all", "failures"] = Field(
        "all",
        description="all: record a sample of every request (mirrored ones carry the reference's "
        "answer and the verdicts). failures: record only mirrored samples that failed a check.",
    )
    sample_rate: Fraction = Field(
        1.0,
        description="Share of requests (mode all) or of failing samples (mode failures) "
        "recorded, independent of mirror.sample_rate. With a request id the decision is the "
        "mirror's hash of the id: at a capture rate <= the mirror rate every recorded request "
        "was also mirrored, and replicas agree.",
    )
    queue_size: PositiveInt = Field(
        1024,
        description="Records waiting for the writer thread, which writes in bursts about every "
        "10 ms; a full queue drops and counts.",
    )
    queue_bytes: PositiveInt = Field(
        256 * 1024 * 1024,
        description="Bytes of tensors (inputs, answers, reference answers) in records waiting "
        "for the writer: past it a record is dropped and counted, whatever queue_size says.",
    )
    max_segment_bytes: PositiveInt = Field(
        64 * 1024 * 1024, description="A segment file is closed and a new one opened past this."
    )
    max_segment_age_s: PositiveFloat = Field(
        600.0, description="A segment file older than this is closed (even when idle)."
    )
    max_total_bytes: PositiveInt = Field(
        1024 * 1024 * 1024,
        description="Disk cap for the model's capture folder: past it the oldest segments are "
        "deleted first (guard_capture_segments_deleted_total).",
    )

    @model_validator(mode="after")
    def _check(self) -> "CaptureConfig":
        if self.max_segment_bytes > self.max_total_bytes:
            raise ValueError("max_segment_bytes must not exceed max_total_bytes")
        return self
