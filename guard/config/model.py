"""One ``models:`` entry: its backends, mirror, checks, policy and capture, and the checks across
them that the schema alone answers (what a backend, a tier or the repair can do the plan step
checks: guard/plan/).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from guard.config.backend import BackendConfig
from guard.config.base import Fraction, PositiveFloat, PositiveInt, Strict, Task
from guard.config.capture import CaptureConfig
from guard.config.checks import AdapterConfig, ChecksConfig, _adapter_entry
from guard.config import generation
from guard.config.policy import PolicyConfig


class MirrorConfig(Strict):
    sample_rate: Fraction = Field(
        0.05,
        description="Share of requests mirrored onto the reference. With a request id, the "
        "decision is a keyed hash of the id (server.sampling_key_file), so replicas that share the "
        "key agree on which requests are mirrored and clients cannot choose.",
    )
    queue_size: PositiveInt = Field(
        64, description="Samples waiting for the reference; a full queue drops and counts."
    )
    queue_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Bytes of samples (inputs and answers) waiting for the reference, in the "
        "verifier process: past it a sample is dropped and counted, whatever queue_size says.",
    )
    timeout_s: PositiveFloat = Field(
        5.0, description="Longest wait for one reference (or probe) inference."
    )
    threads: PositiveInt = Field(
        1, description="CPU threads the reference may use (its intra-op thread pool)."
    )
    # 64: a small model's fixed cost per call (dispatch, a thread's wake-up, Python per sample)
    # is amortised well before that (docs/configuration.md#batched-checking); a larger batch only
    # holds more samples in hand at once.
    max_batch: PositiveInt = Field(
        64, description="Most samples the verifier checks in one go, out of those waiting: one "
        "reference forward over the stacked inputs of same-shaped samples where every input "
        "the reference declares has a dynamic first dimension (else one call per sample), "
        "tiers 1 and 3 over the batch at once, detectors fed in arrival order. 1: one by one. "
        "Tensor models only: a generation model scores one completion at a time."
    )
    # 10: under contention a nice-10 thread gets ~1/10 of a nice-0 one's CPU share (Linux CFS
    # weights 110 vs 1024), so the request path keeps its cores; idle CPU still goes to it.
    nice: int = Field(
        10, ge=0, le=19, description="Niceness added to the mirror's threads (reference "
        "call, checks) and to an op repair's, on Linux: they yield the CPU to the request "
        "path. A mirror that cannot keep up then drops samples (counted) instead of slowing "
        "clients. 0: off."
    )


# A model name becomes a folder name (capture.dir/<name>/): no '/', no '..', no leading dot.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def _model_name(value: str) -> str:
    if not MODEL_NAME.fullmatch(value):
        raise ValueError(
            f"model name {value!r} must start with a letter or digit and hold only letters, "
            "digits, '_', '.' and '-' (at most 128 characters): it names the model's capture "
            "folder")
    return value


class ModelConfig(Strict):
    name: Annotated[str, AfterValidator(_model_name)] = Field(
        description="The model_name clients send; also the name of the model's capture folder: "
        "letters, digits, '_', '.', '-', starting with a letter or digit.")
    task: Task = "generic"
    tap: bool = Field(
        False, description="true: this model's own server answers its clients and "
        "reports each answer to guard over guard.v1.Tap (server.tap's listener); guard never "
        "answers it (ModelInfer for it is FAILED_PRECONDITION). false: guard answers it in the "
        "path and Tap/Observe for it is refused, so that nobody else can feed its detectors.")
    primary: BackendConfig
    reference: BackendConfig | None = Field(
        None, description="The trusted backend that sampled requests are mirrored onto."
    )
    fallback: BackendConfig | None = Field(
        None, description="Where traffic goes when the policy switches the model."
    )
    mirror: MirrorConfig = Field(default_factory=MirrorConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    adapters: list[Annotated[AdapterConfig, BeforeValidator(_adapter_entry)]] = Field(
        default_factory=list,
        description="Deterministic adapters applied, in order, to both sides' outputs before "
        "tiers 1 and 3: stable_nms, tie_aware_topk, canonical_order, float64_softmax.",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    capture: CaptureConfig | None = Field(
        None, description="Record sampled traffic for offline replay; off when absent."
    )

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        problems = generation.model_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        self.policy = generation.with_task_defaults(self.policy, self.task)
        if self.policy.uses("fallback_model") and self.fallback is None:
            raise ValueError("policy.action 'fallback_model' needs a 'fallback' backend")
        if self.policy.uses("fallback_ops"):
            if self.fallback is None or self.reference is None:
                raise ValueError("policy.action 'fallback_ops' needs a 'reference' (to find "
                                 "and validate the ops) and a 'fallback' (served meanwhile)")
        if self.capture is not None and self.capture.mode == "failures" and (
            self.reference is None or self.mirror.sample_rate == 0
        ):
            raise ValueError("capture.mode 'failures' needs a 'reference' and "
                             "mirror.sample_rate > 0 (failures are found by the mirror)")
        other = sorted(
            block for block in self.checks.task.model_fields_set
            if block in ("classification", "detection", "segmentation", "embedding")
            and block != self.task
        )
        if other:
            raise ValueError(
                f"checks.task.{other[0]} is set but the model's task is '{self.task}'"
            )
        policy = self.policy
        if (policy.false_alarms_per_day is not None and policy.detector != "window"
                and self.mirror.sample_rate > 0
                and policy.arl0_for(self.mirror.sample_rate) <= 2.0):
            raise ValueError(
                "policy.false_alarms_per_day: fewer compared samples per day "
                "(expected_rps x mirror.sample_rate x 86400) than allowed false alarms")
        if self.checks.activation.enabled:
            if self.reference is None:
                raise ValueError("checks.activation needs a 'reference' backend to compare with")
        return self

    def activation_primary(self) -> BackendConfig:
        """The block tier 2 captures as the primary: the primary itself, or for a generation
        model the GGUF its upstream serves (``checks.activation.primary_gguf``), run by
        llama.cpp in-process."""
        gguf = self.checks.activation.primary_gguf
        if gguf is None:
            return self.primary
        spec = BackendConfig(backend="llama_cpp", path=gguf)
        spec.context = self.primary.context
        return spec
