"""An echo call (lm-eval's loglikelihood shape) scored by a real reference: the prompt's tokens
after the first, with the primary's logprobs, against the reference's teacher-forced pass from
that first token. A primary that reports the reference's own logprobs passes at KLD ~0; one
whose echo logprobs sit a position off (llama-cpp-python 0.3.36's, upstream issue 1983) fails.

The reference is llama_cpp on the shipped SmolLM2 GGUF (no BOS: the first token is the text's)
and on a copy whose tokenizer adds BOS (tests/unit/test_special_tokens.py: the first token is
BOS, and every token of the text is scored); the "primary" answers are built from the same
reference's numbers, so the property tested is the positions' bookkeeping.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob  # noqa: E402
from guard.verify.generation import SERVER_DEFAULTS, check_generation  # noqa: E402
from guard.zoo.llm import smollm2_gguf  # noqa: E402

try:
    SHIPPED = smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)

CONTEXT = "Question: What is the capital of France?\nAnswer:"
CONTINUATION = " The capital of France is Paris."


@pytest.fixture(scope="module", params=["shipped", "adds_bos"])
def reference(request, tmp_path_factory):
    from test_special_tokens import _adding_bos

    path = str(SHIPPED) if request.param == "shipped" else _adding_bos(
        tmp_path_factory.mktemp("bos"))
    scorer = create_backend(BackendConfig(backend="llama_cpp", path=path,
                                          options={"context_length": 256}), "reference", 1)
    scorer.load()
    yield scorer
    scorer.close()


def test_an_echo_is_scored_from_the_prompts_first_token(reference):
    ids = reference.encode_prompt(CONTEXT + CONTINUATION)
    texts = [reference.vocab.token_text(i) for i in ids]
    # What the echo answer holds after its first token, logprobs to be filled in.
    unscored = GenerationSample(
        model="smol", endpoint="completions", prompt=CONTEXT + CONTINUATION, echo=True,
        completion_text="".join(texts[1:]), sampling=SamplingParams(temperature=0.0,
                                                                    max_tokens=0, logprobs=1),
        tokens=tuple(TokenLogprob(text, 0.0) for text in texts[1:]))
    own = reference.score(unscored)
    assert own.scored and own.prompt_token_ids == tuple(ids[:1])
    assert (ids[0] == reference.bos_id) == reference.adds_bos
    assert own.token_ids == tuple(ids[1:]) and own.findings == ()
    # The reference's own numbers, as a server that computes them right would report them.
    top = [((own.top_texts[t][0], float(own.top_logprobs[t][0])),) for t in range(len(ids) - 1)]
    right = replace(unscored, tokens=tuple(
        TokenLogprob(text, float(own.chosen_logprob[t]), top[t])
        for t, text in enumerate(texts[1:])))
    check = check_generation(right, reference.score(right), SERVER_DEFAULTS["vllm"])
    assert (check.mode, check.passed) == ("logprobs", True), check.reason
    assert check.mean_kld < 1e-6 and check.tokens == len(ids) - 1
    # A vLLM answering processed logprobs echoes the prompt's raw ones all the same (its
    # prompt_logprobs are computed before sampling): compared as they are, whatever the
    # call's temperature.
    processed = replace(SERVER_DEFAULTS["vllm"], logprobs_mode="processed_logprobs",
                        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0)
    warm = replace(right, sampling=replace(right.sampling, temperature=0.6, top_p=0.8))
    check = check_generation(warm, reference.score(warm), processed)
    assert (check.mode, check.passed) == ("logprobs", True) and check.mean_kld < 1e-6
    # Each token given the next one's figures: one position off.
    shifted = replace(right, tokens=tuple(
        TokenLogprob(text, float(own.chosen_logprob[t + 1]), top[t + 1])
        for t, text in enumerate(texts[1:-1])) + (right.tokens[-1],))
    off = check_generation(shifted, reference.score(shifted), SERVER_DEFAULTS["vllm"])
    assert off.mode == "logprobs" and not off.passed, off
