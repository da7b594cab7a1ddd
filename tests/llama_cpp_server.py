"""llama.cpp's own OpenAI-compatible server (``llama-server``) for the e2e tests.

llama-cpp-python ships no server binary, so the Makefile builds one (``make test`` does, once
per version and flags, into ~/.cache/guard, about 6 minutes on 2 cores; the binary is copied
to ``<guard's venv>/bin/llama-server``) from the llama.cpp that llama-cpp-python's sdist vendors:
the same llama.cpp as guard's in-process engine, with the same x86-64-v3 flags. The tests start
it on SmolLM2's GGUF, one thread, a 512-token context, on a free 127.0.0.1 port, and wait for
its ``GET /props`` (it answers once the model is loaded).

Where the binary is absent the fixtures skip saying how to build it; with
GUARD_REQUIRE_LLAMA_SERVER=1 (CI, .ci/run) they fail instead, so that CI never passes by
skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest


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


def start_llama_cpp_server(binary: Path, gguf: Path, log_dir: Path,
                           flags: tuple[str, ...] = (), timeout: float = 120.0
                           ) -> LlamaCppServer:
    """llama-server on ``gguf`` with ``flags`` (its sampling flags ...), once it answers
    ``GET /props``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = log_dir / f"llama-server-{port}.log"
    process = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1",
                                "--port", str(port), "-c", "512", "-t", "1", *flags],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited ({process.returncode}): "
                               f"{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/props", timeout=2) as answer:
                return LlamaCppServer(url, process, log, json.loads(answer.read()))
        except OSError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"llama-server not up in {timeout:g}s: {log.read_text()[-2000:]}")
        time.sleep(0.25)
