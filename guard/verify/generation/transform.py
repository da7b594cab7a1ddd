"""The sampling transform a server applied to a completion (temperature, top_k, top_p, min_p,
penalties: the request's values over the server's declared defaults), and the reference's
distributions under it; which sampling fields a primary leaves unknown."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from guard.backends.scoring import ReferenceScores, largest_k
from guard.protocol.generation import SAMPLING_FIELDS, SamplingParams
from guard.verify.generation.defaults import NEUTRAL, ServerDefaults, declared_defaults


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
    penalties_share_window: bool = False
    min_p_first: bool = False

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def identity(self) -> bool:
        """The model's own distribution comes out unchanged: temperature 1, nothing cut,
        nothing penalized."""
        return (self.temperature == 1.0 and not self.penalized and self.top_k == 0
                and self.top_p >= 1.0 and self.min_p <= 0.0)


_TRUNCATIONS = ("top_p", "top_k", "min_p")
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
assert ("temperature",) + _TRUNCATIONS + _PENALTIES == SAMPLING_FIELDS


def asked(sampling: SamplingParams, defaults: ServerDefaults, name: str) -> Any:
    """The value the request set for the transform field ``name`` as this server reads it
    (None: not set): the repetition penalty from the first of the engine's names for it
    (ServerDefaults.penalty_fields) the request set; a penalty under a name the server
    ignores was not applied."""
    if name != "repetition_penalty":
        return getattr(sampling, name)
    return next((value for value in (getattr(sampling, field)
                                     for field in defaults.penalty_fields)
                 if value is not None), None)


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
                 if asked(sampling, defaults, name) is None and getattr(defaults, name) is None),
                None)


def resolve_transform(sampling: SamplingParams, defaults: ServerDefaults) -> Transform | None:
    """The transform the server applied, or None where a field of it is not known
    (:func:`unknown_sampling`). A greedy request's unknown truncations are taken as neutral:
    the greedy check does not read them."""
    if unknown_sampling(sampling, defaults) is not None:
        return None

    def pick(name: str):
        for value in (asked(sampling, defaults, name), getattr(defaults, name),
                      getattr(NEUTRAL, name)):
            if value is not None:
                return value

    return Transform(
        temperature=float(pick("temperature")), top_p=float(pick("top_p")),
        top_k=int(pick("top_k")), min_p=float(pick("min_p")),
        repetition_penalty=float(pick("repetition_penalty")),
        presence_penalty=float(pick("presence_penalty")),
        frequency_penalty=float(pick("frequency_penalty")),
        penalty_last_n=_penalty_window(sampling, defaults),
        temperature_last=defaults.temperature_last, penalize_prompt=defaults.penalize_prompt,
        penalties_share_window=defaults.penalties_share_window,
        min_p_first=defaults.min_p_first)


def _penalty_window(sampling: SamplingParams, defaults: ServerDefaults) -> int:
    """The penalties' window: the request's ``repeat_last_n`` where the server reads it (-1
    and anything negative: all the tokens, as llama.cpp's -1 is the whole context), else the
    server's."""
    if defaults.reads_repeat_last_n and sampling.repeat_last_n is not None:
        return max(sampling.repeat_last_n, -1)
    return defaults.penalty_last_n


def _window(tokens: list[int], last_n: int) -> list[int]:
    """The last ``last_n`` of ``tokens`` (-1: all, 0: none)."""
    if last_n < 0:
        return tokens
    return tokens[max(0, len(tokens) - last_n):] if last_n else []


def _penalize(logits: np.ndarray, transform: Transform, prompt: Sequence[int],
              completion: Sequence[int], t: int) -> np.ndarray:
    """The server's penalties on one position's logits, over the last ``penalty_last_n``
    tokens before ``t``. vLLM's: the repetition penalty over the prompt's and the
    completion's tokens, presence and frequency over the completion's. llama.cpp's
    (``penalties_share_window``): all three over one window of the tokens its sampler was
    handed, the prompt's among them where ``penalize_prompt``."""
    history = _window((list(prompt) if transform.penalize_prompt else []) + list(completion[:t]),
                      transform.penalty_last_n)
    out = logits.copy()
    if transform.repetition_penalty != 1.0 and history:
        seen = np.unique(np.asarray(history, dtype=np.int64))
        values = out[seen]
        out[seen] = np.where(values > 0, values / transform.repetition_penalty,
                             values * transform.repetition_penalty)
    counted = history if transform.penalties_share_window else \
        _window(list(completion[:t]), transform.penalty_last_n)
    if counted and (transform.presence_penalty or transform.frequency_penalty):
        ids, counts = np.unique(np.asarray(counted, dtype=np.int64), return_counts=True)
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


# Candidates sorted first when looking for top_p's nucleus: it holds a few to a few hundred
# tokens, so sorting the whole vocabulary (49152 here: 9 ms a position, most of a sampled
# check's CPU) is rarely needed.
_NUCLEUS_FIRST = 64


_TINY_MASS = 1e-300  # (a log of no mass at all)


def _nucleus(values: np.ndarray, top_p: float) -> np.ndarray:
    """Indices into ``values`` (logits over the candidates) of the smallest prefix, best first,
    whose softmax mass reaches ``top_p`` (the token that crosses included): what a stable
    argsort of the whole array gives (ties in index order), from the best few first. A
    prefix is taken from a partial sort only where it ends strictly above the partition's
    smallest value, so that no tie across the partition's edge is cut differently."""
    probabilities = _softmax(values)
    size = probabilities.size
    k = min(_NUCLEUS_FIRST, size)
    while True:
        if k < size:
            part = np.argpartition(-probabilities, k - 1)[:k]
            part = part[np.lexsort((part, -probabilities[part]))]
        else:
            part = np.argsort(-probabilities, kind="stable")
        cumulative = np.cumsum(probabilities[part])
        count = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        if k == size or (count < k and
                         probabilities[part[count - 1]] > probabilities[part[k - 1]]):
            return part[:min(count, size)]
        k = min(4 * k, size)


def transformed_support(logprobs: np.ndarray, transform: Transform, keep: int | None = None,
                        slack: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The tokens the server may sample at one position and their probabilities (float64),
    given the model's log-probabilities there (penalties already applied).

    ``keep`` (the token the primary sampled there) stays in the set where a truncation drops
    it by at most ``slack`` nats in the reference's numbers (top_k, min_p: its logprob that
    far below the cut; top_p: the mass before it that far below top_p, in log terms): at the
    edge of a truncation the server's numbers put it inside, and the reference's, a few
    thousandths of a nat apart, outside (a healthy llama-server sampled " \n" at -4.52 where
    min_p 0.05 cut at -4.52, and the reference read it as a token no agreeing server
    samples: z 5.2).

    The truncations work on the candidates top_k left (all tokens without it), so that a
    top_k server costs one partition of the vocabulary, not a sort; only the kept tokens are
    converted and normalized (the vocabulary is tens of thousands, the kept set tens)."""
    mine = -1 if keep is None or slack <= 0.0 or not np.isfinite(logprobs[keep]) else keep
    if 0 < transform.top_k < logprobs.shape[-1]:
        # Temperature is monotonic: the top_k set is the same before or after it.
        candidates = largest_k(logprobs, transform.top_k)
        candidates = candidates[np.isfinite(logprobs[candidates])]
        if mine >= 0 and mine not in candidates and candidates.size and \
                logprobs[mine] >= logprobs[candidates].min() - slack:
            candidates = np.append(candidates, mine)
    else:
        candidates = np.flatnonzero(np.isfinite(logprobs))
    values = logprobs[candidates].astype(np.float64)
    if not transform.temperature_last:
        values = values / transform.temperature

    def kept_value() -> float | None:
        at = np.flatnonzero(candidates == mine)
        return float(values[at[0]]) if mine >= 0 and at.size else None

    def min_p(candidates, values):
        if transform.min_p <= 0.0:
            return candidates, values
        cut = values.max() + math.log(transform.min_p)  # p >= min_p * p_max
        value = kept_value()
        if value is not None and cut - slack <= value < cut:
            cut = value
        kept = values >= cut
        return candidates[kept], values[kept]

    if transform.min_p_first:
        candidates, values = min_p(candidates, values)
    if transform.top_p < 1.0:
        order = _nucleus(values, transform.top_p)
        value = kept_value()
        if value is not None and mine not in candidates[order]:
            probabilities = _softmax(values)
            before = float(probabilities[values > value].sum())
            if math.log(max(before, _TINY_MASS)) <= math.log(transform.top_p) + slack:
                order = np.flatnonzero(values >= value)
                order = order[np.argsort(-values[order], kind="stable")]
        candidates, values = candidates[order], values[order]
    if not transform.min_p_first:
        candidates, values = min_p(candidates, values)
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



UNDECLARED_ADVICE = (
    "sampled calls that leave these to the server are not compared "
    "(guard_generation_not_comparable_total{reason=\"sampling_unknown\"}): declare the "
    "primary's options.generation_config (vLLM) or options.server_defaults, or set "
    "options.sample_logprobs")


def undeclared_sampling(primary_options: Mapping[str, Any] | None,
                        defaults: ServerDefaults | None = None) -> str | None:
    """The first sampling field a call that says nothing leaves unknown on this primary, where
    that matters: its sampled calls carry no logprobs (``options.sample_logprobs`` unset: no
    transform enters a comparison of raw logprobs), or its logprobs are processed or logits
    (``options.logprobs_mode``: the transform enters). None: every such call is comparable.
    What the verifier says at start-up and `guard config validate` notes (UNDECLARED_ADVICE).
    ``defaults``: the tier's, where the server told more than the block declares."""
    options = dict(primary_options or {})
    if options.get("sample_logprobs") and \
            options.get("logprobs_mode", "raw_logprobs") == "raw_logprobs":
        return None
    return unknown_sampling(SamplingParams(),
                            defaults if defaults is not None else declared_defaults(options))
