"""A seeded sample of the OpenAI edge's differential fuzzer (tests/fuzz_openai.py) against real
parts: llama.cpp's llama-server on SmolLM2's F16 GGUF, ``guard serve`` in front of it with every
call sampled and scored by the llama_cpp reference in its verifier. Each case goes to the server
directly and through guard: guard's answer is the server's (status, stream or not, the client's
model name) except for the refusals it documents; no traceback in guard's log, no sample the
verifier failed on, and guard answers correctly afterwards; the same in Envoy mode. The benchmark
(benchmarks/reliability_llm.py) runs thousands of cases with memory and descriptors watched."""

from __future__ import annotations

import json

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
from hypothesis import HealthCheck, given, settings

from envoy_support import Guard, needs_envoy, write
from fuzz_openai import MAX_TOKENS, SERVED, Answer, Case, Tally, cases
from llm_support import require_llama_server, start_llama_cpp_server
from support import Tracebacks, metric, running, scrape, wait_for

pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")

from guard.zoo.llm import quant_ladder  # noqa: E402
from guard.zoo.tool_chat import llama_server_flags  # noqa: E402

EXAMPLES = 120
EXAMPLES_ENVOY = 60  # (Envoy mode's own path: the tap, the observer)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    gguf = quant_ladder(("F16",))["F16"]
    folder = tmp_path_factory.mktemp("llama-server")
    # -n caps every call's tokens (a call whose max_tokens the server reads as absent would
    # otherwise generate to the context's end); --alias: it answers with guard's model name,
    # as Envoy mode needs (Envoy cannot rewrite it); a template that renders tools and has
    # the server parse the calls out (SmolLM2's own ignores them), as the Hermes-form models
    # people serve do.
    server = start_llama_cpp_server(require_llama_server(), gguf, folder,
                                    ("-n", str(2 * MAX_TOKENS), "--seed", "1",
                                     "--alias", SERVED, *llama_server_flags(folder)))
    try:
        yield server, gguf
    finally:
        server.stop()


def model_block(url: str, gguf, **options) -> dict:
    return {"name": SERVED, "task": "generation",
            "primary": {"backend": "openai", "target": url, "model": SERVED,
                        "options": {"engine": "llama.cpp", **options}},
            "reference": {"backend": "llama_cpp", "path": str(gguf),
                          "options": {"context_length": 512}},
            "mirror": {"sample_rate": 1.0, "queue_size": 256, "timeout_s": 120},
            "policy": {"action": "alert"}}


def send(client: httpx.Client, url: str, case: Case) -> Answer:
    answer = client.post(url + case.path, content=case.data,
                         headers={"Content-Type": "application/json"})
    return Answer(answer.status_code, answer.headers.get("content-type", ""), answer.content)


def test_fuzzed_calls_are_answered_as_the_upstream_answers_them(upstream, tmp_path):
    """The Python edge, which adds logprobs to every sampled call (options.sample_logprobs)
    but a streamed chat with tools, which llama-server refuses them."""
    server, gguf = upstream
    with running(tmp_path, [model_block(server.url, gguf, sample_logprobs=5)],
                 http_port=0) as (srv, _), \
            Tracebacks() as tracebacks:
        fuzz_through(srv, server, EXAMPLES)
    assert tracebacks.messages == []


@needs_envoy
def test_fuzzed_calls_through_envoy_mode_are_answered_as_the_upstream_answers_them(
        upstream, tmp_path):
    """Envoy mode: Envoy forwards, guard observes the sampled calls through the tap (its
    reassembly and sample building on whatever a client sends). Envoy forwards what it can
    route, so a call the Python edge refuses before routing may be the upstream's to answer."""
    server, gguf = upstream
    config = write(tmp_path, [model_block(server.url, gguf)], server={"http_port": 0},
                   http_health_port=0)
    with Tracebacks() as tracebacks:
        guard = Guard(config)
        try:
            fuzz_through(guard.srv, server, EXAMPLES_ENVOY, envoy=True)
        finally:
            guard.close()
    assert tracebacks.messages == []


def fuzz_through(srv, server, examples: int, envoy: bool = False) -> None:
    """``examples`` seeded cases, each to the server directly and through guard (``srv``),
    then the verifier's outcomes and one more call, as the module's docs say."""
    tally = Tally()
    with httpx.Client(timeout=120) as client:
        guard = f"http://127.0.0.1:{srv.http_port}"

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def one(case):
            tally.add(case, send(client, server.url, case), send(client, guard, case), envoy)

        one()
        assert tally.broken == []
        statuses = {through for (_, _, through) in tally.statuses}
        assert 200 in statuses and statuses & {400, 404}  # answered calls and refused ones
        # Every sample handed to the verifier is accounted for, none failed on its content.
        values = wait_for(lambda: (lambda v: v if metric(
            v, "guard_mirror_queue_depth", model=SERVED) == 0 else None)(
                scrape(srv.metrics_port)), timeout=300, interval=0.5)
        assert metric(values, "guard_mirror_total", model=SERVED, outcome="compared") > 0
        assert metric(values, "guard_mirror_total", model=SERVED, outcome="error") == 0
        # Still serving, and answering as before.
        final = Case("/v1/completions", b'{"model": "smol", "prompt": "The capital of France'
                     b' is", "max_tokens": 4, "temperature": 0}')
        direct, through = send(client, server.url, final), send(client, guard, final)
        assert (direct.status, through.status) == (200, 200)
        assert json.loads(through.body)["choices"][0]["text"] == json.loads(
            direct.body)["choices"][0]["text"]
