"""KServe's Python ModelServer for the e2e tests, from a virtualenv of its own.

kserve cannot be installed in guard's environment (kserve 0.21 needs starlette>=1.3.1 and
pandas<3; MLServer 1.7.1 needs fastapi<0.116, hence starlette<0.47; docs/model-servers.md), and
its ModelServer runs as a subprocess anyway, so the Makefile gives it its own venv,
``<guard's venv>/kserve`` (kserve, onnxruntime, numpy; ``pip check`` clean there). The server is
``tests/upstream_runtime/kserve_onnx.py`` run with that venv's interpreter: real ``kserve.Model``
subclasses running ONNX Runtime behind KServe's gRPC v2 endpoint, bound to 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from free_ports import free_port
from model_server_process import ServerProcess

KSERVE_PACKAGES = "'kserve==0.21.*' onnxruntime numpy"
SCRIPT = Path(__file__).resolve().parent / "upstream_runtime" / "kserve_onnx.py"


def kserve_home() -> Path:
    """KServe's venv: $GUARD_KSERVE_HOME, else <guard's venv>/kserve."""
    return Path(os.environ.get("GUARD_KSERVE_HOME") or Path(sys.prefix) / "kserve")


def _install_hint(home: Path) -> str:
    return (f"`make venv` in a fresh clone, or `python3 -m venv {home} && {home}/bin/python -m "
            f"pip install {KSERVE_PACKAGES}`")


def unavailable_reason() -> str | None:
    """Why KServe's ModelServer cannot run here, or None. Said in the fixture's skip."""
    home = kserve_home()
    python = home / "bin" / "python"
    if not python.exists():
        return f"KServe's virtualenv not found at {home}: create it with {_install_hint(home)}"
    probe = subprocess.run([str(python), "-c", "import kserve, onnxruntime, numpy"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import kserve, onnxruntime and numpy ({last}): install " \
               f"them with {_install_hint(home)}"
    return None


class KServeServer(ServerProcess):
    """KServe's ModelServer as a child process; ``models`` maps a model name to an ONNX file.

    ``start`` returns once every model is ready on the gRPC port; a server that exits first
    raises with its log's tail.
    """

    label = "KServe's ModelServer"

    def __init__(self, folder: Path, models: dict[str, Path]):
        self.folder = folder
        self.models = models
        self.pick_ports()
        self.log_path = folder / "kserve.log"
        self.process: subprocess.Popen | None = None

    def pick_ports(self) -> None:
        self.port = free_port()
        self.http_port = free_port()
        self.target = f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> None:
        def command() -> list[str]:
            return [str(kserve_home() / "bin" / "python"), str(SCRIPT),
                    f"--grpc_port={self.port}", f"--http_port={self.http_port}",
                    *(f"--model={name}={path}" for name, path in self.models.items())]

        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.launch_on_free_ports(command, env, timeout)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()
