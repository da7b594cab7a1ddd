"""guard reads an ``engine: llama.cpp`` primary's sampling defaults from llama-server's own
report (GET /props): the answers llama-server gave (tests/recorded/llama_server_props.json,
recorded from a real llama-server: tests/recorded/record_llama_server_props.py) served over
HTTP, read by guard's client, turned into the tier's defaults; a server without /props (404,
not JSON) leaves the preset with the reason."""

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
