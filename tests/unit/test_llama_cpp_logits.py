"""The llama_cpp reference asks llama.cpp for the completion positions' logits only
(``completion_logits``): they must be the rows ``Llama.eval`` with ``logits_all`` leaves, over
one decode call and over several (``n_batch`` smaller than the sequence), and the scorer's
``forward`` their log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from guard.backends.llama_cpp import completion_logits, log_softmax, open_llama  # noqa: E402
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
        expected = log_softmax(completion_logits(scorer.llm, ids, 4))
        np.testing.assert_array_equal(scorer.forward(ids, 4), expected)
        assert np.exp(expected).sum(axis=1) == pytest.approx(1.0, abs=1e-4)
    finally:
        scorer.close()
