"""``checks:`` and ``adapters:``: tier 1 (tensor, noise floor, fp64 arbitration), tier 2
(activation), tier 3 (task checks), and the deterministic adapters applied before them.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from guard.config.base import (
    FACTORY_REF,
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Strict,
)
from guard.config.generation import GenerationCheckConfig


class NoiseFloorConfig(Strict):
    """The reference against itself at load (batch 1 vs batched, two thread counts).

    Tier 1 then allows ``atol + rtol * max|ref| + multiplier * floor`` per output: drift is
    judged beyond the noise the reference makes on its own (Diffy's idea, for tensors).
    """

    enabled: bool = Field(True, description="Measure the floor when the model loads.")
    inputs: str | None = Field(
        None,
        description="An .npz of input arrays (batched along axis 0) to measure on; default: "
        "inputs generated from the model's signature (seeded).",
    )
    samples: PositiveInt = Field(4, description="Rows used (batch 1 each, then batched).")
    thread_counts: list[PositiveInt] = Field(
        default_factory=lambda: [1, 2],
        description="Thread counts the reference is run with; every pair is compared.",
    )
    multiplier: NonNegativeFloat = Field(
        1.0, description="How many floors tier 1 allows on top of atol + rtol * max|ref|."
    )


class ArbitrationConfig(Strict):
    """fp64 arbitration (torch._dynamo's accuracy rule) when tier 1 fails.

    A float64 run of the reference's own model is the truth; the primary is judged acceptable
    when ``err(primary) <= multiplier * err(reference) + atol / 10`` (errors: max abs vs fp64).
    Only torch references can run in fp64; for others the verdict says it was not available.
    """

    enabled: bool = Field(
        False, description="Run the fp64 arbiter on every tier-1 failure (one extra inference)."
    )
    multiplier: PositiveFloat = Field(2.0, description="m in the rule above (dynamo uses 2-3).")
    forgive: bool = Field(
        False,
        description="Count a tier-1 failure as a pass when the arbiter finds the reference, not "
        "the primary, to be the side further from fp64.",
    )


class TensorCheckConfig(Strict):
    atol: NonNegativeFloat = Field(1.0e-4, description="Absolute tolerance.")
    rtol: NonNegativeFloat = Field(
        1.0e-3, description="Relative tolerance, scaled by max|reference| of the output."
    )
    outputs: dict[str, "OutputTolerance"] = Field(
        default_factory=dict, description="Per-output overrides of atol/rtol, by output name."
    )
    noise_floor: NoiseFloorConfig = Field(default_factory=NoiseFloorConfig)
    arbitration: ArbitrationConfig = Field(default_factory=ArbitrationConfig)


class OutputTolerance(Strict):
    atol: NonNegativeFloat | None = None
    rtol: NonNegativeFloat | None = None


class ActivationCheckConfig(Strict):
    """Tier 2 (activation alignment): off unless ``sample_rate`` > 0 or ``on_failure``.

    It runs in the mirror worker after tier 1, never on the request path, on capture sessions
    of its own built from the artifacts (never the production sessions).
    """

    sample_rate: Fraction = Field(
        0.0, description="Share of compared (mirrored) samples that also get tier 2.")
    on_failure: bool = Field(
        False, description="Also run tier 2 on every tier-1 failure while the mirror queue "
        "is at most max_queue_fill full (the mirror's budget comes first).")
    max_queue_fill: Fraction = Field(
        0.5, description="on_failure runs only while queue depth / queue_size is at most this.")
    rel_error: PositiveFloat | None = Field(
        None, description="A fixed allowance on each layer's isolated relative error. Default "
        "(unset): derived per layer, the relative error tier 1 allows at the output plus "
        "checks.tensor.noise_floor.multiplier times the reference's own noise on that layer "
        "(measured as the tier-1 floor is: batch 1 vs batched, thread counts).")
    top_k: PositiveInt = Field(5, description="Suspects reported, ranked by isolated error.")
    max_isolated: PositiveInt = Field(
        64, description="Most layers re-run in isolation per sample (largest propagated error "
        "first): each is a small session of its own, built once.")
    torch_factory: str | None = Field(
        None, description="For a TorchScript or .pt2 side (Python hooks cannot see inside "
        "them): an eager 'module:factory' of the same architecture; the artifact's weights "
        "are loaded into it.")
    primary_gguf: str | None = Field(
        None, description="task generation: the GGUF file the primary's OpenAI-compatible "
        "upstream serves (relative to the config file). Tier 2 runs it in-process with "
        "llama.cpp, every node of its graph captured by llama.cpp's eval callback, against a "
        "transformers reference (docs/tier2.md#gguf); the upstream itself is never asked.")

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0 or self.on_failure

    @model_validator(mode="after")
    def _check(self) -> "ActivationCheckConfig":
        if self.torch_factory is not None and not FACTORY_REF.match(self.torch_factory):
            raise ValueError("torch_factory must be 'package.module:function'")
        return self


class ClassificationTaskConfig(Strict):
    """Top-1 agreement, top-k overlap and logit-margin flips, per row of the logits output."""

    logits_output: str | None = Field(
        None, description="Output holding logits or probabilities [..., classes]; default: "
        "'logits' when the model has it, else its only output."
    )
    top_k: PositiveInt = Field(5, description="k of the top-k overlap (capped at the classes).")
    tie_margin: NonNegativeFloat | None = Field(
        None,
        description="A flip whose reference margin (ref[top1_ref] - ref[top1_primary]) is at "
        "most this is a near-tie flip, reported apart and not counted against agreement. "
        "Default: 2 x tier 1's allowed error for the output (each logit may move by that much).",
    )
    min_top1_agreement: Fraction = Field(
        1.0, description="Pass when the share of rows without a real (beyond-margin) flip is "
        "at least this."
    )
    min_topk_overlap: Fraction = Field(
        0.0, description="Pass when the mean tie-aware top-k overlap is at least this "
        "(0: reported only)."
    )


class DetectionTaskConfig(Strict):
    """Boxes matched by IoU with class agreement; mAP of the primary against the reference."""

    boxes_output: str = Field("boxes", description="Boxes [N, 4] or [B, N, 4] as x1, y1, x2, y2.")
    scores_output: str = Field("scores", description="Scores [N] or [B, N].")
    classes_output: str | None = Field(
        "labels", description="Class ids [N] or [B, N]; when the model lacks this output the "
        "match is class-agnostic (stated in the result)."
    )
    score_threshold: float = Field(
        0.0, description="Detections scoring at most this are padding and ignored."
    )
    match_iou: Fraction = Field(0.5, description="IoU at which a primary box matches.")
    min_map: Fraction = Field(
        0.9, description="Pass when the primary's mAP (reference as ground truth) is at least this."
    )
    max_count_mismatch: int | None = Field(
        0, ge=0, description="Pass when the box counts differ by at most this per image "
        "(null: not judged)."
    )


class SegmentationTaskConfig(Strict):
    """mIoU and pixel agreement of the argmax masks."""

    mask_output: str | None = Field(
        None, description="Class scores [B, C, H, W] (argmax over class_axis) or an integer "
        "label mask; default: 'mask' when present, else the only output."
    )
    class_axis: int = Field(1, description="Axis of the class scores.")
    min_pixel_agreement: Fraction = Field(0.99, description="Share of equal pixels needed.")
    min_miou: Fraction = Field(
        0.9, description="Mean IoU over classes present on either side needed."
    )


class EmbeddingTaskConfig(Strict):
    """Cosine per vector and nearest-neighbour agreement over the batch."""

    embedding_output: str | None = Field(
        None, description="Embeddings [B, D]; default: 'embedding' when present, else the only "
        "output."
    )
    min_cosine: Fraction = Field(0.999, description="Every vector's cosine must reach this.")
    min_neighbour_agreement: Fraction = Field(
        1.0, description="Share of rows whose nearest neighbour in the batch agrees (needs a "
        "batch of 3 or more; smaller batches report it as not applicable)."
    )
    # 0.01: reduced precision moves pairwise cosine similarities by 1e-3..1e-2 (MiniLM int8
    # per-channel: a row whose two nearest reference neighbours score 0.047 and 0.045, two
    # unrelated sentences, swaps them). A lead that small is not a decision the model made.
    neighbour_tie: NonNegativeFloat = Field(
        0.01, description="Reference neighbours within this cosine similarity of the best "
        "count as tied: picking any of them is agreement."
    )


class TaskCheckConfig(Strict):
    """Tier 3 (task-level agreement). Only the block of the model's ``task`` is read; setting
    another task's block is an error. ``task: generic`` runs tier 1 only."""

    enabled: bool = Field(True, description="Run tier 3 for models whose task is not generic.")
    classification: ClassificationTaskConfig = Field(default_factory=ClassificationTaskConfig)
    detection: DetectionTaskConfig = Field(default_factory=DetectionTaskConfig)
    segmentation: SegmentationTaskConfig = Field(default_factory=SegmentationTaskConfig)
    embedding: EmbeddingTaskConfig = Field(default_factory=EmbeddingTaskConfig)


def _adapter_entry(value: Any) -> Any:
    """``name`` or ``{name: {options}}`` or ``{name: X, ...options}`` -> ``{name, options}``."""
    if isinstance(value, str):
        return {"name": value, "options": {}}
    if isinstance(value, dict) and "name" not in value and len(value) == 1:
        (name, options), = value.items()
        return {"name": name, "options": options if options is not None else {}}
    if isinstance(value, dict) and "name" in value and "options" not in value:
        return {"name": value["name"], "options": {k: v for k, v in value.items() if k != "name"}}
    return value


class AdapterConfig(Strict):
    """A deterministic post-processing adapter applied to both sides before tiers 1 and 3. Its
    name and options are checked against the adapters' own registry by the plan step
    (guard/plan/complete.py): config/ imports no check."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class ChecksConfig(Strict):
    tensor: TensorCheckConfig = Field(default_factory=TensorCheckConfig)
    generation: GenerationCheckConfig = Field(
        default_factory=GenerationCheckConfig,
        description="task: generation only: the token-level checks of a compared completion.")
    activation: ActivationCheckConfig = Field(default_factory=ActivationCheckConfig)
    task: TaskCheckConfig = Field(default_factory=TaskCheckConfig)
