"""The tier's comparison of one completion with the reference's scores over it, in the mode
what the primary returned allows (logprobs, greedy, sampled): :func:`check_generation`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from guard.backends.scoring import PROMPT_RENDERED_OTHERWISE, ReferenceScores
from guard.backends.token_alignment import comparable_text, names_its_alternatives
from guard.protocol.generation import (
    MASKED_LOGPROB,
    GenerationSample,
    SamplingParams,
    shown_as_logits,
)
from guard.verify.generation.defaults import (
    ARGMAX_KEEPING,
    SERVER_DEFAULTS,
    GenerationThresholds,
    ServerDefaults,
)
from guard.verify.generation.verdict import FirstDivergence, GenerationCheck
from guard.verify.generation.transform import (
    Transform,
    penalized_logprobs,
    resolve_transform,
    transformed_support,
    unknown_sampling,
)


# Probabilities are floored here before a log: a bucket the other side gives no mass to.
_TINY = 1e-12
# The primary's top-k held at least this share of its mass at every position: the top-k KL is
# the full-vocabulary KLD to within about this much.
_EXACT_COVERAGE = 0.999
_TEXT_BEFORE = 200  # characters of completion text kept before the first divergent token
# vLLM decodes greedily below this temperature (its _SAMPLING_EPS); its processed logprobs of
# a greedy call are then the model's own, after penalties and before any temperature.
_GREEDY_TEMPERATURE = 1e-5
# The weight of the reference's untransformed distribution mixed into its transformed one
# where processed logprobs are compared: a token the primary's transform kept and the
# reference's masked (a near tie at the top_p boundary) gets a finite log-ratio. It biases a
# healthy pair's KLD by at most -log(1 - this) per token (1e-3 nats), a fiftieth of
# max_mean_kld.
_PROCESSED_EPSILON = 1e-3
_LOGITS_MODES = ("raw_logits", "processed_logits")
# Nats by which a truncation (top_k, min_p, top_p) may drop the primary's sampled token in the
# reference's numbers and it still counts as kept (transformed_support): the two sides'
# kernels differ by thousandths of a nat (F16 against fp32) to tenths (a healthy Q8_0's), and a
# token the server found just inside the cut is no evidence of drift. A token further out is.
BOUNDARY_SLACK = 0.1

# The reference's best tokens a first divergence names (the report's reference_top).
REPORTED_TOP = 5


def _reference_top(scores: ReferenceScores, t: int) -> tuple[tuple[str, float], ...]:
    """The reference's REPORTED_TOP best tokens at ``t`` with their probabilities."""
    return tuple((text, float(math.exp(lp))) for text, lp in
                 zip(scores.top_texts[t][:REPORTED_TOP], scores.top_logprobs[t]))


def _divergence(sample: GenerationSample, scores: ReferenceScores,
                position: int | None) -> FirstDivergence | None:
    if position is None:
        return None
    texts = scores.token_texts  # the primary's tokens, aligned (also where it sent only text)
    before = "".join(texts[:position])
    return FirstDivergence(position, before[-_TEXT_BEFORE:], texts[position],
                           _reference_top(scores, position), split_known=bool(sample.tokens))


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


@dataclass(frozen=True)
class _Against:
    """The reference's side of a logprobs comparison where it is not its raw distribution:
    its logprob of the primary's token and of each of its alternatives at every position,
    and its best token's text (None where not among the reference's named best)."""

    chosen: np.ndarray
    alternatives: tuple[np.ndarray, ...]
    top_texts: tuple[str | None, ...]


def _processed(sample: GenerationSample, scores: ReferenceScores,
               transform: Transform) -> _Against:
    """The reference's distribution under the transform the server applied, where the
    primary's logprobs are after it (vLLM's processed_logprobs): penalties, then the
    temperature and truncations (:func:`transformed_support`), mixed with a little of the
    untransformed distribution (``_PROCESSED_EPSILON``). Only the tokens asked about are
    looked up: the kept set is tens of tokens, the vocabulary tens of thousands. (Greedy and
    near-greedy calls never come here: check_generation compares them otherwise.)"""
    assert scores.logprobs is not None
    chosen = np.zeros(len(scores.token_ids))
    alternatives, tops = [], []
    for t, token_id in enumerate(scores.token_ids):
        row = penalized_logprobs(scores, transform, t) if transform.penalized else \
            scores.logprobs[t].astype(np.float64)
        named = scores.primary_top_ids[t] if t < len(scores.primary_top_ids) else \
            np.zeros(0, np.int64)
        wanted = np.concatenate(([token_id], np.maximum(named, 0))).astype(np.int64)
        kept, pi = transformed_support(row, transform)
        kept_p = dict(zip(kept.tolist(), pi.tolist()))
        values = np.log([(1.0 - _PROCESSED_EPSILON) * kept_p.get(int(i), 0.0)
                         + _PROCESSED_EPSILON * math.exp(row[i]) + _TINY for i in wanted])
        best = int(kept[np.argmax(pi)]) if kept.size else int(np.argmax(row))
        chosen[t] = values[0]
        alternatives.append(np.where(named >= 0, values[1:], np.nan))
        texts = [text for i, text in zip(scores.top_ids[t], scores.top_texts[t]) if i == best]
        tops.append(texts[0] if texts else None)
    return _Against(chosen, tuple(alternatives), tuple(tops))


def _with_logprobs(sample: GenerationSample, scores: ReferenceScores,
                   limits: GenerationThresholds, against: _Against | None = None
                   ) -> GenerationCheck:
    """The per-token comparison of the primary's logprobs with the reference's distribution
    over the same tokens: its raw one, or ``against`` (:func:`_processed`)."""
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
        ref_chosen = float(against.chosen[t] if against else scores.chosen_logprob[t])
        primary_chosen = float(token.logprob)  # type: ignore[arg-type]
        delta_lp[t] = primary_chosen - ref_chosen
        delta_p[t] = math.exp(primary_chosen) - math.exp(ref_chosen)
        named = against.alternatives if against else scores.primary_top_logprobs
        alternatives = named[t] if t < len(named) else np.zeros(0)
        prim, ref = [primary_chosen], [ref_chosen]
        for (text, lp), ref_lp in zip(token.top, alternatives):
            # A masked alternative holds no mass: it adds nothing to KL(primary || reference).
            if text != token.text and not math.isnan(ref_lp) and lp > MASKED_LOGPROB:
                prim.append(lp)
                ref.append(float(ref_lp))
        kld = _topk_kld(np.array(prim), np.array(ref))
        klds[t], bounds[t], reverse[t], coverage[t] = (kld.estimate, kld.lower_bound,
                                                       kld.reverse, kld.coverage)
        primary_top = token.top[0][0] if token.top else (
            token.text if sample.sampling.greedy else None)
        # Where the chosen token is a piece of a character, the server's texts there are the
        # characters they complete (names_its_alternatives): its top-1 is not compared.
        reference_top = against.top_texts[t] if against else scores.top_texts[t][0]
        if primary_top is not None and reference_top is not None and \
                comparable_text(primary_top) and \
                names_its_alternatives(token.text, scores.token_texts[t]):
            agree = primary_top == reference_top
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
    best, agree, margins = _argmax_agreement(scores, transform)
    resplit = _greedy_split_otherwise(sample, scores, best, agree)
    if resplit is not None:
        scores = resplit
        best, agree, margins = _argmax_agreement(scores, transform)
    n = len(scores.token_ids)
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


def _argmax_agreement(scores: ReferenceScores, transform: Transform
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the reference's argmax (of the penalized distribution where the
    transform has penalties), whether the completion's token is it, and the margin to the
    second best."""
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
    else:
        best = np.asarray(scores.top_ids[:, 0], dtype=np.int64)
        margins = _margins(scores)
    return best, best == ids, margins


def _position(scores: ReferenceScores, transform: Transform, t: int, epsilon: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One position of a sampled completion: the reference's row there (penalties applied),
    the tokens the transform keeps (the primary's own within BOUNDARY_SLACK of a cut), their
    probabilities pi, and the log of the mixture ``(1 - eps) pi + eps q`` at each of them."""
    assert scores.logprobs is not None
    row = penalized_logprobs(scores, transform, t) if transform.penalized else \
        scores.logprobs[t]
    kept, pi = transformed_support(row, transform, scores.token_ids[t], BOUNDARY_SLACK)
    mixed = np.log((1.0 - epsilon) * pi + epsilon * np.exp(row[kept].astype(np.float64))
                   + _TINY)
    return row, kept, pi, mixed


def sampled_terms(scores: ReferenceScores, transform: Transform, epsilon: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the centred surprise at the primary's token, its variance under
    agreement, and whether the token is outside the transformed support."""
    n = len(scores.token_ids)
    terms, variances, outside = np.zeros(n), np.zeros(n), np.zeros(n, bool)
    for t, token_id in enumerate(scores.token_ids):
        # Only the kept set and the primary's token enter: pi is zero elsewhere.
        row, kept, pi, mixed = _position(scores, transform, t, epsilon)
        expected = float(np.dot(pi, mixed))  # -(cross entropy of pi against the mixture)
        chosen = float(pi[kept == token_id].sum())
        mixed_chosen = math.log((1.0 - epsilon) * chosen + epsilon * math.exp(
            float(row[token_id])) + _TINY)
        terms[t] = -mixed_chosen + expected
        variances[t] = max(float(np.dot(pi, mixed ** 2)) - expected ** 2, 0.0)
        outside[t] = chosen == 0.0
    return terms, variances, outside


def sampled_tail_bound(scores: ReferenceScores, transform: Transform, epsilon: float,
                       total: float) -> float:
    """Chernoff's bound on the chance, when the primary samples from the reference's
    transformed distribution, that a completion's summed centred surprise lies at least as far
    from 0 as ``total`` does, on its side: ``min over lambda of E[exp(lambda S)] / exp(lambda
    total)``, the moment generating function taken position by position from the distribution
    the reference gives there (the candidates' centred surprises weighted by their
    probabilities, as :func:`sampled_terms` takes the mean and the variance).

    z is N(0, 1) only over many tokens: one token from a position where the transform keeps
    two candidates, at 0.95 and 0.05, gives z 4.4 one time in twenty. The bound holds for any
    length and any distribution; over a long completion it is exp(-z^2 / 2). 0 where
    ``total`` lies beyond every sum the candidates can give (a token outside the transformed
    support)."""
    side = 1.0 if total >= 0.0 else -1.0
    positions: list[tuple[np.ndarray, np.ndarray]] = []
    reach = 0.0  # the largest sum on this side the candidates can give
    for t in range(len(scores.token_ids)):
        _, _, pi, mixed = _position(scores, transform, t, epsilon)
        held = pi > 0.0
        centred = side * (float(np.dot(pi, mixed)) - mixed[held])
        positions.append((np.log(pi[held]), centred))
        reach += float(centred.max())
    target = side * total
    if target > reach + 1e-6 * (1.0 + abs(reach)):
        return 0.0
    return math.exp(-_chernoff_exponent(positions, target))


def _chernoff_exponent(positions: list[tuple[np.ndarray, np.ndarray]], target: float
                       ) -> float:
    """``max over lambda >= 0 of lambda target - sum_t log E_t[exp(lambda x)]`` for the
    positions' (log probability, value) pairs (values centred: each mean is 0). Concave in
    lambda with slope ``target - sum_t E_lambda,t[x]``: Newton's steps from the Gaussian's
    optimum, kept inside a bracket. Any lambda gives a valid bound: the best one found is
    returned."""
    def at(lam: float) -> tuple[float, float, float]:
        value, slope, curvature = lam * target, target, 0.0
        for log_pi, x in positions:
            a = log_pi + lam * x
            top = float(a.max())
            w = np.exp(a - top)
            mass = float(w.sum())
            mean = float(np.dot(w, x)) / mass
            value -= top + math.log(mass)
            slope -= mean
            curvature += max(float(np.dot(w, x * x)) / mass - mean * mean, 0.0)
        return value, slope, curvature

    variance = sum(float(np.dot(np.exp(lp), x * x)) for lp, x in positions)
    if target <= 0.0 or variance <= 0.0:
        return 0.0
    lam, low, high, best = target / variance, 0.0, math.inf, 0.0
    for _ in range(40):
        value, slope, curvature = at(lam)
        best = max(best, value)
        if abs(slope) <= 1e-9 * (1.0 + target):
            break
        if slope > 0.0:
            low = lam
        else:
            high = lam
        step = lam + slope / curvature if curvature > 0.0 else math.inf
        if not low < step < high:
            step = 2.0 * lam if math.isinf(high) else 0.5 * (low + high)
        lam = step
    return best


def _no_distribution(scores: ReferenceScores, what: str) -> GenerationCheck:
    return GenerationCheck(passed=True, mode="not_comparable", tokens=len(scores.token_ids),
                           cause="no_distribution", reason=f"{what} needs the reference's "
                           "full distribution (a local scorer)")


def _split_otherwise(sample: GenerationSample, scores: ReferenceScores, transform: Transform,
                     outside: np.ndarray) -> tuple[int, int] | None:
    """Where a completion known by its text alone was plausibly split otherwise by the server:
    ``(position, candidate)``, the first position whose token (the reference's canonical
    tokenization of the text) the server's transform excludes while one of the reference's
    top candidates there, which it keeps, may have stood there (:func:`_may_stand`: its text
    begins the text from there on, or it is a byte piece). A server samples such a split as
    readily as any token: a healthy llama-server after ``[0, 0]`` sampled "-" eight times and
    the text's canonical "--------" lay outside the transform, and every token after it was
    scored in a context the server never had (z 34 over 41 tokens). None where there is no
    such position, or the server said its tokens (texts or ids)."""
    if sample.tokens or not outside.any() or scores.logprobs is None:
        return None
    t = int(np.flatnonzero(outside)[0])
    starts = np.cumsum([0, *(len(text) for text in scores.token_texts)])
    text = "".join(scores.token_texts)
    found = _kept_candidate(scores, transform, t, text[starts[t]:], longer_only=False)
    if found is not None:
        return t, found
    # The text may have parted from the server's split before t, the canonical tokens staying
    # inside the transform for a while: a healthy llama-server ran number words together,
    # "three" "three" "nine", which the reference tokenizes "th" "re" "eth" "reen" "inen",
    # outside only from "re" on. Nearest first, a kept candidate longer than the canonical
    # token there (one that swallows it and more: a shorter piece at t is asked above).
    for u in range(t - 1, -1, -1):
        found = _kept_candidate(scores, transform, u, text[starts[u]:], longer_only=True)
        if found is not None:
            return u, found
    return None


def _kept_candidate(scores: ReferenceScores, transform: Transform, t: int, rest: str,
                    longer_only: bool) -> int | None:
    """The most probable token at ``t`` that may have stood there and that the transform
    keeps, or None: among the reference's top candidates, those :func:`_may_stand` allows, and
    the vocabulary's tokens whose text begins the text from ``t`` on (``text_pieces``: a kept
    set holds up to top_k 40 tokens, more than the top 20 say). ``rest``: the text from
    ``t`` on; ``longer_only``: only tokens whose text is longer than the canonical token's.
    The kept set (a pass over the vocabulary) is computed only where there is a candidate."""
    canonical = scores.token_ids[t]
    shortest = len(scores.token_texts[t]) + 1 if longer_only else 0
    candidates = {int(c) for c, text in zip(scores.top_ids[t], scores.top_texts[t])
                  if len(text) >= shortest and _may_stand(text, scores, t, rest)}
    if scores.text_pieces:
        pieces = scores.text_pieces[t]  # shortest first: the canonical token among them
        longer = pieces[pieces.index(canonical) + 1:] if canonical in pieces else ()
        candidates.update(longer if longer_only else
                          (piece for piece in pieces if piece != canonical))
    if not candidates:
        return None
    kept = set(int(i) for i in _position(scores, transform, t, 0.0)[1])
    assert scores.logprobs is not None  # (_split_otherwise: a local scorer's)
    row = scores.logprobs[t]
    return max((c for c in candidates if c in kept), key=lambda c: float(row[c]), default=None)


def _may_stand(candidate_text: str, scores: ReferenceScores, t: int,
               rest: str | None = None) -> bool:
    """Whether a token whose text is ``candidate_text`` may have stood at position ``t``, where
    the reference tokenized the completion's text otherwise: its text begins the text from
    there on (a shorter piece of the canonical token, "one" where the text's "onethree" was
    tokenized "on" "eth" "reen"), or it is a byte piece (no UTF-8 alone): the first byte of a
    character, or a character's byte that no later token completed, which servers leave out
    of their text (llama-server, llama-cpp-python; a healthy llama-server after a prompt
    ending in "Ã" answered "‚Ð's personal ...", the reference's best there a byte piece, and
    "'s" read as a token no agreeing server samples: z 6.8). ``rest``: the text from ``t``
    on, where the caller has it."""
    if candidate_text == scores.token_texts[t]:
        return False
    if not comparable_text(candidate_text):
        return True
    if rest is None:
        rest = "".join(scores.token_texts[t:])
    return bool(candidate_text) and rest.startswith(candidate_text)


def _cut_at(scores: ReferenceScores, t: int, candidate: int) -> ReferenceScores:
    """``scores`` up to position ``t``, with ``candidate`` the token there: what follows was
    generated after a split the text does not say, so it is not scored."""
    if scores.logprobs is not None:
        chosen = float(scores.logprobs[t, candidate])
    else:
        chosen = float(scores.top_logprobs[t][list(scores.top_ids[t]).index(candidate)])
    return replace(
        scores, token_ids=scores.token_ids[:t] + (candidate,),
        token_texts=scores.token_texts[:t + 1], top_ids=scores.top_ids[:t + 1],
        top_logprobs=scores.top_logprobs[:t + 1], top_texts=scores.top_texts[:t + 1],
        text_pieces=scores.text_pieces[:t + 1],
        chosen_logprob=np.append(scores.chosen_logprob[:t], chosen),
        logprobs=None if scores.logprobs is None else scores.logprobs[:t + 1],
        logit_offsets=None if scores.logit_offsets is None else scores.logit_offsets[:t + 1])


def _greedy_split_otherwise(sample: GenerationSample, scores: ReferenceScores,
                            best: np.ndarray, agree: np.ndarray) -> ReferenceScores | None:
    """A greedy completion known by its text alone, that the server plausibly split
    otherwise: at the first position where the text's canonical token is not the reference's
    argmax, the argmax may have stood there (:func:`_may_stand`). A greedy server takes the
    argmax there: the scores up to that position with it (:func:`_cut_at`). A healthy
    llama-server answered " Paris" "." "\\n" "\\n" (each the argmax), whose text the
    reference tokenizes " Paris" "." "\\n\\n": that read as a confident flip (a failed greedy
    check).
    None where there is no such position, or the server said its tokens."""
    if sample.tokens or agree.all():
        return None
    t = int(np.flatnonzero(~agree)[0])
    candidate = int(best[t])
    texts = dict(zip((int(i) for i in scores.top_ids[t]), scores.top_texts[t]))
    if candidate not in texts or not _may_stand(texts[candidate], scores, t):
        return None
    return _cut_at(scores, t, candidate)


def _sampled(sample: GenerationSample, scores: ReferenceScores, transform: Transform,
             limits: GenerationThresholds) -> GenerationCheck:
    if scores.logprobs is None:
        return _no_distribution(scores, "a sampled completion without logprobs")
    terms, variances, outside = sampled_terms(scores, transform, limits.support_epsilon)
    resplit = _split_otherwise(sample, scores, transform, outside)
    if resplit is not None:
        scores = _cut_at(scores, *resplit)
        terms, variances, outside = sampled_terms(scores, transform, limits.support_epsilon)
    total_var = float(variances.sum())
    total = float(terms.sum())
    z = total / math.sqrt(total_var) if total_var > 0 else 0.0
    reason = ""
    if abs(z) > limits.max_abs_z:
        # Only as rare as |z| beyond max_abs_z is for many tokens: exp(-max_abs_z^2 / 2) on
        # each side (3.4e-4 at 4), whatever the completion's length (a short one's z is far
        # from normal: a healthy server's 1-token answers failed 1 in 20 on z alone).
        bound = sampled_tail_bound(scores, transform, limits.support_epsilon, total)
        if bound <= math.exp(-0.5 * limits.max_abs_z ** 2):
            chance = f"chance under agreement <= {bound:.2g}" if bound > 0.0 else \
                "out of reach under agreement: a token the transform excludes"
            reason = f"|z| {abs(z):.3g} > max_abs_z {limits.max_abs_z:g} ({chance})"
    passed = not reason
    firsts = np.flatnonzero(outside)
    # No same-top-1 here: it compares the two sides' argmaxes, and a sampled token is a draw,
    # not the primary's argmax (a healthy server at temperature 0.8 draws the reference's
    # argmax about half the time, which a dashboard beside the logprobs mode's 96% would read
    # as drift). The draw's evidence is z.
    return GenerationCheck(
        passed=passed, mode="sampled", tokens=len(scores.token_ids), statistic=z, z=z,
        reason=reason, out_of_support=int(outside.sum()),
        first_divergence=_divergence(sample, scores, int(firsts[0]) if firsts.size else None))


def _with_processed(sample: GenerationSample, scores: ReferenceScores, transform: Transform,
                    limits: GenerationThresholds) -> GenerationCheck:
    if scores.logprobs is None:
        return _no_distribution(scores, "comparing logprobs after the sampling transform "
                                "(processed_logprobs)")
    return _with_logprobs(sample, scores, limits, _processed(sample, scores, transform))


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


def _logprobs_tell(sample: GenerationSample, mode: str) -> str:
    """Why the primary's logprobs cannot be what ``mode`` (the primary block's
    ``options.logprobs_mode``) says ("": they can): a value above 0 or a top-k holding more
    than all the mass is a logit; a masked token (``MASKED_LOGPROB``) in a raw distribution
    is a transform's mark. Scored as they are, either would read as drift on a healthy pair."""
    for token in sample.tokens:
        values = [v for _, v in token.top] or [float(token.logprob)]  # type: ignore[arg-type]
        logits = shown_as_logits(values)
        if logits:
            return (f"the primary's logprobs are not log-probabilities (at {token.text!r}: "
                    f"{logits}): logits, as vLLM returns them when started with "
                    "--logprobs-mode raw_logits or processed_logits; declare it in the "
                    "primary's options.logprobs_mode")
        if mode == "raw_logprobs" and min(values) <= MASKED_LOGPROB:
            return (f"the primary's logprobs mask tokens (at {token.text!r}: "
                    f"{MASKED_LOGPROB:g}, vLLM's log 0): they are after the sampling "
                    "transform, as vLLM returns them when started with --logprobs-mode "
                    "processed_logprobs; declare it in the primary's options.logprobs_mode")
    return ""


def _fits_processed(sample: GenerationSample, scores: ReferenceScores, defaults: ServerDefaults,
                    limits: GenerationThresholds, raw: GenerationCheck) -> str:
    """Why a failed raw comparison is rather a server answering processed logprobs that mask
    nothing ("": it is not): where the request's transform is not the identity (a temperature
    alone, say), logprobs after it look raw, and read as drift. They are taken for processed
    where they pass against the reference under that transform with a tenth of the raw KLD: a
    drifted model's raw distribution matching the reference sharpened at the request's own
    temperature would be a coincidence. Needs the reference's full distribution."""
    if scores.logprobs is None or \
            _outside_transform(sample.sampling, "raw_logprobs", defaults):
        return ""
    transform = resolve_transform(sample.sampling, defaults)
    if transform is None or transform.identity or transform.top_k == 1 or \
            transform.temperature <= limits.near_greedy_temperature or \
            _unscorable_penalties(scores, transform):
        return ""
    processed = _with_logprobs(sample, scores, limits, _processed(sample, scores, transform))
    if not processed.passed or processed.mean_kld > raw.mean_kld / 10:
        return ""
    return (f"the primary's logprobs fit the reference's distribution after the request's "
            f"sampling transform (mean KLD {processed.mean_kld:.3g}) far better than its raw one "
            f"({raw.mean_kld:.3g}): they are after the transform, as vLLM returns them when "
            "started with --logprobs-mode processed_logprobs; declare it in the primary's "
            "options.logprobs_mode")


def _outside_transform(sampling: SamplingParams, logprobs_mode: str,
                       defaults: ServerDefaults) -> tuple[str, str] | None:
    """(cause, reason) where the request asked for decoding the sampled and greedy checks
    cannot rebuild: a constraint (a grammar, a schema, a logit bias ...) or a sampler guard
    does not model, among those the server's engine acts on (ServerDefaults.acts_on: a
    field another engine reads, this one ignores), or one the server turns on itself
    (ServerDefaults.default_samplers). The logprobs comparison needs no transform
    where the server's logprobs are raw (the model's own distribution, before any
    constraint); processed ones carry the constraint's mask, so they are not comparable
    either."""
    constraints = tuple(name for name in sampling.constraints if defaults.acts_on(name))
    samplers = tuple(name for name in sampling.other_samplers if defaults.acts_on(name))
    advice = ("; the per-token comparison still applies where the answer carries logprobs "
              "(options.sample_logprobs)") if logprobs_mode == "raw_logprobs" else \
        f" (the server's logprobs are {logprobs_mode}, not the model's raw distribution)"
    if defaults.default_samplers and not (
            sampling.greedy and ARGMAX_KEEPING.issuperset(defaults.default_samplers)):
        return "sampler", (f"the server samples with {', '.join(defaults.default_samplers)} "
                           "where a request does not say (what it reported: llama-server's "
                           "/props), which guard does not model" + advice)
    if constraints:
        return "constrained", (f"decoding was constrained ({', '.join(constraints)}):"
                               f" the server chose from a masked or biased distribution"
                               + advice)
    if samplers:
        return "sampler", (f"a sampler guard does not model "
                           f"({', '.join(samplers)}) chose the tokens" + advice)
    return None


def _per_token(sample: GenerationSample, scores: ReferenceScores) -> dict[str, Any]:
    """The per-token fields every scored mode shares: texts, the reference's surprise at each
    token, the primary's logprob of it where it said."""
    told = sample.has_logprobs and len(sample.tokens) == len(scores.token_ids)
    return {"per_token_text": tuple(scores.token_texts),
            "per_token_surprise": -np.asarray(scores.chosen_logprob, dtype=np.float64),
            "per_token_primary_logprob": np.array([t.logprob for t in sample.tokens],
                                                  dtype=np.float64) if told else None}


_DEFAULT_LIMITS = GenerationThresholds()  # (frozen: one instance serves every call)


def check_generation(sample: GenerationSample, scores: ReferenceScores,
                     defaults: ServerDefaults = SERVER_DEFAULTS["unknown"],
                     limits: GenerationThresholds = _DEFAULT_LIMITS) -> GenerationCheck:
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

    def uncompared(cause: str, reason: str) -> GenerationCheck:  # one of NOT_COMPARABLE_CAUSES
        return GenerationCheck(passed=True, mode="not_comparable", tokens=n, cause=cause,
                               reason=reason, **common)

    if n < max(limits.min_tokens, 1):
        return uncompared("too_short", f"{n} completion tokens (< min_tokens)")
    meaning = defaults.logprobs_mode
    if sample.echo and meaning == "processed_logprobs":
        # An echo's logprobs are the prompt's, which vLLM computes before any sampling
        # (its prompt_logprobs are raw in every processed mode); the one token an echo call
        # may generate after them is the exception, and a temperature moves one position.
        meaning = "raw_logprobs"
    # The primary's logprobs are read unless they are logits (the reference alone judges).
    told = sample.has_logprobs and len(sample.tokens) == n and meaning not in _LOGITS_MODES
    tell = _logprobs_tell(sample, meaning) if told else ""
    if tell:
        return uncompared("logprobs_mode", tell)
    if told and meaning == "raw_logprobs":
        check = _with_logprobs(sample, scores, limits)
        tell = "" if check.passed else _fits_processed(sample, scores, defaults, limits, check)
        if tell:
            return uncompared("logprobs_mode", tell)
    else:
        outside = _outside_transform(sample.sampling, meaning, defaults)
        if outside is not None:
            return uncompared(*outside)
        transform = resolve_transform(sample.sampling, defaults)
        if transform is None:
            unsaid = unknown_sampling(sample.sampling, defaults)
            return uncompared(
                "sampling_unknown", f"the sampling transform is unknown: {unsaid} is neither "
                "in the request nor declared for the server (options.engine, "
                "generation_config, server_defaults)")
        unscorable = _unscorable_penalties(scores, transform)
        if unscorable:
            return uncompared("penalties", unscorable)
        if told and transform.temperature < _GREEDY_TEMPERATURE and not transform.penalized:
            check = _with_logprobs(sample, scores, limits)  # processed = raw for greedy
        elif transform.temperature <= limits.near_greedy_temperature or transform.top_k == 1:
            # (processed logprobs too: sharpened by 1/T, a near tie's flip would be nats)
            check = _greedy(sample, scores, transform, limits)
        elif told:
            check = _with_processed(sample, scores, transform, limits)
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
