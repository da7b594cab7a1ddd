"""guard in front of llama.cpp's own server, end to end with real parts: ``llama-server``
(tests/e2e/llm_support.py; the Makefile builds it from the llama.cpp llama-cpp-python vendors)
on SmolLM2's F16 GGUF, started with a model card's sampling flags (``--temp 0.6 --top-k 20
--min-p 0``), ``guard serve`` in front of it (``engine: llama.cpp``, the llama_cpp reference on
the same file, every call sampled and captured), the ``openai`` client and plain HTTP as
clients, and ``guard replay`` over what was captured.

What it holds: the verifier reads what the server samples with at GET /props and scores with
it (calls that leave sampling to the server compare and pass; under the llama.cpp preset they
lean to drift: benchmarks/llm_llama_server_props.py); llama-server names its model by its
file's path in every answer, and through guard the client reads the name it asked for; calls
that name no model (llama-server answers them, and llama.cpp's native ``/completion``) are
served through guard too; each capture record keeps the server's report, and the replay
scores the captured calls as the live verifier did. guard asks the server how it rendered each
sampled call's prompt, so that the reference scores what the server read, and a server that
renders otherwise than the model's template is a finding.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import urllib.parse
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest

from envoy_support import Guard, needs_envoy, write
from llm_support import post_json, require_llama_server, start_llama_cpp_server
from support import events, metric, running, scrape, wait_for

openai = pytest.importorskip("openai")
pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")

from guard.backends import create_backend  # noqa: E402
from guard.capture.reader import FileStats, expand_paths, read_records  # noqa: E402
from guard.capture.records import generation_calls  # noqa: E402
from guard.cli import main  # noqa: E402
from guard.plan.serving import load_config  # noqa: E402
from guard.verify.generation import GenerationCheck  # noqa: E402
from guard.verify.pipeline import Comparator  # noqa: E402
from guard.zoo.llm import PROMPTS, quant_ladder  # noqa: E402
from guard.zoo.tool_chat import WEATHER_TOOL, llama_server_flags, weather_chat  # noqa: E402

FLAGS = ("--temp", "0.6", "--top-k", "20", "--min-p", "0")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    binary = require_llama_server()
    gguf = quant_ladder(("F16",))["F16"]
    server = start_llama_cpp_server(binary, gguf, tmp_path_factory.mktemp("llama-server"),
                                    FLAGS)
    try:
        yield server, gguf
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(llama):
    """The llama_cpp reference on the server's GGUF, in this process (one for the module)."""
    scorer = create_backend(load_config_block(llama[1]), "reference", 1)
    scorer.load()
    try:
        yield scorer
    finally:
        scorer.close()


def test_an_undeclared_engine_is_named_from_llama_servers_listing(llama, caplog):
    """A primary block without options.engine in front of llama-server: guard says, once at
    load, that its model listing (owned_by "llamacpp") names the engine, and what declaring
    it turns on (without it the sampled calls that leave sampling to the server are not
    compared, and a streamed tool chat's refused logprobs would turn guard's additions off
    for the whole upstream); it adopts nothing unasked. A declared engine is told nothing."""
    from guard.config.backend import BackendConfig

    caplog.set_level("INFO", logger="guard.events")
    server, _ = llama
    for options in ({}, {"engine": "llama.cpp"}):
        backend = create_backend(BackendConfig(backend="openai", target=server.url,
                                               model="smol", options=options), "fallback")
        backend.load()
        backend.close()
    (said,) = events(caplog, "openai_engine_undeclared")
    assert (said["engine"], said["role"]) == ("llama.cpp", "fallback")
    assert "declare options.engine: llama.cpp" in said["reason"] and "/props" in said["reason"]


def test_guard_in_front_of_llama_server_scores_with_its_flags_and_replays_as_live(
        llama, tmp_path, caplog):
    caplog.set_level("INFO", logger="guard.events")
    server, gguf = llama
    params = server.props["default_generation_settings"]["params"]
    assert (round(params["temperature"], 3), params["top_k"]) == (0.6, 20)  # (its flags)
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": server.url, "model": "smol",
                         "options": {"engine": "llama.cpp"}},
             "reference": {"backend": "llama_cpp", "path": str(gguf),
                           "options": {"context_length": 512}},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"},
             "capture": {"dir": str(tmp_path / "capture"), "mode": "all"}}
    with running(tmp_path, [model], http_port=0) as (srv, _):
        base = f"http://127.0.0.1:{srv.http_port}"
        through = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                timeout=120)
        direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=120)
        # Greedy: the server's own answer, under the name the client asked guard for (the
        # server names its model by the GGUF's path).
        greedy = dict(prompt=PROMPTS[0], max_tokens=12, temperature=0)
        ours = through.completions.create(model="smol", **greedy)
        theirs = direct.completions.create(model="smol", **greedy)
        assert ours.choices[0].text == theirs.choices[0].text
        assert (ours.model, theirs.model) == ("smol", str(gguf))
        # Calls that leave sampling to the server (its flags): a completion, a streamed chat,
        # and one naming no model.
        for i, prompt in enumerate(PROMPTS[1:3]):
            assert through.completions.create(model="smol", prompt=prompt, max_tokens=32,
                                              seed=11 + i).model == "smol"
        chunks = list(through.chat.completions.create(model="smol", messages=MESSAGES,
                                                      max_tokens=24, seed=5, stream=True))
        assert chunks and {c.model for c in chunks} == {"smol"}
        status, unnamed = post_json(f"{base}/v1/chat/completions",
                                {"messages": MESSAGES, "max_tokens": 24, "seed": 6})
        assert (status, unnamed["model"]) == (200, "smol")
        # llama.cpp's native completion endpoint (no model in its body): forwarded unchecked.
        status, native = post_json(f"{base}/completion", {"prompt": PROMPTS[0], "n_predict": 4,
                                                      "temperature": 0})
        assert status == 200 and isinstance(native["content"], str) and native["content"]

        values = compared_at_least(srv, 5, 300)
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="pass") == 5
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="fail") == 0
        assert metric(values, "guard_generation_not_comparable_total", model="smol",
                      reason="endpoint") == 1
    (read,) = events(caplog, "llama_server_defaults")
    assert (read["temperature"], read["top_k"], read["min_p"]) == (0.6, 20, 0.0)
    assert not events(caplog, "llama_server_rendering_unavailable")

    stats = FileStats()
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, stats)]
    assert len(records) == 5 and stats.undecodable == 0
    calls = [generation_calls(r)[0] for r in records]
    assert all(c.server_settings is not None and c.server_settings["top_k"] == 20
               for c in calls)
    modes = sorted(json.loads(r.verdicts[0].details_json)["mode"] for r in records)
    assert modes == ["greedy", "sampled", "sampled", "sampled", "sampled"]
    # The prompt as the server read it (it was asked: options.tokenize_prompts), so no score
    # is an approximation, and the record keeps the ids for the replay.
    assert all(c.prompt_token_ids for c in calls)
    assert not any(json.loads(r.verdicts[0].details_json)["approximate"] for r in records)

    # Offline, with the server gone or not: scored with what each record says the server
    # sampled with, as live.
    generation = replay_report(tmp_path)
    assert (generation["checks"], generation["passed"]) == (5, 5)
    # The replay's own check of each sampled call gives the live verdict's z; the same call
    # without the record's report (as records were before) is scored with the preset.
    config = load_config(tmp_path / "guard.yaml").models[0]
    reference = create_backend(config.reference, "reference", 1)
    reference.load()
    comparator = Comparator.for_model(config)
    try:
        for record, call in zip(records, calls):
            live = GenerationCheck.from_dict(json.loads(record.verdicts[0].details_json))
            if live.mode != "sampled":
                continue
            scores = reference.score(call)
            replayed = comparator.check(scores, call).tiers["generation"]
            preset = comparator.check(scores, replace(call, server_settings=None)).tiers[
                "generation"]
            assert replayed.statistic == pytest.approx(live.statistic, abs=1e-6)
            assert abs(preset.statistic - live.statistic) > 0.05
    finally:
        reference.close()


PREFILLED = [
    [{"role": "user", "content": "Give me a JSON object with a name."},
     {"role": "assistant", "content": "{\"name\": \""}],
    [{"role": "assistant", "content": "Hello"}],  # (the template's system prompt: none here)
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Well then"}],
]


@pytest.mark.parametrize("messages", PREFILLED)
def test_a_chat_llama_server_continues_is_rendered_as_it_renders_it(llama, reference,
                                                                    messages):
    """llama-server continues a chat whose last message is the assistant's (its default
    --prefill-assistant): the reference renders the sample as the server's own
    /apply-template does, token for token, where it opened a new turn before (a healthy
    server's prefilled chats read as drift: z 5 to 10 in benchmarks/reliability_llm.py)."""
    from guard.protocol.generation import GenerationSample, SamplingParams, rendered_as_served

    server, gguf = llama
    status, template = post_json(f"{server.url}/apply-template", {"messages": messages})
    assert status == 200
    status, tokens = post_json(f"{server.url}/tokenize", {"content": template["prompt"],
                                                          "add_special": True,
                                                          "parse_special": True})
    sample = GenerationSample(model="smol", endpoint="chat", completion_text="",
                              tokens=(), messages=tuple(messages), sampling=SamplingParams())
    served = rendered_as_served(sample, "llama.cpp")
    assert reference.render(served).ids == tokens["tokens"]
    assert reference.render(sample).ids != tokens["tokens"]  # (a new turn)
    # Its answer repeats the continued content first: the completion is what follows.
    status, answer = post_json(f"{server.url}/v1/chat/completions",
                               {"messages": messages, "max_tokens": 4, "seed": 1})
    said = answer["choices"][0]["message"]["content"]
    assert status == 200 and said.startswith(messages[-1]["content"])
    answered = rendered_as_served(replace(sample, completion_text=said), "llama.cpp")
    assert answered.completion_text == said[len(messages[-1]["content"]):]


# Chats and prompts whose rendering differs from engine to engine: a plain chat (SmolLM2's
# template adds its system prompt), a system prompt of the chat's own, content parts (the
# template concatenates strings: llama-server joins the parts first, guard's own rendering
# cannot), a prefilled answer and one of parts (continued, its parts joined by a blank line),
# special-token text in a completions prompt (read as the special token) and non-Latin text.
RENDERED = [
    ("chat", MESSAGES),
    ("chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    ("chat", [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                           {"type": "text", "text": "One word."}]}]),
    ("chat", [{"role": "user", "content": [{"type": "text", "text": t}
                                           for t in ("", "Hi", "", "there")]},
              {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": [{"type": "text", "text": ""},
                                           {"type": "text", "text": "1 + 1 ="}]}]),
    ("chat", PREFILLED[0]),
    ("chat", [{"role": "user", "content": "Say hello."},
              {"role": "assistant", "content": [{"type": "text", "text": "Hello"},
                                                {"type": "text", "text": "and"}]}]),
    ("chat", [{"role": "assistant", "content": [{"type": "text", "text": t}
                                                for t in ("", "Hello", "", "there")]}]),
    ("completions", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("completions", "Der Käse kostet 3 € in München; 日本の首都は"),
]


@pytest.mark.parametrize("endpoint,prompt", RENDERED)
def test_the_prompt_llama_server_says_it_read_is_the_one_its_call_read(llama, reference,
                                                                       endpoint, prompt):
    """guard asks llama-server how it rendered a sampled call's prompt (/apply-template,
    /tokenize: guard/backends/llama_server_prompts.py). Those ids are as many as the call's
    own usage counts, the reference's own rendering of the call agrees with them token for
    token where it can render it (no finding: a healthy server is no template drift), and
    the completion is what follows the prompt (a continued answer's repeated content off)."""
    from guard.backends.llama_server_prompts import LlamaServerPrompts
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import GenerationSample, rendered_as_served

    server, gguf = llama
    body = {"max_tokens": 3, "seed": 1, **({"messages": prompt} if endpoint == "chat"
                                           else {"prompt": prompt})}
    status, answer = post_json(f"{server.url}/v1/{'chat/' if endpoint == 'chat' else ''}"
                               "completions", body)
    assert status == 200
    choice = answer["choices"][0]
    said = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    sample = GenerationSample(model="smol", endpoint=endpoint, completion_text=said, tokens=(),
                              **({"messages": tuple(prompt)} if endpoint == "chat"
                                 else {"prompt": prompt}))
    spec = BackendConfig(backend="openai", target=server.url, model="smol",
                         options={"engine": "llama.cpp"})
    asked = LlamaServerPrompts(spec, timeout_s=30)(sample)
    assert asked.prompt_token_ids is not None
    assert len(asked.prompt_token_ids) == answer["usage"]["prompt_tokens"]
    served = rendered_as_served(asked, "llama.cpp")
    rendered = reference.render(served)
    assert (rendered.ids, rendered.approximate, rendered.findings) == (
        list(asked.prompt_token_ids), False, ())
    if endpoint == "chat" and prompt[-1]["role"] == "assistant":
        assert not served.completion_text.startswith("Hello")  # (the prompt's)


def test_a_server_that_renders_otherwise_is_template_drift(llama, tmp_path, caplog):
    """llama-server started with --no-jinja renders chats with its built-in ChatML, not the
    model's template (SmolLM2's adds a system prompt): behind guard every sampled chat fails
    with the finding prompt_rendered_otherwise, naming the first token that differs, though
    the model itself is the reference's (before guard asked the server, it scored its own
    rendering and could not tell)."""
    caplog.set_level("INFO", logger="guard.events")
    _, gguf = llama
    server = start_llama_cpp_server(require_llama_server(), gguf, tmp_path, ("--no-jinja",))
    try:
        model = {"name": "smol", "task": "generation",
                 "primary": {"backend": "openai", "target": server.url, "model": "smol",
                             "options": {"engine": "llama.cpp"}},
                 "reference": {"backend": "llama_cpp", "path": str(gguf),
                               "options": {"context_length": 512}},
                 "mirror": {"sample_rate": 1.0, "timeout_s": 120},
                 "policy": {"action": "alert"}}
        with running(tmp_path, [model], http_port=0) as (srv, _):
            base = f"http://127.0.0.1:{srv.http_port}"
            for seed in (1, 2):
                status, _answer = post_json(f"{base}/v1/chat/completions",
                                            {"model": "smol", "messages": MESSAGES,
                                             "max_tokens": 8, "seed": seed})
                assert status == 200
            values = compared_at_least(srv, 2, 120)
            assert metric(values, "guard_checks_total", model="smol", tier="generation",
                          result="fail") == 2
            (found, *_) = wait_for(lambda: events(caplog, "generation_divergence"), timeout=30)
    finally:
        server.stop()
    assert found["findings"] == ["prompt_rendered_otherwise"]


def compared_at_least(srv, count: int, timeout: float = 300) -> dict:
    """guard's metrics once its verifier compared ``count`` completions of "smol"."""
    return wait_for(lambda: (lambda v: v if metric(
        v, "guard_mirror_total", model="smol", outcome="compared") >= count else None)(
            scrape(srv.metrics_port)), timeout=timeout, interval=0.2)


def replay_report(folder) -> dict:
    """``guard replay`` of ``folder``'s capture with its config: the generation tier's figures
    in the report."""
    out = folder / "report"
    assert main(["replay", "--config", str(folder / "guard.yaml"), str(folder / "capture"),
                 "--report-dir", str(out), "--quiet"]) == 0
    return json.loads((out / "report.json").read_text())["models"]["smol"]["tiers"][
        "generation"]


def test_calls_guard_asked_logprobs_of_answer_as_llama_server_answers_unasked(llama, tmp_path):
    """options.sample_logprobs: guard asks llama-server for logprobs on every sampled call and
    takes them out of the client's answer as the server answers when nobody asked: no key in a
    chat answer (streamed or whole), ``"logprobs": null`` in a completion. Each shape's answer
    through guard is the server's own but for the id, the time, the model's name and the
    server's prompt-cache counts (the second call of a prompt reads it from the cache)."""
    import re

    import httpx2 as httpx

    from llm_support import masked

    def alike(body: bytes) -> bytes:
        body = re.sub(rb'"(cache_n|prompt_n|cached_tokens)": ?\d+', rb'"\1":0', masked(body))
        return body.replace(json.dumps(str(gguf)).encode(), b'"smol"')

    server, gguf = llama
    model = tool_chat_model(server, gguf, tmp_path / "capture", sample_logprobs=5)
    shapes = [("chat/completions", {"messages": MESSAGES}),
              ("chat/completions", {"messages": MESSAGES, "stream": True}),
              ("completions", {"prompt": PROMPTS[0]}),
              ("completions", {"prompt": PROMPTS[0], "stream": True})]
    with running(tmp_path, [model], http_port=0) as (srv, _), \
            httpx.Client(timeout=120) as http:
        for path, fields in shapes:
            body = {"model": "smol", "max_tokens": 5, "temperature": 0, **fields}
            ours = http.post(f"http://127.0.0.1:{srv.http_port}/v1/{path}", json=body)
            theirs = http.post(f"{server.url}/v1/{path}", json=body)
            assert ours.status_code == theirs.status_code == 200
            assert alike(ours.content) == alike(theirs.content), (path, fields)
            assert b"logprobs" not in ours.content or path == "completions"
        compared_at_least(srv, len(shapes), 300)  # (sampled, and compared on logprobs)


def load_config_block(gguf):
    from guard.config.backend import BackendConfig

    return BackendConfig(backend="llama_cpp", path=str(gguf), options={"context_length": 512})


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """llama-server on the F16 GGUF with a template that renders tools and has it parse the
    calls out (SmolLM2's own template renders no tools)."""
    gguf = quant_ladder(("F16",))["F16"]
    folder = tmp_path_factory.mktemp("llama-server-tools")
    # (--alias: the name guard serves, which Envoy mode needs: Envoy rewrites no answer.)
    server = start_llama_cpp_server(require_llama_server(), gguf, folder,
                                    (*llama_server_flags(folder), "--alias", "smol"))
    try:
        yield server, gguf
    finally:
        server.stop()


def tool_chat_model(server, gguf, capture, **options) -> dict:
    return {"name": "smol", "task": "generation",
            "primary": {"backend": "openai", "target": server.url, "model": "smol",
                        "options": {"engine": "llama.cpp", **options}},
            "reference": load_config_block(gguf).model_dump(exclude_defaults=True),
            "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"},
            "capture": {"dir": str(capture), "mode": "all"}}


TOOL_CALL = {"model": "smol", "messages": weather_chat("Paris"), "tools": [WEATHER_TOOL],
             "max_tokens": 40}


def test_tool_chats_on_llama_server_are_compared_on_its_rendering_of_the_tools(
        hermes, tmp_path, caplog):
    """llama-server tells no prompt ids in its answers, but guard asks it how it rendered a
    sampled chat, tools included (/apply-template with the call's tool fields); the output's
    ids come from its logprobs (options.sample_logprobs): so a chat that offers tools is
    compared, where before it was counted not comparable (``tools``). A streamed one cannot
    be (llama-server refuses logprobs on a streamed chat with tools): guard adds none to it,
    counts it not comparable, and one such call does not turn the logprobs off for every
    later call to the server (``openai_additions_refused``)."""
    caplog.set_level("INFO", logger="guard.events")
    server, gguf = hermes
    model = tool_chat_model(server, gguf, tmp_path / "capture", sample_logprobs=5)
    call = TOOL_CALL
    with running(tmp_path, [model], http_port=0) as (srv, _):
        base = f"http://127.0.0.1:{srv.http_port}"
        through = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                                timeout=120)
        direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none",
                               max_retries=0, timeout=120)
        # Greedy: the server's own tool call, parsed out of the text, through guard.
        ours = through.chat.completions.create(**call, temperature=0)
        theirs = direct.chat.completions.create(**call, temperature=0)
        (called,) = ours.choices[0].message.tool_calls
        assert (called.function.name, json.loads(called.function.arguments)) == (
            "get_weather", {"city": "Paris"})
        assert called.function.arguments == \
            theirs.choices[0].message.tool_calls[0].function.arguments
        assert ours.choices[0].logprobs is None  # (guard's logprobs, stripped)
        # Streamed: answered as the server answers it, not compared.
        chunks = list(through.chat.completions.create(**call, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""
                       for c in chunks if c.choices and c.choices[0].delta.tool_calls)
        # Sampled, and an ordinary streamed chat after them: compared on logprobs still.
        through.chat.completions.create(**call, temperature=0.8, seed=3)
        # (Without tools the template renders as the model's own: no template drift.)
        list(through.chat.completions.create(model="smol", messages=MESSAGES,
                                             max_tokens=16, seed=4, stream=True))
        values = compared_at_least(srv, 3, 300)
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="pass") == 3
        assert metric(values, "guard_generation_not_comparable_total", model="smol",
                      reason="tools") == 1
        status, rendered = post_json(f"{server.url}/apply-template", call)
        assert status == 200 and "get_weather" in rendered["prompt"].split("<tools>\n")[1]
        status, tokens = post_json(f"{server.url}/tokenize", {
            "content": rendered["prompt"], "add_special": True, "parse_special": True})
        served = tokens["tokens"]
    assert not events(caplog, "openai_additions_refused")
    assert not events(caplog, "llama_server_rendering_unavailable")

    stats = FileStats()
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, stats)]
    compared = [(generation_calls(r)[0], json.loads(r.verdicts[0].details_json))
                for r in records if r.verdicts]
    assert len(compared) == 3 and stats.undecodable == 0
    assert all(details["mode"] == "logprobs" and not details["approximate"]
               for _, details in compared)
    tool_calls = [c for c, _ in compared if c.tools]
    assert len(tool_calls) == 2 and {c.tool_calls for c in tool_calls} == {("get_weather",)}
    # The prompt the reference scored is the server's, the tools rendered into it.
    assert all(c.prompt_token_ids == tuple(served) for c in tool_calls)
    # Offline (a replay of captured calls asks the server nothing): the capture replays to
    # the same verdicts (the records keep the server's prompt ids and the output's).
    generation = replay_report(tmp_path)
    assert (generation["checks"], generation["passed"]) == (3, 3)


def test_an_undeclared_engines_refused_streamed_tool_chat_keeps_the_logprobs_on(
        hermes, tmp_path, caplog):
    """A block that does not declare engine llama.cpp adds logprobs to a sampled streamed chat
    that lists tools, which llama-server refuses (400) on that shape of call alone: the client's
    own call goes instead and is answered, guard adds none to the next call of that shape
    (``openai_additions_refused`` says so once, naming the shape), and keeps adding logprobs to
    the server's other calls, so a later chat is still compared on them. The engine's absence
    is named at load (``openai_engine_undeclared``)."""
    caplog.set_level("INFO", logger="guard.events")
    server, gguf = hermes
    model = tool_chat_model(server, gguf, tmp_path / "capture", engine="unknown",
                            sample_logprobs=5)
    with running(tmp_path, [model], http_port=0) as (srv, _):
        through = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1",
                                api_key="none", max_retries=0, timeout=120)
        for _ in range(2):  # the first refused as guard amended it, then answered as asked
            chunks = list(through.chat.completions.create(**TOOL_CALL, temperature=0,
                                                          stream=True))
            assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        answer = through.chat.completions.create(model="smol", messages=MESSAGES,
                                                 max_tokens=16, temperature=0)
        assert answer.choices[0].logprobs is None  # (guard's, stripped)
        compared_at_least(srv, 1, 300)
    (refused,) = events(caplog, "openai_additions_refused")
    assert refused["shape"] == "chat, streamed, with tools" and refused["status"] == 400
    assert "tools + stream" in refused["error"]
    (said,) = events(caplog, "openai_engine_undeclared")
    assert said["engine"] == "llama.cpp"
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, FileStats())]
    modes = [json.loads(r.verdicts[0].details_json)["mode"] for r in records if r.verdicts]
    assert "logprobs" in modes  # the chat after the tool chats, on the logprobs guard added


@contextmanager
def v1_only(upstream: str):
    """A reverse proxy that passes ``/v1/...`` to ``upstream`` and answers 404 to every other
    path, as a gateway that exposes only the OpenAI API does: its base URL."""
    target = urllib.parse.urlsplit(upstream)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not self.path.startswith("/v1/"):
                data, status, kind = b'{"error": "not found"}', 404, "application/json"
            else:
                connection = http.client.HTTPConnection(target.hostname, target.port,
                                                        timeout=120)
                try:
                    connection.request(self.command, self.path, body=body or None,
                                       headers={"Content-Type": "application/json"})
                    answer = connection.getresponse()
                    data, status = answer.read(), answer.status
                    kind = answer.getheader("Content-Type", "application/json")
                finally:
                    connection.close()
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _forward

        def log_message(self, *args):
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}"
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_a_tool_chat_whose_rendering_the_server_does_not_tell_is_not_comparable(
        hermes, tmp_path, caplog):
    """Behind a gateway that passes only /v1, llama-server's /apply-template and /tokenize are
    out of reach: guard says so once (``llama_server_rendering_unavailable``), a chat that
    offers tools, whose prompt only the server's rendering of the tools tells, is counted not
    comparable (``tools``) by the verifier and never scored on the reference's own rendering,
    and a plain chat is still compared, on the reference's rendering (approximate)."""
    caplog.set_level("INFO", logger="guard.events")
    server, gguf = hermes
    with v1_only(server.url) as gateway:
        model = tool_chat_model(SimpleNamespace(url=gateway), gguf, tmp_path / "capture",
                                sample_logprobs=5)
        with running(tmp_path, [model], http_port=0) as (srv, _):
            through = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1",
                                    api_key="none", max_retries=0, timeout=120)
            called = through.chat.completions.create(**TOOL_CALL, temperature=0)
            assert called.choices[0].message.tool_calls  # answered through both proxies
            through.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=16,
                                            temperature=0)
            values = compared_at_least(srv, 1, 300)
            values = wait_for(lambda: (lambda v: v if metric(
                v, "guard_generation_not_comparable_total", model="smol",
                reason="tools") == 1 else None)(scrape(srv.metrics_port)), timeout=120)
            assert metric(values, "guard_checks_total", model="smol", tier="generation",
                          result="pass") == 1
    (unavailable,) = events(caplog, "llama_server_rendering_unavailable")
    assert "404" in json.dumps(unavailable)
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, FileStats())]
    details = [json.loads(r.verdicts[0].details_json) for r in records if r.verdicts]
    (told,) = [d for d in details if d["mode"] == "not_comparable"]
    assert told.get("cause") == "tools", told
    assert [(d["mode"], d["approximate"]) for d in details if d is not told] == \
        [("logprobs", True)]


def test_a_streamed_tool_chat_is_compared_on_the_primary_probed_where_asked(hermes, tmp_path):
    """``probe_streamed_tool_chats``: the streamed tool chat llama-server gives no logprobs
    for is handed on, and the verifier compares the primary's answer to the same call asked
    again, not streamed, with logprobs (as it probes the primary on a fallback's calls); the
    capture record keeps the client's call and the probe's answer, which a replay compares."""
    server, gguf = hermes
    model = tool_chat_model(server, gguf, tmp_path / "capture", sample_logprobs=5,
                            probe_streamed_tool_chats=True)
    with running(tmp_path, [model], http_port=0) as (srv, _):
        through = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1",
                                api_key="none", max_retries=0, timeout=120)
        chunks = list(through.chat.completions.create(**TOOL_CALL, temperature=0, stream=True))
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        values = compared_at_least(srv, 1, 300)
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="pass") == 1
        assert metric(values, "guard_generation_not_comparable_total", model="smol",
                      reason="tools") == 0
    stats = FileStats()
    (record,) = [r for path in expand_paths([tmp_path / "capture"])
                 for r in read_records(path, stats)]
    call, probed = generation_calls(record)
    assert call.streamed and call.tools and probed is not None and not probed.streamed
    assert probed.tool_calls == ("get_weather",) and probed.prompt_token_ids
    assert all(t.token_id is not None for t in probed.tokens)
    assert json.loads(record.verdicts[0].details_json)["mode"] == "logprobs"
    generation = replay_report(tmp_path)
    assert (generation["checks"], generation["passed"]) == (1, 1)


@needs_envoy
def test_envoy_mode_compares_tool_chats_and_probes_a_streamed_one(hermes, tmp_path):
    """Envoy mode: Envoy forwards, guard observes the sampled calls through the tap and adds
    nothing, so a tool chat is compared where its client asked logprobs, on the prompt the
    verifier asks llama-server for; a streamed one (no logprobs on llama-server's stream) on
    the primary probed (``probe_streamed_tool_chats``)."""
    server, gguf = hermes
    model = tool_chat_model(server, gguf, tmp_path / "capture", probe_streamed_tool_chats=True)
    guard = Guard(write(tmp_path, [model], server={"http_port": 0}, http_health_port=0))
    try:
        through = openai.OpenAI(base_url=f"http://127.0.0.1:{guard.srv.http_port}/v1",
                                api_key="none", max_retries=0, timeout=120)
        answer = through.chat.completions.create(**TOOL_CALL, temperature=0, logprobs=True)
        assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert answer.choices[0].logprobs is not None  # (the client's own: kept)
        chunks = list(through.chat.completions.create(**TOOL_CALL, temperature=0, stream=True))
        assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        values = compared_at_least(guard.srv, 2)
        assert metric(values, "guard_checks_total", model="smol", tier="generation",
                      result="pass") == 2
        assert metric(values, "guard_generation_not_comparable_total", model="smol",
                      reason="tools") == 0
    finally:
        guard.close()
    records = [r for path in expand_paths([tmp_path / "capture"])
               for r in read_records(path, FileStats())]
    probed = [generation_calls(r)[1] for r in records]
    assert sorted(p is not None for p in probed) == [False, True]
