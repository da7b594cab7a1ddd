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
  transformed distribution, so the zero mean holds exactly). Verdict: ``|z| <= max_abs_z``;
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

A tokenization mismatch (guard/backends/scoring.py) is a failure of its own: nothing is scored,
``findings`` names it. Prompt findings (``double_bos``, ``missing_bos``, and
``prompt_rendered_otherwise`` unless ``prompt_rendering`` is "server") fail the completion
too: they change every token after them. Every mode reports the first divergent token: the
first confident position where the primary's choice is not the reference's argmax (greedy,
logprobs), or the first token outside the reference's transformed support (sampled).

Defaults (:class:`GenerationThresholds`) were calibrated on SmolLM2-135M-Instruct against its
fp32 reference (benchmarks/llm_ladder.py; numbers in docs/generation.md): F16, Q4_1 and Q8_0
primaries pass them and Q2_K fails them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

import numpy as np

from guard.backends.scoring import (
    PROMPT_RENDERED_OTHERWISE,
    ReferenceScores,
    comparable_text,
    largest_k,
    names_its_alternatives,
)
from guard.protocol.generation import (
    SAMPLING_FIELDS,
    GenerationSample,
    SamplingParams,
    generation_config_defaults,
)

# Probabilities are floored here before a log: a bucket the other side gives no mass to.
_TINY = 1e-12
# The primary's top-k held at least this share of its mass at every position: the top-k KL is
# the full-vocabulary KLD to within about this much.
_EXACT_COVERAGE = 0.999
_TEXT_BEFORE = 200  # characters of completion text kept before the first divergent token


@dataclass(frozen=True)
class ServerDefaults:
    """The sampling transform a server applies where the request does not say (the backend
    block declares it: it depends on the server and its launch flags).

    A field that is None is not known: a sampled request that does not set it is not
    comparable (``temperature=None`` alone: only greedy requests and requests that set the
    temperature compare). ``temperature_last``: the server applies the truncations (top_k,
    top_p, min_p) at temperature 1 and the temperature after them (llama.cpp's sampler chain);
    otherwise temperature first (vLLM, transformers). Penalties follow vLLM's meaning: the
    repetition penalty over prompt and completion tokens, presence and frequency over
    completion tokens, within the last ``penalty_last_n`` tokens (-1: all);
    ``penalize_prompt`` false: the repetition penalty too sees only the completion's tokens
    (llama-cpp-python's sampler is handed the sampled tokens alone).
    """

    temperature: float | None = None
    top_p: float | None = 1.0
    top_k: int | None = 0  # 0: off
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    penalty_last_n: int = -1
    temperature_last: bool = False
    penalize_prompt: bool = True


# vLLM without a model's generation_config.json (``--generation-config vllm``): temperature 1,
# no truncation, no penalty. OpenAI's API means the same.
NEUTRAL = ServerDefaults(temperature=1.0)

# Starting points for the backend block; the server's launch flags can change them.
SERVER_DEFAULTS: dict[str, ServerDefaults] = {
    # llama.cpp's server (llama-server): top_k 40, top_p 0.95, min_p 0.05, temperature 0.8,
    # repeat_penalty 1.0 over the last 64 tokens, the prompt's among them (once the prompt is
    # evaluated its server hands every prompt token to the sampler: common_sampler_accept in
    # its slot loop, read in its source, not run here); temperature last.
    "llama.cpp": ServerDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                penalty_last_n=64, temperature_last=True),
    # llama-cpp-python's server (llama_cpp.server): the same chain, but repeat_penalty 1.1
    # unless told (its server's default; its Llama API's is 1.0), over the last 64 sampled
    # tokens only (its sampler never sees the prompt's).
    "llama-cpp-python": ServerDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                                       repetition_penalty=1.1, penalty_last_n=64,
                                       temperature_last=True, penalize_prompt=False),
    # vLLM applies the sampling fields of the model's generation_config.json over its neutral
    # defaults (``--generation-config auto``, its default: 0.32 here): which they are is not
    # known until the block declares the file (options.generation_config) or the values
    # (options.server_defaults). Qwen2.5-Instruct's, for one, sample at temperature 0.7,
    # top_p 0.8, top_k 20 and repetition_penalty 1.05, not at vLLM's temperature 1.
    "vllm": ServerDefaults(temperature=None, top_p=None, top_k=None, min_p=None,
                           repetition_penalty=None, presence_penalty=None,
                           frequency_penalty=None),
    "openai": NEUTRAL,
    # Nothing known: only greedy requests and requests that set the temperature compare.
    "unknown": ServerDefaults(),
}


def server_defaults(declared: Mapping[str, Any] | None = None, engine: str = "unknown",
                    generation_config: Mapping[str, Any] | None = None) -> ServerDefaults:
    """The defaults of ``engine`` (a key of SERVER_DEFAULTS: its sampler order and penalty
    window), with ``generation_config`` (the sampling fields vLLM takes from a model's
    generation_config.json, over its neutral defaults; engine vllm only) and then what the
    backend block declares (None: not declared) laid over them."""
    if engine not in SERVER_DEFAULTS:
        raise ValueError(f"engine: {engine!r} is not one of {', '.join(SERVER_DEFAULTS)}")
    base = SERVER_DEFAULTS[engine]
    if generation_config is not None:
        if engine != "vllm":
            raise ValueError(f"generation_config: engine {engine} does not apply a model's "
                             "generation_config.json (vLLM does): declare server_defaults")
        base = replace(NEUTRAL, **_known_fields(generation_config, "generation_config"))
    return replace(base, **_known_fields(declared or {}, "server_defaults"))


def _known_fields(values: Mapping[str, Any], key: str) -> dict[str, Any]:
    told = {k: v for k, v in values.items() if v is not None}
    unknown = sorted(set(told) - set(ServerDefaults.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown field")
    return told


@dataclass(frozen=True)
class GenerationThresholds:
    """The tier's defaults. Why these values: docs/generation.md (measured ladder)."""

    # Mean KLD per token (nats) over one completion, logprobs mode. Q8_0's ladder mean is
    # 0.0046 and Q2_K's 0.52: 0.05 sits near their geometric mean.
    max_mean_kld: float = 0.05
    # |z| of one sampled completion (N(0, 1) under agreement: 4 is 6e-5 two-sided).
    max_abs_z: float = 4.0
    # Reference margin (nats) above which an argmax flip is not kernel noise.
    margin_floor: float = 1.0
    # Greedy: the share of confident positions where the primary left the reference's argmax.
    max_greedy_disagreement: float = 0.05
    # Sampling at or below this temperature (or top_k 1) is checked as greedy: the server
    # leaves a confident argmax with a chance of e^(-margin_floor / T) at most, and the
    # sampled z would amplify kernel noise by 1 / T (guard/config/generation.py says more).
    near_greedy_temperature: float = 0.1
    # Weight of the untransformed distribution in the sampled surprise (finite for a token the
    # transform excludes).
    support_epsilon: float = 0.05
    # Fewer compared positions than this: not comparable (counted, not scored).
    min_tokens: int = 1
    # The server's prompt ids against the reference's own rendering of the same messages or
    # text: "must_match" fails a completion whose prompt the server rendered otherwise (chat
    # template or tokenizer drift); "server" takes the server's rendering as intended (a
    # deliberate --chat-template) and only reports the difference.
    prompt_rendering: str = "must_match"


# The verifier's reasons a completion is not compared (the HTTP edge counts its own: n, echo,
# tools, reasoning, stateful, input, prompt_list, upstream_error, incomplete, endpoint).
NOT_COMPARABLE_CAUSES = (
    "unaligned",         # the primary's tokens cannot be aligned with the reference's
    "too_short",         # fewer completion tokens than checks.generation.min_tokens
    "sampling_unknown",  # a sampling field neither the request nor the declared defaults say
    "penalties",         # the server's penalties cannot be applied to these scores
    "no_distribution",   # a sampled completion without logprobs, a remote reference
    "constrained",       # no logprobs, and a grammar, schema, logit bias ... chose the tokens
    "sampler",           # no logprobs, and a sampler guard does not model (mirostat ...)
)


@dataclass(frozen=True)
class FirstDivergence:
    position: int
    text_before: str
    primary_token: str
    reference_top: tuple[tuple[str, float], ...]  # (token text, probability), best first
    record: int | None = None  # set by whoever numbers the samples (replay)

    def as_dict(self) -> dict[str, Any]:
        return {"record": self.record, "position": self.position,
                "text_before": self.text_before, "primary_token": self.primary_token,
                "reference_top": [[t, p] for t, p in self.reference_top]}


@dataclass
class GenerationCheck:
    """One completion's comparison. ``statistic`` is what a detector accumulates (None when
    the completion was not scored); the metric fields are NaN where the mode has none."""

    passed: bool
    mode: str  # logprobs | sampled | greedy | not_comparable | tokenization_mismatch
    reason: str = ""
    # Why a not_comparable completion was not scored, as a metric label
    # (guard_generation_not_comparable_total{reason}): one of NOT_COMPARABLE_CAUSES.
    cause: str = ""
    tokens: int = 0
    statistic: float | None = None
    mean_kld: float = math.nan
    kld_p99: float = math.nan
    # The lumped top-k figure (never above the full-vocabulary KLD) and llama-perplexity's
    # direction, KL(reference || primary), estimated alike (_topk_kld).
    mean_kld_lower_bound: float = math.nan
    mean_kld_reverse: float = math.nan
    kld_exact: bool = False
    top1_agreement: float = math.nan
    delta_p_rms: float = math.nan
    mean_delta_logprob: float = math.nan
    z: float = math.nan
    out_of_support: int = 0
    confident_positions: int = 0
    confident_disagreements: int = 0
    first_divergence: FirstDivergence | None = None
    findings: tuple[str, ...] = ()
    approximate: bool = False
    top1_compared: int = 0  # positions where both top-1s are known (top1_agreement's count)
    # Per completion token (what the replay report shades and plots): its text, the
    # reference's surprise at it (-log p, nats), the primary's logprob of it where it said,
    # the top-k KLD and delta p (logprobs mode).
    per_token_text: tuple[str, ...] = field(default=(), repr=False)
    per_token_surprise: np.ndarray | None = field(default=None, repr=False)
    per_token_primary_logprob: np.ndarray | None = field(default=None, repr=False)
    per_token_kld: np.ndarray | None = field(default=None, repr=False)
    per_token_kld_lower_bound: np.ndarray | None = field(default=None, repr=False)
    per_token_kld_reverse: np.ndarray | None = field(default=None, repr=False)
    per_token_delta_p: np.ndarray | None = field(default=None, repr=False)

    @property
    def comparable(self) -> bool:
        return self.statistic is not None

    def summary(self) -> str:
        """One line: why it failed, or its mode's figure."""
        if not self.passed or self.mode == "tokenization_mismatch":
            return self.reason or self.mode
        if self.mode == "logprobs":
            return f"mean KLD {self.mean_kld:.3g} nats over {self.tokens} tokens"
        if self.mode == "greedy":
            return (f"{self.confident_disagreements} of {self.confident_positions} confident "
                    "positions off the reference's argmax")
        if self.mode == "sampled":
            return f"z {self.z:.2f} over {self.tokens} tokens"
        return f"{self.mode}: {self.reason}" if self.reason else self.mode

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if not k.startswith("per_token")}
        data["first_divergence"] = (None if self.first_divergence is None
                                    else self.first_divergence.as_dict())
        data["findings"] = list(self.findings)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in data.items()}

    def per_token_dict(self) -> dict[str, list | None]:
        """The per-token figures as JSON-able lists (6 significant digits; None: not known)."""
        def values(array: np.ndarray | None) -> list[float] | None:
            return None if array is None else [float(f"{v:.6g}") for v in array.tolist()]

        return {"text": list(self.per_token_text),
                "surprise": values(self.per_token_surprise),
                "primary_logprob": values(self.per_token_primary_logprob),
                "kld": values(self.per_token_kld), "delta_p": values(self.per_token_delta_p)}

    def details(self) -> dict[str, Any]:
        """What the capture record and the replay report keep of this check: ``as_dict()``
        and, for a scored completion, ``per_token`` (:meth:`per_token_dict`)."""
        data = self.as_dict()
        if self.per_token_text:
            data["per_token"] = self.per_token_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GenerationCheck":
        """The check :meth:`details` (or ``as_dict``) described; ValueError for what is not
        one (a record's details from another guard version)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
            raise ValueError("generation check: expected an object with a 'mode'")
        names = {f.name: f for f in fields(cls) if not f.name.startswith("per_token")}
        values: dict[str, Any] = {}
        for name, spec in names.items():
            if name not in data:
                continue
            value = data[name]
            if value is None and spec.type == "float":
                value = math.nan
            values[name] = value
        first = data.get("first_divergence")
        values["first_divergence"] = None if not first else FirstDivergence(
            int(first["position"]), str(first["text_before"]), str(first["primary_token"]),
            tuple((str(t), float(p)) for t, p in first.get("reference_top") or ()),
            first.get("record"))
        values["findings"] = tuple(data.get("findings") or ())
        per_token = data.get("per_token") or {}

        def array(key: str) -> np.ndarray | None:
            found = per_token.get(key)
            return None if found is None else np.asarray(found, dtype=np.float64)

        return cls(**values, per_token_text=tuple(per_token.get("text") or ()),
                   per_token_surprise=array("surprise"),
                   per_token_primary_logprob=array("primary_logprob"),
                   per_token_kld=array("kld"), per_token_delta_p=array("delta_p"))


# -- the sampling transform ------------------------------------------------------------------
@dataclass(frozen=True)
class Transform:
    """The sampling transform one completion was drawn with (request over server defaults)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_last_n: int
    temperature_last: bool
    penalize_prompt: bool = True

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


_TRUNCATIONS = ("top_p", "top_k", "min_p")
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
assert ("temperature",) + _TRUNCATIONS + _PENALTIES == SAMPLING_FIELDS


def unknown_sampling(sampling: SamplingParams, defaults: ServerDefaults) -> str | None:
    """The first sampling field that the request does not set and the server's defaults do
    not know (None: the transform is known). A greedy request needs its temperature and the
    penalties, not the truncations."""
    temperature = sampling.temperature if sampling.temperature is not None else \
        defaults.temperature
    if temperature is None:
        return "temperature"
    # Greedy decoding reads no truncation, but the penalties move its argmax too.
    needed = _PENALTIES if temperature <= 0.0 else _TRUNCATIONS + _PENALTIES
    return next((name for name in needed
                 if getattr(sampling, name) is None and getattr(defaults, name) is None), None)


def resolve_transform(sampling: SamplingParams, defaults: ServerDefaults) -> Transform | None:
    """The transform the server applied, or None where a field of it is not known
    (:func:`unknown_sampling`). A greedy request's unknown truncations are taken as neutral:
    the greedy check does not read them."""
    if unknown_sampling(sampling, defaults) is not None:
        return None

    def pick(name: str):
        for value in (getattr(sampling, name), getattr(defaults, name),
                      getattr(NEUTRAL, name)):
            if value is not None:
                return value

    return Transform(
        temperature=float(pick("temperature")), top_p=float(pick("top_p")),
        top_k=int(pick("top_k")), min_p=float(pick("min_p")),
        repetition_penalty=float(pick("repetition_penalty")),
        presence_penalty=float(pick("presence_penalty")),
        frequency_penalty=float(pick("frequency_penalty")),
        penalty_last_n=defaults.penalty_last_n, temperature_last=defaults.temperature_last,
        penalize_prompt=defaults.penalize_prompt)


def _penalize(logits: np.ndarray, transform: Transform, prompt: Sequence[int],
              completion: Sequence[int], t: int) -> np.ndarray:
    """vLLM's penalties on one position's logits (completion tokens before ``t`` and, for the
    repetition penalty, the prompt), within the last ``penalty_last_n`` tokens."""
    history = (list(prompt) if transform.penalize_prompt else []) + list(completion[:t])
    if transform.penalty_last_n >= 0:
        history = history[len(history) - transform.penalty_last_n:] if \
            transform.penalty_last_n else []
    out = logits.copy()
    if transform.repetition_penalty != 1.0 and history:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        values = out[seen]
        out[seen] = np.where(values > 0, values / transform.repetition_penalty,
                             values * transform.repetition_penalty)
    generated = list(completion[:t])
    if transform.penalty_last_n >= 0:
        generated = generated[max(0, len(generated) - transform.penalty_last_n):] if \
            transform.penalty_last_n else []
    if generated and (transform.presence_penalty or transform.frequency_penalty):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        out[ids] -= transform.presence_penalty + transform.frequency_penalty * counts
    return out


def penalized_logprobs(scores: ReferenceScores, transform: Transform, t: int) -> np.ndarray:
    """The reference's log-probabilities at position ``t`` after the transform's penalties
    (float64 ``[V]``). The repetition penalty divides a positive raw logit and multiplies a
    negative one (vLLM, llama.cpp), so it is applied to the raw logits (the log-softmax plus
    the scorer's ``logit_offsets``); presence and frequency penalties shift, which a
    log-softmax does not mind."""
    assert scores.logprobs is not None
    row = scores.logprobs[t].astype(np.float64)
    if transform.repetition_penalty != 1.0:
        assert scores.logit_offsets is not None
        row = row + float(scores.logit_offsets[t])
    row = _penalize(row, transform, scores.prompt_token_ids, scores.token_ids, t)
    return row - np.logaddexp.reduce(row)


def _softmax(logits: np.ndarray) -> np.ndarray:
    finite = np.isfinite(logits)
    out = np.zeros_like(logits)
    if not finite.any():
        return out
    shifted = np.where(finite, logits - logits[finite].max(), -np.inf)
    out = np.exp(shifted)
    return out / out.sum()


def transformed_support(logprobs: np.ndarray, transform: Transform
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens the server may sample at one position and their probabilities (float64),
    given the model's log-probabilities there (penalties already applied).

    The truncations work on the candidates top_k left (all tokens without it), so that a
    top_k server costs one partition of the vocabulary, not a sort; only the kept tokens are
    converted and normalized (the vocabulary is tens of thousands, the kept set tens)."""
    if 0 < transform.top_k < logprobs.shape[-1]:
        # Temperature is monotonic: the top_k set is the same before or after it.
        candidates = largest_k(logprobs, transform.top_k)
        candidates = candidates[np.isfinite(logprobs[candidates])]
    else:
        candidates = np.flatnonzero(np.isfinite(logprobs))
    values = logprobs[candidates].astype(np.float64)
    if not transform.temperature_last:
        values = values / transform.temperature
    if transform.top_p < 1.0:
        order = np.argsort(-values, kind="stable")
        cumulative = np.cumsum(_softmax(values[order]))
        # The smallest prefix whose mass reaches top_p (the token that crosses included).
        count = int(np.searchsorted(cumulative, transform.top_p, side="left")) + 1
        candidates, values = candidates[order[:count]], values[order[:count]]
    if transform.min_p > 0.0:
        kept = values >= values.max() + math.log(transform.min_p)  # p >= min_p * p_max
        candidates, values = candidates[kept], values[kept]
    if transform.temperature_last:
        values = values / transform.temperature
    return candidates, _softmax(values)


def transformed(logprobs: np.ndarray, transform: Transform) -> np.ndarray:
    """The distribution the server samples from at one position: float64 ``[V]``, zero
    outside the kept set (:func:`transformed_support`, dense)."""
    candidates, probabilities = transformed_support(logprobs, transform)
    out = np.zeros(logprobs.shape, dtype=np.float64)
    out[candidates] = probabilities
    return out


# -- the tier ----------------------------------------------------------------------------------
def _reference_top(scores: ReferenceScores, t: int) -> tuple[tuple[str, float], ...]:
    return tuple((text, float(math.exp(lp))) for text, lp in
                 zip(scores.top_texts[t], scores.top_logprobs[t][:len(scores.top_texts[t])]))


def _divergence(sample: GenerationSample, scores: ReferenceScores,
                position: int | None) -> FirstDivergence | None:
    if position is None:
        return None
    texts = scores.token_texts  # the primary's tokens, aligned (also where it sent only text)
    before = "".join(texts[:position])
    return FirstDivergence(position, before[-_TEXT_BEFORE:], texts[position],
                           _reference_top(scores, position))


def _margins(scores: ReferenceScores) -> np.ndarray:
    if scores.top_logprobs.shape[1] < 2:
        return np.full(scores.top_logprobs.shape[0], np.inf)
    return (scores.top_logprobs[:, 0] - scores.top_logprobs[:, 1]).astype(np.float64)


@dataclass(frozen=True)
class TopKKld:
    """One position's KLD figures from the primary's top-k (nats)."""

    estimate: float  # KL(primary || reference): the lumped bound plus the tail correction
    lower_bound: float  # KL(primary || reference) over the top-k plus one tail bucket
    reverse: float  # KL(reference || primary), llama-perplexity's direction, estimated alike
    coverage: float  # the share of the primary's mass its top-k held


def _bucket_kld(a: np.ndarray, b: np.ndarray, a_tail: float, b_tail: float) -> float:
    """KL(a || b) between two distributions given on the same tokens plus one tail bucket."""
    kld = float(np.sum(a * (np.log(np.maximum(a, _TINY)) - np.log(np.maximum(b, _TINY)))))
    if a_tail > 0.0:
        kld += a_tail * (math.log(max(a_tail, _TINY)) - math.log(max(b_tail, _TINY)))
    return kld


def _topk_kld(primary_lp: np.ndarray, reference_lp: np.ndarray) -> TopKKld:
    """KL(primary || reference) at one position from the primary's top-k logprobs and the
    reference's logprobs of the same tokens, and the other direction alike.

    The top-k tokens plus one bucket for the rest (the tail) give an exact KL between the
    coarse-grained distributions: a lower bound (lumping can only lower a KL), which loses
    ``P_tail * KL(p_tail || q_tail)``, the tail's own divergence (p_tail, q_tail: the two
    distributions within the tail, P_tail the primary's tail mass). Measured on SmolLM2's
    quant ladder from top-20, the bound is 0.70-0.84 of the full-vocabulary KLD: the tail
    holds about a tenth of the mass and its log-ratios spread as much as the top-k's.

    The correction: a quantized, reordered or otherwise perturbed model's logits are the
    reference's plus noise that does not depend on the token, so every log-ratio
    ``d = log p - log q`` is one constant plus that noise, in the tail as in the top-k. With
    noise of variance s² (Gaussian, over a tail of many tokens), ``p_tail`` is ``q_tail``
    tilted by ``exp(noise)`` and ``KL(p_tail || q_tail) = s²/2`` exactly (and the same for
    ``KL(q_tail || p_tail)``). s² is estimated by the sample variance of ``d`` over the
    top-k, where both sides are known; the estimate adds ``P_tail * s²/2`` (the reverse
    direction ``Q_tail * s²/2``). On the ladder it came out at 0.95-1.02 of the full figure
    (docs/generation.md); with the whole vocabulary the tail is empty and it is exact.
    """
    p = np.exp(primary_lp)
    q = np.exp(reference_lp)
    p_tail = max(1.0 - float(p.sum()), 0.0)
    q_tail = max(1.0 - float(q.sum()), 0.0)
    lower = max(_bucket_kld(p, q, p_tail, q_tail), 0.0)
    reverse = max(_bucket_kld(q, p, q_tail, p_tail), 0.0)
    noise = float(np.var(primary_lp - reference_lp, ddof=1)) if p.size >= 2 else 0.0
    return TopKKld(estimate=lower + p_tail * noise / 2, lower_bound=lower,
                   reverse=reverse + q_tail * noise / 2, coverage=float(p.sum()))


def _with_logprobs(sample: GenerationSample, scores: ReferenceScores,
                   limits: GenerationThresholds) -> GenerationCheck:
    n = len(scores.token_ids)
    klds, bounds, reverse = np.zeros(n), np.zeros(n), np.zeros(n)
    coverage = np.ones(n)
    delta_lp = np.zeros(n)
    delta_p = np.zeros(n)
    same_top: list[bool] = []
    margins = _margins(scores)
    first = None
    for t in range(n):
        token = sample.tokens[t]
        ref_chosen = float(scores.chosen_logprob[t])
        primary_chosen = float(token.logprob)  # type: ignore[arg-type]
        delta_lp[t] = primary_chosen - ref_chosen
        delta_p[t] = math.exp(primary_chosen) - math.exp(ref_chosen)
        alternatives = scores.primary_top_logprobs[t] if t < len(scores.primary_top_logprobs) \
            else np.zeros(0)
        prim, ref = [primary_chosen], [ref_chosen]
        for (text, lp), ref_lp in zip(token.top, alternatives):
            if text != token.text and not math.isnan(ref_lp):
                prim.append(lp)
                ref.append(float(ref_lp))
        kld = _topk_kld(np.array(prim), np.array(ref))
        klds[t], bounds[t], reverse[t], coverage[t] = (kld.estimate, kld.lower_bound,
                                                       kld.reverse, kld.coverage)
        primary_top = token.top[0][0] if token.top else (
            token.text if sample.sampling.greedy else None)
        # Where the chosen token is a piece of a character, the server's texts there are the
        # characters they complete (names_its_alternatives): its top-1 is not compared.
        if primary_top is not None and comparable_text(primary_top) and \
                names_its_alternatives(token.text, scores.token_texts[t]):
            agree = primary_top == scores.top_texts[t][0]
            same_top.append(agree)
            if not agree and first is None and margins[t] > limits.margin_floor:
                first = t
    mean_kld = float(klds.mean())
    passed = mean_kld <= limits.max_mean_kld
    return GenerationCheck(
        passed=passed, mode="logprobs", tokens=n, statistic=mean_kld,
        reason="" if passed else f"mean KLD {mean_kld:.4g} > max_mean_kld {limits.max_mean_kld:g}",
        mean_kld=mean_kld, kld_p99=float(np.percentile(klds, 99)),
        mean_kld_lower_bound=float(bounds.mean()), mean_kld_reverse=float(reverse.mean()),
        kld_exact=bool(coverage.min() >= _EXACT_COVERAGE),
        top1_agreement=float(np.mean(same_top)) if same_top else math.nan,
        delta_p_rms=float(np.sqrt(np.mean(delta_p ** 2))),
        mean_delta_logprob=float(delta_lp.mean()),
        top1_compared=len(same_top), first_divergence=_divergence(sample, scores, first),
        per_token_kld=klds, per_token_kld_lower_bound=bounds, per_token_kld_reverse=reverse,
        per_token_delta_p=delta_p)


def _greedy(sample: GenerationSample, scores: ReferenceScores, transform: Transform,
            limits: GenerationThresholds) -> GenerationCheck:
    n = len(scores.token_ids)
    ids = np.asarray(scores.token_ids, dtype=np.int64)
    if transform.penalized:  # the argmax and margin of the penalized distribution
        best = np.zeros(n, np.int64)
        margins = np.full(n, np.inf)
        for t in range(n):
            row = penalized_logprobs(scores, transform, t)
            two = np.argpartition(-row, 1)[:2] if row.size > 1 else np.zeros(1, np.int64)
            two = two[np.argsort(-row[two])]
            best[t] = two[0]
            if two.size > 1:
                margins[t] = row[two[0]] - row[two[1]]
        agree = best == ids
    else:
        agree = scores.top_ids[:, 0] == ids
        margins = _margins(scores)
    confident = margins > limits.margin_floor
    disagreements = int(np.sum(confident & ~agree))
    positions = int(confident.sum())
    share = disagreements / positions if positions else 0.0
    passed = share <= limits.max_greedy_disagreement
    flips = np.flatnonzero(confident & ~agree)
    return GenerationCheck(
        passed=passed, mode="greedy", tokens=n, statistic=share,
        reason="" if passed else (f"{disagreements} of {positions} confident positions left the "
                                  f"reference's argmax (> {limits.max_greedy_disagreement:g})"),
        top1_agreement=float(agree.mean()), top1_compared=n, confident_positions=positions,
        confident_disagreements=disagreements,
        first_divergence=_divergence(sample, scores, int(flips[0]) if flips.size else None))


def sampled_terms(scores: ReferenceScores, transform: Transform, epsilon: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the centred surprise at the primary's token, its variance under
    agreement, and whether the token is outside the transformed support."""
    assert scores.logprobs is not None
    n = len(scores.token_ids)
    terms, variances, outside = np.zeros(n), np.zeros(n), np.zeros(n, bool)
    for t, token_id in enumerate(scores.token_ids):
        row = penalized_logprobs(scores, transform, t) if transform.penalized else \
            scores.logprobs[t]
        # Only the kept set and the primary's token enter: pi is zero elsewhere.
        kept, pi = transformed_support(row, transform)
        mixed = np.log((1.0 - epsilon) * pi + epsilon * np.exp(row[kept].astype(np.float64))
                       + _TINY)
        expected = float(np.dot(pi, mixed))  # -(cross entropy of pi against the mixture)
        chosen = float(pi[kept == token_id].sum())
        mixed_chosen = math.log((1.0 - epsilon) * chosen + epsilon * math.exp(
            float(row[token_id])) + _TINY)
        terms[t] = -mixed_chosen + expected
        variances[t] = max(float(np.dot(pi, mixed ** 2)) - expected ** 2, 0.0)
        outside[t] = chosen == 0.0
    return terms, variances, outside


def _sampled(sample: GenerationSample, scores: ReferenceScores, transform: Transform,
             limits: GenerationThresholds) -> GenerationCheck:
    if scores.logprobs is None:
        return GenerationCheck(passed=True, mode="not_comparable", tokens=len(scores.token_ids),
                               cause="no_distribution",
                               reason="a sampled completion without logprobs needs the "
                               "reference's full distribution (a local scorer)")
    terms, variances, outside = sampled_terms(scores, transform, limits.support_epsilon)
    total_var = float(variances.sum())
    z = float(terms.sum() / math.sqrt(total_var)) if total_var > 0 else 0.0
    passed = abs(z) <= limits.max_abs_z
    ids = np.asarray(scores.token_ids, dtype=np.int64)
    firsts = np.flatnonzero(outside)
    return GenerationCheck(
        passed=passed, mode="sampled", tokens=len(ids), statistic=z, z=z,
        reason="" if passed else f"|z| {abs(z):.3g} > max_abs_z {limits.max_abs_z:g}",
        top1_agreement=float(np.mean(scores.top_ids[:, 0] == ids)), top1_compared=len(ids),
        out_of_support=int(outside.sum()),
        first_divergence=_divergence(sample, scores, int(firsts[0]) if firsts.size else None))


def _unscorable_penalties(scores: ReferenceScores, transform: Transform) -> str:
    """Why penalties that moved the server's choices cannot be applied to these scores ("":
    they can): they need the reference's whole distribution, and a repetition penalty its raw
    logits, which a local scorer gives and a remote one does not."""
    if not transform.penalized:
        return ""
    if scores.logprobs is None:
        return ("the server's penalties move every token's score: they need the reference's "
                "full distribution (a local scorer)")
    if transform.repetition_penalty != 1.0 and scores.logit_offsets is None:
        return ("a repetition penalty acts on raw logits, which this reference's scores do not "
                "carry")
    return ""


def _outside_transform(sampling: SamplingParams) -> tuple[str, str] | None:
    """(cause, reason) where the request asked for decoding the sampled and greedy checks
    cannot rebuild: a constraint (a grammar, a schema, a logit bias ...) or a sampler guard
    does not model. The logprobs comparison needs no transform: the server's logprobs are the
    model's own distribution, before any constraint."""
    advice = ("; the per-token comparison still applies where the answer carries logprobs "
              "(options.sample_logprobs)")
    if sampling.constraints:
        return "constrained", (f"decoding was constrained ({', '.join(sampling.constraints)}):"
                               f" the server chose from a masked or biased distribution"
                               + advice)
    if sampling.other_samplers:
        return "sampler", (f"a sampler guard does not model "
                           f"({', '.join(sampling.other_samplers)}) chose the tokens" + advice)
    return None


def _per_token(sample: GenerationSample, scores: ReferenceScores) -> dict[str, Any]:
    """The per-token fields every scored mode shares: texts, the reference's surprise at each
    token, the primary's logprob of it where it said."""
    told = sample.has_logprobs and len(sample.tokens) == len(scores.token_ids)
    return {"per_token_text": tuple(scores.token_texts),
            "per_token_surprise": -np.asarray(scores.chosen_logprob, dtype=np.float64),
            "per_token_primary_logprob": np.array([t.logprob for t in sample.tokens],
                                                  dtype=np.float64) if told else None}


def check_generation(sample: GenerationSample, scores: ReferenceScores,
                     defaults: ServerDefaults = SERVER_DEFAULTS["unknown"],
                     limits: GenerationThresholds = GenerationThresholds()) -> GenerationCheck:
    """Compare one completion with the reference's teacher-forced distributions."""
    common: dict[str, Any] = {"approximate": scores.approximate, "findings": scores.findings}
    if scores.mismatch is not None and not scores.mismatch.drift:
        m = scores.mismatch
        return GenerationCheck(passed=True, mode="not_comparable", tokens=len(sample.tokens),
                               cause="unaligned",
                               reason=f"the primary's tokens cannot be aligned at token "
                                      f"{m.position}: {m.reason}", **common)
    if scores.mismatch is not None:
        m = scores.mismatch
        return GenerationCheck(
            passed=False, mode="tokenization_mismatch", tokens=len(sample.tokens),
            reason=f"tokenization mismatch at token {m.position}: primary {m.primary!r}, "
                   f"reference {m.reference!r} ({m.reason})",
            approximate=scores.approximate,
            findings=scores.findings + ("tokenization_mismatch",))
    n = len(scores.token_ids)
    if n < max(limits.min_tokens, 1):
        return GenerationCheck(passed=True, mode="not_comparable", tokens=n, cause="too_short",
                               reason=f"{n} completion tokens (< min_tokens)", **common)
    if sample.has_logprobs and len(sample.tokens) == n:
        check = _with_logprobs(sample, scores, limits)
    else:
        outside = _outside_transform(sample.sampling)
        if outside is not None:
            return GenerationCheck(passed=True, mode="not_comparable", tokens=n,
                                   cause=outside[0], reason=outside[1], **common)
        transform = resolve_transform(sample.sampling, defaults)
        if transform is None:
            unsaid = unknown_sampling(sample.sampling, defaults)
            return GenerationCheck(
                passed=True, mode="not_comparable", tokens=n, cause="sampling_unknown",
                reason=f"the sampling transform is unknown: {unsaid} is neither in the request "
                "nor declared for the server (options.engine, generation_config, "
                "server_defaults)", **common)
        unscorable = _unscorable_penalties(scores, transform)
        if unscorable:
            return GenerationCheck(passed=True, mode="not_comparable", tokens=n,
                                   cause="penalties", reason=unscorable, **common)
        if transform.temperature <= limits.near_greedy_temperature or transform.top_k == 1:
            check = _greedy(sample, scores, transform, limits)
        else:
            check = _sampled(sample, scores, transform, limits)
    check = replace(check, **common, **_per_token(sample, scores))
    failing = [f for f in scores.findings
               if f != PROMPT_RENDERED_OTHERWISE or limits.prompt_rendering == "must_match"]
    if scores.prompt_difference:
        check.reason = "; ".join(filter(None, [check.reason, scores.prompt_difference]))
    if failing and check.comparable:
        check.passed = False
        check.reason = "; ".join(filter(None, [check.reason, "prompt: " + ", ".join(failing)]))
    return check


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _joined(arrays) -> np.ndarray:
    arrays = [a for a in arrays if a is not None]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def perplexities(checks: Sequence[GenerationCheck]) -> dict[str, float | None]:
    """llama-perplexity's PPL figures over the completions' tokens where the primary said its
    logprob: ``PPL(Q) = exp(mean(-log p_primary))``, ``PPL(base) = exp(mean(-log
    p_reference))`` over the same tokens, and their ratio. Mind what the tokens are: the
    primary's own completion (llama-perplexity scores a fixed text), so a drifting primary
    shows as a ratio below 1: the reference finds the text less likely than the primary that
    wrote it did. Agreeing models give about 1."""
    primary, reference = [], []
    for c in checks:
        if c.per_token_primary_logprob is not None and c.per_token_surprise is not None and \
                len(c.per_token_primary_logprob) == len(c.per_token_surprise):
            primary.append(-c.per_token_primary_logprob)
            reference.append(c.per_token_surprise)
    nll_primary, nll_reference = _joined(primary), _joined(reference)
    if not nll_primary.size:
        return {"ppl_primary": None, "ppl_reference": None, "ppl_ratio": None,
                "ppl_tokens": 0}
    return {"ppl_primary": float(np.exp(nll_primary.mean())),
            "ppl_reference": float(np.exp(nll_reference.mean())),
            "ppl_ratio": float(np.exp(nll_primary.mean() - nll_reference.mean())),
            "ppl_tokens": int(nll_primary.size)}


def summarize(checks: Sequence[GenerationCheck], records: Sequence[int] | None = None
              ) -> dict[str, Any]:
    """The report's ``tiers.generation`` block over many completions (CONTRACT.md): checks
    and passes counted over the completions with a verdict (scored, or failed on a
    tokenization mismatch; the not comparable ones are counted apart), KLD and Δp over every
    token (not a mean of means), and the first divergence of the first completion that had
    one (``records`` numbers the completions; their positions in ``checks`` otherwise).
    Beside the contract's fields, llama-perplexity's summary: KLD p99.9, median and maximum,
    mean Δp, and the perplexities (:func:`perplexities`)."""
    scored = [c for c in checks if c.comparable]
    counted = [c for c in checks if c.comparable or c.mode == "tokenization_mismatch"]
    kld = _joined(c.per_token_kld for c in scored)
    delta = _joined(c.per_token_delta_p for c in scored)
    bound = _joined(c.per_token_kld_lower_bound for c in scored)
    reverse = _joined(c.per_token_kld_reverse for c in scored)
    compared = sum(c.top1_compared for c in scored)
    agreeing = sum(c.top1_agreement * c.top1_compared for c in scored if c.top1_compared)
    first = None
    for index, check in enumerate(checks):
        if check.first_divergence is not None:
            record = records[index] if records is not None else index
            first = replace(check.first_divergence, record=record).as_dict()
            break
    return {
        "checks": len(counted), "passed": sum(c.passed for c in counted),
        "not_comparable": sum(c.mode == "not_comparable" for c in checks),
        "tokenization_mismatches": sum(c.mode == "tokenization_mismatch" for c in checks),
        # completions with each finding (the prompt's, and tokenization_mismatch)
        "findings": {name: sum(name in c.findings for c in checks)
                     for name in sorted({f for c in checks for f in c.findings})},
        "modes": {mode: sum(c.mode == mode for c in checks)
                  for mode in sorted({c.mode for c in checks})},
        "tokens": sum(c.tokens for c in scored),
        "mean_kld": float(kld.mean()) if kld.size else None,
        "kld_p99": _percentile(kld, 99),
        "kld_p999": _percentile(kld, 99.9),
        "kld_median": _percentile(kld, 50),
        "kld_max": float(kld.max()) if kld.size else None,
        "kld_tokens": int(kld.size),
        "mean_kld_lower_bound": float(bound.mean()) if bound.size else None,
        "mean_kld_reverse": float(reverse.mean()) if reverse.size else None,
        "top1_agreement": agreeing / compared if compared else None,
        "delta_p_rms": float(np.sqrt(np.mean(delta ** 2))) if delta.size else None,
        "delta_p_mean": float(delta.mean()) if delta.size else None,
        **perplexities(scored),
        "first_divergence": first,
    }


def by_position(checks: Sequence[GenerationCheck]) -> dict[str, list]:
    """Per completion position (0 = the first generated token), over the scored completions
    long enough to have it: how many, the mean and the largest KLD (logprobs mode), the mean
    surprise of the reference at the primary's token (every scored mode)."""
    # (surprise, kld) per scored completion; kld only in logprobs mode
    scored = [(c.per_token_surprise, c.per_token_kld) for c in checks
              if c.comparable and c.per_token_surprise is not None]
    length = max((len(surprise) for surprise, _ in scored), default=0)
    out: dict[str, list] = {"completions": [], "kld_mean": [], "kld_max": [],
                            "surprise_mean": []}
    for t in range(length):
        surprise = [s[t] for s, _ in scored if len(s) > t]
        kld = [k[t] for _, k in scored if k is not None and len(k) > t]
        out["completions"].append(len(surprise))
        out["surprise_mean"].append(float(np.mean(surprise)))
        out["kld_mean"].append(float(np.mean(kld)) if kld else None)
        out["kld_max"].append(float(np.max(kld)) if kld else None)
    return out


# The failing completions the replay report shows token by token (the rest are counted).
MAX_FLAGGED = 10


class GenerationFigures:
    """The replay report's ``tiers.generation`` figures of one model (the kind's ``figures``):
    each record's tier report (``details``: :meth:`GenerationCheck.details`) and where it came
    from are added in record order; ``as_dict`` is :func:`summarize` over them, KLD by
    position (:func:`by_position`) and the first ``MAX_FLAGGED`` failing completions with
    their tokens (``flagged``; ``flagged_total`` counts them all)."""

    def __init__(self):
        self.checks: list[GenerationCheck] = []
        self.records: list[int] = []
        self.flagged: list[dict[str, Any]] = []
        self.flagged_total = 0

    def add(self, report, where: Mapping[str, Any] | None = None) -> None:
        check = GenerationCheck.from_dict(report.details)
        record = int(where["index"]) if where else len(self.records)
        if not check.passed:
            self.flagged_total += 1
            if len(self.flagged) < MAX_FLAGGED:
                self.flagged.append(_flagged(record, check, report.details, where or {}))
        self.checks.append(replace(check, per_token_text=()))  # texts: the flagged ones only
        self.records.append(record)

    def as_dict(self) -> dict[str, Any]:
        out = summarize(self.checks, self.records)
        out["by_position"] = by_position(self.checks)
        out["flagged"] = self.flagged
        out["flagged_total"] = self.flagged_total
        return out


def _flagged(record: int, check: GenerationCheck, details: Mapping[str, Any],
             where: Mapping[str, Any]) -> dict[str, Any]:
    first = check.first_divergence
    return {"record": record, "request_id": where.get("request_id", ""),
            "source": where.get("source", ""), "prompt": details.get("prompt"),
            "mode": check.mode, "reason": check.reason, "tokens": check.tokens,
            "statistic": check.statistic,
            "mean_kld": None if math.isnan(check.mean_kld) else check.mean_kld,
            "per_token": check.per_token_dict() if check.per_token_text else None,
            "first_divergence": None if first is None else replace(first, record=record)
            .as_dict()}


# -- the tier's registration (guard/verify/tiers.py) ------------------------------------------
def thresholds_of(checks) -> GenerationThresholds:
    """The tier's thresholds from a model's ``checks.generation`` block."""
    block = checks.generation
    return GenerationThresholds(**{name: getattr(block, name)
                                   for name in GenerationThresholds.__dataclass_fields__
                                   if hasattr(block, name)})


def declared_defaults(primary_options: Mapping[str, Any] | None) -> ServerDefaults:
    """The sampling defaults the primary's server applies: its block's ``options.engine``
    preset (sampler order, penalty window), the sampling fields of the generation_config.json
    that ``options.generation_config`` names (vLLM), and ``options.server_defaults`` over
    them."""
    options = dict(primary_options or {})
    source = options.get("generation_config")
    from_file = None
    if source is not None:
        from_file = generation_config_defaults(str(source))
    return server_defaults(options.get("server_defaults"), options.get("engine") or "unknown",
                           from_file)


UNDECLARED_ADVICE = (
    "sampled calls that leave these to the server are not compared "
    "(guard_generation_not_comparable_total{reason=\"sampling_unknown\"}): declare the "
    "primary's options.generation_config (vLLM) or options.server_defaults, or set "
    "options.sample_logprobs")


def undeclared_sampling(primary_options: Mapping[str, Any] | None) -> str | None:
    """The first sampling field a call that says nothing leaves unknown on this primary, where
    that matters: its sampled calls carry no logprobs (``options.sample_logprobs`` unset: no
    transform enters a logprobs comparison). None: every such call is comparable. What the
    verifier says at start-up and `guard config validate` notes (UNDECLARED_ADVICE)."""
    options = dict(primary_options or {})
    if options.get("sample_logprobs"):
        return None
    return unknown_sampling(SamplingParams(), declared_defaults(options))


class GenerationTier:
    """One generative model's instance of the tier: ``Compared.primary`` is the completion (a
    ``GenerationSample``), ``Compared.reference`` the reference's scores over it."""

    name = "generation"

    def __init__(self, defaults: ServerDefaults, limits: GenerationThresholds):
        self.defaults, self.limits = defaults, limits

    def check(self, sample) -> GenerationCheck:
        return check_generation(sample.primary, sample.reference, self.defaults, self.limits)


def _build(setup) -> GenerationTier | None:
    if setup.task != "generation":
        return None
    primary = setup.model.primary.options if setup.model is not None else None
    return GenerationTier(declared_defaults(primary), thresholds_of(setup.checks))


def _declare():
    from guard.verify.tiers import TierKind

    return TierKind("generation", build=_build, takes="generation",
                    details=lambda check: check.details(), figures=GenerationFigures)


TIER = _declare()
