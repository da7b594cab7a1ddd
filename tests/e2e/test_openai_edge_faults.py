"""The HTTP edge's bad input and faults (issue 29 item 6), end to end: a real guard (``http_port``)
in front of a real HTTP server whose answers the test scripts (tests/e2e/sse_upstream.py), with
plain HTTP clients (httpx2, the one the openai package uses). Every case is a counted outcome with
the right status, never a crash and never a changed answer; guard serves the next call after
each."""

from __future__ import annotations

import json
import re

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest

from sse_upstream import MODEL, ScriptedUpstream, responses_answer, responses_events, wait_until
from support import metric, running, scrape

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Capital of France?"}]}


@pytest.fixture(scope="module")
def upstreams():
    with ScriptedUpstream() as primary, ScriptedUpstream() as doomed:
        yield primary, doomed


@pytest.fixture(scope="module")
def guard(upstreams, tmp_path_factory):
    primary, doomed = upstreams
    block = {"backend": "openai", "target": primary.url, "model": MODEL,
             "options": {"api_key_env": "GUARD_TEST_UPSTREAM_KEY"}}
    models = [
        {"name": "smol", "task": "generation", "primary": block,
         "fallback": dict(block, options={"api_key_env": "GUARD_TEST_UPSTREAM_KEY"}),
         "policy": {"action": "fallback_model"}},
        {"name": "impatient", "task": "generation",  # the same upstream, a short read timeout
         "primary": dict(block, options={"read_timeout_s": 0.5})},
        {"name": "doomed", "task": "generation",
         "primary": {"backend": "openai", "target": doomed.url, "model": MODEL}},
    ]
    import os

    os.environ["GUARD_TEST_UPSTREAM_KEY"] = "upstream-secret"
    try:
        # 1 MiB: the longest event (endless_line below); every other message here is smaller.
        with running(tmp_path_factory.mktemp("edge"), models, http_port=0,
                     max_message_bytes=1 << 20) as (server, _):
            yield server
    finally:
        os.environ.pop("GUARD_TEST_UPSTREAM_KEY", None)


@pytest.fixture
def http(guard, upstreams):
    upstreams[0].reset()
    with httpx.Client(base_url=f"http://127.0.0.1:{guard.http_port}", timeout=30) as client:
        yield client


def errors(guard, code: str, model: str = "smol") -> float:
    return metric(scrape(guard.metrics_port), "guard_request_errors_total", model=model,
                  code=code)


def not_comparable(guard, reason: str) -> float:
    return metric(scrape(guard.metrics_port), "guard_generation_not_comparable_total",
                  model="smol", reason=reason)


def still_serves(http) -> None:
    answer = http.post("/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200 and answer.json()["model"] == "smol"


# -- what guard sends and answers ------------------------------------------------------------------
def test_a_plain_answer_is_the_upstreams_bytes_but_the_model_name(http, upstreams):
    answer = http.post("/v1/chat/completions", json=CHAT,
                       headers={"Authorization": "Bearer client-key", "X-Custom": "kept"})
    assert answer.status_code == 200 and answer.headers["guard-route"] == "primary"
    # The scripted server indents its JSON: the edge changed the model value, no other byte.
    sent = json.loads(answer.content)
    assert sent["model"] == "smol"
    assert answer.content == json.dumps(dict(sent, model=MODEL), indent=1).encode().replace(
        f'"model": "{MODEL}"'.encode(), b'"model": "smol"')
    seen = upstreams[0].requests[-1]
    assert json.loads(seen["body"]) == dict(CHAT, model=MODEL)
    assert seen["headers"]["Authorization"] == "Bearer upstream-secret"  # api_key_env
    assert seen["headers"]["X-Custom"] == "kept"
    assert seen["headers"].get("Accept-Encoding", "identity") == "identity"


def test_a_cookie_the_upstream_sets_goes_to_its_client_and_never_to_another(upstreams,
                                                                           tmp_path):
    """guard's upstream session keeps no cookies: one an upstream (or a load balancer before
    it) sets reaches the client that called, and is not sent on the calls of other clients.
    The upstream is addressed by name (``localhost``): a cookie jar refuses IP addresses'
    cookies, a Service's DNS name it would keep."""
    primary = upstreams[0]
    primary.reset()
    block = {"backend": "openai", "target": f"http://localhost:{primary.port}", "model": MODEL}
    with running(tmp_path, [{"name": "smol", "task": "generation", "primary": block}],
                 http_port=0) as (server, _):
        base = f"http://127.0.0.1:{server.http_port}"
        with httpx.Client(base_url=base, timeout=30) as first:
            answer = first.post("/v1/chat/completions", json=CHAT,
                                headers={"x-test-scenario": "cookie"})
            assert answer.status_code == 200
            cookies = answer.headers.get_list("set-cookie")  # both, not the last one only
            assert len(cookies) == 2 and "upstream_shard=b" in cookies[1]
            assert "upstream_session=for-this-client-only" in cookies[0]
        with httpx.Client(base_url=base, timeout=30) as other:
            assert other.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert len(primary.requests) == 2
    assert "Cookie" not in primary.requests[-1]["headers"], primary.requests[-1]["headers"]


def test_a_stream_reaches_the_client_before_the_upstream_has_sent_its_last_event(http,
                                                                               upstreams):
    upstream = upstreams[0]
    body = dict(CHAT, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body,
                     headers={"x-test-scenario": "hold"}) as answer:
        assert answer.headers["guard-route"] == "primary"
        lines = answer.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        # The upstream holds its last event until told: the first came through alone.
        assert not upstream.sent_last.is_set()
        assert json.loads(first[5:])["choices"][0]["delta"]["content"] == "first"
        assert json.loads(first[5:])["model"] == "smol"
        upstream.let_go()
        rest = [line for line in lines if line.startswith("data:")]
    assert upstream.sent_last.is_set()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[0][5:])["model"] == "smol"


def test_events_cut_anywhere_reach_the_client_whole_and_renamed(http):
    answer = http.post("/v1/chat/completions", json=dict(CHAT, stream=True),
                       headers={"x-test-scenario": "split"})
    assert answer.status_code == 200
    text = answer.content
    assert b": a comment\r\n\r\n" in text and text.endswith(b"data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in re.split(rb"\r?\n\r?\n", text)
              if e.startswith(b"data: {")]
    assert [e["model"] for e in events] == ["smol"] * 3
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == "Paris"


def test_every_answer_names_its_route_and_the_fallback_answers_when_pinned(guard, http):
    from guard.admin_client import set_route

    address = f"127.0.0.1:{guard.admin_port}"
    set_route(address, "smol", "fallback", "test")
    try:
        assert wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).headers[
            "guard-route"] == "fallback")
        streamed = http.post("/v1/chat/completions", json=dict(CHAT, stream=True),
                             headers={"x-test-scenario": "split"})
        assert streamed.headers["guard-route"] == "fallback"
    finally:
        set_route(address, "smol", "primary", "test")
    assert wait_until(lambda: http.post("/v1/chat/completions", json=CHAT).headers[
        "guard-route"] == "primary")
    set_route(address, "smol", "auto", "test")


# -- bad input -------------------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000  # nested far past the interpreter's stack


@pytest.mark.parametrize("content", [
    b"not json", b"\xff\xfe\x00", b"[]", b'{"model": 3}',
    b'{"model": "smol", "messages": ' + DEEP + b"}",
    b'{"model": "smol", "max_tokens": ' + b"9" * 5000 + b"}",  # past int()'s 4300 digits
    json.dumps(CHAT).encode("utf-16"),  # JSON, but not in UTF-8
    b'{"model": "smol", "messages": [], "model": "doomed"}',  # routed by which one?
], ids=["text", "bytes", "array", "model-number", "nested", "digits", "utf-16", "model-twice"])
def test_a_body_that_is_not_an_openai_call_is_400_and_counted(guard, http, content):
    before = errors(guard, "INVALID_ARGUMENT", "_unknown")
    answer = http.post("/v1/chat/completions", content=content,
                       headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert errors(guard, "INVALID_ARGUMENT", "_unknown") == before + 1
    still_serves(http)


def test_a_body_that_cannot_be_decoded_is_400_counted_once_and_logged_in_one_line(
        guard, http, caplog):
    caplog.set_level("WARNING", logger="aiohttp.server")
    before = errors(guard, "INVALID_ARGUMENT", "_unknown")
    answer = http.post("/v1/chat/completions", content=b"not gzip at all",
                       headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert answer.status_code == 400 and "cannot be read" in answer.json()["error"]["message"]
    assert errors(guard, "INVALID_ARGUMENT", "_unknown") == before + 1
    assert all(r.exc_info is None for r in caplog.records if r.name == "aiohttp.server")
    still_serves(http)


def test_malformed_http_is_400_counted_and_logged_in_one_line(guard, http, caplog):
    """aiohttp answers what is not HTTP 400 itself; guard counts it and logs one line, no
    traceback (a client looping on it fills no disk)."""
    import socket

    before = errors(guard, "INVALID_ARGUMENT", "_unknown")
    caplog.set_level("WARNING", logger="aiohttp.server")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", guard.http_port), timeout=10) as raw:
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello")
            assert raw.recv(4096).split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")
    assert wait_until(lambda: errors(guard, "INVALID_ARGUMENT", "_unknown") == before + 3)
    logged = [r for r in caplog.records
              if r.name == "aiohttp.server" and "Duplicate Content-Length" in r.getMessage()]
    assert len(logged) == 3 and all(r.exc_info is None and "\n" not in r.getMessage()
                                    for r in logged), logged
    still_serves(http)


def test_headers_the_client_names_in_connection_are_not_forwarded(http, upstreams):
    """RFC 9110 7.6.1: a header the Connection header names is for the next hop alone."""
    answer = http.post("/v1/chat/completions", json=CHAT,
                       headers={"Connection": "keep-alive, X-Hop", "X-Hop": "for guard",
                                "X-Kept": "yes"})
    assert answer.status_code == 200
    seen = upstreams[0].requests[-1]["headers"]
    assert seen["X-Kept"] == "yes" and "X-Hop" not in seen, seen


def test_a_call_is_counted_not_comparable_for_one_reason(guard, http):
    """A body without messages (not comparable: input) that the upstream refuses is not also
    counted upstream_error: one call, one reason."""
    before = not_comparable(guard, "input"), not_comparable(guard, "upstream_error")
    answer = http.post("/v1/chat/completions", json={"model": "smol"},
                       headers={"x-test-scenario": "status", "x-test-status": "400"})
    assert answer.status_code == 400
    assert wait_until(lambda: not_comparable(guard, "input") == before[0] + 1)
    assert not_comparable(guard, "upstream_error") == before[1]


def test_a_call_while_guard_loads_its_models_is_503_not_404(tmp_path):
    """The edge listens before the models are loaded (an upstream not ready yet, a reference
    loading): a call then is 503, which a client retries, not 404 model_not_found."""
    import asyncio

    import aiohttp

    from guard.observe.metrics import GuardMetrics
    from guard.plan.serving import load_config
    from guard.serve.openai_edge import OpenAIEdge
    from support import write_config

    block = {"backend": "openai", "target": "http://127.0.0.1:9", "model": MODEL}
    config = load_config(write_config(tmp_path, [{"name": "smol", "task": "generation",
                                                  "primary": block}], http_port=0))
    edge = OpenAIEdge(lambda: {}, GuardMetrics("test"), config.server)  # nothing loaded yet

    async def call() -> tuple[int, dict]:
        await edge.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{edge.port}/v1/chat/completions",
                                        json=CHAT) as answer:
                    return answer.status, await answer.json()
        finally:
            await edge.stop(0)

    status, body = asyncio.run(call())
    assert status == 503 and body["error"]["type"] == "server_error", body


def test_a_reference_that_cannot_load_is_named_by_its_key_at_start(upstreams, tmp_path):
    """`guard serve` says which block failed, as `guard config validate --load` does."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
    from guard.errors import GuardError

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(996))
    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": upstreams[0].url, "model": MODEL},
             "reference": {"backend": "llama_cpp", "path": str(broken)}}
    with pytest.raises(GuardError, match=r"^models\[smol\]\.reference: llama\.cpp cannot load"):
        with running(tmp_path, [model], http_port=0):
            pass


def test_a_client_trickling_its_request_is_cut_at_http_client_timeout_s(upstreams, tmp_path):
    """Slow-loris: a head that never ends holds its connection until
    server.http_client_timeout_s (here 1 s), then it is closed; a body that never ends is
    answered 408 then, counted."""
    import socket
    import time

    model = {"name": "smol", "task": "generation",
             "primary": {"backend": "openai", "target": upstreams[0].url, "model": MODEL}}
    with running(tmp_path, [model], http_port=0, http_client_timeout_s=1.0) as (srv, _):
        def trickle(first: bytes) -> tuple[bytes, float]:
            """Send ``first``, then a byte every 0.2 s; what came back and when."""
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as raw:
                raw.sendall(first)
                raw.settimeout(0.2)
                while time.monotonic() - started < 20:
                    try:
                        raw.sendall(b"x")
                        answer = raw.recv(4096)
                    except socket.timeout:
                        continue
                    except OSError:  # reset: the connection was closed under the trickle
                        answer = b""
                    return answer, time.monotonic() - started
            raise AssertionError("still open after 20 s")

        _, after = trickle(b"POST /v1/chat/completions HTTP/1.1\r\nX-Slow: ")
        assert after < 10, after  # cut at ~1 s (the timer's resolution is coarse)
        before = metric(scrape(srv.metrics_port), "guard_request_errors_total",
                        model="_unknown", code="DEADLINE_EXCEEDED")
        answer, after = trickle(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Type: application/json\r\n"
                                b"Content-Length: 100000\r\n\r\n{")
        assert answer.split(b"\r\n", 1)[0].endswith(b" 408 Request Timeout"), answer[:200]
        assert after < 10, after
        assert metric(scrape(srv.metrics_port), "guard_request_errors_total",
                      model="_unknown", code="DEADLINE_EXCEEDED") == before + 1
        # A client that leaves before its body's end is counted as one that left.
        left = metric(scrape(srv.metrics_port), "guard_request_errors_total",
                      model="_unknown", code="CANCELLED")
        with socket.create_connection(("127.0.0.1", srv.http_port), timeout=30) as raw:
            raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"model\"")
            time.sleep(0.2)
        assert wait_until(lambda: metric(scrape(srv.metrics_port), "guard_request_errors_total",
                                         model="_unknown", code="CANCELLED") == left + 1)


def test_an_unknown_model_is_404_in_openais_error_shape(guard, http):
    before = errors(guard, "NOT_FOUND", "_unknown")
    answer = http.post("/v1/completions", json={"model": "gpt-nope", "prompt": "x"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model",
                                                              "invalid_request_error")
    assert "gpt-nope" in error["message"]
    assert errors(guard, "NOT_FOUND", "_unknown") == before + 1
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["doomed", "impatient",
                                                                       "smol"]


@pytest.mark.parametrize("extra, reason", [({"best_of": 2}, "n")])
def test_calls_that_cannot_be_compared_are_forwarded_unchanged_and_counted(
        guard, http, upstreams, extra, reason):
    before = not_comparable(guard, reason)
    answer = http.post("/v1/chat/completions", json=dict(CHAT, **extra))
    assert answer.status_code == 200 and answer.json()["model"] == "smol"
    assert json.loads(upstreams[0].requests[-1]["body"]) == dict(CHAT, model=MODEL, **extra)
    assert wait_until(lambda: not_comparable(guard, reason) == before + 1)


def test_the_gaps_are_one_completions_and_a_stream_of_several_times_its_first_token(
        guard, http):
    """A stream of two completions (n = 2) interleaves their tokens: the gaps between its
    events are no one completion's, so only its time to first token is observed; a stream of
    one completion observes both."""
    def counts() -> tuple[float, float]:
        values = scrape(guard.metrics_port)
        return tuple(metric(values, f"guard_generation_{name}_seconds_count", model="smol",
                            route="primary") for name in ("ttft", "inter_token"))

    before = counts()
    several = http.post("/v1/chat/completions", json=dict(CHAT, stream=True, n=2),
                        headers={"x-test-scenario": "interleaved"})
    assert several.status_code == 200 and several.content.count(b'"index": 1') == 3
    assert counts() == (before[0] + 1, before[1])
    one = http.post("/v1/chat/completions", json=dict(CHAT, stream=True),
                    headers={"x-test-scenario": "split"})
    assert one.status_code == 200
    assert counts() == (before[0] + 2, before[1] + 1)  # "Par" then "is": one gap


def test_an_upstream_error_status_reaches_the_client_as_it_came(guard, http):
    before = errors(guard, "RESOURCE_EXHAUSTED")
    answer = http.post("/v1/chat/completions", json=CHAT,
                       headers={"x-test-scenario": "status", "x-test-status": "429"})
    assert answer.status_code == 429 and answer.headers["guard-route"] == "primary"
    assert answer.json() == {"error": {"message": "no such thing", "type": "x"}}
    # Counted once the client has its answer (off the response path): waited for.
    assert wait_until(lambda: errors(guard, "RESOURCE_EXHAUSTED") == before + 1)


def test_another_endpoint_is_forwarded_unchecked_with_its_query_and_its_errors(guard, http,
                                                                              upstreams):
    """A POST to an endpoint guard does not check (here the path of Anthropic's Messages API,
    which vLLM and llama.cpp serve too) goes to the route with its path and query, the model
    re-addressed, the answer's name set back; an error status comes back as it came. Each is
    a request and not comparable (endpoint)."""
    before, errors_before = not_comparable(guard, "endpoint"), errors(guard, "RESOURCE_EXHAUSTED")
    message = {"model": "smol", "max_tokens": 4, "messages": []}
    answer = http.post("/v1/messages?api-version=2", json=message)
    assert answer.status_code == 200 and answer.headers["guard-route"] == "primary"
    assert answer.json()["model"] == "smol"
    (sent,) = upstreams[0].requests
    assert (sent["path"], sent["query"]) == ("/v1/messages", "api-version=2")
    assert json.loads(sent["body"]) == dict(message, model="scripted-upstream")
    refused = http.post("/v1/messages", json=message,
                        headers={"x-test-scenario": "status", "x-test-status": "429"})
    assert refused.status_code == 429 and refused.json()["error"]["message"] == "no such thing"
    assert wait_until(lambda: errors(guard, "RESOURCE_EXHAUSTED") == errors_before + 1)
    assert not_comparable(guard, "endpoint") == before + 2
    # A GET names no model to route it by: 404, as Envoy mode answers it.
    got = http.get("/v1/responses/resp-1")
    assert got.status_code == 404 and "GET /v1/responses/resp-1" in got.json()["error"]["message"]


def test_a_responses_call_is_the_upstreams_answer_with_the_clients_model_and_is_timed(
        guard, http, upstreams):
    """A Responses API call, whole and streamed: every byte the upstream's but the model's
    name, at the top of the whole answer and in each event's response object; the stream
    relayed event by event, its first token timed and its tokens counted from the last
    event's usage (the stream has no [DONE])."""
    def seen() -> tuple[float, float, float]:
        values = scrape(guard.metrics_port)
        return (metric(values, "guard_requests_total", model="smol", route="primary"),
                metric(values, "guard_generation_ttft_seconds_count", model="smol",
                       route="primary"),
                metric(values, "guard_generation_tokens_total", model="smol", route="primary"))

    before = seen()
    body = {"model": "smol", "input": "Capital of France?"}
    whole = http.post("/v1/responses", json=body)
    assert whole.status_code == 200 and whole.headers["guard-route"] == "primary"
    assert whole.json() == dict(responses_answer(), model="smol")
    assert json.loads(upstreams[0].requests[-1]["body"]) == dict(body, model=MODEL)
    with http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        streamed = b"".join(answer.iter_raw())
    expected = b"".join(responses_events()).replace(f'"model": "{MODEL}"'.encode(),
                                                    b'"model": "smol"')
    assert streamed == expected and expected.count(b'"model": "smol"') == 2
    assert wait_until(lambda: seen() == (before[0] + 2, before[1] + 1, before[2] + 10))


def test_a_sampled_stream_closed_before_its_end_is_incomplete(upstreams, tmp_path):
    """A sampled Responses stream the upstream closes cleanly before ``response.completed``
    (the event that holds the answer), and a chat stream closed before ``[DONE]``: the client
    gets what came, the call is answered, and the edge counts it not comparable (incomplete),
    as the Envoy observer does, instead of handing the verifier an empty or cut completion; a
    whole stream of the same call is handed over and compared. A sampled chat that offers
    tools, answered without token ids, is forwarded as it came and counted (tools)."""
    from llm_support import smollm2_gguf

    block = {"backend": "openai", "target": upstreams[0].url, "model": MODEL,
             "options": {"engine": "llama-cpp-python"}}
    model = {"name": "smol", "task": "generation", "primary": block,
             "reference": {"backend": "llama_cpp", "path": str(smollm2_gguf())},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}}
    with running(tmp_path, [model], http_port=0) as (server, _):
        def counted() -> tuple[float, float]:
            values = scrape(server.metrics_port)
            return (metric(values, "guard_generation_not_comparable_total", model="smol",
                           reason="incomplete"),
                    metric(values, "guard_mirror_total", model="smol", outcome="compared"))

        body = {"model": "smol", "input": "Capital of France?", "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
            cut = http.post("/v1/responses", json=body,
                            headers={"x-test-scenario": "responses_cut"})
            assert cut.status_code == 200 and b"response.completed" not in cut.content
            assert wait_until(lambda: counted()[0] == 1)
            chat = {"model": "smol", "messages": [{"role": "user", "content": "Capital?"}],
                    "temperature": 0, "stream": True}
            unfinished = http.post("/v1/chat/completions", json=chat,
                                   headers={"x-test-scenario": "unfinished"})
            assert unfinished.status_code == 200 and b"[DONE]" not in unfinished.content
            assert unfinished.content.count(b'"model": "smol"') == 2  # what came, renamed
            assert wait_until(lambda: counted()[0] == 2)
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            offered = http.post("/v1/chat/completions",
                                json=dict(chat, stream=False, tools=tools))
            assert offered.status_code == 200 and offered.json()["model"] == "smol"
            assert json.loads(upstreams[0].requests[-1]["body"])["tools"] == tools
            assert wait_until(lambda: metric(scrape(server.metrics_port),
                                             "guard_generation_not_comparable_total",
                                             model="smol", reason="tools") == 1)
            whole = http.post("/v1/responses", json=body)
            assert b"event: response.completed" in whole.content
        assert wait_until(lambda: counted() == (2, 1), timeout=120)


def test_a_call_refused_for_guards_additions_is_answered_as_the_client_asked(upstreams,
                                                                            tmp_path, caplog):
    """A server that refuses the logprobs guard adds to a sampled call (vLLM with
    --max-logprobs 2 against options.sample_logprobs 5: a 400 a client that asked nothing
    would never get; shown on the real vLLM in the stop's note) gets the client's own call
    instead, and the client its answer; from then on guard adds nothing to that upstream's
    calls of that shape (endpoint, streamed or not, tools or not: servers refuse per shape),
    said once per shape. A call the server refuses as the client sent it gets the server's own
    refusal, and proves nothing about the additions."""
    import logging

    from llm_support import smollm2_gguf

    from support import events

    caplog.set_level(logging.INFO, logger="guard.events")
    primary = upstreams[0]
    block = {"backend": "openai", "target": primary.url, "model": MODEL,
             "options": {"engine": "llama-cpp-python", "sample_logprobs": 5}}
    model = {"name": "smol", "task": "generation", "primary": block,
             "reference": {"backend": "llama_cpp", "path": str(smollm2_gguf())},
             "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}}
    primary.reset()
    with running(tmp_path, [model], http_port=0) as (server, _), \
            httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=60) as http:
        chat = dict(CHAT, temperature=0)
        bad = http.post("/v1/chat/completions", json=chat,
                        headers={"x-test-scenario": "status", "x-test-status": "400"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "no such thing"
        sent = [json.loads(r["body"]) for r in primary.requests]
        assert [b.get("top_logprobs") for b in sent] == [5, None]  # then as the client sent it
        assert not events(caplog, "openai_additions_refused")
        primary.reset()
        for _ in range(2):
            answer = http.post("/v1/chat/completions", json=chat,
                               headers={"x-test-scenario": "max_logprobs"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "Paris"
            assert answer.json()["model"] == "smol"
        sent = [json.loads(r["body"]) for r in primary.requests]
        # The first call twice (amended, refused; then the client's), the second once.
        assert [b.get("top_logprobs") for b in sent] == [5, None, None]
        assert sent[1] == dict(chat, model=MODEL) == sent[2]
        (said,) = events(caplog, "openai_additions_refused")
        assert said["status"] == 400 and "max allowed: 2" in said["error"]
        assert said["options"] == ["options.sample_logprobs"]
        assert said["shape"] == "chat, whole, no tools"
        assert wait_until(lambda: metric(scrape(server.metrics_port), "guard_mirror_total",
                                         model="smol", outcome="compared") == 2, timeout=120)
        # Another shape (a streamed chat that lists tools) is amended until it is refused
        # itself, then not; the whole chat's refusal stands, and neither is said again.
        primary.reset()
        tool_chat = dict(chat, stream=True, tools=[{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}])
        for body in (tool_chat, tool_chat, chat):
            answer = http.post("/v1/chat/completions", json=body,
                               headers={"x-test-scenario": "max_logprobs"})
            assert answer.status_code == 200, answer.text
        sent = [json.loads(r["body"]) for r in primary.requests]
        assert [(b.get("top_logprobs"), b.get("stream")) for b in sent] == [
            (5, True), (None, True), (None, True), (None, None)]
        shapes = [e["shape"] for e in events(caplog, "openai_additions_refused")]
        assert shapes == ["chat, whole, no tools", "chat, streamed, with tools"]


def test_the_probe_refused_for_its_logprobs_asks_the_clients_call_and_no_more(upstreams,
                                                                              caplog):
    """The verifier's probe (and replay's generation) asks 5 top logprobs: a vLLM with
    --max-logprobs 2 refuses it, and a fallback would never route back. The call as the
    client sent it is asked instead and compared without them; later probes ask it so."""
    import logging

    from guard.backends.openai_generate import PrimaryProbe
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import GenerationSample, SamplingParams, TokenLogprob

    from support import events

    caplog.set_level(logging.INFO, logger="guard.events")
    primary = upstreams[0]
    primary.reset()
    primary.default_scenario = "max_logprobs"
    try:
        probe = PrimaryProbe(BackendConfig(backend="openai", target=primary.url, model=MODEL),
                             timeout_s=30)
        sample = GenerationSample(
            model="smol", endpoint="chat", messages=tuple(CHAT["messages"]),
            completion_text="Paris", tokens=(TokenLogprob("Paris"),),
            sampling=SamplingParams(temperature=0.0, max_tokens=1))
        for _ in range(2):
            probed = probe(sample)
            assert probed.completion_text == "Paris" and probed.sampling == sample.sampling
        sent = [json.loads(r["body"]) for r in primary.requests]
        assert [b.get("top_logprobs") for b in sent] == [5, None, None]
        assert "logprobs" not in sent[1] and sent[1]["messages"] == CHAT["messages"]
        (said,) = events(caplog, "openai_additions_refused")
        assert said["route"] == "probe" and "max allowed: 2" in said["error"]
        assert said["shape"] == "chat, whole, no tools"  # (a probe is never streamed)
    finally:
        primary.reset()


# -- faults mid-stream ---------------------------------------------------------------------------
def test_a_client_that_disconnects_mid_stream_stops_the_upstream(guard, http, upstreams):
    upstream = upstreams[0]
    before = errors(guard, "CANCELLED")
    with http.stream("POST", "/v1/chat/completions", json=dict(CHAT, stream=True),
                     headers={"x-test-scenario": "slow"}) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # The client closed its connection; guard closed the upstream's, whose handler saw it.
    assert wait_until(upstream.disconnected.is_set)
    assert wait_until(lambda: errors(guard, "CANCELLED") == before + 1)
    still_serves(http)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_client_that_leaves_before_its_answer_is_counted_and_stops_the_upstream(
        guard, upstreams, path):
    """A whole answer still generating (or a stream's head not yet sent) when the client goes:
    counted CANCELLED (it was counted nowhere before: only a stream cut mid-way was), and
    guard closes the upstream's connection."""
    upstream = upstreams[0]
    upstream.reset()
    before = errors(guard, "CANCELLED")
    with httpx.Client(base_url=f"http://127.0.0.1:{guard.http_port}", timeout=0.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(path, json=CHAT, headers={"x-test-scenario": "stall"})
    assert wait_until(upstream.disconnected.is_set)
    assert wait_until(lambda: errors(guard, "CANCELLED") == before + 1)
    if path == "/v1/chat/completions":
        assert not_comparable(guard, "incomplete") >= 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_an_upstream_that_dies_mid_stream_cuts_the_client_after_what_had_arrived(guard, http,
                                                                                  path):
    """On a checked endpoint and on one guard forwards unchecked alike."""
    before = errors(guard, "UNAVAILABLE")
    received = []
    with pytest.raises(httpx.RemoteProtocolError):  # the body never ends properly
        with http.stream("POST", path, json=dict(CHAT, stream=True),
                         headers={"x-test-scenario": "die"}) as answer:
            for data in answer.iter_raw():
                received.append(data)
    text = b"".join(received)
    assert text.count(b'"model": "smol"') == 2 and text.endswith(b'data: {"id')
    assert wait_until(lambda: errors(guard, "UNAVAILABLE") == before + 1)
    still_serves(http)


def test_an_upstream_silent_past_read_timeout_is_504_before_its_answer_and_cut_after(
        guard, http, upstreams):
    upstream = upstreams[0]
    before = errors(guard, "DEADLINE_EXCEEDED", "impatient")
    answer = http.post("/v1/chat/completions", json=dict(CHAT, model="impatient"),
                       headers={"x-test-scenario": "stall"})
    assert answer.status_code == 504 and answer.headers["guard-route"] == "primary"
    assert answer.json()["error"]["type"] == "server_error"
    assert wait_until(upstream.disconnected.is_set)  # guard closed the silent connection
    # Silent after the first event: what had arrived, then a cut connection.
    upstream.reset()
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        with http.stream("POST", "/v1/chat/completions",
                         json=dict(CHAT, model="impatient", stream=True),
                         headers={"x-test-scenario": "hold"}) as answer:
            for data in answer.iter_raw():
                received.append(data)
    assert b'"content": "first"' in b"".join(received)
    assert wait_until(upstream.disconnected.is_set)
    assert wait_until(lambda: errors(guard, "DEADLINE_EXCEEDED", "impatient") == before + 2)
    still_serves(http)


def test_an_error_event_is_forwarded_and_counted(guard, http):
    before, unusable = errors(guard, "INTERNAL"), not_comparable(guard, "upstream_error")
    answer = http.post("/v1/chat/completions", json=dict(CHAT, stream=True),
                       headers={"x-test-scenario": "error_event"})
    assert answer.status_code == 200
    assert b'data: {"error": {"message": "out of memory"' in answer.content
    assert wait_until(lambda: errors(guard, "INTERNAL") == before + 1)
    assert wait_until(lambda: not_comparable(guard, "upstream_error") == unusable + 1)


def served(guard, model: str = "smol") -> float:
    return metric(scrape(guard.metrics_port), "guard_requests_total", model=model,
                  route="primary")


def test_an_answer_nested_deeper_than_guard_reads_reaches_the_client_renamed(guard, http):
    """Python's json cannot read it (RecursionError); the edit of its leading ``model`` needs
    no reading of the rest, and the call is counted once, as answered."""
    before = served(guard)
    answer = http.post("/v1/chat/completions", json=CHAT,
                       headers={"x-test-scenario": "nested"})
    assert answer.status_code == 200
    assert answer.content == b'{"model": "smol", "x": ' + DEEP + b"}"
    assert wait_until(lambda: served(guard) == before + 1)
    still_serves(http)


def test_a_last_event_without_its_blank_line_is_renamed_and_counted(guard, http):
    before = served(guard)
    answer = http.post("/v1/chat/completions", json=dict(CHAT, stream=True),
                       headers={"x-test-scenario": "unterminated"})
    events = [json.loads(line[5:]) for line in answer.text.splitlines()
              if line.startswith("data:")]
    assert [e["model"] for e in events] == ["smol", "smol"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert wait_until(lambda: served(guard) == before + 1)


def test_an_event_past_max_message_bytes_cuts_the_stream_and_is_counted(guard, http):
    """An upstream line that never ends is not held in memory without bound: past
    server.max_message_bytes the client has what came before it, then a cut connection."""
    before = errors(guard, "UNAVAILABLE")
    lines = []
    with pytest.raises(httpx.RemoteProtocolError):  # the chunked body never ends
        with http.stream("POST", "/v1/chat/completions", json=dict(CHAT, stream=True),
                         headers={"x-test-scenario": "endless_line"}) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                lines.append(line)
    assert [json.loads(line[5:])["model"] for line in lines if line.startswith("data:")] == \
        ["smol"]
    assert wait_until(lambda: errors(guard, "UNAVAILABLE") == before + 1)
    still_serves(http)


def test_an_upstream_that_is_down_is_502_and_counted(guard, http, upstreams):
    doomed = upstreams[1]
    doomed.stop()  # the server goes away after guard started
    before = errors(guard, "UNAVAILABLE", "doomed")
    answer = http.post("/v1/chat/completions", json=dict(CHAT, model="doomed"))
    assert answer.status_code == 502 and answer.headers["guard-route"] == "primary"
    assert answer.json()["error"]["type"] == "server_error"
    assert wait_until(lambda: errors(guard, "UNAVAILABLE", "doomed") == before + 1)
    still_serves(http)


def test_health_answers_live_and_ready(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health/ready").json() == {"status": "ready"}
