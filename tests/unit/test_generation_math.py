"""The generation tier's math on its own (numpy): the sampling transform, the top-k KLD and the
z-score's null distribution. The real model's side is tests/unit/test_generation_tier.py."""

from __future__ import annotations

import collections
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from guard.backends.scoring import ReferenceScores, largest_k, top_of
from guard.protocol.generation import (GenerationSample, SamplingParams, TokenLogprob,
                                      divergent_token_phrase)
from guard.verify.generation import (
    NEUTRAL,
    NOT_COMPARABLE_CAUSES,
    SERVER_DEFAULTS,
    GenerationCheck,
    GenerationThresholds,
    ServerDefaults,
    Transform,
    check_generation,
    resolve_transform,
    sampled_tail_bound,
    sampled_terms,
    server_defaults,
    transformed,
    unknown_sampling,
)
from guard.verify.generation.checks import _topk_kld


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _transform(**kw) -> Transform:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, penalty_last_n=-1,
                temperature_last=False)
    base.update(kw)
    return Transform(**base)


@pytest.mark.parametrize("shape", [(64, 49152), (3, 32000), (2, 151936), (5, 49153),
                                   (4, 1000), (1, 300), (300,)])
@pytest.mark.parametrize("k", [1, 5, 20, 40])
def test_largest_k_finds_what_a_partition_of_the_whole_row_finds(shape, k):
    """The block-maxima shortcut against np.argpartition over the whole row: the same values
    (indices may differ only among ties), k distinct indices, on vocabularies with and without
    a partial last block, with masked (-inf) entries and with ties."""
    rng = np.random.default_rng(k)
    values = rng.normal(size=shape).astype(np.float32)
    values[..., ::7] = -np.inf
    values[..., 5::97] = values.max()  # ties at the top, spread over many blocks
    got = largest_k(values, k)
    whole = np.argpartition(-values, k - 1, axis=-1)[..., :k]
    assert got.shape == whole.shape
    assert np.array_equal(np.sort(np.take_along_axis(values, got, -1), axis=-1),
                          np.sort(np.take_along_axis(values, whole, -1), axis=-1))
    assert all(len(set(row)) == k for row in got.reshape(-1, k))


def test_largest_k_on_a_row_with_nan_is_the_plain_partition():
    values = np.random.default_rng(0).normal(size=(2, 4096)).astype(np.float32)
    values[1, 100] = np.nan
    assert np.array_equal(largest_k(values, 5), np.argpartition(-values, 4, axis=-1)[:, :5])


@pytest.mark.parametrize("temperature_last", [False, True])
def test_transform_keeps_what_each_truncation_allows(temperature_last):
    rng = np.random.default_rng(0)
    for _ in range(50):
        logprobs = _log_softmax(rng.normal(0, 3, 300))
        top_k, top_p, min_p = int(rng.integers(1, 60)), float(rng.uniform(0.3, 1.0)), \
            float(rng.uniform(0, 0.2))
        pi = transformed(logprobs, _transform(temperature=float(rng.uniform(0.3, 1.5)),
                                              top_k=top_k, top_p=top_p, min_p=min_p,
                                              temperature_last=temperature_last))
        kept = np.flatnonzero(pi > 0)
        assert math.isclose(pi.sum(), 1.0, rel_tol=1e-9)
        assert 1 <= kept.size <= top_k
        # The kept set is a top set of the model's own order (every truncation keeps the best).
        assert logprobs[kept].min() >= np.sort(logprobs)[::-1][kept.size - 1]
        # The argmax always survives and keeps the largest probability.
        assert pi.argmax() == logprobs.argmax()


@pytest.mark.parametrize("size", [3, 64, 65, 300, 49152])
def test_the_nucleus_is_the_prefix_a_sort_of_the_whole_vocabulary_gives(size):
    """top_p's nucleus from a partial sort against a stable argsort of every candidate: the
    same tokens in the same order, on flat and peaked rows, with ties (across the partial
    sort's edge too) and with top_p the whole mass."""
    from guard.verify.generation.transform import _NUCLEUS_FIRST, _nucleus, _softmax

    rng = np.random.default_rng(size)
    for trial in range(40):
        values = rng.normal(0, float(rng.choice([0.1, 1.0, 4.0])), size)
        if trial % 4 == 1:  # ties at the top, and one straddling the partial sort's edge
            values[::5] = values.max()
        if trial % 4 == 2 and size > _NUCLEUS_FIRST:
            edge = np.sort(values)[::-1][_NUCLEUS_FIRST - 1]
            values[rng.choice(size, 8, replace=False)] = edge
        top_p = float(rng.choice([0.1, 0.5, 0.9, 0.99, 1.0 - 1e-12]))
        probabilities = _softmax(values)
        order = np.argsort(-probabilities, kind="stable")
        count = int(np.searchsorted(np.cumsum(probabilities[order]), top_p, side="left")) + 1
        assert np.array_equal(_nucleus(values, top_p), order[:count]), (trial, top_p)


def test_temperature_last_applies_truncation_at_temperature_one():
    # One dominant token with p > top_p at temperature 1: llama.cpp (temperature last) keeps
    # it alone; temperature first flattens the distribution before top_p and keeps more.
    logprobs = _log_softmax(np.array([4.0, 2.0, 1.9, 1.8, 0.0]))
    first = transformed(logprobs, _transform(temperature=3.0, top_p=0.7))
    last = transformed(logprobs, _transform(temperature=3.0, top_p=0.7, temperature_last=True))
    assert np.count_nonzero(last) == 1
    assert np.count_nonzero(first) > 1


def _vllms_chain(logprobs: np.ndarray, temperature: float, top_k: int, top_p: float,
                 min_p: float) -> np.ndarray:
    """vLLM's sampler written out densely, step by step as vllm/v1/sample/sampler.py orders
    it: temperature, min_p over the probabilities, top_k, then top_p over what is left."""
    logits = logprobs / temperature
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    logits = np.where(probabilities >= min_p * probabilities.max(), logits, -np.inf)
    if top_k:
        logits = np.where(logits >= np.sort(logits)[::-1][top_k - 1], logits, -np.inf)
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    order = np.argsort(-probabilities, kind="stable")
    count = int(np.searchsorted(np.cumsum(probabilities[order]), top_p, side="left")) + 1
    out = np.zeros_like(probabilities)
    out[order[:count]] = probabilities[order[:count]] / probabilities[order[:count]].sum()
    return out


def test_min_p_first_is_vllms_chain_and_keeps_no_more_than_min_p_last():
    """With min_p before top_p (vLLM) the distribution is vLLM's chain written out densely;
    top_p's nucleus over what min_p left is never wider than over the whole distribution."""
    rng = np.random.default_rng(3)
    narrower = 0
    for _ in range(60):
        logprobs = _log_softmax(rng.normal(0, 2.5, 400))
        kw = dict(temperature=float(rng.uniform(0.4, 1.5)), top_k=int(rng.choice([0, 50])),
                  top_p=float(rng.uniform(0.3, 0.99)), min_p=float(rng.uniform(0.01, 0.2)))
        first = transformed(logprobs, _transform(**kw, min_p_first=True))
        np.testing.assert_allclose(first, _vllms_chain(logprobs, **kw), atol=1e-12)
        last = transformed(logprobs, _transform(**kw))
        assert np.count_nonzero(first) <= np.count_nonzero(last)
        narrower += np.count_nonzero(first) < np.count_nonzero(last)
    assert narrower > 10  # the order matters, often


def test_unknown_server_without_temperature_is_not_resolvable():
    assert resolve_transform(SamplingParams(), SERVER_DEFAULTS["unknown"]) is None
    llama = resolve_transform(SamplingParams(), SERVER_DEFAULTS["llama.cpp"])
    assert (llama.top_k, llama.min_p, llama.temperature_last) == (40, 0.05, True)
    told = resolve_transform(SamplingParams(temperature=0.5, top_k=5), ServerDefaults())
    assert (told.temperature, told.top_k, told.top_p) == (0.5, 5, 1.0)


def test_topk_kld_is_exact_with_the_whole_vocabulary_and_a_lower_bound_without():
    rng = np.random.default_rng(1)
    for _ in range(20):
        p = _log_softmax(rng.normal(0, 2, 200))
        q = _log_softmax(rng.normal(0, 2, 200))
        exact = float(np.sum(np.exp(p) * (p - q)))  # KL(primary || reference)
        reverse = float(np.sum(np.exp(q) * (q - p)))  # llama-perplexity's direction
        full = _topk_kld(p, q)
        assert math.isclose(full.estimate, exact, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(full.lower_bound, exact, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(full.reverse, reverse, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(full.coverage, 1.0, rel_tol=1e-9)
        top = np.argsort(-p)[:10]
        part = _topk_kld(p[top], q[top])
        assert part.lower_bound <= exact + 1e-12 and part.coverage < 1.0
        assert part.estimate >= part.lower_bound


def test_topk_kld_tail_correction_recovers_the_mass_lumping_loses():
    """A primary whose logits are the reference's plus token-independent noise (what
    quantization does): from its top-20 alone the lumped figure misses the tail's share, the
    corrected one lands on the full-vocabulary KLD, in both directions."""
    rng = np.random.default_rng(2)
    for noise in (0.05, 0.3, 0.8):
        exact, rev_exact, bound, estimate, reverse = [], [], [], [], []
        for _ in range(200):
            q = _log_softmax(rng.gumbel(0, 1.5, 5000))
            p = _log_softmax(q + rng.normal(0, noise, q.size))
            top = np.argsort(-p)[:20]
            kld = _topk_kld(p[top], q[top])
            exact.append(np.sum(np.exp(p) * (p - q)))
            rev_exact.append(np.sum(np.exp(q) * (q - p)))
            bound.append(kld.lower_bound)
            estimate.append(kld.estimate)
            reverse.append(kld.reverse)
        assert np.mean(bound) < 0.9 * np.mean(exact)  # the tail matters here
        assert abs(np.mean(estimate) / np.mean(exact) - 1) <= 0.10, (noise, np.mean(estimate),
                                                                    np.mean(exact))
        assert abs(np.mean(reverse) / np.mean(rev_exact) - 1) <= 0.10


def _synthetic_scores(logprobs: np.ndarray, tokens: np.ndarray,
                      offsets: np.ndarray | None = None) -> ReferenceScores:
    """A local scorer's scores of ``tokens``: ``offsets`` the rows' log-normalizers (raw
    logits = logprobs + offsets; 3 nats everywhere unless given: mixed-sign raw logits)."""
    top_ids, top_lp = top_of(logprobs.astype(np.float32))
    return ReferenceScores(
        logit_offsets=np.full(len(tokens), 3.0) if offsets is None else offsets,
        token_ids=tuple(int(t) for t in tokens), token_texts=tuple(f"t{t}" for t in tokens),
        top_ids=top_ids, top_logprobs=top_lp,
        top_texts=tuple(tuple(f"t{i}" for i in row) for row in top_ids),  # all k, as local
        chosen_logprob=logprobs[np.arange(len(tokens)), tokens].astype(np.float32),
        logprobs=logprobs.astype(np.float32), prompt_token_ids=(0,))


def _sample(tokens: np.ndarray, sampling: SamplingParams) -> GenerationSample:
    return GenerationSample(model="m", endpoint="completions", prompt="p",
                            completion_text="".join(f"t{t}" for t in tokens),
                            tokens=tuple(TokenLogprob(f"t{t}") for t in tokens),
                            sampling=sampling)


@pytest.mark.parametrize("server", ["llama.cpp", "vllm"])
def test_z_is_standard_normal_when_the_primary_samples_the_reference(server):
    """Property: tokens drawn from the reference's own transformed distribution give z with
    mean ~0 and variance ~1 (loose bounds over 200 completions of 32 tokens)."""
    rng = np.random.default_rng(2)
    # vLLM's sampler order at its neutral defaults (--generation-config vllm)
    defaults = SERVER_DEFAULTS[server] if server == "llama.cpp" else \
        server_defaults(engine="vllm", generation_config={})
    sampling = SamplingParams(temperature=0.9)
    transform = resolve_transform(sampling, defaults)
    zs = []
    for _ in range(200):
        logprobs = _log_softmax(rng.normal(0, 2.5, (32, 400)))
        tokens = np.array([rng.choice(400, p=transformed(row, transform)) for row in logprobs])
        check = check_generation(_sample(tokens, sampling), _synthetic_scores(logprobs, tokens),
                                 defaults)
        assert check.mode == "sampled"
        zs.append(check.statistic)
    zs = np.array(zs)
    assert abs(zs.mean()) < 0.3 and 0.6 < zs.std() < 1.4
    assert np.mean(np.abs(zs) > GenerationThresholds().max_abs_z) < 0.02


def _two_candidate_rows(rng, n: int, vocab: int = 300) -> np.ndarray:
    """Rows where the transform keeps two candidates, the second at 2-5% (a capital after "The
    capital of France is", and an article): a short completion's z is far from normal."""
    logits = np.full((n, vocab), -30.0)
    minority = rng.uniform(0.02, 0.05, n)
    logits[:, 0], logits[:, 1] = 0.0, np.log(minority / (1.0 - minority))
    return _log_softmax(logits)


@pytest.mark.parametrize("length", [1, 2])
def test_a_short_sampled_completion_fails_no_more_often_than_max_abs_z_promises(length):
    """A healthy server's 1-2 token answers from such positions: |z| beyond max_abs_z up to one
    time in twenty (the minority token's surprise over a small variance), but the verdict
    fails them at most as often as exp(-max_abs_z^2 / 2) per side allows (3.4e-4 at 4): over
    1,500 completions, at most a few, where z alone failed tens."""
    rng = np.random.default_rng(11 + length)
    defaults = SERVER_DEFAULTS["llama.cpp"]
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.01)
    transform = resolve_transform(sampling, defaults)
    beyond = failed = 0
    for _ in range(1500):
        logprobs = _two_candidate_rows(rng, length)
        tokens = np.array([rng.choice(300, p=transformed(row, transform)) for row in logprobs])
        check = check_generation(_sample(tokens, sampling), _synthetic_scores(logprobs, tokens),
                                 defaults)
        beyond += abs(check.statistic) > GenerationThresholds().max_abs_z
        failed += not check.passed
    assert beyond >= 10  # z alone would have failed these
    assert failed <= 3


def test_the_tail_bound_bounds_the_exact_tail_and_is_tight_over_many_tokens():
    """Chernoff's bound against the exact chance (every outcome of 3 positions enumerated):
    never below it; over 200 tokens it is exp(-z^2 / 2) within a small factor; 0 beyond every
    sum the candidates can give. (The surprise's right tail is heavier than the Gaussian's:
    there the bound exceeds exp(-z^2 / 2), by 2x at z 4 over 200 tokens.)"""
    rng = np.random.default_rng(4)
    transform = _transform(temperature=1.0, top_k=4)
    logprobs = _log_softmax(rng.normal(0, 2.0, (3, 50)))
    supports = []
    for row in logprobs.astype(np.float32).astype(np.float64):  # (as the scores hold them)
        pi = transformed(row, transform)
        mixed = np.log(0.95 * pi + 0.05 * np.exp(row) + 1e-12)
        held = np.flatnonzero(pi)
        supports.append([(pi[j], -mixed[j] + pi @ mixed, j) for j in held])
    outcomes = [(a[0] * b[0] * c[0], a[1] + b[1] + c[1], (a[2], b[2], c[2]))
                for a in supports[0] for b in supports[1] for c in supports[2]]
    for _, total, tokens in outcomes:
        scores = _synthetic_scores(logprobs, np.array(tokens))
        total = float(sampled_terms(scores, transform, 0.05)[0].sum())
        side = 1 if total >= 0 else -1
        exact = sum(p for p, s, _ in outcomes if side * s >= side * total - 1e-6)
        bound = sampled_tail_bound(scores, transform, 0.05, total)
        assert bound >= exact * (1 - 1e-6), (tokens, bound, exact)
    # Many tokens: the bound approaches the Gaussian's exponent.
    logprobs = _log_softmax(rng.normal(0, 2.5, (200, 400)))
    transform = _transform(temperature=1.0)
    tokens = np.array([rng.choice(400, p=transformed(row, transform)) for row in logprobs])
    scores = _synthetic_scores(logprobs, tokens)
    terms, variances, _ = sampled_terms(scores, transform, 0.05)
    for z in (-4.0, 3.0, 4.5):
        total = z * math.sqrt(variances.sum())
        ratio = sampled_tail_bound(scores, transform, 0.05, total) / math.exp(-z * z / 2)
        assert 0.05 < ratio < 5.0, (z, ratio)
    assert sampled_tail_bound(scores, transform, 0.05, 1e6) == 0.0


@pytest.mark.parametrize("truncation", ["min_p", "top_k", "top_p"])
def test_a_token_the_server_kept_at_a_truncations_edge_is_inside_within_the_slack(truncation):
    """Token 7 lies a hundredth of a nat past the cut in the reference's numbers (the server's
    own put it inside, as a healthy llama-server's did): kept; half a nat past it, outside,
    as it is without the slack."""
    from guard.verify.generation import transformed_support
    from guard.verify.generation.checks import BOUNDARY_SLACK

    for past, inside in ((0.01, True), (0.5, False)):
        probabilities = np.full(50, 1e-6)
        if truncation == "top_p":  # top_p 0.5: token 0 alone holds 0.5 e^past, 7 comes next
            transform = _transform(top_p=0.5)
            probabilities[0], probabilities[7] = 0.5 * math.exp(past), 0.05
            probabilities[8:] = (1.0 - probabilities[0] - 0.05) / 42  # (below token 7)
        else:
            probabilities[:6] = [0.3, 0.2, 0.15, 0.1, 0.08, 0.06]
            if truncation == "min_p":  # the cut: 0.05 x 0.3
                transform = _transform(min_p=0.05)
                probabilities[7] = 0.015 * math.exp(-past)
            else:  # top_k 6: token 7 just below the sixth
                transform = _transform(top_k=6)
                probabilities[7] = 0.06 * math.exp(-past)
        row = np.log(probabilities / probabilities.sum())
        kept, _ = transformed_support(row, transform, 7, BOUNDARY_SLACK)
        assert (7 in kept) == inside, (truncation, past, kept)
        assert 7 not in transformed_support(row, transform)[0]  # (no slack: outside)


def test_a_text_the_server_split_otherwise_is_scored_up_to_where_the_split_parts():
    """A completion known by its text alone, whose canonical first token ("--", id 7) the
    transform excludes while a kept top candidate ("-", id 3) begins it: the server sampled
    "-" and "-" (min_p keeps "-", drops "--"); scored on the canonical split it failed, with
    every later token read in a context the server never had. Scored up to that position with
    the candidate there, it passes; the same text with ids (the split known) is scored whole.
    A token outside the transform that no kept candidate begins still fails."""
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 1.0, (6, 50))
    logits[:, 3] += 6.0  # "-": kept everywhere
    logits[:, 7] -= 8.0  # "--": outside min_p 0.05
    logprobs = _log_softmax(logits)
    tokens = np.array([7, 3, 3, 3, 3, 3])
    texts = {3: "-", 7: "--"}
    scores = replace(_synthetic_scores(logprobs, tokens),
                     token_texts=tuple(texts.get(int(t), f"t{t}") for t in tokens))
    scores = replace(scores, top_texts=tuple(tuple(texts.get(int(i), f"t{i}") for i in row[:5])
                                             for row in scores.top_ids))
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.05)
    text_only = GenerationSample(model="m", endpoint="completions", prompt="p",
                                 completion_text="-------", sampling=sampling, tokens=())
    check = check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (check.mode, check.passed, check.tokens, check.out_of_support) == (
        "sampled", True, 1, 0)
    # (No same-top-1 for a draw: it compares argmaxes, and the primary's is not known.)
    assert math.isnan(check.top1_agreement) and check.top1_compared == 0
    with_ids = replace(text_only, tokens=tuple(TokenLogprob(texts.get(int(t), f"t{t}"),
                                                            token_id=int(t)) for t in tokens))
    whole = check_generation(with_ids, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (whole.mode, whole.passed, whole.tokens, whole.out_of_support) == (
        "sampled", False, 6, 1)
    no_prefix = replace(scores, top_texts=tuple(tuple(f"t{i}" for i in row[:5])
                                                for row in scores.top_ids))
    failed = check_generation(text_only, no_prefix, SERVER_DEFAULTS["llama.cpp"])
    assert not failed.passed
    # The reports say which token the server said, and which is only the reference's split
    # of a text the server said alone.
    said, split = whole.first_divergence, failed.first_divergence
    assert said is not None and split is not None
    assert said.split_known and not split.split_known
    assert divergent_token_phrase(said.as_dict()) == "the primary wrote '--'"
    assert divergent_token_phrase(split.as_dict()).startswith("the primary's text reads '--' "
                                                              "there (as the reference splits")
    again = GenerationCheck.from_dict(failed.as_dict()).first_divergence
    assert again is not None and not again.split_known


def _onethree(logprobs: np.ndarray, candidate_text: str
              ) -> tuple[ReferenceScores, GenerationSample]:
    """The scores of the text "onethree" tokenized "on" "et" "hree" (ids 7, 8, 9) and then id
    5 (``candidate_text``), and the sample that says the text alone, sampled at min_p 0.05."""
    tokens = np.array([7, 8, 9, 5])
    texts = {5: candidate_text, 7: "on", 8: "et", 9: "hree"}
    text_of = lambda i: texts.get(int(i), f"t{i}")  # noqa: E731
    base = _synthetic_scores(logprobs, tokens)
    scores = replace(base, token_texts=tuple(text_of(t) for t in tokens),
                     top_texts=tuple(tuple(text_of(i) for i in row) for row in base.top_ids))
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.05)
    return scores, GenerationSample(model="m", endpoint="completions", prompt="p", tokens=(),
                                    completion_text="onethree", sampling=sampling)


def test_a_split_candidate_below_the_best_five_is_seen():
    """The server's token where the text parts from the reference's tokenization may be any
    the transform keeps, not only one of the reference's best five: a healthy llama-server
    after a token-id prompt ([1, 27867, 27867, 270, 27867]) spelled "onethree" "one" "three"
    where "one" ranked below five other kept tokens (3 of 9 false drifts in 199 such calls
    came from there). Kept at rank 9 of 20 here: scored up to there; the best five alone would
    not see it and the completion fails."""
    rng = np.random.default_rng(13)
    logits = rng.normal(0, 1.0, (4, 50))
    logits[:, 10:18] = 8.0  # eight tokens ahead of the candidate, all kept
    logits[:, 5] = 7.0  # "one": kept (e^-1 of the best), ninth
    logits[:, 7] = -8.0  # "on", the text's canonical first token: outside min_p 0.05
    logprobs = _log_softmax(logits)
    scores, text_only = _onethree(logprobs, "one")
    assert list(scores.top_ids[0]).index(5) == 8
    check = check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (check.mode, check.passed, check.tokens, check.out_of_support) == (
        "sampled", True, 1, 0)
    best_five = replace(scores, top_texts=tuple(row[:5] for row in scores.top_texts))
    assert not check_generation(text_only, best_five, SERVER_DEFAULTS["llama.cpp"]).passed


def test_a_split_candidate_below_the_best_20_is_found_among_the_texts_pieces():
    """The transform keeps up to top_k 40 tokens, more than the reference's best 20 name: a
    healthy llama-server after a token-id prompt wrote "teennine...", which the reference
    tokenizes "te" "enn" ..., "te" outside the transform, and the server's "teen" kept but
    below the best 20 (z 24 scored on the canonical split: a false drift). A local scorer
    names, for a text-only completion, the vocabulary's tokens that begin the text at each
    position (``text_pieces``): the rule finds the candidate there; without them it fails."""
    rng = np.random.default_rng(19)
    logits = rng.normal(0, 1.0, (4, 60))
    logits[:, 20:45] = 8.0  # 25 tokens ahead of the candidate, all kept
    logits[:, 5] = 7.0  # "one": kept (e^-1 of the best), 26th
    logits[:, 7] = -8.0  # "on", the text's canonical first token: outside min_p 0.05
    logprobs = _log_softmax(logits)
    scores, text_only = _onethree(logprobs, "one")
    assert 5 not in scores.top_ids[0]
    assert not check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"]).passed
    pieces = replace(scores, text_pieces=((7, 5), (8,), (9,), (5,)))  # "on", "one" at 0
    check = check_generation(text_only, pieces, SERVER_DEFAULTS["llama.cpp"])
    assert (check.mode, check.passed, check.tokens, check.out_of_support) == (
        "sampled", True, 1, 0)


def test_a_text_that_parted_before_its_first_token_outside_is_scored_up_to_where_it_parted():
    """A healthy llama-server ran number words together, "three" "three", which the reference
    tokenizes "th" "re" "eth" ...: "th" is inside the transform, "re" (after "th", a context
    the server never had) is not. Where a kept candidate longer than the canonical token
    begins the text at an earlier position ("three" at 0), the completion is scored up to
    there with it; with no such candidate (one that does not begin the text, or a shorter
    piece alone) it still fails."""
    rng = np.random.default_rng(17)
    logits = rng.normal(0, 1.0, (4, 50))
    logits[:, 10:14] = 8.0  # the best tokens, kept
    logits[0, 7] = 7.0  # "th": inside the transform at 0
    logits[0, 5] = 7.5  # the candidate: kept at 0
    logits[1:, 8:10] = -8.0  # "re", "eth": outside min_p 0.05
    logprobs = _log_softmax(logits)
    tokens = np.array([7, 8, 9, 9])
    base = _synthetic_scores(logprobs, tokens)
    sampling = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.05)
    text_only = GenerationSample(model="m", endpoint="completions", prompt="p", tokens=(),
                                 completion_text="threetheth", sampling=sampling)

    def checked(candidate_text: str):
        texts = {5: candidate_text, 7: "th", 8: "re", 9: "eth"}
        scores = replace(base, token_texts=tuple(texts[int(t)] for t in tokens),
                         top_texts=tuple(tuple(texts.get(int(i), f"t{i}") for i in row)
                                         for row in base.top_ids))
        check = check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"])
        return check.mode, check.passed, check.tokens, check.out_of_support

    assert checked("three") == ("sampled", True, 1, 0)
    assert checked("thro") == ("sampled", False, 4, 3)  # does not begin the text
    assert checked("t") == ("sampled", False, 4, 3)  # a shorter piece before the first outside


@pytest.mark.parametrize("candidate_text", ["one", "\ufffd"])
def test_a_text_split_across_canonical_tokens_or_a_dropped_byte_is_scored_up_to_there(
        candidate_text):
    """The server's token at a position may be longer than the canonical one there ("one"
    where the text "onethree" was tokenized "on" "et" "hree") or a byte piece it left out of
    its text (no later token completed its character): where the canonical token lies
    outside the transform and such a kept candidate leads, the completion is scored up to
    there with it, as for a shorter piece."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 1.0, (4, 50))
    logits[:, 5] += 6.0  # the candidate: kept everywhere
    logits[:, 7] -= 8.0  # "on": outside min_p 0.05
    logprobs = _log_softmax(logits)
    scores, text_only = _onethree(logprobs, candidate_text)
    check = check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (check.mode, check.passed, check.tokens, check.out_of_support) == (
        "sampled", True, 1, 0)
    other = replace(scores, top_texts=tuple(tuple("two" if t == candidate_text else t
                                                  for t in row) for row in scores.top_texts))
    assert not check_generation(text_only, other, SERVER_DEFAULTS["llama.cpp"]).passed


def test_a_greedy_text_the_server_split_otherwise_is_scored_up_to_where_the_split_parts():
    """A greedy completion known by its text alone: the server took the argmax "\n" (id 3)
    twice, whose text the reference tokenizes as one "\n\n" (id 7), then went on. On the
    canonical split "\n\n" is a confident flip and every later token is read in a context the
    server never had; scored up to that position with the argmax there, it passes (a healthy
    llama-server's " Paris.\n\n"). With ids the split is known and the completion scored as
    the server said it. A confident flip that the argmax does not begin still fails."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1.0, (4, 50))
    logits[:, 3] += 8.0  # "\n": the argmax everywhere, by a wide margin
    logprobs = _log_softmax(logits)
    tokens = np.array([3, 7, 11, 12])  # the canonical tokenization: "\n" "\n\n" ...
    texts = {3: "\n", 7: "\n\n"}
    text_of = lambda i: texts.get(int(i), f"t{i}")  # noqa: E731
    scores = replace(_synthetic_scores(logprobs, tokens),
                     token_texts=tuple(text_of(t) for t in tokens))
    scores = replace(scores, top_texts=tuple(tuple(text_of(i) for i in row[:5])
                                             for row in scores.top_ids))
    greedy = SamplingParams(temperature=0.0)
    text_only = GenerationSample(model="m", endpoint="completions", prompt="p", tokens=(),
                                 completion_text="\n\n\nt11t12", sampling=greedy)
    check = check_generation(text_only, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (check.mode, check.passed, check.tokens, check.confident_disagreements) == (
        "greedy", True, 2, 0)
    with_ids = replace(text_only, tokens=tuple(TokenLogprob(text_of(t), token_id=int(t))
                                               for t in tokens))
    whole = check_generation(with_ids, scores, SERVER_DEFAULTS["llama.cpp"])
    assert (whole.mode, whole.passed, whole.tokens) == ("greedy", False, 4)
    unrelated = replace(scores, token_texts=("\n", "x\n", "t11", "t12"))
    assert not check_generation(text_only, unrelated, SERVER_DEFAULTS["llama.cpp"]).passed


@pytest.mark.parametrize("actual", [0.5, 1.6])
def test_z_is_large_when_the_primary_samples_another_distribution(actual):
    """A server that samples at another temperature than the request says (sharper or
    flatter): |z| over the threshold on most 64-token completions, with the sign of the fault."""
    rng = np.random.default_rng(3)
    sampling = SamplingParams(temperature=1.0)
    zs = []
    for _ in range(20):
        logprobs = _log_softmax(rng.normal(0, 2.5, (64, 400)))
        tokens = np.array([rng.choice(400, p=transformed(row, _transform(temperature=actual)))
                           for row in logprobs])
        zs.append(check_generation(_sample(tokens, sampling),
                                   _synthetic_scores(logprobs, tokens),
                                   NEUTRAL).statistic)
    zs = np.array(zs)
    assert np.mean(np.abs(zs) > GenerationThresholds().max_abs_z) >= 0.8
    assert np.sign(np.median(zs)) == (1 if actual > 1 else -1)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, temperature_last=True),
    dict(temperature=1.3, top_p=0.7),
    dict(temperature=0.6, repetition_penalty=1.3, presence_penalty=0.5, penalty_last_n=64),
])
def test_sampled_terms_match_the_dense_formula(kw):
    """The z-score's terms, computed on the kept set only, equal the formula over the whole
    vocabulary: s_t = -log m(x_t) + E_pi[log m], Var_pi[log m], m = (1-eps) pi + eps q (a
    token outside the support included)."""
    rng = np.random.default_rng(5)
    logprobs = _log_softmax(rng.gumbel(0, 2, (16, 3000)))
    tokens = np.array([rng.choice(3000, p=np.exp(row)) for row in logprobs])
    tokens[3] = int(np.argmin(logprobs[3]))  # outside every truncation
    transform = _transform(**kw)
    scores = replace(_synthetic_scores(logprobs, tokens), prompt_token_ids=(0, 5, 7))
    terms, variances, outside = sampled_terms(scores, transform, 0.05)
    for t, token in enumerate(tokens):
        row = scores.logprobs[t].astype(np.float64)
        if transform.penalized:  # on the raw logits (the repetition penalty's sign test)
            from guard.verify.generation.transform import _penalize

            row = _penalize(row + scores.logit_offsets[t], transform, (0, 5, 7),
                            tuple(int(i) for i in tokens), t)
            row = row - np.logaddexp.reduce(row)
        pi = transformed(row, transform)
        mixed = np.log(0.95 * pi + 0.05 * np.exp(row) + 1e-12)
        assert math.isclose(terms[t], -mixed[token] + pi @ mixed, rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(variances[t], pi @ mixed ** 2 - (pi @ mixed) ** 2, rel_tol=1e-6,
                            abs_tol=1e-9)
        assert outside[t] == (pi[token] == 0.0)
    truncated = transform.top_k or transform.top_p < 1.0 or transform.min_p > 0.0
    assert outside[3] == bool(truncated)


def test_a_sampled_completion_with_an_unknown_transform_is_not_comparable():
    rng = np.random.default_rng(4)
    logprobs = _log_softmax(rng.normal(0, 2, (8, 50)))
    tokens = logprobs.argmax(axis=1)
    check = check_generation(_sample(tokens, SamplingParams()), _synthetic_scores(logprobs, tokens))
    assert (check.mode, check.passed, check.statistic) == ("not_comparable", True, None)


def test_declared_server_defaults_lie_over_the_engines():
    declared = server_defaults({"top_k": 20, "min_p": None}, engine="llama.cpp")
    assert (declared.top_k, declared.min_p, declared.temperature_last) == (20, 0.05, True)
    assert server_defaults().temperature is None
    with pytest.raises(ValueError, match="server_defaults.top_q"):
        server_defaults({"top_q": 1})
    with pytest.raises(ValueError, match="engine"):
        server_defaults(engine="tgi")


# Qwen2.5-7B-Instruct's generation_config.json: what vLLM samples a request with that sets
# nothing (its --generation-config auto).
QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
        "repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def test_vllms_defaults_are_unknown_until_its_generation_config_is_declared():
    """vLLM samples a request that leaves them unsaid with the model's generation_config.json:
    without it every sampled field is unknown (only greedy and fully said requests compare);
    with it, the file's values over vLLM's neutral ones, the block's server_defaults over
    both (vLLM's --override-generation-config)."""
    vllm = SERVER_DEFAULTS["vllm"]
    assert unknown_sampling(SamplingParams(), vllm) == "temperature"
    rng = np.random.default_rng(7)
    logprobs = _log_softmax(rng.normal(0, 2, (8, 50)))
    tokens = logprobs.argmax(axis=1)
    check = check_generation(_sample(tokens, SamplingParams(temperature=0.7)),
                             _synthetic_scores(logprobs, tokens), vllm)
    assert (check.mode, check.cause) == ("not_comparable", "sampling_unknown")
    assert check.reason.startswith("the sampling transform is unknown: top_p is neither")
    assert unknown_sampling(SamplingParams(temperature=0.7), vllm) == "top_p"
    # Greedy: no truncation enters, the penalties do (they move the argmax).
    assert unknown_sampling(SamplingParams(temperature=0.0), vllm) == "repetition_penalty"
    assert unknown_sampling(SamplingParams(temperature=0.0, repetition_penalty=1.0,
                                           presence_penalty=0.0, frequency_penalty=0.0),
                            vllm) is None
    assert unknown_sampling(SamplingParams(temperature=0.0), SERVER_DEFAULTS["unknown"]) is None
    told = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0,
                          repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert resolve_transform(told, vllm) is not None

    qwen = server_defaults(engine="vllm", generation_config={
        k: v for k, v in QWEN.items() if k in ("temperature", "top_p", "top_k",
                                                "repetition_penalty")})
    transform = resolve_transform(SamplingParams(), qwen)
    assert (transform.temperature, transform.top_p, transform.top_k, transform.min_p,
            transform.repetition_penalty, transform.temperature_last) == \
        (0.7, 0.8, 20, 0.0, 1.05, False)
    assert resolve_transform(SamplingParams(temperature=1.0), qwen).top_k == 20
    over = server_defaults({"temperature": 0.5}, engine="vllm",
                           generation_config={"temperature": 0.7, "top_k": 20})
    assert (over.temperature, over.top_k, over.top_p) == (0.5, 20, 1.0)
    # An empty file: vLLM's neutral values, its own sampler order and penalty name.
    empty = server_defaults(engine="vllm", generation_config={})
    assert empty == replace(NEUTRAL, min_p_first=True, penalty_fields=("repetition_penalty",),
                            reads_repeat_last_n=False,
                            distribution_fields=SERVER_DEFAULTS["vllm"].distribution_fields)
    with pytest.raises(ValueError, match="generation_config: engine llama.cpp"):
        server_defaults(engine="llama.cpp", generation_config={})


def test_a_transform_declared_wider_than_vllms_raises_false_drift_and_the_file_clears_it(
        tmp_path):
    """Why the vllm preset no longer guesses: completions drawn from the reference's own
    distribution as vLLM draws them for a model whose generation_config.json says temperature
    0.7, top_p 0.8, top_k 20 fail on most 64-token completions when scored as if vLLM sampled
    at its neutral temperature 1 (false drift on a healthy server), and pass once the file is
    declared (options.generation_config, read as vLLM reads it)."""
    from guard.protocol.generation import generation_config_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "eos_token_id": 2}')
    declared = server_defaults(engine="vllm",
                               generation_config=generation_config_defaults(str(tmp_path)))
    sampling = SamplingParams()  # the client leaves sampling to the server
    actual = resolve_transform(sampling, declared)
    rng = np.random.default_rng(4)
    failed = {"declared": 0, "neutral": 0}
    for _ in range(20):
        logprobs = _log_softmax(rng.normal(0, 2.5, (64, 400)))
        tokens = np.array([rng.choice(400, p=transformed(row, actual)) for row in logprobs])
        for name, defaults in (("declared", declared), ("neutral", NEUTRAL)):
            check = check_generation(_sample(tokens, sampling),
                                     _synthetic_scores(logprobs, tokens), defaults)
            assert check.mode == "sampled"
            failed[name] += not check.passed
    assert failed["declared"] <= 1 and failed["neutral"] >= 16, failed


def _draw(raw: np.ndarray, transform, prompt: tuple[int, ...], rng, greedy=False) -> np.ndarray:
    """Tokens as vLLM draws them: penalties on the raw logits (a positive one divided by the
    repetition penalty, a negative one multiplied), then the transform."""
    from guard.verify.generation.transform import _penalize

    tokens: list[int] = []
    for t, row in enumerate(raw):
        penalized = _penalize(row.astype(np.float64), transform, prompt, tuple(tokens) + (0,), t)
        lp = penalized - np.logaddexp.reduce(penalized)
        tokens.append(int(np.argmax(lp)) if greedy else
                      int(rng.choice(len(row), p=transformed(lp, transform))))
    return np.array(tokens)


def test_a_repetition_penalty_is_applied_to_the_raw_logits():
    """vLLM and llama.cpp divide a positive raw logit by the repetition penalty and multiply a
    negative one: a log-softmax (all negative) alone would be multiplied everywhere, a
    penalty of a few hundredths of a nat where the server takes off one or more. Scored on
    the raw logits (the local scorer's offsets), completions drawn so give z about N(0, 1)
    and greedy ones agree with the penalized argmax; scores without the offsets are not
    comparable, never scored on the wrong penalty."""
    rng = np.random.default_rng(6)
    penalty = SamplingParams(temperature=0.8, repetition_penalty=1.3)
    transform = resolve_transform(penalty, NEUTRAL)
    prompt = tuple(range(0, 400, 7))
    zs, flips = [], 0
    for _ in range(100):
        raw = rng.normal(4.0, 2.5, (48, 400))  # mostly positive, as an LLM's logits are
        logprobs = _log_softmax(raw)
        offsets = (raw - logprobs)[:, 0]
        tokens = _draw(raw, transform, prompt, rng)
        scores = replace(_synthetic_scores(logprobs, tokens, offsets), prompt_token_ids=prompt)
        check = check_generation(_sample(tokens, penalty), scores, NEUTRAL)
        assert check.mode == "sampled"
        zs.append(check.statistic)
    zs = np.array(zs)
    assert abs(zs.mean()) < 0.3 and 0.6 < zs.std() < 1.4, (zs.mean(), zs.std())

    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    for _ in range(5):
        raw = rng.normal(4.0, 2.5, (48, 400))
        logprobs = _log_softmax(raw)
        tokens = _draw(raw, resolve_transform(greedy, NEUTRAL), prompt, rng, greedy=True)
        scores = replace(_synthetic_scores(logprobs, tokens, (raw - logprobs)[:, 0]),
                         prompt_token_ids=prompt)
        check = check_generation(_sample(tokens, greedy), scores, NEUTRAL)
        assert (check.mode, check.passed, check.statistic) == ("greedy", True, 0.0)
        flips += int(np.sum(logprobs.argmax(axis=1) != tokens))
    assert flips > 0  # the penalty moved argmaxes an unpenalized check would call flips

    remote = replace(scores, logit_offsets=None)
    check = check_generation(_sample(tokens, greedy), remote, NEUTRAL)
    assert (check.mode, check.cause) == ("not_comparable", "penalties")
    assert "raw logits" in check.reason and check.cause in NOT_COMPARABLE_CAUSES


class _LlamaCppPenalties:
    """llama.cpp's penalties sampler (src/llama-sampler.cpp, llama_sampler_penalties), written
    out: a ring of the last ``last_n`` accepted tokens and their counts; every token with a
    count has its logit divided (positive) or multiplied (not) by the repeat penalty, less
    ``count * frequency + presence``. llama-server accepts the prompt's tokens into it before
    the first sampled one (server-context.cpp, init_sampler)."""

    def __init__(self, last_n: int, repeat: float, frequency: float, presence: float):
        self.last_n, self.repeat = last_n, repeat
        self.frequency, self.presence = frequency, presence
        self.ring: list[int] = []

    def accept(self, token: int) -> None:
        self.ring = (self.ring + [token])[-self.last_n:] if self.last_n else []

    def apply(self, logits: np.ndarray) -> np.ndarray:
        out = logits.copy()
        for token, count in collections.Counter(self.ring).items():
            out[token] = out[token] * self.repeat if out[token] <= 0 else \
                out[token] / self.repeat
            out[token] -= count * self.frequency + self.presence
        return out


def _llama_cpp_completion(raw: np.ndarray, prompt: tuple[int, ...], transform, rng,
                          greedy: bool = False) -> list[int]:
    """One completion as llama-server draws it: the prompt's tokens accepted into its penalty
    sampler, then per position the penalties and its chain (or the penalized argmax)."""
    sampler = _LlamaCppPenalties(transform.penalty_last_n, transform.repetition_penalty,
                                 transform.frequency_penalty, transform.presence_penalty)
    for token in prompt:
        sampler.accept(token)
    tokens = []
    for row in raw:
        penalized = _log_softmax(sampler.apply(row))
        token = int(np.argmax(penalized)) if greedy else \
            int(rng.choice(row.size, p=transformed(penalized, transform)))
        tokens.append(token)
        sampler.accept(token)
    return tokens


@pytest.mark.parametrize("window", [None, 16])
def test_llama_cpps_penalties_count_the_prompt_in_one_window(window):
    """Completions drawn by llama.cpp's own penalty sampler (above, the prompt's tokens
    accepted first) with presence and frequency penalties: scored with the llama.cpp preset,
    sampled ones give z about N(0, 1) and greedy ones agree with the penalized argmax; with
    vLLM's meaning of those two penalties (the completion's tokens only) the same healthy
    greedy completions leave the argmax guard expects. A request's ``repeat_last_n`` is the
    window llama-server uses."""
    rng = np.random.default_rng(11)
    llama = SERVER_DEFAULTS["llama.cpp"]
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.2, presence_penalty=1.0, frequency_penalty=0.5,
                              repeat_last_n=window)
    transform = resolve_transform(sampling, llama)
    assert transform.penalty_last_n == (window or 64) and transform.penalties_share_window
    prompt = tuple(int(t) for t in rng.choice(60, 40))  # its tokens among the likely ones

    def scored(raw, tokens):
        logprobs = _log_softmax(raw)
        return replace(_synthetic_scores(logprobs, np.array(tokens), (raw - logprobs)[:, 0]),
                       prompt_token_ids=prompt)

    def logits():
        raw = rng.normal(3.0, 1.0, (32, 300))
        raw[:, :60] += 3.0  # the prompt's tokens the likely ones: penalties move the argmax
        return raw

    zs = []
    for _ in range(80):
        raw = logits()
        tokens = _llama_cpp_completion(raw, prompt, transform, rng)
        check = check_generation(_sample(np.array(tokens), sampling), scored(raw, tokens), llama)
        zs.append(check.statistic)
    zs = np.array(zs)
    assert abs(zs.mean()) < 0.35 and 0.6 < zs.std() < 1.4, (zs.mean(), zs.std())

    # Greedy, on a prompt that says one word 8 times: the penalties (0.5 a count) take the
    # word off the top, as llama.cpp counts the prompt; with vLLM's meaning guard expects
    # the word, confidently, and reads the healthy greedy answer as drift.
    word, other = 7, 200
    repeated = tuple(range(100, 132)) + (word,) * 8
    greedy = replace(sampling, temperature=0.0)
    vllms_meaning = replace(llama, penalties_share_window=False)
    for _ in range(3):
        raw = rng.normal(3.0, 1.0, (16, 300))
        raw[:, word] += 8.0
        raw[:, other] += 4.0
        tokens = _llama_cpp_completion(raw, repeated, resolve_transform(greedy, llama), rng,
                                       greedy=True)
        assert tokens[0] == other
        logprobs = _log_softmax(raw)
        scores = replace(_synthetic_scores(logprobs, np.array(tokens), (raw - logprobs)[:, 0]),
                         prompt_token_ids=repeated)
        sample = _sample(np.array(tokens), greedy)
        check = check_generation(sample, scores, llama)
        assert (check.mode, check.passed, check.statistic) == ("greedy", True, 0.0)
        misread = check_generation(sample, scores, vllms_meaning)
        assert (misread.mode, misread.passed) == ("greedy", False), misread.statistic


def test_the_penalty_window_is_the_requests_where_the_server_reads_it():
    asked = SamplingParams(temperature=0.0, repeat_last_n=256)
    assert resolve_transform(asked, SERVER_DEFAULTS["llama.cpp"]).penalty_last_n == 256
    assert resolve_transform(replace(asked, repeat_last_n=-1),
                             SERVER_DEFAULTS["llama.cpp"]).penalty_last_n == -1
    # llama-cpp-python's server and vLLM have no such request field: their own window.
    assert resolve_transform(asked, SERVER_DEFAULTS["llama-cpp-python"]).penalty_last_n == 64
    vllm = server_defaults(engine="vllm", generation_config={})
    assert resolve_transform(asked, vllm).penalty_last_n == -1
    # llama-server's --repeat-last-n, declared.
    assert server_defaults({"penalty_last_n": 256}, engine="llama.cpp").penalty_last_n == 256


def test_a_low_temperature_is_checked_as_greedy_where_z_would_amplify_kernel_noise():
    """A primary whose logits differ from the reference's by kernel noise (0.1 nat, about a
    Q8_0's against its F16) samples at temperature 0.05: the sampled z reads the noise,
    amplified twenty-fold, as drift on some completions (beyond max_abs_z: the detector
    accumulates z^2); checked as greedy (the default below
    near_greedy_temperature) none fails. A primary that drifted (logits off by 1.5 nats)
    still fails every time."""
    rng = np.random.default_rng(7)
    sampling = SamplingParams(temperature=0.05)
    transform = resolve_transform(sampling, NEUTRAL)
    as_sampled = replace(GenerationThresholds(), near_greedy_temperature=0.0)
    failed = {"sampled": 0, "greedy": 0, "drifted": 0}
    for _ in range(40):
        raw = rng.normal(0.0, 2.0, (32, 200))
        logprobs = _log_softmax(raw)
        scores = _synthetic_scores(logprobs, np.zeros(32, np.int64), (raw - logprobs)[:, 0])
        for way, noise in (("healthy", 0.1), ("drifted", 1.5)):
            primary = raw + rng.normal(0.0, noise, raw.shape)
            tokens = np.array([rng.choice(200, p=transformed(_log_softmax(row), transform))
                               for row in primary])
            told = replace(scores, token_ids=tuple(int(t) for t in tokens),
                           token_texts=tuple(f"t{t}" for t in tokens),
                           chosen_logprob=logprobs[np.arange(32), tokens].astype(np.float32))
            sample = _sample(tokens, sampling)
            check = check_generation(sample, told, NEUTRAL)
            assert check.mode == "greedy"
            if way == "drifted":
                failed["drifted"] += not check.passed
                continue
            failed["greedy"] += not check.passed
            old = check_generation(sample, told, NEUTRAL, as_sampled)
            assert old.mode == "sampled"
            # (its z beyond max_abs_z: read as drift by the detector, which takes z^2)
            failed["sampled"] += abs(old.statistic) > as_sampled.max_abs_z
    assert failed["sampled"] > 0 and failed["greedy"] == 0 and failed["drifted"] == 40, failed
    top_k_one = check_generation(_sample(tokens, SamplingParams(temperature=0.9, top_k=1)),
                                 told, NEUTRAL)
    assert top_k_one.mode == "greedy"


@pytest.mark.parametrize("mark", [{"constraints": ("response_format",)},
                                  {"other_samplers": ("mirostat_mode",)}])
def test_constrained_decoding_is_not_comparable_without_logprobs_and_compared_with_them(mark):
    """A server that decodes greedily under a grammar picks the best token the grammar allows:
    where the grammar forbids the model's argmax, a greedy check reads a flip (and a sampled
    one a surprise) on a healthy pair. Marked, such a completion is not comparable; with the
    primary's logprobs (the model's own distribution, before the mask) it is compared and
    passes."""
    rng = np.random.default_rng(5)
    raw = rng.normal(0.0, 3.0, (32, 300))
    logprobs = _log_softmax(raw)
    allowed = rng.random((32, 300)) < 0.3  # the grammar's tokens at each position
    tokens = np.where(allowed, logprobs, -np.inf).argmax(axis=1)
    scores = _synthetic_scores(logprobs, tokens, (raw - logprobs)[:, 0])
    greedy = SamplingParams(temperature=0.0)

    unmarked = check_generation(_sample(tokens, greedy), scores, NEUTRAL)
    assert (unmarked.mode, unmarked.passed) == ("greedy", False)  # the false drift

    marked = _sample(tokens, replace(greedy, **mark))
    check = check_generation(marked, scores, NEUTRAL)
    cause = "constrained" if "constraints" in mark else "sampler"
    assert (check.mode, check.passed, check.cause, check.statistic) == (
        "not_comparable", True, cause, None)
    assert cause in NOT_COMPARABLE_CAUSES and next(iter(mark.values()))[0] in check.reason
    sampled = check_generation(replace(marked, sampling=replace(marked.sampling,
                                                                temperature=0.7)),
                               scores, NEUTRAL)
    assert (sampled.mode, sampled.cause) == ("not_comparable", cause)

    order = np.argsort(-logprobs, axis=1)[:, :5]
    told = replace(marked, tokens=tuple(
        TokenLogprob(f"t{t}", float(logprobs[i, t]),
                     tuple((f"t{j}", float(logprobs[i, j])) for j in order[i]))
        for i, t in enumerate(tokens)))
    check = check_generation(told, scores, NEUTRAL)
    assert (check.mode, check.passed) == ("logprobs", True)
    assert check.mean_kld < 1e-6


def test_a_field_the_servers_engine_ignores_constrains_nothing():
    """A constraint or sampler field is judged by the engine that got it: vLLM ignores
    llama.cpp's typical_p and grammar (and samples on past EOS under ignore_eos), llama.cpp
    ignores vLLM's min_tokens and bad_words; an unknown engine counts them all. Every field
    an engine is said to act on is one the request parser knows."""
    from guard.protocol.openai.requests import CONSTRAINT_FIELDS, SAMPLER_FIELDS
    from guard.verify.generation.defaults import (
        LLAMA_CPP_PYTHON_ACTS_ON,
        LLAMA_SERVER_ACTS_ON,
        VLLM_ACTS_ON,
    )

    known = set(CONSTRAINT_FIELDS) | set(SAMPLER_FIELDS)
    assert VLLM_ACTS_ON | LLAMA_SERVER_ACTS_ON | LLAMA_CPP_PYTHON_ACTS_ON <= known
    rng = np.random.default_rng(9)
    logprobs = _log_softmax(rng.normal(0.0, 2.0, (24, 300)))
    tokens = np.array([rng.choice(300, p=np.exp(row)) for row in logprobs])
    scores = _synthetic_scores(logprobs, tokens)
    vllm = server_defaults(engine="vllm", generation_config={})
    llama = SERVER_DEFAULTS["llama.cpp"]
    neutral_llama = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for fields, acts in ((dict(other_samplers=("typical_p",)), {"llama": True, "vllm": False}),
                         (dict(constraints=("grammar",)), {"llama": True, "vllm": False}),
                         (dict(constraints=("ignore_eos",)), {"llama": True, "vllm": False}),
                         (dict(constraints=("min_tokens", "bad_words")),
                          {"llama": False, "vllm": True})):
        sample = _sample(tokens, replace(neutral_llama, **fields))
        for name, defaults in (("llama", llama), ("vllm", vllm)):
            check = check_generation(sample, scores, defaults)
            assert (check.mode == "not_comparable") == acts[name], (fields, name, check.reason)
            if not acts[name]:
                assert check.mode == "sampled" and check.passed
        assert check_generation(sample, scores, NEUTRAL).mode == "not_comparable"


def _props_params(**changes) -> dict:
    """llama-server's GET /props default_generation_settings.params (the sampling part), as it
    answers them with its built-in defaults (tests/recorded/llama_server_props.json), with
    ``changes`` laid over."""
    recorded = json.loads((Path(__file__).parent.parent / "recorded" /
                           "llama_server_props.json").read_text())
    return {**recorded["props"]["default_generation_settings"]["params"], **changes}


def test_what_llama_server_reports_it_samples_with_is_what_the_tier_scores_with():
    """llama-server's own report (its defaults after the GGUF's general.sampling.* metadata and
    its flags) over the llama.cpp preset: its built-in defaults are the preset; a model's
    sampling defaults (here Qwen3's: temperature 0.6, top_k 20, min_p 0) and its chain's
    order replace the preset's; samplers guard does not model, on by default, make sampled
    calls not comparable; the block's server_defaults still win."""
    from guard.verify.generation.defaults import declared_defaults, llama_server_defaults

    preset = SERVER_DEFAULTS["llama.cpp"]
    assert llama_server_defaults(_props_params(), preset) == preset
    qwen = llama_server_defaults(_props_params(temperature=0.6, top_k=20, min_p=0.0), preset)
    assert (qwen.temperature, qwen.top_k, qwen.top_p, qwen.min_p) == (0.6, 20, 0.95, 0.0)
    assert declared_defaults({"engine": "llama.cpp", "server_defaults": {"top_k": 40}},
                             reported=_props_params(top_k=20)).top_k == 40
    chain = ["penalties", "temperature", "top_k", "min_p", "top_p"]
    reordered = llama_server_defaults(_props_params(samplers=chain), preset)
    assert (reordered.temperature_last, reordered.min_p_first) == (False, True)
    assert reordered.default_samplers == ()
    for odd in (["top_k", "temperature"], ["top_k", "penalties", "top_p", "min_p",
                                           "temperature"]):
        assert llama_server_defaults(_props_params(samplers=odd), preset
                                     ).default_samplers == ("samplers",)

    rng = np.random.default_rng(4)
    logprobs = _log_softmax(rng.normal(0.0, 2.0, (16, 300)))
    tokens = logprobs.argmax(axis=1)
    scores = _synthetic_scores(logprobs, tokens)
    sampled = _sample(tokens, SamplingParams(temperature=0.7, repeat_penalty=1.0))
    greedy = _sample(tokens, SamplingParams(temperature=0.0, repeat_penalty=1.0))
    for on, greedy_compared in (({"mirostat": 2}, False), ({"dry_multiplier": 0.8}, False),
                                ({"top_n_sigma": 1.5}, True)):
        defaults = llama_server_defaults(_props_params(**on), preset)
        check = check_generation(sampled, scores, defaults)
        assert (check.mode, check.cause) == ("not_comparable", "sampler"), on
        assert next(iter(on)) in check.reason and "/props" in check.reason
        assert (check_generation(greedy, scores, defaults).mode == "greedy") == greedy_compared
    assert check_generation(sampled, scores, preset).mode == "sampled"


@pytest.mark.parametrize("text, message", [
    ("{", "is not JSON"),
    ("[1]", "is not a JSON object"),
    ('{"temperature": "hot"}', "temperature 'hot' is not a number"),
])
def test_a_generation_config_that_cannot_be_read_is_refused_naming_it(tmp_path, text, message):
    from guard.protocol.generation import generation_config_defaults

    path = tmp_path / "generation_config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"generation_config: {path}.*{message}"):
        generation_config_defaults(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        generation_config_defaults(str(tmp_path / "absent.json"))
    assert generation_config_defaults("vllm") == {}


def test_summary_weighs_every_token_and_names_the_first_divergent_record():
    from guard.verify.generation import summarize

    rng = np.random.default_rng(5)
    checks = []
    for length in (4, 12):
        logits = rng.normal(0, 1, (length, 30))
        logits[np.arange(length), logits.argmax(axis=1)] += 5.0  # a confident reference
        logprobs = _log_softmax(logits)
        tokens = np.argsort(-logprobs, axis=1)[:, 1]  # always the reference's second choice
        scores = _synthetic_scores(logprobs, tokens)
        sample = _sample(tokens, SamplingParams(temperature=0.0))
        told = replace(sample, tokens=tuple(
            TokenLogprob(f"t{t}", float(logprobs[i, t] - 0.1),
                         ((f"t{t}", float(logprobs[i, t] - 0.1)),))
            for i, t in enumerate(tokens)))
        checks.append(check_generation(told, scores))
    summary = summarize(checks, records=[7, 9])
    every = np.concatenate([c.per_token_kld for c in checks])
    assert summary["checks"] == 2 and math.isclose(summary["mean_kld"], every.mean())
    assert summary["top1_agreement"] == 0.0
    assert (summary["first_divergence"]["record"], summary["first_divergence"]["position"]) \
        == (7, 0)


def test_the_summary_gives_the_sampled_completions_z():
    """Sampled completions have no KLD and no same top-1: the summary (the report's
    tiers.generation block) gives their z instead, mean, standard deviation and pooled
    (sum / sqrt(n): about N(0, 1) over healthy completions), and the report shows them."""
    from guard.replay.generation_report import summary_rows
    from guard.verify.generation import summarize

    zs = (0.5, -1.0, 2.0, 0.1)
    checks = [GenerationCheck(passed=True, mode="sampled", statistic=z, z=z, tokens=8)
              for z in zs]
    checks.append(GenerationCheck(passed=True, mode="greedy", statistic=0.0, tokens=8,
                                  top1_agreement=1.0, top1_compared=8))
    summary = summarize(checks)
    assert summary["z_completions"] == 4 and summary["top1_agreement"] == 1.0
    assert math.isclose(summary["z_mean"], np.mean(zs))
    assert math.isclose(summary["z_sd"], np.std(zs))
    assert math.isclose(summary["z_pooled"], sum(zs) / 2.0)
    rows = dict(summary_rows(summary))
    assert rows["Pooled z (sum / sqrt(n))"] == "0.8"
    none = summarize(checks[-1:])
    assert none["z_completions"] == 0 and none["z_pooled"] is None
    assert "Mean z" not in dict(summary_rows(none))
