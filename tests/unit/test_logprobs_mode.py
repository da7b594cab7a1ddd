"""What a server's logprobs are (``options.logprobs_mode``, vLLM's ``--logprobs-mode``): raw,
after the sampling transform (processed_logprobs), or logits. A real primary whose logprobs
are after the transform: SmolLM2 in transformers (an implementation of temperature, top_k and
top_p of its own, ``generate(output_scores=True)``: the scores after its warpers, -inf where
they masked, written -9999 as vLLM writes them), against guard's llama_cpp reference on the
F16 file of the same weights. vLLM's own answers in these modes were recorded from vLLM 0.32
on the same model (benchmarks/llm_logprobs_mode.py runs them through guard end to end).

Every assertion is a property: a healthy pair agrees to kernel noise, a 3-bit primary is
nats away, and logits are never read as log-probabilities. vLLM's sampler order and the
repetition penalty's names are checked on its recorded answers (tests/recorded/).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.backends.openai_scorer import returns_logits  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob  # noqa: E402
from guard.verify.generation import (  # noqa: E402
    NEUTRAL,
    NOT_COMPARABLE_CAUSES,
    SERVER_DEFAULTS,
    GenerationThresholds,
    check_generation,
    declared_defaults,
)
from guard.verify.generation.transform import (  # noqa: E402
    resolve_transform,
    transformed_support,
)
from guard.zoo import llm as smol  # noqa: E402

try:
    smol.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)

VLLM_MASK = -9999.0  # how vLLM writes log 0 in a JSON answer
TOP = 5
TOKENS = 24
PROCESSED = replace(NEUTRAL, logprobs_mode="processed_logprobs")
LIMITS = GenerationThresholds()
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.9, logprobs=TOP)
TEMPERATURE_ONLY = SamplingParams(temperature=0.5, logprobs=TOP)
TOP_RECORDED = 40  # the top logprobs tests/recorded/vllm_sampler.json's nucleus calls asked

# vLLM 0.32, SmolLM2 fp32, `--logprobs-mode processed_logprobs`, "The capital of France is",
# temperature 0.7, top_p 0.8, logprobs 5 (the first two tokens of the answer): the nucleus
# held one token, the rest masked.
VLLM_PROCESSED = {"choices": [{"index": 0, "text": " Paris.", "logprobs": {
    "tokens": [" Paris", "."], "token_logprobs": [0.0, 0.0],
    "top_logprobs": [{" Paris": 0.0, "<|im_start|>": -9999.0, "<repo_name>": -9999.0,
                      "<reponame>": -9999.0, "<|endoftext|>": -9999.0},
                     {".": 0.0, "<|im_start|>": -9999.0, "<repo_name>": -9999.0,
                      "<reponame>": -9999.0, "<|endoftext|>": -9999.0}]}}]}
# The same server's chat answer, "Hi", temperature 0.5, top_p 0.5, top_logprobs 3.
VLLM_PROCESSED_CHAT = {"choices": [{"index": 0, "finish_reason": "length", "message": {
    "role": "assistant", "content": "Hello! How"}, "logprobs": {"content": [
        {"token": text, "logprob": 0.0, "bytes": list(text.encode()), "top_logprobs": [
            {"token": text, "logprob": 0.0, "bytes": list(text.encode())},
            {"token": "<|im_start|>", "logprob": -9999.0, "bytes": list(b"<|im_start|>")},
            {"token": "<|endoftext|>", "logprob": -9999.0, "bytes": list(b"<|endoftext|>")}]}
        for text in ("Hello", "!", " How")]}}]}
# The same server with `--logprobs-mode processed_logits`, temperature 1: logits.
VLLM_LOGITS = {"choices": [{"index": 0, "text": " Paris,", "logprobs": {
    "tokens": [" Paris", ","], "token_logprobs": [17.37127113342285, 23.86431312561035],
    "top_logprobs": [{" Paris": 17.3713, " the": 14.8886, " London": 13.245, " Le": 13.0095,
                      " New": 12.9515},
                     {",": 23.8643, ".": 25.1427, " and": 22.5274, " (": 21.0712,
                      '."': 21.0168}]}}]}


@pytest.fixture(scope="module")
def reference():
    f16 = smol.quant_ladder(("F16",))["F16"]
    built = create_backend(BackendConfig(backend="llama_cpp", path=str(f16),
                                         options={"context_length": 512}), "reference", 1)
    built.load()
    yield built
    built.close()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smol.hf_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(folder), model


@pytest.fixture(scope="module")
def coarse(hf):
    """The same model with every linear weight rounded to 31 levels per output row
    (round-to-nearest, symmetric, about 5 bits): a badly quantized primary (mean KLD
    0.7-1.6 nats per token here, Q2_K's order; its text still reads as English)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol.hf_folder(), dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True) / 15.0
                w.copy_(torch.round(w / scale).clamp(-15, 15) * scale)
    return hf[0], model


def _generate(pair, prompt: str, sampling: SamplingParams, seed: int,
              values: str = "processed") -> GenerationSample:
    """One sampled completion with its top-5 per token as a server in mode ``values``
    returns them: processed (log-softmax of the warped scores, masked at -9999), raw (of the
    model's logits), raw_logits or processed_logits; the prompt's and the completion's token
    ids ride along (vLLM's return_token_ids)."""
    from transformers import GenerationConfig

    tokenizer, model = pair
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    config = GenerationConfig(do_sample=True, temperature=sampling.temperature,
                              top_p=sampling.top_p or 1.0, top_k=sampling.top_k or 0,
                              repetition_penalty=sampling.repetition_penalty or 1.0,
                              max_new_tokens=TOKENS, pad_token_id=tokenizer.eos_token_id,
                              eos_token_id=tokenizer.eos_token_id, output_scores=True,
                              output_logits=True, return_dict_in_generate=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompt_ids, generation_config=config)
    ids = out.sequences[0, prompt_ids.shape[1]:].tolist()
    tokens = []
    for t, token_id in enumerate(ids):
        if values in ("processed", "raw"):
            row = torch.log_softmax((out.scores if values == "processed" else out.logits)[t][0]
                                    .double(), -1).numpy()
            row = np.where(np.isfinite(row), row, VLLM_MASK)
        else:
            row = (out.logits if values == "raw_logits" else out.scores)[t][0].double().numpy()
            row = np.where(np.isfinite(row), row, VLLM_MASK)
        best = np.argsort(-row, kind="stable")[:TOP]
        text = tokenizer.decode([token_id])
        tokens.append(TokenLogprob(text, float(row[token_id]),
                                   tuple((tokenizer.decode([int(i)]), float(row[i]))
                                         for i in best), token_id))
    return GenerationSample(model="smollm2", endpoint="completions", prompt=prompt,
                            completion_text="".join(t.text for t in tokens),
                            tokens=tuple(tokens), prompt_token_ids=tuple(prompt_ids[0].tolist()),
                            sampling=replace(sampling, max_tokens=TOKENS, seed=seed))


def _masked(sample: GenerationSample) -> bool:
    return any(v <= VLLM_MASK for token in sample.tokens for _, v in token.top)


@pytest.fixture(scope="module")
def nucleus_samples(hf):
    return [_generate(hf, prompt, NUCLEUS, seed) for seed, prompt in enumerate(smol.PROMPTS[:3])]


def test_processed_logprobs_are_compared_under_the_requests_transform(reference,
                                                                      nucleus_samples):
    """A healthy pair, sampled at temperature 0.7 and top_p 0.9 with the logprobs after the
    transform: declared, every completion is compared per token and agrees to kernel noise;
    undeclared, the masked tokens say what they are and the completion is counted not
    comparable, never scored as drift."""
    assert any(_masked(sample) for sample in nucleus_samples)  # top_p left < 5 tokens somewhere
    for sample in nucleus_samples:
        scores = reference.score(sample)
        check = check_generation(sample, scores, PROCESSED, LIMITS)
        assert (check.mode, check.passed) == ("logprobs", True), check.reason
        assert check.mean_kld < LIMITS.max_mean_kld / 5, check.mean_kld
        assert check.top1_agreement >= 0.9
        raw = check_generation(sample, scores, NEUTRAL, LIMITS)
        if _masked(sample):
            assert (raw.mode, raw.cause, raw.passed) == ("not_comparable", "logprobs_mode", True)
            assert "options.logprobs_mode" in raw.reason and raw.cause in NOT_COMPARABLE_CAUSES


def test_a_temperature_alone_is_told_apart_from_drift(hf, coarse, reference):
    """Temperature 0.5 and nothing masked: processed logprobs look like raw ones, and read as
    raw they sit far from the reference's raw distribution (the drift a launch flag would
    fake). Undeclared, their far better fit under the request's transform says what they are
    (counted not comparable, with the option to set); declared, they are compared and agree.
    A drifted primary's raw logprobs at the same temperature fit neither: still drift."""
    for seed, prompt in enumerate(smol.PROMPTS[:2]):
        sample = _generate(hf, prompt, TEMPERATURE_ONLY, seed)
        assert not _masked(sample)
        scores = reference.score(sample)
        declared = check_generation(sample, scores, PROCESSED, LIMITS)
        assert (declared.mode, declared.passed) == ("logprobs", True), declared.reason
        undeclared = check_generation(sample, scores, NEUTRAL, LIMITS)
        assert (undeclared.mode, undeclared.cause) == ("not_comparable", "logprobs_mode")
        assert "options.logprobs_mode" in undeclared.reason
        drifted = _generate(coarse, prompt, TEMPERATURE_ONLY, seed, values="raw")
        check = check_generation(drifted, reference.score(drifted), NEUTRAL, LIMITS)
        assert (check.mode, check.passed) == ("logprobs", False), check.reason


def test_processed_logprobs_with_a_repetition_penalty_are_compared_after_it(hf, reference):
    """transformers applies the repetition penalty before its warpers, over the prompt and the
    completion (vLLM's meaning): the reference's distribution is penalized alike."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, logprobs=TOP)
    for seed, prompt in enumerate(smol.PROMPTS[3:5]):
        sample = _generate(hf, prompt, sampling, seed)
        check = check_generation(sample, reference.score(sample), PROCESSED, LIMITS)
        assert (check.mode, check.passed) == ("logprobs", True), check.reason
        assert check.mean_kld < LIMITS.max_mean_kld / 5, check.mean_kld


def test_a_coarsely_quantized_primary_fails_on_its_processed_logprobs(coarse, reference):
    checks = [check_generation(sample, reference.score(sample), PROCESSED, LIMITS)
              for sample in (_generate(coarse, prompt, NUCLEUS, seed)
                             for seed, prompt in enumerate(smol.PROMPTS[:3]))]
    assert all(check.mode == "logprobs" for check in checks)
    assert sum(not check.passed for check in checks) >= 2, [c.mean_kld for c in checks]


def test_a_greedy_call_in_processed_mode_is_compared_as_raw(hf, reference):
    """vLLM's processed logprobs of a greedy call are the model's own (no temperature, no
    truncation): compared with the reference's raw distribution."""
    tokenizer, model = hf
    prompt = smol.PROMPTS[0]
    raw = _generate(hf, prompt, SamplingParams(temperature=1.0, logprobs=TOP), 0)
    greedy = replace(raw, sampling=replace(raw.sampling, temperature=0.0))
    check = check_generation(greedy, reference.score(greedy), PROCESSED, LIMITS)
    assert (check.mode, check.passed) == ("logprobs", True), check.reason


@pytest.mark.parametrize("values", ["raw_logits", "processed_logits"])
def test_logits_are_never_read_as_logprobs(hf, reference, values):
    """A server that returns logits: undeclared, counted not comparable; declared, its values
    are not read and the reference alone judges the completion (sampled mode)."""
    sample = _generate(hf, smol.PROMPTS[1], replace(NUCLEUS, top_p=None), 3, values=values)
    scores = reference.score(sample)
    undeclared = check_generation(sample, scores, NEUTRAL, LIMITS)
    assert (undeclared.mode, undeclared.cause) == ("not_comparable", "logprobs_mode")
    assert "logits" in undeclared.reason
    declared = check_generation(sample, scores, replace(NEUTRAL, logprobs_mode=values), LIMITS)
    assert declared.mode == "sampled" and declared.passed, declared.reason


def _through_the_edge(endpoint: str, body: dict, answer: dict) -> GenerationSample:
    """The sample guard's HTTP edge builds from a client's call and the server's answer."""
    import json

    from guard.protocol import openai as api

    call = api.parse_request(endpoint, json.dumps(body).encode())
    completion = api.Completion()
    api.gather(completion, endpoint, answer, streamed=False)
    assert api.unusable(completion, call) == ""
    return api.build_sample(call, completion, route="primary")


def test_vllms_own_answers_in_these_modes_say_what_they_are(reference):
    """The answers vLLM 0.32 wrote (recorded above), as the edge reads them: the masked
    nucleus and the logits are told apart from raw logprobs, by the tier and by the remote
    scorer's load check."""
    prompt = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 2,
              "logprobs": 5, "temperature": 0.7, "top_p": 0.8}
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "logprobs": True, "top_logprobs": 3, "temperature": 0.5, "top_p": 0.5}
    for endpoint, body, answer, says in (
            ("completions", prompt, VLLM_PROCESSED, "processed_logprobs"),
            ("chat", chat, VLLM_PROCESSED_CHAT, "processed_logprobs"),
            ("completions", dict(prompt, temperature=1.0, top_p=None), VLLM_LOGITS, "logits")):
        sample = _through_the_edge(endpoint, body, answer)
        assert sample.has_logprobs
        check = check_generation(sample, reference.score(sample), NEUTRAL, LIMITS)
        assert (check.mode, check.cause) == ("not_comparable", "logprobs_mode"), check.reason
        assert says in check.reason
    assert returns_logits(VLLM_LOGITS["choices"][0]) is not None
    assert returns_logits(VLLM_PROCESSED["choices"][0]) is None


def _recorded(group: str) -> list[GenerationSample]:
    """vLLM's recorded answers of one group (tests/recorded/vllm_sampler.json: vLLM 0.32 on
    SmolLM2 fp32, --logprobs-mode processed_logprobs --generation-config vllm), as the edge
    reads them."""
    import json
    from pathlib import Path

    recorded = json.loads((Path(__file__).parent.parent / "recorded" / "vllm_sampler.json")
                          .read_text())
    return [_through_the_edge("chat" if "messages" in call["request"] else "completions",
                              call["request"], call["answer"])
            for call in recorded[group]]


VLLM = declared_defaults({"engine": "vllm", "generation_config": "vllm",
                          "logprobs_mode": "processed_logprobs"})


def test_vllms_min_p_cuts_before_top_ps_nucleus(reference):
    """vLLM applies the temperature, then min_p, then top_k/top_p (its processed logprobs
    show what it kept): guard's vllm preset keeps as many tokens as vLLM at every position,
    and its healthy completions agree; taken in the other order (top_p's nucleus first, as
    llama.cpp and transformers do), the nucleus is wider than vLLM's and the same healthy
    server reads as drift."""
    other_order = replace(VLLM, min_p_first=False)
    assert VLLM.min_p_first and not SERVER_DEFAULTS["llama.cpp"].min_p_first
    differed = failed = 0
    for sample in _recorded("top_p_and_min_p"):
        scores = reference.score(sample)
        ours, other = (resolve_transform(sample.sampling, d) for d in (VLLM, other_order))
        for t, token in enumerate(sample.tokens):
            kept_by_vllm = sum(value > VLLM_MASK for _, value in token.top)
            assert kept_by_vllm < TOP_RECORDED  # (the whole kept set is in the answer)
            assert len(transformed_support(scores.logprobs[t], ours)[0]) == kept_by_vllm
            differed += len(transformed_support(scores.logprobs[t], other)[0]) != kept_by_vllm
        check = check_generation(sample, scores, VLLM, LIMITS)
        assert (check.mode, check.passed) == ("logprobs", True), check.reason
        assert check.mean_kld < LIMITS.max_mean_kld / 10
        failed += not check_generation(sample, scores, other_order, LIMITS).passed
    assert differed >= 4 and failed >= 1, (differed, failed)


def test_each_engine_reads_its_own_name_for_the_repetition_penalty(reference):
    """vLLM applied ``repetition_penalty: 3.0`` and ignored ``repeat_penalty: 3.0`` (its
    processed logprobs: the penalized and the model's own distribution): with the engine
    declared both calls agree; an engine that takes either name scores the ignored one
    against a penalized distribution, a healthy server as drift."""
    ignored, applied = _recorded("penalty_names")
    assert (ignored.sampling.repeat_penalty, ignored.sampling.repetition_penalty) == (3.0, None)
    assert (applied.sampling.repeat_penalty, applied.sampling.repetition_penalty) == (None, 3.0)
    assert resolve_transform(ignored.sampling, VLLM).repetition_penalty == 1.0
    assert resolve_transform(ignored.sampling, SERVER_DEFAULTS["llama.cpp"]
                             ).repetition_penalty == 3.0
    for sample in (ignored, applied):
        check = check_generation(sample, reference.score(sample), VLLM, LIMITS)
        assert (check.mode, check.passed) == ("logprobs", True), check.reason
    either_name = check_generation(ignored, reference.score(ignored), PROCESSED, LIMITS)
    assert (either_name.mode, either_name.passed) == ("logprobs", False)


def test_vllms_ignore_eos_masks_nothing_and_its_answer_past_eos_agrees(reference):
    """vLLM's ignore_eos samples on past the end of the answer (its EOS among the token ids,
    the text after it the model's next turn): with the engine declared the call is compared,
    per token and from the reference alone, and agrees; where the engine is not known
    (llama.cpp's ignore_eos masks EOS) it is counted not comparable, never scored."""
    (sample,) = _recorded("ignore_eos")
    assert sample.sampling.constraints == ("ignore_eos",)
    assert 2 in [token.token_id for token in sample.tokens]  # <|im_end|>, mid-answer
    scores = reference.score(sample)
    told = check_generation(sample, scores, VLLM, LIMITS)
    assert (told.mode, told.passed) == ("logprobs", True), told.reason
    bare = replace(sample, tokens=tuple(replace(t, logprob=None, top=()) for t in sample.tokens))
    alone = check_generation(bare, reference.score(bare), VLLM, LIMITS)
    assert (alone.mode, alone.passed) == ("sampled", True), alone.reason
    unknown = check_generation(bare, reference.score(bare),
                               replace(PROCESSED, temperature=None), LIMITS)
    assert (unknown.mode, unknown.cause) == ("not_comparable", "constrained")


def test_the_declared_mode_reaches_the_tier():
    assert declared_defaults({"logprobs_mode": "processed_logprobs"}).logprobs_mode == \
        "processed_logprobs"
    assert declared_defaults({}).logprobs_mode == "raw_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode"):
        declared_defaults({"logprobs_mode": "processed"})

