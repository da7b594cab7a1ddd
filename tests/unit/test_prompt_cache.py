"""The local scorers cache the prompt (``options.cache_prompt``, on by default), as llama.cpp's
server and vLLM do: a sample whose prompt shares a preamble with the last one scored runs the
model only on what follows it, and scores exactly what a whole evaluation scores (within
summation-order noise). llama.cpp's decode calls are counted in
tests/unit/test_llama_cpp_logits.py; here the transformers model's input is."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.backends.scoring import common_prefix  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.zoo import llm  # noqa: E402

try:
    SHIPPED = llm.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)

OPTIONS = {"llama_cpp": {"context_length": 512}, "transformers": {}}


@pytest.fixture(scope="module", params=["llama_cpp", "transformers"])
def pair(request):
    """One scorer with the prompt cache, one without, of the same backend and file."""
    made = {}
    for cache in (True, False):
        made[cache] = create_backend(BackendConfig(
            backend=request.param, path=str(SHIPPED),
            options={**OPTIONS[request.param], "cache_prompt": cache}), "reference")
        made[cache].load()
    yield made[True], made[False]
    for scorer in made.values():
        scorer.close()


def _sequences(scorer):
    preamble = scorer.encode_prompt("You are a helpful assistant. " + " ".join(llm.PROMPTS))
    prompts = [preamble + scorer.vocab.encode(q) for q in
               (" Question: the capital of France?", " Question: a river in Germany?")]
    completion = scorer.vocab.encode(" The answer is short, and it is given in one line.")
    return preamble, prompts, completion


def test_a_shared_preamble_scores_as_a_whole_evaluation(pair):
    cached, whole = pair
    preamble, prompts, completion = _sequences(cached)
    for prompt in prompts + prompts[:1]:  # the first again, after the second
        got = cached.forward(prompt + completion, len(prompt))
        expected = whole.forward(prompt + completion, len(prompt))
        assert got.shape == expected.shape == (len(completion), cached.vocab.size)
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)
        assert (got.argmax(axis=1) == expected.argmax(axis=1)).all()


def test_transformers_runs_only_what_follows_the_cached_prefix(monkeypatch):
    scorer = create_backend(BackendConfig(backend="transformers", path=str(SHIPPED)),
                            "reference")
    scorer.load()
    try:
        preamble, (first, second), completion = _sequences(scorer)
        seen: list[int] = []
        embeddings = scorer._loaded_model().get_input_embeddings()
        hook = embeddings.register_forward_pre_hook(
            lambda module, args: seen.append(int(args[0].shape[-1])))
        try:
            scorer.forward(first + completion, len(first))
            scorer.forward(second + completion, len(second))
            scorer.forward(second + completion, len(second))
        finally:
            hook.remove()
        shared = common_prefix(first, second)
        assert len(preamble) <= shared < len(second)
        # Whole; after the shared prefix; from the position that predicts the completion.
        assert seen == [len(first) + len(completion), len(second) + len(completion) - shared,
                        len(completion) + 1]
    finally:
        scorer.close()
