"""``task: generation``: the generation tier's thresholds (``checks.generation``), the policy
defaults of the task, and the checks of a generation model block, kept together in one place
(they move as one when tiers become plug-ins).

The figures behind the defaults (SmolLM2-135M-Instruct against its fp32 reference, mean KLD per
token over 10 prompts x 32 tokens, STACK.md): F16 0.00000, Q4_1 0.00285, Q8_0 0.00415, Q2_K
0.454 nats. The in-control bound sits ~5x above the worst agreeing primary and ~20x below Q2_K.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from guard.config.base import Fraction, PositiveFloat, Strict

if TYPE_CHECKING:
    from guard.config.model import ModelConfig
    from guard.config.policy import PolicyConfig

TASK = "generation"
PRIMARY_BACKENDS = ("openai",)  # an OpenAI-compatible upstream guard forwards to
REFERENCE_BACKENDS = ("transformers", "llama_cpp", "openai")  # teacher-forcing scorers
# Backends that only make sense for a generation model (a tensor model cannot use them).
GENERATION_ONLY = frozenset({"openai", "transformers", "llama_cpp"})

# Policy defaults of task generation (fields the model's policy block leaves unset). A detector
# sample is a compared completion: tens of tokens, each with its own KLD, so far fewer are
# needed than pass/fail bits of a tensor model (min_samples 20 there). ARL0 stays the shared
# 1e5: the targets hold without lowering it.
POLICY_DEFAULTS: dict[str, Any] = {"min_samples": 5}


class GenerationCheckConfig(Strict):
    """The generation tier (token-level checks of a compared completion).

    Each compared completion gives its mean KLD per token (reference || primary, over the
    primary's returned top-k with the tail mass) and the share of positions whose top-1 agrees.
    ``max_mean_kld`` and ``min_top1_agreement`` make the per-completion pass/fail verdict
    (guard_checks_total, guard_drift_ratio). The detector does not read the verdict: it
    accumulates the mean KLD itself (a continuous statistic carries far more evidence per
    completion than one bit), as an e-CUSUM against ``in_control_kld``:
    ``S = max(0, S + ln(1 + bet x (kld / in_control_kld - 1)))``, alarm at ``S >= ln(ARL0)``.
    Each factor has expectation <= 1 whenever the primary's mean KLD is at most
    ``in_control_kld`` (KLD is never negative and bet < 1), so ARL0 holds as for the Bernoulli
    CUSUM (guard/policy/detector.py ``ScoreCusum``).
    """

    max_mean_kld: PositiveFloat = Field(
        0.1, description="A completion fails when its mean KLD per token (nats) exceeds this "
        "(Q8_0 of SmolLM2: 0.004, Q2_K: 0.45).")
    min_top1_agreement: Fraction = Field(
        0.8, description="A completion fails when fewer of its positions than this share have "
        "the reference's top-1 token equal to the primary's (Q8_0: 95%, Q2_K: 65%).")
    in_control_kld: PositiveFloat = Field(
        0.02, description="The detector's null: the mean KLD per token (nats) of a primary "
        "that agrees with the reference is at most this; ARL0 (policy.arl0) is promised for "
        "any such primary. Must be below max_mean_kld.")
    bet: float = Field(
        0.5, gt=0.0, lt=1.0, description="The detector's bet in (0, 1): larger reaches the "
        "threshold in fewer completions on a large drift and falls back faster on an agreeing "
        "one (each agreeing completion takes at most ln(1 - bet) off the statistic).")

    @model_validator(mode="after")
    def _check(self) -> "GenerationCheckConfig":
        if self.in_control_kld >= self.max_mean_kld:
            raise ValueError("in_control_kld must be below max_mean_kld (the detector's null "
                             "lies inside what a completion passes)")
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
    generation-only parts), as ``dotted.path: message`` lines relative to the model."""
    if model.task != TASK:
        problems = []
        if "generation" in model.checks.model_fields_set:
            problems.append(f"checks.generation: is set but the model's task is '{model.task}'")
        for role in ("primary", "reference", "fallback"):
            spec = getattr(model, role)
            if spec is not None and spec.backend in GENERATION_ONLY:
                problems.append(f"{role}.backend: '{spec.backend}' serves or scores an LLM: "
                                f"set task: generation (the model's task is '{model.task}')")
        return problems
    problems = []
    if model.primary.backend not in PRIMARY_BACKENDS:
        problems.append(f"primary.backend: a generation model is served by an OpenAI-compatible "
                        f"upstream (backend: openai), not '{model.primary.backend}'")
    if model.fallback is not None and model.fallback.backend not in PRIMARY_BACKENDS:
        problems.append(f"fallback.backend: the fallback of a generation model is another "
                        f"OpenAI-compatible upstream (backend: openai), not "
                        f"'{model.fallback.backend}'")
    if model.reference is not None and model.reference.backend not in REFERENCE_BACKENDS:
        problems.append(f"reference.backend: a generation model is scored by "
                        f"{', '.join(REFERENCE_BACKENDS)}, not '{model.reference.backend}'")
    for block in ("tensor", "activation", "task"):
        if block in model.checks.model_fields_set:
            problems.append(f"checks.{block}: tensor checks do not apply to a generation model "
                            "(its checks are checks.generation)")
    if model.adapters:
        problems.append("adapters: tensor adapters do not apply to a generation model")
    if model.policy.action == "fallback_ops":
        problems.append("policy.action: 'fallback_ops' rebuilds a tensor model's ops; a "
                        "generation model switches with 'fallback_model' (or 'alert')")
    if model.tap:
        problems.append("tap: a generation model is observed on guard's HTTP edge, not Tap")
    return problems


def document_problems(config) -> list[str]:
    """Checks across the document (``GuardConfig``): the HTTP edge a generation model needs."""
    problems = []
    for i, model in enumerate(config.models):
        if model.task == TASK and getattr(config.server, "http_port", None) is None:
            problems.append(f"models[{i}].task: 'generation' needs server.http_port (guard's "
                            "OpenAI-compatible HTTP edge)")
    return problems
