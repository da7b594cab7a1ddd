"""The llama_cpp reference asks llama.cpp for the completion positions' logits only
(``completion_logits``): they must be the rows ``Llama.eval`` with ``logits_all`` leaves, over
one decode call and over several (``n_batch`` smaller than the sequence), and the scorer's
``forward`` their log-softmax; with the prompt cached (``options.cache_prompt``), the rows of a
whole evaluation."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from guard.backends.llama_cpp import completion_logits, open_llama  # noqa: E402
from guard.backends.scoring import log_normalize  # noqa: E402
from guard.backends.scoring import common_prefix  # noqa: E402
from guard.zoo import llm  # noqa: E402

try:
    SHIPPED = llm.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module")
def models():
    every = open_llama(SHIPPED, context_length=128, threads=1, batch=16, logits_all=True)
    marked = open_llama(SHIPPED, context_length=128, threads=1, batch=16, logits_all=False)
    yield every, marked
    every.close()
    marked.close()


@pytest.mark.parametrize("prompt_length", [1, 7, 16, 17, 40])
def test_the_marked_rows_are_the_rows_every_position_gives(models, prompt_length):
    every, marked = models
    text = " ".join(llm.PROMPTS * 4)
    ids = every.tokenize(text.encode(), add_bos=True)[:41]
    assert len(ids) == 41  # 3 decode calls of at most 16 tokens
    every.reset()
    every.eval(ids)
    expected = np.array(every.scores[prompt_length - 1:len(ids) - 1])
    got = completion_logits(marked, ids, prompt_length)
    assert got.shape == expected.shape == (len(ids) - prompt_length, marked.n_vocab())
    # The LM head runs over fewer rows, which may change the kernel's summation order.
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=0)
    # The best token agrees, up to a near-tie within that noise.
    best = expected.argmax(axis=1)
    assert (got[np.arange(len(best)), best] >= got.max(axis=1) - 2e-2).all()


def test_a_second_evaluation_starts_from_an_empty_cache(models):
    _, marked = models
    first = marked.tokenize(llm.PROMPTS[0].encode(), add_bos=True)
    other = marked.tokenize(llm.PROMPTS[1].encode(), add_bos=True)
    once = completion_logits(marked, first, 3)
    completion_logits(marked, other, 2)
    np.testing.assert_array_equal(completion_logits(marked, first, 3), once)


def test_the_scorer_forward_is_their_log_softmax(tmp_path):
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig

    scorer = create_backend(BackendConfig(backend="llama_cpp", path=str(SHIPPED),
                                          options={"context_length": 128}), "reference")
    scorer.load()
    try:
        ids = scorer.encode_prompt(llm.PROMPTS[2])
        expected = log_normalize(completion_logits(scorer.llm, ids, 4))[0]
        np.testing.assert_array_equal(scorer.forward(ids, 4), expected)
        assert np.exp(expected).sum(axis=1) == pytest.approx(1.0, abs=1e-4)
    finally:
        scorer.close()


@pytest.fixture(scope="module")
def scorers():
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig

    made = {}
    for cache in (True, False):
        made[cache] = create_backend(BackendConfig(
            backend="llama_cpp", path=str(SHIPPED),
            options={"context_length": 256, "batch": 64, "cache_prompt": cache}), "reference")
        made[cache].load()
    yield made
    for scorer in made.values():
        scorer.close()


def _decoded_tokens(scorer, monkeypatch) -> list[int]:
    """The tokens each of llama.cpp's decode calls evaluates, counted as they go in."""
    counts: list[int] = []
    context = scorer.llm._ctx
    decode = context.decode

    def counted(batch):
        counts.append(int(batch.batch.n_tokens))
        return decode(batch)

    monkeypatch.setattr(context, "decode", counted)
    return counts


def test_a_shared_prompt_prefix_is_evaluated_once_and_scores_as_a_whole_evaluation(
        scorers, monkeypatch):
    """A second sample whose prompt shares the first's preamble evaluates only what follows
    it (llama.cpp's cache_prompt), and its rows are those of a whole evaluation from an empty
    cache (a scorer with cache_prompt false), within summation-order noise."""
    cached, whole = scorers[True], scorers[False]
    preamble = cached.encode_prompt(" ".join(llm.PROMPTS) + " Answer briefly.")
    first = preamble + cached.vocab.encode(" What is the capital of France?")
    second = preamble + cached.vocab.encode(" Name a large river in Europe:")
    completion = cached.vocab.encode(" The Danube, which flows through Vienna.")
    cached.forward(first + completion, len(first))
    counts = _decoded_tokens(cached, monkeypatch)
    got = cached.forward(second + completion, len(second))
    shared = common_prefix(first, second)  # the preamble (and any token after it alike)
    assert len(preamble) <= shared < len(second)
    assert sum(counts) == len(second) + len(completion) - shared
    expected = whole.forward(second + completion, len(second))
    assert got.shape == expected.shape == (len(completion), cached.vocab.size)
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)
    assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()


def test_the_same_sequence_again_evaluates_from_the_first_scored_position(scorers,
                                                                          monkeypatch):
    cached = scorers[True]
    ids = cached.encode_prompt(llm.PROMPTS[3]) + cached.vocab.encode(" and so on")
    once = cached.forward(ids, 5)
    counts = _decoded_tokens(cached, monkeypatch)
    np.testing.assert_array_equal(cached.forward(ids, 5), once)
    assert sum(counts) == len(ids) - 4  # position 4 predicts ids[5]: it is evaluated again


def test_after_a_greedy_continuation_the_next_score_starts_from_an_empty_cache(scorers,
                                                                               monkeypatch):
    cached, whole = scorers[True], scorers[False]
    prompt = cached.encode_prompt(llm.PROMPTS[4])
    continuation = cached.greedy(prompt, 6)
    ids = prompt + continuation
    counts = _decoded_tokens(cached, monkeypatch)
    got = cached.forward(ids, len(prompt))
    assert sum(counts) == len(ids)
    np.testing.assert_allclose(got, whole.forward(ids, len(prompt)), atol=1e-3, rtol=0)
