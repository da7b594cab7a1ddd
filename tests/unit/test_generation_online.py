"""The verifier's generation path, in its parts: the detector's score per mode, the probe's
request, the KLD window of admin status (the loop itself: tests/e2e/test_llm_online.py)."""

from __future__ import annotations

import math

import pytest

from guard.config import GenerationCheckConfig
from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob
from guard.verifier_process.generation_model import KldWindow, detector_score
from guard.backends.openai_generate import probe_body
from guard.verify.generation import FirstDivergence, GenerationCheck, GenerationThresholds

LIMITS = GenerationThresholds()


def test_config_and_tier_defaults_agree():
    """checks.generation's defaults are the tier's own (one set of calibrated numbers)."""
    config = GenerationCheckConfig()
    for name in GenerationThresholds.__dataclass_fields__:
        if hasattr(config, name):
            assert getattr(config, name) == getattr(LIMITS, name), name


@pytest.mark.parametrize("mode,statistic,score", [
    ("logprobs", LIMITS.max_mean_kld, 1.0),  # the failing level is 1 in every mode
    ("logprobs", 0.0, 0.0),
    ("greedy", LIMITS.max_greedy_disagreement * 3, 3.0),
    ("sampled", -LIMITS.max_abs_z, 1.0),  # two-sided: z^2
    ("sampled", LIMITS.max_abs_z / 2, 0.25),
])
def test_the_score_is_the_statistic_over_its_failing_level(mode, statistic, score):
    check = GenerationCheck(passed=True, mode=mode, statistic=statistic)
    assert detector_score(check, LIMITS) == pytest.approx(score)


def test_what_was_not_scored_has_no_score():
    for mode in ("not_comparable", "tokenization_mismatch"):
        assert detector_score(GenerationCheck(passed=False, mode=mode), LIMITS) is None


def _sample(endpoint="completions", **sampling) -> GenerationSample:
    return GenerationSample(
        model="smol", endpoint=endpoint, completion_text=" Paris.",
        tokens=(TokenLogprob(" Paris"), TokenLogprob(".")),
        sampling=SamplingParams(**sampling), prompt="The capital of France is",
        messages=({"role": "user", "content": "Capital?"},) if endpoint == "chat" else None)


def test_the_probe_asks_the_call_again_with_logprobs():
    body = probe_body(_sample(temperature=0.0, max_tokens=32, top_k=40, seed=7,
                              repeat_penalty=1.1, stop=("\n",)), "smol-q2", 5)
    assert body == {"model": "smol-q2", "stream": False, "prompt": "The capital of France is",
                    "logprobs": 5, "temperature": 0.0, "top_k": 40, "seed": 7,
                    "repeat_penalty": 1.1,  # as the client named it (llama.cpp's name)
                    "max_tokens": 32, "stop": ["\n"]}
    # A record from before the names were kept apart holds both: either server applies it.
    both = probe_body(_sample(repetition_penalty=1.1, repeat_penalty=1.1), "smol-q2", 5)
    assert both["repetition_penalty"] == both["repeat_penalty"] == 1.1
    chat = probe_body(_sample("chat"), "smol-q2", 5)
    assert chat["messages"] == [{"role": "user", "content": "Capital?"}]
    assert (chat["logprobs"], chat["top_logprobs"]) == (True, 5)
    assert chat["max_tokens"] == 2  # no max_tokens in the call: as long as its answer
    assert "temperature" not in chat  # unset stays unset: the server's default applies


def test_the_kld_window_keeps_the_last_completions():
    window = KldWindow(3)
    first = FirstDivergence(4, " Paris", ",", ((".", 0.7), (",", 0.2)))
    for kld in (0.5, 0.01, 0.02, 0.03):
        window.add(GenerationCheck(passed=kld < 0.05, mode="logprobs", statistic=kld,
                                   mean_kld=kld, top1_agreement=1 - kld,
                                   first_divergence=first if kld >= 0.05 else None))
    figures = window.figures()
    assert figures["completions"] == 3 and figures["window"] == 3
    assert figures["mean_kld"] == pytest.approx(0.02)
    assert figures["top1_agreement"] == pytest.approx(0.98)
    assert window.last_divergence["primary_token"] == ","
    greedy = GenerationCheck(passed=True, mode="greedy", statistic=0.0, top1_agreement=1.0)
    window.add(greedy)  # no KLD without the primary's logprobs: the KLD window keeps its own
    assert window.figures()["completions"] == 3 and not math.isnan(window.figures()["kld_p99"])


def test_admin_status_says_when_the_kld_window_has_nothing_yet():
    """A model whose completions are all sampled without logprobs (or greedy) has no KLD and
    no same-top-1 from them: the window's figures are NaN, not 0 (which would read as
    perfect agreement), and admin status says so in words, with the sampled completions' z
    pooled instead."""
    from guard.admin_client import format_model_status
    from guard.v1 import admin_pb2 as pb

    window = KldWindow(100)
    window.add(GenerationCheck(passed=True, mode="sampled", statistic=0.3, z=0.3, tokens=12))
    figures = window.figures()
    assert figures["completions"] == 0
    assert all(math.isnan(figures[k]) for k in ("mean_kld", "kld_p99", "top1_agreement"))
    status = pb.ModelStatus(name="smol", route="primary", has_generation=True,
                            generation=pb.GenerationWindow(**figures))
    text = format_model_status(status)
    assert "no completion with the primary's logprobs yet" in text and "nan" not in text
    assert "same top-1 n/a" in text
    # The sampled completion's own figure: its z, pooled over the window.
    assert "sampled without logprobs: 1 of the last 100, pooled z 0.30" in text
    window.add(GenerationCheck(passed=True, mode="logprobs", statistic=0.01, mean_kld=0.01,
                               top1_agreement=0.9))
    text = format_model_status(pb.ModelStatus(name="smol", route="primary",
                                              has_generation=True,
                                              generation=pb.GenerationWindow(**window.figures())))
    assert "1 of the last 100 completions, mean KLD 0.0100" in text
    assert "same top-1 90.0%" in text


def test_admin_status_json_has_every_field_and_null_for_what_was_not_measured():
    """--json: one shape whatever was counted (empty maps and zeros kept), and no "NaN"
    string where JSON has no NaN (protobuf's JSON mapping writes one)."""
    import json

    from guard.admin_client import status_json
    from guard.v1 import admin_pb2 as pb

    window = KldWindow(100)
    window.add(GenerationCheck(passed=True, mode="greedy", statistic=0.0, tokens=4))
    status = pb.ModelStatus(name="smol", route="primary", has_generation=True,
                            generation=pb.GenerationWindow(**window.figures()))
    generation = json.loads(json.dumps(status_json(pb.GetStatusResponse(
        models=[status]))))["models"][0]["generation"]
    assert generation["not_comparable_by_reason"] == {}
    assert generation["completions"] == 0 and generation["sampled_completions"] == 0
    assert all(generation[k] is None
               for k in ("mean_kld", "kld_p99", "top1_agreement", "z_pooled")), generation
