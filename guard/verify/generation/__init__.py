"""The ``generation`` tier: one LLM completion against a teacher-forced reference (numpy only).

Input: the primary's completion (:class:`~guard.protocol.generation.GenerationSample`) and the
reference's distributions at each of its positions (:class:`~guard.backends.scoring.
ReferenceScores`, one forward pass of the reference over prompt + completion). Output: one
:class:`GenerationCheck` per completion, with a verdict and a continuous ``statistic`` for the
detectors. Which comparison applies depends on what the primary returned:

- **logprobs** (the primary's answer carries each token's logprob, best with ``top_logprobs``):
  per token, ``KL(primary || reference)`` estimated from the primary's returned top-k and the
  reference's logprobs of the same tokens (:func:`_topk_kld`): the exact KL over the top-k
  plus one bucket for the rest of the mass (a lower bound, ``mean_kld_lower_bound``) plus a
  correction for the divergence within that bucket, taken from the spread of the top-k's
  log-ratios. On SmolLM2's quant ladder from top-20 the estimate is 0.95-1.02 of the
  full-vocabulary KLD over the same tokens, the bound 0.70-0.84 (docs/generation.md);
  ``kld_exact`` says the top-k held at least 99.9% of the mass everywhere (the figure is then
  exact to that). llama-perplexity's direction, ``KL(reference || primary)``, is estimated
  the same way (``mean_kld_reverse``: for close models the two agree to second order). Also
  Δ logprob and Δp of the chosen token, same top-1. Verdict: the completion's mean KLD per
  token <= ``max_mean_kld``; statistic: that mean.
- **sampled** (no logprobs; temperature above ``near_greedy_temperature``, 0.1): at each position
  the reference's surprise at the primary's token minus its expectation under the sampling
  transform the server applied (temperature, top_k, top_p, min_p, penalties: the request's values
  over the server's declared defaults, :class:`ServerDefaults`). When the primary samples from the
  reference's transformed distribution, each term has mean 0 given the past and a variance the
  reference knows (the varentropy), so the sum over the completion divided by the square root of
  the summed variances is a z-score, approximately N(0, 1) under agreement (a martingale CLT). A
  token the transform excludes would give an infinite surprise: the surprise is taken under
  ``(1 - eps) * transformed + eps * untransformed`` (mean and variance taken under the
  transformed distribution, so the zero mean holds exactly). Verdict: ``|z| <= max_abs_z``,
  or, beyond it, Chernoff's bound on the chance of such a sum under agreement above
  ``exp(-max_abs_z^2 / 2)`` (z is far from normal over a few tokens: :func:`sampled_tail_bound`);
  statistic: z. A completion whose transform is unknown (a server whose defaults the block does
  not declare, and a request that does not set them) is ``not_comparable``: counted, never
  scored.
- **greedy** (no logprobs; temperature 0, or up to ``near_greedy_temperature``, or top_k 1:
  at such a temperature the server leaves a confident argmax with a chance of
  e^(-margin_floor / T) at most, where z would read kernel noise amplified by 1 / T as
  drift): the primary's token must be the reference's argmax wherever the reference's margin
  (top-1 minus top-2 logprob) exceeds ``margin_floor`` nats: below it, kernel noise flips the
  argmax of agreeing models. Verdict: the share of confident
  positions that disagree <= ``max_greedy_disagreement``; statistic: that share.

A tokenization mismatch (guard/backends/token_alignment.py) is a failure of its own: nothing
is scored, ``findings`` names it. Prompt findings (``double_bos``, ``missing_bos``, and
``prompt_rendered_otherwise`` unless ``prompt_rendering`` is "server") fail the completion
too: they change every token after them. Every mode reports the first divergent token: the
first confident position where the primary's choice is not the reference's argmax (greedy,
logprobs), or the first token outside the reference's transformed support (sampled).

Defaults (:class:`GenerationThresholds`) were calibrated on SmolLM2-135M-Instruct against its
fp32 reference (benchmarks/llm_ladder.py; numbers in docs/generation.md): F16, Q4_1 and Q8_0
primaries pass them and Q2_K fails them.

One module per part: ``defaults`` (the servers' sampling defaults, the thresholds),
``transform`` (the sampling transform and the reference under it), ``checks`` (the modes and
``check_generation``), ``verdict`` (what a check returns), ``summary`` (many checks summed
up); this module registers the tier and gathers their public names.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from guard.verify.generation.defaults import (
    GenerationThresholds,
    NEUTRAL,
    SERVER_DEFAULTS,
    ServerDefaults,
    declared_defaults,
    llama_server_sampling,
    reported_fields,
    server_defaults,
)
from guard.verify.generation.transform import (
    Transform,
    UNDECLARED_ADVICE,
    penalized_logprobs,
    resolve_transform,
    transformed,
    transformed_support,
    undeclared_sampling,
    unknown_sampling,
)
from guard.verify.generation.verdict import FirstDivergence, GenerationCheck, NOT_COMPARABLE_CAUSES
from guard.verify.generation.checks import (
    TopKKld,
    check_generation,
    sampled_tail_bound,
    sampled_terms,
)
from guard.verify.generation.summary import (
    GenerationFigures,
    MAX_FLAGGED,
    by_position,
    perplexities,
    pooled_z,
    summarize,
)


def thresholds_of(checks) -> GenerationThresholds:
    """The tier's thresholds from a model's ``checks.generation`` block."""
    block = checks.generation
    return GenerationThresholds(**{name: getattr(block, name)
                                   for name in GenerationThresholds.__dataclass_fields__
                                   if hasattr(block, name)})


class GenerationTier:
    """One generative model's instance of the tier: ``Compared.primary`` is the completion (a
    ``GenerationSample``), ``Compared.reference`` the reference's scores over it.

    ``defaults``: the primary's server's sampling defaults (the block's, or what the server
    reported at load: the verifier sets them). A call that carries its server's report
    (``server_settings``: a capture record of a llama-server's call) is scored with that
    report under the block's options instead, as the live verifier scored it."""

    name = "generation"

    def __init__(self, defaults: ServerDefaults, limits: GenerationThresholds,
                 primary_options: Mapping[str, Any] | None = None):
        self.defaults, self.limits = defaults, limits
        self._options = dict(primary_options or {})
        self._reported: dict[str, ServerDefaults] = {}  # by the report's JSON: a handful

    def check(self, sample) -> GenerationCheck:
        return check_generation(sample.primary, sample.reference,
                                self.defaults_for(sample.primary), self.limits)

    @property
    def reads_the_server(self) -> bool:
        """A llama.cpp primary (``options.engine: llama.cpp``) says what it samples with where
        a request does not (llama-server's GET /props, which the engine's preset cannot
        know: its defaults after the GGUF's ``general.sampling.*`` metadata and its launch
        flags); its caller fetches that (guard.backends.openai ``reported_settings``) for
        :meth:`take_report`. The verifier asks at load, a replay before the primary generates
        a prompt set."""
        return self._options.get("engine") == "llama.cpp"

    def take_report(self, model: str, target: str,
                    report: tuple[dict[str, Any] | None, str]) -> dict[str, Any] | None:
        """Score with what the server reported (``report``: its /props params, or None and
        why not), under the block's own server_defaults, and say so (event
        ``llama_server_defaults``); the settings that decided it (what a capture record
        keeps). None where it did not say: the preset stays (event
        ``llama_server_defaults_unavailable`` with the reason)."""
        from guard.observe.events import emit

        params, why = report
        if params is None:
            emit("llama_server_defaults_unavailable", model=model, target=target, reason=why,
                 note="the llama.cpp preset's built-in defaults apply")
            return None
        settings = llama_server_sampling(params)
        self.defaults = declared_defaults(self._options, reported=settings)
        emit("llama_server_defaults", model=model, target=target,
             **reported_fields(self.defaults))
        return settings

    def defaults_for(self, call) -> ServerDefaults:
        """The sampling defaults ``call`` is scored with."""
        settings = call.server_settings
        if settings is None:
            return self.defaults
        key = json.dumps(settings, sort_keys=True)
        found = self._reported.get(key)
        if found is None:
            found = self._reported[key] = declared_defaults(self._options, reported=settings)
        return found


def _build(setup) -> GenerationTier | None:
    if setup.task != "generation":
        return None
    primary = setup.model.primary.options if setup.model is not None else None
    return GenerationTier(declared_defaults(primary), thresholds_of(setup.checks), primary)


def _declare():
    from guard.verify.tiers import TierKind

    return TierKind("generation", build=_build, takes="generation",
                    details=lambda check: check.details(), figures=GenerationFigures)


TIER = _declare()


__all__ = [
    "FirstDivergence",
    "GenerationCheck",
    "GenerationFigures",
    "GenerationThresholds",
    "GenerationTier",
    "MAX_FLAGGED",
    "NEUTRAL",
    "NOT_COMPARABLE_CAUSES",
    "SERVER_DEFAULTS",
    "ServerDefaults",
    "TIER",
    "TopKKld",
    "Transform",
    "UNDECLARED_ADVICE",
    "by_position",
    "check_generation",
    "declared_defaults",
    "llama_server_sampling",
    "penalized_logprobs",
    "perplexities",
    "resolve_transform",
    "sampled_tail_bound",
    "sampled_terms",
    "server_defaults",
    "pooled_z",
    "summarize",
    "thresholds_of",
    "transformed",
    "transformed_support",
    "undeclared_sampling",
    "unknown_sampling",
]
