"""What the tests' model-server fixtures (tests/triton_server.py, tests/kserve_server.py) share:
a server as a child process in its own process group, its log in a file, and a start that
returns once every model is ready on the gRPC port (or raises with the log's tail).

A port from tests/free_ports.py is free when picked, not when the server binds it: that module
keeps the tests' own picks and client connections off each other's ports, but another process
may still take one in between, and the server then exits at start ("Address already in use";
seen once in CI for tritonserver, before free_ports). ``start`` picks new ports and launches
again then (:meth:`ServerProcess.launch_on_free_ports`)."""

from __future__ import annotations

import abc
import os
import signal
import subprocess
import time
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


# What a server's log says where its port was taken between free_port() and its bind.
PORT_TAKEN = "already in use"
PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server exited at start because another process had taken its port."""


class ServerProcess(abc.ABC):
    """Subclasses set ``label`` (for messages), ``models`` (names to wait for), ``target``
    (host:port of the gRPC endpoint), ``log_path`` and ``folder``, define ``pick_ports`` (new
    free ports, ``target`` with them) and call ``launch_on_free_ports``."""

    label = "the model server"
    models: dict
    target: str
    log_path: Path
    folder: Path
    process: subprocess.Popen | None = None

    @abc.abstractmethod
    def pick_ports(self) -> None:
        """New free ports for the server, and ``target`` with them."""

    def launch_on_free_ports(self, command, env: dict[str, str], timeout: float) -> None:
        """``launch(command(), ...)``, on new ports (``pick_ports``) where the server lost the
        ones it was given to another process before it bound them."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self.launch(command(), env, timeout)
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                self.pick_ports()

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
                    self._log.close()
                    tail = self.log_tail()
                    error = PortTaken if PORT_TAKEN in tail else RuntimeError
                    raise error(f"{self.label} exited with {self.process.returncode} at "
                                f"start:\n{tail}")
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
