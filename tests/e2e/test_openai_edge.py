"""The OpenAI-compatible HTTP edge end to end with real parts: llama-cpp-python's server serving
the real SmolLM2 GGUF (tests/e2e/llm_support.py), guard in front of it on ``http_port``, and
the ``openai`` Python client (and plain HTTP) as the users' side.

Greedy calls (temperature 0) answer the same text directly and through guard; guard renames
the model both ways, names the route, and hands every sampled call to the verifier as a
GenerationSample (asserted here on the ring itself, decoded, until the verifier's generation
tier lands)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import yaml

from guard.plan.serving import load_config
from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.ipc.routes import RouteTable
from guard.observe.metrics import GuardMetrics
from guard.serve.model import ServedModel
from llm_support import call_both_ways, llama_server, smollm2_gguf  # noqa: F401  (the module's server)
from llm_support import SERVED_NAME, assert_answered_alike, fractions, masked, stop_llama_server
from support import events, metric, running, scrape, wait_for, write_config

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def model_block(server, **options) -> dict:
    upstream = {"backend": "openai", "target": server.url, "model": server.model,
                "options": options}
    # A reference makes the model sampled (mirror.sample_rate 1): llama.cpp in guard's
    # verifier on the server's own GGUF (llama-cpp-python's server cannot be a remote one: it
    # scores no given token ids, guard/backends/openai_scorer.py).
    reference = {"backend": "llama_cpp", "path": str(smollm2_gguf())}
    return {"name": "smol", "task": "generation", "primary": upstream, "reference": reference,
            "mirror": {"sample_rate": 1.0, "timeout_s": 120}}


@pytest.fixture(scope="module")
def guard(llama_server, tmp_path_factory):  # noqa: F811
    with running(tmp_path_factory.mktemp("edge"), [model_block(llama_server)],
                 http_port=0) as (server, _):
        yield server


@pytest.fixture(scope="module")
def through(guard):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{guard.http_port}/v1", api_key="none",
                       max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def direct(llama_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="none",
                       max_retries=0) as client:
        yield client


def handed(guard) -> float:
    """Samples the verifier took from the ring, whatever it made of them."""
    values = scrape(guard.metrics_port)
    return sum(metric(values, "guard_mirror_total", model="smol", outcome=o)
               for o in ("compared", "error", "timeout"))


def test_a_completion_through_guard_is_the_servers_under_the_clients_name(
        guard, through, direct, llama_server):  # noqa: F811
    raw = through.completions.with_raw_response.create(model="smol", prompt=PROMPT,
                                                       max_tokens=8, temperature=0)
    assert raw.headers["guard-route"] == "primary"
    answer = raw.parse()
    expected = direct.completions.create(model=llama_server.model, prompt=PROMPT,
                                         max_tokens=8, temperature=0)
    assert answer.model == "smol" and expected.model == llama_server.model
    assert answer.choices[0].text == expected.choices[0].text
    assert answer.choices[0].text.startswith(" Paris")
    assert answer.usage.completion_tokens == expected.usage.completion_tokens


def test_a_chat_through_guard_is_the_servers_under_the_clients_name(guard, through, direct,
                                                                    llama_server):  # noqa: F811
    raw = through.chat.completions.with_raw_response.create(
        model="smol", messages=MESSAGES, max_tokens=8, temperature=0)
    assert raw.headers["guard-route"] == "primary"
    answer = raw.parse()
    expected = direct.chat.completions.create(model=llama_server.model, messages=MESSAGES,
                                              max_tokens=8, temperature=0)
    assert answer.model == "smol"
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.choices[0].finish_reason == expected.choices[0].finish_reason


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_streamed_call_comes_token_by_token_and_is_counted(guard, through, direct,
                                                             llama_server, endpoint):  # noqa: F811
    def stream(client, model):
        if endpoint == "chat":
            chunks = client.chat.completions.create(model=model, messages=MESSAGES,
                                                    max_tokens=12, temperature=0, stream=True)
            return [c for c in chunks], lambda c: c.choices[0].delta.content or "" \
                if c.choices else ""
        chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                           temperature=0, stream=True)
        return [c for c in chunks], lambda c: c.choices[0].text if c.choices else ""

    before = metric(scrape(guard.metrics_port), "guard_generation_tokens_total", model="smol",
                    route="primary")
    ttft_before = metric(scrape(guard.metrics_port), "guard_generation_ttft_seconds_count",
                         model="smol", route="primary")
    ours, text = stream(through, "smol")
    theirs, _ = stream(direct, llama_server.model)
    assert {c.model for c in ours} == {"smol"}
    assert [text(c) for c in ours] == [text(c) for c in theirs]  # the same events, in order
    tokens = sum(1 for c in ours if text(c))
    assert tokens > 3  # one event per token: streamed, not one buffered answer
    # Counted once the client has its last event: off the response path.
    wait_for(lambda: metric(scrape(guard.metrics_port), "guard_generation_tokens_total",
                            model="smol", route="primary") == before + tokens)
    values = scrape(guard.metrics_port)
    assert metric(values, "guard_generation_ttft_seconds_count", model="smol",
                  route="primary") == ttft_before + 1
    assert metric(values, "guard_generation_inter_token_seconds_count", model="smol",
                  route="primary") >= tokens - 1


def test_every_serving_process_answers_on_the_http_port_and_counts_there(
        tmp_path, direct, llama_server):  # noqa: F811
    """server.processes 2: the extra serving process runs the HTTP edge too (it failed to
    start once, missing the edge's metrics). Calls on fresh connections until each process
    has answered some: each answer the server's own, and /metrics sums both processes'
    counts, tokens included; every call reaches the verifier from either ring."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    expected = direct.completions.create(model=llama_server.model, prompt=PROMPT,
                                         max_tokens=4, temperature=0).choices[0].text

    def answered(text: str) -> float:
        return sum(s.value for family in text_string_to_metric_families(text)
                   for s in family.samples if s.name == "guard_requests_total"
                   and s.labels.get("model") == "smol")

    with running(tmp_path, [model_block(llama_server)], http_port=0, processes=2) as (srv, _):
        def per_process() -> list[float]:
            own = generate_latest(srv.metrics.registry).decode()
            return [answered(text) for text in (own, *srv.serving.expositions())]

        tokens = 0
        for _ in range(64):  # a new connection each: the kernel picks the process
            answer = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/completions",
                                json={"model": "smol", "prompt": PROMPT, "max_tokens": 4,
                                      "temperature": 0}, timeout=60).json()
            assert answer["model"] == "smol" and answer["choices"][0]["text"] == expected
            tokens += answer["usage"]["completion_tokens"]
            if min(per_process()) >= 2:
                break
        counts = per_process()
        assert min(counts) >= 2, counts
        sent = sum(counts)
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_requests_total", model="smol", route="primary") == sent
        assert metric(values, "guard_generation_tokens_total", model="smol",
                      route="primary") == tokens
        wait_for(lambda: handed(srv) == sent, timeout=120)


def test_a_stream_cut_when_the_shutdown_grace_runs_out_is_unavailable_not_the_client_leaving(
        tmp_path, llama_server, caplog):  # noqa: F811
    """guard stops (grace 1 s) while a long stream runs: the client gets what had arrived,
    then a cut, and the call is counted UNAVAILABLE with an event saying guard cut it; it was
    counted as a client that went away (CANCELLED), which it never did."""
    import asyncio
    import logging

    from guard.serve.app import BackgroundServer

    caplog.set_level(logging.INFO, logger="guard.events")
    background = BackgroundServer(load_config(write_config(
        tmp_path, [model_block(llama_server)], http_port=0, shutdown_grace_s=1)))
    with background as srv:
        received, ended = [], threading.Event()

        def stream() -> None:
            try:
                body = {"model": "smol", "prompt": "a a a a a a a a", "max_tokens": 300,
                        "temperature": 0, "stream": True,
                        # no end-of-text: seconds of tokens (5 s here)
                        "logit_bias": {"0": -100, "1": -100, "2": -100}}
                with httpx.stream("POST", f"http://127.0.0.1:{srv.http_port}/v1/completions",
                                  json=body, timeout=120) as answer:
                    for line in answer.iter_lines():
                        received.append(line)
            except httpx.HTTPError:
                pass  # the cut: asserted below by what arrived
            finally:
                ended.set()

        threading.Thread(target=stream, daemon=True).start()
        wait_for(lambda: any(line.startswith("data: {") for line in received), timeout=60)
        asyncio.run_coroutine_threadsafe(srv.stop(grace=1), background._loop).result(60)
        assert ended.wait(30)
        errors = {sample.labels["code"]: sample.value  # (the stopped server's own series)
                  for family in srv.metrics.request_errors.collect()
                  for sample in family.samples if sample.name.endswith("_total")}
    assert "data: [DONE]" not in received  # 300 tokens take longer than the grace
    assert errors == {"UNAVAILABLE": 1.0}
    assert events(caplog, "openai_cut_at_shutdown") and not events(
        caplog, "openai_client_disconnected")


def test_with_the_fallback_down_a_reload_applies_and_its_calls_go_to_the_primary(
        tmp_path, llama_server, caplog):  # noqa: F811
    """In an incident the fallback's server is down. A reload that changes the model's
    sampling applies (one look at the fallback, an event saying it is down), where it waited
    out ready_timeout_s, held every other reload back, then failed; the completion compared
    before it stays in the model's evidence. Calls routed to the fallback (pinned here, as a
    trip would) are answered by the primary, said once, where every one was a 502."""
    import logging

    import grpc

    from guard.serve.app import BackgroundServer
    from guard.v1 import admin_pb2, admin_pb2_grpc
    from llm_support import start_llama_cpp_upstream

    caplog.set_level(logging.INFO, logger="guard.events")
    fallback = start_llama_cpp_upstream(tmp_path, smollm2_gguf(), "smol-fallback")
    model = model_block(llama_server) | {
        "fallback": {"backend": "openai", "target": fallback.url, "model": fallback.model,
                     "options": {"ready_timeout_s": 30}},
        "policy": {"action": "fallback_model", "dwell_s": 0.3}}
    path = write_config(tmp_path, [model], http_port=0, reload_interval_s=0.1)

    def complete(srv) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/completions",
                          json={"model": "smol", "prompt": PROMPT, "max_tokens": 2,
                                "temperature": 0}, timeout=60)

    try:
        with BackgroundServer(load_config(path)) as srv:
            assert httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/completions", json={
                "model": "smol", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                "logprobs": 2}, timeout=60).status_code == 200  # (its KLD is measured)
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_checks_total",
                                    model="smol", tier="generation", result="pass") == 1)
            stop_llama_server(fallback)
            data = yaml.safe_load(path.read_text())
            data["models"][0]["mirror"]["sample_rate"] = 0.5
            path.write_text(yaml.safe_dump(data))
            wait_for(lambda: metric(scrape(srv.metrics_port), "guard_config_reloads_total",
                                    result="applied") == 1, timeout=25)
            assert metric(scrape(srv.metrics_port), "guard_config_reloads_total",
                          result="failed") == 0
            (down,) = events(caplog, "openai_upstream_not_ready")
            assert down["target"] == fallback.url and down["role"] == "fallback"
            (reloaded,) = events(caplog, "config_reloaded")
            assert reloaded["evidence_carried"] == ["smol"]
            with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
                status = admin_pb2_grpc.AdminStub(channel).GetStatus(
                    admin_pb2.GetStatusRequest(model="smol")).models[0]
            assert (status.windows[0].samples, status.generation.completions) == (1, 1)

            with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
                admin_pb2_grpc.AdminStub(channel).SetRoute(admin_pb2.SetRouteRequest(
                    model="smol", route=admin_pb2.FALLBACK, reason="test"))
            answers = [complete(srv) for _ in range(2)]
            assert [(a.status_code, a.headers["guard-route"]) for a in answers] == [
                (200, "primary")] * 2
            (spilled,) = events(caplog, "openai_fallback_unreachable")  # (then skipped)
            assert spilled["target"] == fallback.url
            values = scrape(srv.metrics_port)
            assert metric(values, "guard_requests_total", model="smol", route="primary") == 3
            assert metric(values, "guard_request_errors_total", model="smol",
                          code="UNAVAILABLE") == 0
            # Handed back to the policy, still on the fallback: once the dwell is over the
            # route probes, and the primary's answers standing in are its probes (compared),
            # so the route can come back while the fallback is down. They were never sampled.
            compared = metric(values, "guard_mirror_total", model="smol", outcome="compared")
            with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
                admin_pb2_grpc.AdminStub(channel).SetRoute(admin_pb2.SetRouteRequest(
                    model="smol", route=admin_pb2.AUTO))
            wait_for(lambda: complete(srv).headers["guard-route"] == "primary" and metric(
                scrape(srv.metrics_port), "guard_mirror_total", model="smol",
                outcome="compared") > compared, timeout=120, interval=0.3)
    finally:
        stop_llama_server(fallback)


def test_every_sampled_call_reaches_the_verifier(guard, through):
    before = handed(guard)
    call_both_ways(through, "smol", max_tokens=4)
    wait_for(lambda: handed(guard) >= before + 2)
    values = scrape(guard.metrics_port)
    assert metric(values, "guard_mirror_total", model="smol", outcome="dropped") == 0


def test_a_prompt_sent_as_a_batch_of_one_is_compared(guard, through, direct):
    """LangChain's completions client sends every prompt as a list (``["text"]``): one
    prompt, one completion, compared as the prompt it holds (it was never compared).
    Without its repeat penalty (llama-cpp-python's server applies 1.1 unless told, even at
    temperature 0, and this block declares no engine): penalized, the server's greedy
    " Paris.\n" went on with "-" when the test ran alone, "\n" after the module's other
    calls."""
    def passed() -> float:
        return metric(scrape(guard.metrics_port), "guard_checks_total", model="smol",
                      tier="generation", result="pass")

    before, listed = passed(), metric(scrape(guard.metrics_port),
                                      "guard_generation_not_comparable_total", model="smol",
                                      reason="prompt_list")
    unpenalized = {"repeat_penalty": 1.0}
    ours = through.completions.create(model="smol", prompt=[PROMPT], max_tokens=6,
                                      temperature=0, extra_body=unpenalized)
    theirs = direct.completions.create(model=SERVED_NAME, prompt=[PROMPT], max_tokens=6,
                                       temperature=0, extra_body=unpenalized)
    assert ours.choices[0].text == theirs.choices[0].text
    wait_for(lambda: passed() == before + 1)
    assert metric(scrape(guard.metrics_port), "guard_generation_not_comparable_total",
                  model="smol", reason="prompt_list") == listed


def test_admin_status_says_why_calls_were_never_compared(guard, through):
    """A call with best_of=2 (the best of two: no sample) and a fill-in-the-middle call (a
    suffix: llama-cpp-python wraps prompt and suffix in the model's FIM tokens, a prompt the
    reference would not score) are
    forwarded, never handed over; a sampled call that leaves the temperature to a server no
    engine declares is taken by the verifier, which cannot score it: admin status names the
    reasons, as the merged /metrics counts them."""
    from guard.admin_client import format_model_status, get_status, status_json
    from guard.v1.admin_pb2 import GetStatusResponse

    def reasons() -> dict[str, float]:
        values = scrape(guard.metrics_port)
        return {r: metric(values, "guard_generation_not_comparable_total", model="smol",
                          reason=r) for r in ("n", "input", "sampling_unknown")}

    before = reasons()
    with httpx.Client(timeout=60) as http:
        http.post(f"http://127.0.0.1:{guard.http_port}/v1/completions", json={
            "model": "smol", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "best_of": 2})
    middle = through.completions.create(model="smol", prompt="def add(a, b):\n",
                                        suffix="\n    return result\n", max_tokens=4,
                                        temperature=0)
    assert middle.choices[0].text  # the server's answer, as it came
    through.completions.create(model="smol", prompt=PROMPT, max_tokens=2)  # no temperature
    wait_for(lambda: all(reasons()[r] == before[r] + 1 for r in before))
    (status,) = get_status(f"127.0.0.1:{guard.admin_port}", "smol").models
    assert status.has_generation
    counted = reasons()
    assert {r: status.generation.not_comparable_by_reason[r] for r in counted} == counted
    text = format_model_status(status)
    as_json = status_json(GetStatusResponse(models=[status]))["models"][0]
    assert as_json["generation"]["not_comparable_by_reason"]["n"] == before["n"] + 1  # a number
    assert f"n={before['n'] + 1:.0f}" in text and "sampling_unknown=" in text, text


def test_constrained_calls_are_never_scored_as_drift_and_compared_with_logprobs(guard, through):
    """JSON mode (llama-cpp-python decodes response_format with a grammar), sampled: the
    grammar forces '{' and quotes the model itself gives a few percent or less, which the
    sampled check would read as drift on this healthy pair (the reference runs the server's
    own GGUF; z 5.8-15.5 over 12 such calls in benchmarks/results/llm_constrained.md, where
    free calls give |z| < 2). Without logprobs the verifier counts it not comparable
    (``constrained``), and a mirostat call (``sampler``) likewise; with the client's
    logprobs (the model's distribution before the grammar) the call is compared token by
    token and passes."""
    def counts() -> dict[str, float]:
        values = scrape(guard.metrics_port)
        found = {r: metric(values, "guard_generation_not_comparable_total", model="smol",
                           reason=r) for r in ("constrained", "sampler")}
        for result in ("pass", "fail"):
            found[result] = metric(values, "guard_checks_total", model="smol",
                                   tier="generation", result=result)
        return found

    before = counts()
    # The whole transform in the request: this module's server declares no engine.
    sampled = dict(model="smol", messages=MESSAGES, temperature=0.8, seed=1,
                   presence_penalty=0, frequency_penalty=0, top_p=0.95,
                   extra_body={"repeat_penalty": 1.0, "top_k": 40, "min_p": 0.05})
    json_mode = dict(sampled, max_tokens=10, response_format={"type": "json_object"})
    answer = through.chat.completions.create(**json_mode)
    assert answer.choices[0].message.content.lstrip().startswith("{"), answer
    through.chat.completions.create(**dict(sampled, max_tokens=6, extra_body={
        **sampled["extra_body"], "mirostat_mode": 2}))
    wait_for(lambda: counts()["constrained"] == before["constrained"] + 1
             and counts()["sampler"] == before["sampler"] + 1)
    through.chat.completions.create(**json_mode, logprobs=True, top_logprobs=5)
    wait_for(lambda: counts()["pass"] == before["pass"] + 1)
    assert counts()["fail"] == before["fail"]


def test_plain_http_gets_openai_errors_and_the_model_list(guard):
    with httpx.Client(base_url=f"http://127.0.0.1:{guard.http_port}", timeout=30) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "smol"
        missing = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        bad = http.post("/v1/chat/completions", content=b"{not json",
                        headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]


# -- the hand-off, read off the ring ---------------------------------------------------------------
class EdgeOnOwnRing:
    """The edge of one served model on an event loop thread, sampling every call into a ring
    this test reads (no verifier takes from it)."""

    def __init__(self, config_path):
        from guard.serve.openai_edge import OpenAIEdge

        self.config = load_config(config_path)
        self.metrics = GuardMetrics("test")
        self.table = RouteTable(capacity=4)
        self.ring = SampleRing(4 * 1024 * 1024)
        self.model = ServedModel(self.config.models[0], self.metrics, self.table, 0, self.ring)
        self.model.load()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.edge = OpenAIEdge(lambda: {"smol": self.model}, self.metrics, self.config.server)
        self._run(self.model.connect())
        self._run(self.edge.start())
        self._run(self.edge.set_ready(True))
        self.port = self.edge.port

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def samples(self, count: int = 1) -> list:
        """The next ``count`` samples (handed over once the client has its answer: waited
        for), and any more already there."""
        out: list = []

        def take() -> bool:
            while (record := self.ring.take()) is not None:
                out.append(wire.decode(bytes(record)))
            return len(out) >= count

        wait_for(take)
        return out

    def close(self) -> None:
        self._run(self.edge.stop(1.0))
        self.model.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.ring.close()
        self.table.close()


@pytest.fixture(scope="module")
def own_ring(llama_server, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("own_ring")
    edge = EdgeOnOwnRing(write_config(folder, [model_block(llama_server, sample_logprobs=3)],
                                      http_port=0))
    try:
        yield edge
    finally:
        edge.close()


def test_a_sampled_chat_hands_over_the_primarys_tokens_with_logprobs_the_client_never_sees(
        own_ring, llama_server):  # noqa: F811
    body = {"model": "smol", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        ours = http.post(f"http://127.0.0.1:{own_ring.port}/v1/chat/completions", json=body)
        theirs = http.post(f"{llama_server.url}/v1/chat/completions",
                           json=dict(body, model=llama_server.model))
    assert ours.status_code == 200 and ours.headers["guard-route"] == "primary"
    # guard asked for logprobs (sample_logprobs: 3) and set them back to null: the client's
    # bytes are the server's answer to the call it sent, but for the model's name.
    assert json.loads(ours.content)["choices"][0]["logprobs"] is None
    assert masked(ours.content) == masked(theirs.content).replace(
        f'"model":"{llama_server.model}"'.encode(), b'"model":"smol"')
    assert fractions(ours.content) == pytest.approx(fractions(theirs.content), abs=1e-3)
    (sample,) = [s.payload.call for s in own_ring.samples()]
    assert sample.model == "smol" and sample.endpoint == "chat" and sample.route == "primary"
    assert sample.messages == tuple(MESSAGES) and sample.upstream_model == llama_server.model
    assert sample.completion_text == json.loads(ours.content)["choices"][0]["message"]["content"]
    assert sample.has_logprobs and len(sample.tokens) == 6
    assert "".join(t.text for t in sample.tokens) == sample.completion_text
    assert all(len(t.top) == 3 and t.top[0][1] >= t.top[-1][1] for t in sample.tokens)
    assert sample.sampling.greedy and sample.sampling.max_tokens == 6
    assert sample.sampling.logprobs is None  # the client's transform: it asked for none
    assert sample.finish_reason == "length" and not sample.streamed


def test_a_sampled_stream_hands_over_its_tokens_and_timing(own_ring):
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        answer = http.post(f"http://127.0.0.1:{own_ring.port}/v1/completions", json=body)
    events = [json.loads(line[6:]) for line in answer.text.split("\n\n")
              if line.startswith("data: {")]
    assert all(e["model"] == "smol" for e in events)
    assert all(e["choices"][0]["logprobs"] is None for e in events)  # stripped in each event
    text = "".join(e["choices"][0]["text"] for e in events)
    (sample,) = [s.payload.call for s in own_ring.samples()]
    assert sample.streamed and sample.prompt == PROMPT and sample.completion_text == text
    assert [t.text for t in sample.tokens] and "".join(t.text for t in sample.tokens) == text
    assert sample.has_logprobs and sample.tokens[0].text == " Paris"
    assert 0 < sample.first_token_seconds <= sample.request_seconds


def test_a_call_naming_no_model_is_the_one_models_and_named_so(own_ring, llama_server):  # noqa: F811
    """vLLM and llama.cpp's servers answer a body without ``model`` (their one model), so a
    client written against one may send none: guard routes it to the one generation model it
    serves, tells the upstream the block's name (llama-cpp-python's server echoes it: the
    sample's ``upstream_model``; asked with none it answers its file's path) and names its own
    in the answer. With several models such a call is a 400 that lists them."""
    base = f"http://127.0.0.1:{own_ring.port}"
    whole = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    streamed = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        ours = http.post(f"{base}/v1/chat/completions", json=whole)
        theirs = http.post(f"{llama_server.url}/v1/chat/completions", json=whole)
        events = http.post(f"{base}/v1/completions", json=streamed).text.split("\n\n")
        named_null = http.post(f"{base}/v1/chat/completions", json=dict(whole, model=None))
        not_a_name = http.post(f"{base}/v1/chat/completions", json=dict(whole, model=7))
    assert ours.status_code == 200 and ours.json()["model"] == "smol"
    assert theirs.json()["model"] != llama_server.model  # (its path: asked with no name)
    assert ours.json()["choices"][0]["message"] == theirs.json()["choices"][0]["message"]
    chunks = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"smol"}
    assert named_null.status_code == 200 and named_null.json()["model"] == "smol"
    assert not_a_name.status_code == 400
    assert "'model' must be a string" in not_a_name.json()["error"]["message"]
    samples = [s.payload.call for s in own_ring.samples(3)]
    assert [(s.model, s.upstream_model) for s in samples] == [
        ("smol", llama_server.model)] * 3

    served = own_ring.edge.models
    own_ring.edge.models = lambda: {**served(), "other": served()["smol"]}
    try:
        with httpx.Client(timeout=60) as http:
            refused = http.post(f"{base}/v1/chat/completions", json=whole)
            named = http.post(f"{base}/v1/chat/completions", json=dict(whole, model="smol"))
    finally:
        own_ring.edge.models = served
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    assert "several models (other, smol)" in refused.json()["error"]["message"]
    assert named.status_code == 200
    own_ring.samples(1)  # (the named call's sample, taken off the ring)


def test_calls_the_client_asked_logprobs_for_keep_them_and_best_of_2_is_not_sampled(
        own_ring):
    with httpx.Client(timeout=60) as http:
        asked = http.post(f"http://127.0.0.1:{own_ring.port}/v1/completions", json={
            "model": "smol", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "logprobs": 2})
        several = http.post(f"http://127.0.0.1:{own_ring.port}/v1/completions", json={
            "model": "smol", "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "best_of": 2})
    logprobs = asked.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3 and len(logprobs["top_logprobs"][0]) == 2
    assert several.status_code in (200, 400)  # the server's own answer, forwarded
    (sample,) = [s.payload.call for s in own_ring.samples()]  # the first only
    assert sample.sampling.logprobs == 2 and len(sample.tokens[0].top) == 2
    values = own_ring.metrics.registry.get_sample_value(
        "guard_generation_not_comparable_total", {"model": "smol", "reason": "n"})
    assert values == 1


def test_a_completions_call_asking_zero_logprobs_gets_the_servers_answer(own_ring,
                                                                          llama_server):  # noqa: F811
    """``logprobs: 0`` asks a completions server for the chosen tokens' logprobs without
    alternatives. It is the client's own ask: guard adds none and strips none (before, it
    took 0 for unasked, asked its own 3 and set the answer's logprobs to null)."""
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "logprobs": 0}
    with httpx.Client(timeout=60) as http:
        ours = http.post(f"http://127.0.0.1:{own_ring.port}/v1/completions", json=body)
        theirs = http.post(f"{llama_server.url}/v1/completions",
                           json=dict(body, model=llama_server.model))
    assert ours.status_code == 200
    assert masked(ours.content) == masked(theirs.content).replace(
        f'"model":"{llama_server.model}"'.encode(), b'"model":"smol"')
    assert fractions(ours.content) == pytest.approx(fractions(theirs.content), abs=1e-3)
    (sample,) = [s.payload.call for s in own_ring.samples()]
    assert sample.sampling.logprobs == 0


# Request shapes clients send to llama-cpp-python's server (its own extensions too: grammar,
# a fill-in-the-middle suffix), each answered through guard with every call sampled and guard
# asking its own logprobs where the client did not, and directly (tests/e2e/test_vllm.py
# holds vLLM's). (Last in the file: the ring keeps what these calls handed over.)
SHAPES = [
    ("completions", {}), ("completions", {"logprobs": 0}), ("completions", {"logprobs": 2}),
    ("completions", {"echo": True, "logprobs": 1}), ("completions", {"echo": True}),
    ("completions", {"temperature": 0.8, "seed": 3, "n": 2}),
    ("completions", {"prompt": [PROMPT]}), ("completions", {"stream": True}),
    ("completions", {"stream": True, "logprobs": 1}),
    ("completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ("completions", {"stop": [" is"]}), ("completions", {"suffix": " end"}),
    ("completions", {"logit_bias": {"7042": -100}}),
    ("completions", {"grammar": 'root ::= "yes"'}),
    ("chat", {}), ("chat", {"logprobs": True}), ("chat", {"logprobs": True, "top_logprobs": 0}),
    ("chat", {"top_logprobs": 2}), ("chat", {"stream": True}),
    ("chat", {"stream": True, "logprobs": True, "top_logprobs": 2}),
    ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"temperature": 0.7, "seed": 5}),
]


def test_every_request_shape_gets_the_servers_own_answer_through_guard(
        own_ring, llama_server):  # noqa: F811
    with httpx.Client(timeout=60) as http:
        assert_answered_alike(http, f"http://127.0.0.1:{own_ring.port}", llama_server.url,
                              llama_server.model, SHAPES, PROMPT, MESSAGES)


def test_a_server_that_fails_guards_logprobs_answers_the_client_as_it_asked(tmp_path, caplog):
    """llama-cpp-python's server started without --logits_all (as it starts by default) fails
    any call that asks logprobs: HTTP 500 to a whole one, an empty stream to a streamed one.
    guard asks them of every sampled call here (sample_logprobs 5), so each first call of a
    shape is refused: the client's own call goes instead and its answer is the client's (the
    server's text, as a direct call gets it), the refusal is said once per shape, and later
    calls of that shape go as the client sent them. Every call is still compared."""
    from llm_support import start_llama_server

    from support import events

    caplog.set_level("INFO", logger="guard.events")
    upstream = start_llama_server(tmp_path, logits_all=False)
    try:
        block = model_block(upstream, sample_logprobs=5, engine="llama-cpp-python")
        with running(tmp_path, [block], http_port=0) as (server, _), \
                openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                              api_key="none", max_retries=0, timeout=120) as through, \
                openai.OpenAI(base_url=f"{upstream.url}/v1", api_key="none",
                              max_retries=0) as direct:
            asked = dict(prompt=PROMPT, max_tokens=6, temperature=0)
            expected = direct.completions.create(model=upstream.model, **asked).choices[0].text
            chat = dict(messages=MESSAGES, max_tokens=6, temperature=0)
            said = direct.chat.completions.create(model=upstream.model, **chat)
            for _ in range(2):  # the first call of each shape refused, the second not amended
                assert through.completions.create(model="smol", **asked).choices[0].text == \
                    expected
                streamed = "".join(c.choices[0].text for c in through.completions.create(
                    model="smol", stream=True, **asked) if c.choices)
                assert streamed == expected
                answer = through.chat.completions.create(model="smol", **chat)
                assert answer.choices[0].message.content == said.choices[0].message.content
            refused = events(caplog, "openai_additions_refused")
            assert sorted(e["shape"] for e in refused) == \
                sorted(["chat, whole, no tools", "completions, whole, no tools",
                        "completions, streamed, no tools"])
            assert {e["status"] for e in refused} == {500, 200}  # the stream opened, then ended
            assert all(e["error"] for e in refused)
            wait_for(lambda: handed(server) >= 6, timeout=120)
            values = scrape(server.metrics_port)
            assert metric(values, "guard_mirror_total", model="smol", outcome="compared") == 6
        # The probe of a primary behind a fallback asks its logprobs likewise: refused, it asks
        # the call as the client sent it, and is answered.
        from guard.backends.openai_generate import PrimaryProbe
        from guard.config.backend import BackendConfig
        from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob

        probe = PrimaryProbe(BackendConfig(backend="openai", target=upstream.url,
                                           model=upstream.model), timeout_s=60)
        sample = GenerationSample(model="smol", endpoint="completions", prompt=PROMPT,
                                  completion_text=expected, tokens=(TokenLogprob(expected),),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=6))
        assert probe(sample).completion_text == expected
        (probed,) = [e for e in events(caplog, "openai_additions_refused")
                     if e["route"] == "probe"]
        assert probed["status"] == 500 and "logits_all" in probed["error"]
    finally:
        stop_llama_server(upstream)
