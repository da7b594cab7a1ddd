"""``policy:``: detectors, route hysteresis, the action (per tier: ``policy.actions``), and the op
repair (``policy.repair``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from guard.config.base import (
    Action,
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Strict,
    _percent,
)


class RepairConfig(Strict):
    """``action: fallback_ops``: how the guard searches for the ops to keep back."""

    buffer: PositiveInt = Field(
        32, description="Recent mirrored inputs kept in memory: suspects are found on the "
        "failing ones, every candidate is validated on all of them.")
    buffer_bytes: PositiveInt = Field(
        64 * 1024 * 1024, description="Bytes of inputs the buffer may hold: past it the oldest "
        "samples are let go, whatever buffer says.")
    suspect_samples: PositiveInt = Field(
        4, description="Failing buffered samples tier 2 runs on to rank the suspects.")
    min_isolated_error: NonNegativeFloat = Field(
        0.001, description="Suspects whose isolated relative error is below this are ignored.")
    max_ops: PositiveInt = Field(16, description="Most candidate ops the search starts from.")
    max_candidates: PositiveInt = Field(
        24, description="Most variants rebuilt and validated in one repair.")
    budget_s: PositiveFloat = Field(
        300.0, description="Wall-clock budget of one repair; past it the best passing variant "
        "found so far is used, or the whole-model fallback stays.")
    max_failure_share: Fraction = Field(
        0.0, description="Share of buffered samples a candidate may fail (tier 1 and 3) and "
        "still be accepted.")
    # 1: the fallback serves while the repair runs, and ONNX Runtime's own default would spin
    # a thread per core for every candidate session.
    threads: PositiveInt = Field(
        1, description="Intra-op threads of each candidate session while it is validated "
        "(ONNX Runtime primaries; torch's thread pool is process-wide and TensorRT runs on "
        "the GPU): the repair's CPU budget beside the fallback that serves meanwhile. The "
        "variant that passes is loaded again with the primary's own options and validated "
        "once more before it serves.")


class PolicyConfig(Strict):
    """When to switch a model to its fallback, and when to switch it back.

    The trigger is a detector per tier on the stream of per-sample failures. ``cusum`` (the
    default) is a one-sided Bernoulli CUSUM from the in-control failure rate p0 to the alarm
    rate p1 with threshold h = ln(ARL0): on average at least ARL0 compared samples pass
    between false alarms. ``e_detector`` is its variant for when p0 is only known as an upper
    bound and the alarm rate is unknown (a mixture over several). ``window`` is the v0 rule
    (failing share of the last ``window`` samples over ``trip_ratio``). Recovery is decided by
    a second detector with a lower rate, on probes of the primary.
    """

    action: Action = Field(
        "alert",
        description="What a tier's trip does (every tier not named in actions). alert: "
        "report only. fallback_model: route the model to its fallback "
        "while the detector says it drifts. fallback_ops: route to the fallback, find the ops "
        "that drift (tier 2), rebuild the primary with them kept back at reference precision "
        "and route back to it. Primaries it can rebuild: onnxruntime int8/fp16 (ONNX nodes, "
        "nodes_to_exclude), torch_compile fp32/fp16/bf16 with a torch reference (submodules "
        "run eagerly in fp32, eager_fp32_modules), tensorrt int8/fp16 (layers pinned to fp32, "
        "fp32_layers).",
    )
    actions: dict[str, Action] = Field(
        default_factory=dict,
        description="Per tier, the action taken when that tier's detector trips, for the "
        "tiers where it differs from action (the default of every tier not named here). "
        "{tensor: alert, task: fallback_model}: tensor drift is reported and clients keep the "
        "primary's answers; the fallback serves once the task tier (what clients see: top-1, "
        "masks, boxes) drifts. Keys: tiers whose failures feed the detectors (tensor, task, "
        "generation). While the fallback serves, only the tiers that switch decide when the "
        "primary is back.")
    repair: RepairConfig = Field(default_factory=RepairConfig)
    detector: Literal["cusum", "e_detector", "window"] = Field(
        "cusum", description="The trip/recovery rule: cusum, e_detector or window.")
    min_samples: PositiveInt = Field(
        20, description="No decision on fewer samples than this, for every detector: neither "
        "a trip nor a recovery until the detector has taken this many compared samples since "
        "it (re)started: at a route change, a manual override, a dry-run report, the re-arm "
        "after an alert, and once burn_in has measured p0. The detector's statistic moves "
        "from the first sample; only the decision waits.")
    # -- sequential detectors (cusum, e_detector) --
    arl0: PositiveFloat | None = Field(
        None, description="Expected compared samples between false alarms, per tier "
        "(threshold h = ln(arl0)). Default 1e5 unless false_alarms_per_day is given.")
    threshold: Literal["exact", "bound"] = Field(
        "exact", description="cusum threshold: exact = the smallest h whose in-control ARL "
        "(Markov chain of the CUSUM at p0) is at least arl0; bound = ln(arl0), which keeps the "
        "promise for any CUSUM but raises ~100x fewer false alarms than asked, and detects "
        "later. The e_detector always uses ln(arl0) (its p0 is only a bound).")
    false_alarms_per_day: PositiveFloat | None = Field(
        None, description="Instead of arl0: false alarms per day, converted to arl0 through "
        "expected_rps x mirror.sample_rate x 86400 compared samples per day.")
    expected_rps: PositiveFloat | None = Field(
        None, description="Requests per second the model is expected to serve (only with "
        "false_alarms_per_day).")
    p0: Fraction | None = Field(
        None, description="In-control failure rate. Unset: measured during burn_in (primary "
        "vs reference, one-sided Wilson upper bound at 90%), clipped to [p0_min, p0_max].")
    p0_min: Fraction = Field(0.001, description="Floor of a measured p0.")
    p0_max: Fraction = Field(
        0.05, description="Ceiling of a measured p0, and the p0 used during burn-in (a model "
        "broken from the start still trips during its burn-in).")
    burn_in: PositiveInt = Field(
        500, description="Compared samples on the primary that measure p0 when it is unset.")
    shift: PositiveFloat = Field(
        0.02, description="Alarm rate p1 = p0 + shift (cusum), or the base of the mixture of "
        "alarm rates (e_detector).")
    p1: Fraction | None = Field(None, description="Pin the cusum alarm rate instead of shift.")
    recover_rate: Fraction | None = Field(
        None, description="Failure rate of probes at which the primary counts as recovered "
        "(the recovery detector tests it against p1). Default: p0.")
    recover_arl0: PositiveFloat = Field(
        1000.0, description="Expected probes of a still-drifting primary between false "
        "recoveries (recovery threshold = ln(recover_arl0)).")
    # -- window detector --
    window: PositiveInt = Field(100, description="Compared samples kept per tier.")
    trip_ratio: Fraction = Field(
        0.2, description="window: switch to the fallback when the failing share exceeds this."
    )
    recover_ratio: Fraction = Field(
        0.05,
        description="window: switch back when the failing share of fresh probe samples is at "
        "most this (lower than trip_ratio: hysteresis).",
    )
    # -- dwell and rollout --
    dwell_s: NonNegativeFloat = Field(
        30.0,
        description="Minimum time on the fallback before the primary is probed again. It "
        "grows with repeated trips (dwell_s x trips, Envoy's ejection rule), up to max_dwell_s; "
        "each dwell_s spent healthy on the primary takes one trip off the count.",
    )
    max_dwell_s: NonNegativeFloat | None = Field(
        None, description="Cap of the growing dwell; default 10 x dwell_s (Envoy's 30 s base "
        "and 300 s cap). Set it equal to dwell_s for a fixed dwell.")
    primary_dwell_s: NonNegativeFloat = Field(
        0.0, description="Minimum time on the primary after routing back before it may trip "
        "again (the detector keeps counting meanwhile).")
    dry_run_percent: Annotated[float, AfterValidator(lambda v: _percent(v))] = Field(
        0.0, description="Share (0-100) of trips that are evaluated and reported (event "
        "drift_dry_run) but not enforced: a way to roll the policy out.")

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        for tier in self.actions:
            if not tier.isidentifier():
                raise ValueError(f"actions: '{tier}' is not a tier name (tensor, task, "
                                 "generation)")
        if self.recover_ratio > self.trip_ratio:
            raise ValueError("recover_ratio must not exceed trip_ratio (hysteresis)")
        if self.min_samples > self.window:
            raise ValueError("min_samples must not exceed window")
        if self.arl0 is not None and self.false_alarms_per_day is not None:
            raise ValueError("give arl0 or false_alarms_per_day, not both")
        if (self.false_alarms_per_day is None) != (self.expected_rps is None):
            raise ValueError("false_alarms_per_day and expected_rps go together")
        if self.arl0 is not None and self.arl0 <= 1:
            raise ValueError("arl0 must be > 1 (samples between false alarms)")
        if self.p0_min > self.p0_max:
            raise ValueError("p0_min must not exceed p0_max")
        if self.p0 is not None and not 0 < self.p0 < 1:
            raise ValueError("p0 must be in (0, 1)")
        if self.p0_min <= 0 or self.p0_max >= 1:
            raise ValueError("p0_min and p0_max must be in (0, 1)")
        if self.p1 is not None:
            low = self.p0 if self.p0 is not None else self.p0_max
            if not low < self.p1 < 1:
                raise ValueError(
                    f"p1 must be in ({low}, 1): above p0 (or p0_max while p0 is measured)")
        if self.recover_rate is not None and self.p1 is not None and self.recover_rate >= self.p1:
            raise ValueError("recover_rate must be below p1 (hysteresis)")
        if self.max_dwell_s is not None and self.dwell_s > self.max_dwell_s:
            raise ValueError("dwell_s must not exceed max_dwell_s")
        return self

    def action_for(self, tier: str) -> Action:
        """What a trip of ``tier``'s detector does: its entry in ``actions``, else ``action``."""
        return self.actions.get(tier, self.action)

    def uses(self, action: Action) -> bool:
        """Whether a trip of some tier may take ``action`` (what it needs must be there: a
        fallback, a reference the repair can capture)."""
        return action == self.action or action in self.actions.values()

    @property
    def dwell_cap_s(self) -> float:
        return self.max_dwell_s if self.max_dwell_s is not None else 10.0 * self.dwell_s

    def arl0_for(self, sample_rate: float) -> float:
        """ARL0 in compared samples: given, or converted from false alarms per day."""
        if self.false_alarms_per_day is not None and self.expected_rps is not None:
            per_day = self.expected_rps * sample_rate * 86400.0
            return max(per_day / self.false_alarms_per_day, 2.0)
        return self.arl0 if self.arl0 is not None else 1.0e5
