"""``task: generation``: the generation tier's thresholds (``checks.generation``), the policy
defaults of the task, and the checks of a generation model block, kept together in one place
(they move as one when tiers become plug-ins).

The figures behind the defaults (SmolLM2-135M-Instruct against its fp32 reference, guard's mean
KLD per token over 10 prompts x 32 tokens from top-20 logprobs, benchmarks/llm_ladder.py): F16
0.0000036, Q4_1 0.00303, Q8_0 0.00461, Q2_K 0.519 nats. The detector's in-control bound (0.4 x
0.05 = 0.02 nats) sits ~4x above the worst agreeing primary and ~25x below Q2_K.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from guard.config.base import Fraction, NonNegativeFloat, PositiveFloat, PositiveInt, Strict

if TYPE_CHECKING:
    from guard.config.model import ModelConfig
    from guard.config.policy import PolicyConfig

TASK = "generation"

# Policy defaults of task generation (fields the model's policy block leaves unset). A detector
# sample is a compared completion: tens of tokens, each with its own KLD, so far fewer are
# needed than pass/fail bits of a tensor model (min_samples 20 there). ARL0 stays the shared
# 1e5: the targets hold without lowering it.
POLICY_DEFAULTS: dict[str, Any] = {"min_samples": 5}


class GenerationCheckConfig(Strict):
    """The generation tier (guard/verify/generation/): the token-level checks of a compared
    completion, and what the detector accumulates.

    The tier compares per token where the primary returned logprobs (mean KLD estimated from
    its returned top-k: the lumped bound plus the tail's correction), tests greedy calls
    against the reference's argmax where its margin is beyond the noise floor, and turns a
    sampled call into a z-score under the sampling transform the server applied. Each mode's
    verdict has a threshold below. The detector does not read the verdict: it accumulates each
    completion's statistic over its mode's threshold (1 = the failing level; KLD / max_mean_kld,
    flips / max_greedy_disagreement, z^2 / max_abs_z^2) as an e-CUSUM against ``in_control_ratio``:
    ``S = max(0, S + ln(1 + bet x (score / in_control_ratio - 1)))``, alarm at
    ``S >= ln(ARL0)``. Each factor has expectation <= 1 while the primary's mean score is at
    most ``in_control_ratio`` (scores are never negative and bet < 1), so ARL0 holds as for the
    Bernoulli CUSUM (guard/policy/detector.py ``ScoreCusum``), with far fewer samples needed:
    a continuous figure per completion carries more evidence than a pass/fail bit.
    """

    max_mean_kld: PositiveFloat = Field(
        0.05, description="logprobs mode: a completion fails when its mean KLD per token "
        "(nats, KL(primary || reference) estimated from the primary's top-k logprobs) exceeds "
        "this (SmolLM2 Q8_0: 0.005, Q2_K: 0.5).")
    max_abs_z: PositiveFloat = Field(
        4.0, description="sampled mode (no logprobs, temperature above "
        "near_greedy_temperature): a completion fails "
        "when |z| of its surprise under the reference exceeds this (N(0, 1) over many tokens "
        "when they agree) and Chernoff's bound on the chance of such a sum under agreement is "
        "at most exp(-max_abs_z^2 / 2) (over a few tokens z is far from normal).")
    margin_floor: NonNegativeFloat = Field(
        1.0, description="Reference margin (nats, top-1 minus top-2 logprob) above which an "
        "argmax flip is not kernel noise (greedy mode, and the first divergent token).")
    max_greedy_disagreement: Fraction = Field(
        0.05, description="greedy mode (no logprobs, temperature up to near_greedy_temperature): "
        "a completion fails when "
        "more of its confident positions than this left the reference's argmax.")
    near_greedy_temperature: NonNegativeFloat = Field(
        0.1, description="A call sampled at this temperature or below (or with top_k 1) is "
        "checked as greedy decoding: wherever the reference's margin exceeds margin_floor the "
        "server takes its argmax but for a chance of e^(-margin_floor / temperature) (5e-5 "
        "at 0.1), while the z of the sampled mode would read kernel noise, amplified by "
        "1 / temperature, as drift (a healthy Q8_0 primary at temperature 0.05: |z| beyond "
        "max_abs_z in about 1 completion of 16).")
    support_epsilon: Fraction = Field(
        0.05, description="sampled mode: weight of the untransformed distribution in the "
        "surprise (keeps a token the transform excludes finite).")
    min_tokens: PositiveInt = Field(
        1, description="Completions with fewer compared positions are not comparable "
        "(counted, never scored).")
    prompt_rendering: Literal["must_match", "server"] = Field(
        "must_match", description="Where the primary's server returns the prompt's token ids "
        "(vLLM, sample_token_ids), they are compared with the reference's own rendering of the "
        "same messages or text (the model's chat template and tokenizer). 'must_match': a "
        "difference is chat template or tokenizer drift (another --chat-template, an engine "
        "upgrade, a client's template): finding prompt_rendered_otherwise, the completion "
        "fails. 'server': the server's rendering is the intended one; the difference is "
        "reported, not failed. The completion is scored on the server's ids either way.")
    in_control_ratio: Fraction = Field(
        0.4, description="The detector's null: the mean score of a primary that agrees is at "
        "most this share of the failing level (a mean KLD of 0.02 nats at max_mean_kld 0.05); "
        "ARL0 (policy.arl0) is promised for any such primary. In (0, 1).")
    bet: float = Field(
        0.5, gt=0.0, lt=1.0, description="The detector's bet in (0, 1): larger reaches the "
        "threshold in fewer completions on a large drift and falls back faster on an agreeing "
        "one (an agreeing completion takes at most -ln(1 - bet) off the statistic).")

    @model_validator(mode="after")
    def _check(self) -> "GenerationCheckConfig":
        if not 0.0 < self.in_control_ratio < 1.0:
            raise ValueError("in_control_ratio must be in (0, 1): the detector's null lies "
                             "below the level at which one completion fails")
        return self


def with_task_defaults(policy: "PolicyConfig", task: str) -> "PolicyConfig":
    """``policy`` with the task's own defaults for the fields it leaves unset."""
    if task != TASK:
        return policy
    unset = {k: v for k, v in POLICY_DEFAULTS.items() if k not in policy.model_fields_set}
    if not unset:
        return policy
    if "min_samples" in unset and unset["min_samples"] > policy.window:
        unset.pop("min_samples")
    return policy.model_copy(update=unset)


def model_problems(model: "ModelConfig") -> list[str]:
    """Why a model block cannot run as ``task: generation`` (or why a tensor model names
    generation-only parts), as ``dotted.path: message`` lines relative to the model. Which
    backends serve or score an LLM their declarations say: the plan step checks the roles
    (guard/plan/serving.py, ``BackendKind.llm``)."""
    if model.task != TASK:
        problems = []
        if "generation" in model.checks.model_fields_set:
            problems.append(f"checks.generation: is set but the model's task is '{model.task}'")
        if model.checks.activation.primary_gguf is not None:
            problems.append("checks.activation.primary_gguf: names what a generation model's "
                            f"upstream serves; the model's task is '{model.task}'")
        return problems
    problems = []
    for block in ("tensor", "task"):
        if block in model.checks.model_fields_set:
            problems.append(f"checks.{block}: tensor checks do not apply to a generation model "
                            "(its checks are checks.generation)")
    activation = model.checks.activation
    if activation.enabled and activation.primary_gguf is None:
        problems.append("checks.activation: tier 2 of a generation model captures the GGUF "
                        "its upstream serves: set checks.activation.primary_gguf to that file")
    if model.adapters:
        problems.append("adapters: tensor adapters do not apply to a generation model")
    if model.policy.uses("fallback_ops"):
        problems.append("policy.action: 'fallback_ops' rebuilds a tensor model's ops; a "
                        "generation model switches with 'fallback_model' (or 'alert')")
    if model.tap:
        problems.append("tap: a generation model is observed on guard's HTTP edge, not Tap")
    if "max_batch" in model.mirror.model_fields_set:
        problems.append("mirror.max_batch: a generation model scores one completion at a time "
                        "(one reference pass already covers its tokens: nothing to stack); "
                        "max_batch applies to tensor models")
    return problems
