"""llama.cpp's own server (llama-server), from its recorded answers
(tests/recorded/llama_server_props.json, recorded from a real llama-server:
tests/recorded/record_llama_server_props.py). guard reads an ``engine: llama.cpp`` primary's
sampling defaults from its report (GET /props), served over HTTP here, read by guard's client,
turned into the tier's defaults; a server without /props (404, not JSON) leaves the preset with
the reason. Its answers with logprobs are read by guard's edge parser: the token ids in its
logprobs entries name the end-of-generation token it lists last, with an empty text, at a
natural end, so that such a call is compared instead of counted unaligned."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from guard.backends.openai import llama_server_settings
from guard.verify.generation import SERVER_DEFAULTS, declared_defaults

RECORDED = json.loads((Path(__file__).parent.parent / "recorded" / "llama_server_props.json")
                      .read_text())


@pytest.fixture
def server():
    """An HTTP server answering GET /props with ``server.body`` (status ``server.status``)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = httpd.body if self.path == "/props" else b"{}"
            self.send_response(httpd.status if self.path == "/props" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.body, httpd.status = b"{}", 200
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def _base(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_llama_servers_own_defaults_are_the_presets():
    params = RECORDED["props"]["default_generation_settings"]["params"]
    assert declared_defaults({"engine": "llama.cpp"}, reported=params) == \
        SERVER_DEFAULTS["llama.cpp"]


def test_the_flags_a_server_was_started_with_are_what_the_tier_scores_with(server):
    server.body = json.dumps(RECORDED["props_with_flags"]).encode()
    params, why = llama_server_settings(_base(server), None)
    assert why == "" and params is not None
    defaults = declared_defaults({"engine": "llama.cpp"}, reported=params)
    assert (defaults.temperature, defaults.top_k, defaults.min_p) == (0.6, 20, 0.0)
    assert RECORDED["props_with_flags_flags"] == ["--temp", "0.6", "--top-k", "20",
                                                  "--min-p", "0"]


def test_a_servers_sampler_chain_is_its_order(server):
    server.body = json.dumps(RECORDED["props_with_chain"]).encode()
    params, _ = llama_server_settings(_base(server), None)
    defaults = declared_defaults({"engine": "llama.cpp"}, reported=params)
    # --samplers "penalties;temperature;top_k;min_p;top_p"
    assert (defaults.temperature_last, defaults.min_p_first) == (False, True)
    assert defaults.default_samplers == ()


@pytest.mark.parametrize("status, body, says", [
    (404, b'{"detail": "Not Found"}', "HTTP 404"),  # llama-cpp-python's server, a proxy
    (200, b"<html>", "JSONDecodeError"),
    (200, b'{"model_path": "m.gguf"}', "no default_generation_settings.params"),
])
def test_a_server_that_does_not_say_leaves_the_preset_with_the_reason(server, status, body,
                                                                      says):
    server.status, server.body = status, body
    params, why = llama_server_settings(_base(server), None)
    assert params is None and says in why


def _sample(call: dict):
    """A recorded call and llama-server's answer (or streamed events), as the edge reads them."""
    from guard.protocol import openai as api

    endpoint = call["endpoint"]
    parsed = api.parse_request(endpoint, json.dumps(call["request"]).encode())
    completion = api.Completion()
    for part in call.get("events") or [call["answer"]]:
        api.gather(completion, endpoint, part, streamed="events" in call)
    assert api.unusable(completion, parsed) == ""
    return api.build_sample(parsed, completion, route="primary")


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llm extra) is not installed")
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig
    from guard.zoo import llm as smol

    scorer = create_backend(BackendConfig(
        backend="llama_cpp", path=str(smol.quant_ladder(("F16",))["F16"]),
        options={"context_length": 512}), "reference", 1)
    scorer.load()
    try:
        yield scorer
    finally:
        scorer.close()


def test_llama_servers_answers_ending_at_eos_are_compared_by_their_ids(reference):
    from guard.verify.generation import check_generation

    defaults = declared_defaults({"engine": "llama.cpp"},
                                 reported=RECORDED["props"]["default_generation_settings"]
                                 ["params"])
    ended = 0
    for call in RECORDED["answers"]:
        sample = _sample(call)
        assert sample.has_logprobs and all(t.token_id is not None for t in sample.tokens)
        last = sample.tokens[-1]
        ended += last.text == "" and last.token_id == 2  # <|im_end|>, at a natural end
        check = check_generation(sample, reference.score(sample), defaults)
        assert (check.mode, check.passed) == ("logprobs", True), check.reason
        assert check.mean_kld < 1e-3
    assert ended == 2  # the plain completion and chat; the stream leaves it out


def test_a_character_sampled_in_pieces_that_llama_server_wrote_as_one_entry_is_not_drift(
        reference):
    """llama-server answers a character the model sampled as several byte tokens with one
    logprobs entry (the character, the last piece's id and logprob): 12 tokens, 6 entries in
    Japanese. Scored by those ids, the healthy pair read as a mean KLD of 8 nats; now the
    completion is not comparable (``unaligned``), saying why."""
    from guard.verify.generation import check_generation

    defaults = declared_defaults({"engine": "llama.cpp"})
    for call in RECORDED["answers_in_pieces"]:
        answer = call["answer"]
        assert len(answer["choices"][0]["logprobs"]["content"]) < \
            answer["usage"]["completion_tokens"]  # (entries left out)
        check = check_generation(_sample(call), reference.score(_sample(call)), defaults)
        assert (check.mode, check.cause, check.passed) == ("not_comparable", "unaligned", True)
        assert "one logprobs entry" in check.reason


def test_the_engine_a_model_listing_names():
    """GET /v1/models' owned_by, as llama-server ("llamacpp") and vLLM ("vllm") write it: the
    model's own entry decides, else the listing's one owner; several, or an owner guard has
    no preset for (llama-cpp-python's "me"), name none."""
    from guard.backends.openai import listed_engine

    assert listed_engine((("smol", "llamacpp"),), "smol") == "llama.cpp"
    assert listed_engine((("/models/smol.gguf", "llamacpp"),), "smol") == "llama.cpp"
    assert listed_engine((("a", "vllm"), ("lora-1", "vllm")), "a") == "vllm"
    assert listed_engine((("a", "vllm"), ("b", "llamacpp")), "b") == "llama.cpp"
    assert listed_engine((("a", "vllm"), ("b", "llamacpp")), "c") is None
    assert listed_engine((("smol", "me"),), "smol") is None
    assert listed_engine((), "smol") is None
