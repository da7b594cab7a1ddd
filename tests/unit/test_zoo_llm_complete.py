"""``guard.zoo.llm.complete`` builds the logprobs block itself (numpy, from the same logits):
it must be the block llama-cpp-python's own ``create_completion(logprobs=k)`` writes."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

from guard.backends.llama_cpp import open_llama  # noqa: E402
from guard.protocol.generation import SamplingParams  # noqa: E402
from guard.zoo import llm  # noqa: E402

try:
    SHIPPED = llm.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_k=40)])
def test_the_logprobs_block_is_llama_cpp_pythons_own(sampling):
    # Opened as guard opens a model: one thread for the prompt's batch too. llama-cpp-python's
    # default there is the CPU count; on a busy machine, after a torch test in the same worker,
    # a thread torch had started then spun during this one (per-thread CPU from /proc): the
    # suite charged it 14 s of CPU where alone it costs 1 s.
    model = open_llama(SHIPPED, context_length=256)
    try:
        ours = llm.complete(model, llm.PROMPTS[1], 12, sampling, logprobs=5, seed=7)
        model.reset()
        asked = {"temperature": 0.0} if sampling is None else {"temperature": 0.8, "top_k": 40}
        theirs = llm.sample_from_response(llm.PROMPTS[1], model.create_completion(
            llm.PROMPTS[1], max_tokens=12, logprobs=5, seed=7, **asked), ours.sampling)
    finally:
        model.close()
    assert ours.completion_text == theirs.completion_text
    assert len(ours.tokens) == len(theirs.tokens) > 0
    for a, b in zip(ours.tokens, theirs.tokens):
        assert a.text == b.text
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
