"""What the tests' model-server fixtures (tests/triton_server.py, tests/kserve_server.py) share:
a server as a child process in its own process group, its log in a file, and a start that
returns once every model is ready on the gRPC port (or raises with the log's tail)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Subclasses set ``label`` (for messages), ``models`` (names to wait for), ``target``
    (host:port of the gRPC endpoint), ``log_path`` and ``folder``, and call ``launch``."""

    label = "the model server"
    models: dict
    target: str
    log_path: Path
    folder: Path
    process: subprocess.Popen | None = None

    def launch(self, command: list[str], env: dict[str, str], timeout: float) -> None:
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=self.folder,
                                        start_new_session=True)
        client = grpcclient.InferenceServerClient(self.target)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.label} exited with {self.process.returncode} "
                                       f"at start:\n{self.log_tail()}")
                try:
                    if all(client.is_model_ready(name) for name in self.models):
                        return
                except InferenceServerException:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.label} not ready in {timeout:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.3)
        finally:
            client.close()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the server and whatever it started (one process group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
