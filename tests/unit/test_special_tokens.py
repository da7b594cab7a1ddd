"""vLLM's ``add_special_tokens: false`` on a completions call: the server tokenizes the prompt
without the model's BOS, as the client asked. The reference renders it so and expects no BOS,
where before the healthy call failed as a missing BOS and another template (false drift).

The shipped SmolLM2 adds no BOS, so the model here is a copy of its GGUF whose metadata says it
does (``tokenizer.ggml.add_bos_token``, as Llama's and Mistral's files say): llama.cpp then
adds BOS to every prompt it tokenizes, and the llama_cpp reference finds ``adds_bos``.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
gguf = pytest.importorskip("gguf", reason="gguf (the llm extra) is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.backends.scoring import PROMPT_RENDERED_OTHERWISE  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob  # noqa: E402
from guard.verify.generation import SERVER_DEFAULTS, check_generation  # noqa: E402
from guard.zoo.llm import smollm2_gguf  # noqa: E402

try:
    SHIPPED = smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0)
LLAMA = SERVER_DEFAULTS["llama.cpp"]


def _adding_bos(folder) -> str:
    """A copy of the shipped GGUF whose tokenizer adds BOS (the flag set in place)."""
    path = folder / "smol-adds-bos.gguf"
    shutil.copyfile(SHIPPED, path)
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["tokenizer.ggml.add_bos_token"]
    field.parts[field.data[0]][0] = 1
    del reader  # (its memory map, written back)
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = _adding_bos(tmp_path_factory.mktemp("bos"))
    scorer = create_backend(BackendConfig(backend="llama_cpp", path=path,
                                          options={"context_length": 256}), "reference", 1)
    scorer.load()
    yield scorer
    scorer.close()


def _sample(reference, server_ids, **fields) -> GenerationSample:
    """A greedy completion of ``server_ids`` (the prompt as the server read it), by the
    reference's own model: the healthy primary."""
    output = reference.greedy(list(server_ids), 8)
    tokens = tuple(TokenLogprob(reference.vocab.token_text(i), None, (), i) for i in output)
    return GenerationSample(model="smol", tokens=tokens, sampling=GREEDY,
                            completion_text="".join(t.text for t in tokens),
                            prompt_token_ids=tuple(server_ids), **fields)


def test_a_prompt_asked_without_special_tokens_is_compared_without_bos(reference):
    assert reference.adds_bos
    bos = reference.bos_id
    with_bos = reference.encode_prompt(PROMPT)
    assert with_bos[0] == bos
    plain = with_bos[1:]  # what vLLM reads with add_special_tokens false
    sample = _sample(reference, plain, endpoint="completions", prompt=PROMPT,
                     add_special_tokens=False)
    # With the server's ids: they are the prompt, and they are the rendering asked for.
    scores = reference.score(sample)
    assert scores.scored and not scores.approximate
    assert (scores.findings, scores.prompt_difference) == ((), "")
    check = check_generation(sample, scores, LLAMA)
    assert (check.mode, check.passed) == ("greedy", True), check.reason
    # The same ids without the client's field: a missing BOS and another rendering, failed.
    unasked = replace(sample, add_special_tokens=None)
    found = reference.score(unasked)
    assert found.findings == ("missing_bos", PROMPT_RENDERED_OTHERWISE)
    assert not check_generation(unasked, found, LLAMA).passed
    # Without the server's ids: the reference renders the prompt as asked (no BOS) ...
    rendered = reference.score(replace(sample, prompt_token_ids=None))
    assert rendered.approximate and rendered.findings == ()
    assert rendered.prompt_token_ids == tuple(plain)
    # ... and with it where the client left the default.
    default = reference.score(replace(sample, prompt_token_ids=None, add_special_tokens=None))
    assert default.prompt_token_ids == tuple(with_bos) and default.findings == ()
    # A prompt the client gave as token ids (lm-eval's tokenized requests) is read as given,
    # BOS or not: the client's choice too.
    given = replace(sample, prompt=None, add_special_tokens=None)
    assert reference.score(given).findings == ()
    assert check_generation(given, reference.score(given), LLAMA).passed
    # Two BOS the client wrote itself are its input too (found by the fuzzer: a healthy
    # llama-server's answer to ``"prompt": [1, 1]`` failed as double_bos).
    twice = _sample(reference, (bos, bos) + tuple(plain), endpoint="completions", prompt=None)
    assert reference.score(twice).findings == ()
    assert check_generation(twice, reference.score(twice), LLAMA).passed


def test_a_server_that_adds_bos_all_the_same_is_compared_as_it_read_the_prompt(reference):
    """llama.cpp's servers do not read ``add_special_tokens``: their ids start with BOS
    whatever the client asked. That is the prompt, as the model's own rendering: no
    finding. A doubled BOS stays one."""
    with_bos = reference.encode_prompt(PROMPT)
    sample = _sample(reference, with_bos, endpoint="completions", prompt=PROMPT,
                     add_special_tokens=False)
    scores = reference.score(sample)
    assert scores.scored and (scores.findings, scores.prompt_difference) == ((), "")
    assert check_generation(sample, scores, LLAMA).passed
    doubled = replace(sample, prompt_token_ids=(reference.bos_id,) + tuple(with_bos))
    assert "double_bos" in reference.score(doubled).findings


def test_a_chat_keeps_its_bos_check_whatever_the_client_asked(reference):
    """A chat's template writes its special tokens: add_special_tokens false is the chat
    endpoint's default, and a chat prompt without BOS is still a missing BOS."""
    messages = ({"role": "user", "content": "What is the capital of France?"},)
    rendered = reference.render_chat(messages)
    assert rendered[0] == reference.bos_id
    sample = _sample(reference, rendered[1:], endpoint="chat", messages=messages,
                     add_special_tokens=False)
    assert "missing_bos" in reference.score(sample).findings
