"""A real Triton Inference Server for the e2e tests, from nvidia-pytriton's wheel.

nvidia-pytriton 0.7.0 ships Triton 2.51.0 (``tritonserver``, ``libtritonserver``) and the Python
backend with a stub per Python version. Its Python package pins numpy<2, which this venv cannot
take (pandas 3 needs numpy 2), so the Makefile installs the wheel's files beside the venv with
``pip install --no-deps --target .venv/triton`` instead of into it: the server binary needs none
of the package's Python dependencies, and ``pip check`` stays green. Only the binary is used
here, never pytriton's Python API.

What it takes to run that server from a test (each learned the hard way):

- The backend folder is built per server: ``backends/python`` holds ``libtriton_python.so``,
  ``triton_python_backend_utils.py`` and the stub for this interpreter's version (pytriton does
  the same copy at start).
- The stub runs Python in isolated mode (PYTHONPATH is ignored) and takes its packages from the
  first ``python3`` on PATH: the venv's bin folder goes first, so models import the venv's
  onnxruntime and numpy.
- The stub's libpython can resolve to another build of the same Python version than the
  interpreter's (``'_thread.RLock' object has no attribute '_recursion_count'``): the
  interpreter's own LIBDIR goes first on LD_LIBRARY_PATH, then the wheel's bundled libraries.
- Triton's defaults bind 0.0.0.0:8000-8002: gRPC is bound to 127.0.0.1 on a free port, HTTP
  and metrics are off.
- ``--model-control-mode=explicit`` with ``--load-model=*``: every model loads at start, and
  the repository API (load, unload) works, which the tests use.
- The Python backend's shared-memory regions stay in /dev/shm when the server is killed: each
  server gets its own region prefix, and ``stop`` removes them.
- Without a GPU, Triton logs CUDA-driver warnings (pinned memory, CudaDriverHelper) and serves
  ``KIND_CPU`` models normally.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

from free_ports import free_port
from model_server_process import ServerProcess

TRITON_PACKAGE = "nvidia-pytriton==0.7.0"
MODEL_PY = Path(__file__).resolve().parent / "upstream_runtime" / "triton_onnx" / "model.py"
_INSTALL = (f"`make venv` in a fresh clone, or `{sys.executable} -m pip install --no-deps "
            f"--target {Path(sys.prefix) / 'triton'} {TRITON_PACKAGE}`")


def triton_home() -> Path:
    """Where the wheel's files are: $GUARD_TRITON_HOME, else <venv>/triton."""
    return Path(os.environ.get("GUARD_TRITON_HOME") or Path(sys.prefix) / "triton")


def unavailable_reason() -> str | None:
    """Why Triton cannot run on this machine, or None. Said in the fixture's skip."""
    home = triton_home()
    binary = home / "pytriton" / "tritonserver" / "bin" / "tritonserver"
    if not binary.exists():
        return f"Triton server binary not found at {binary}: install it with {_INSTALL}"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"nvidia-pytriton's Triton runs on x86_64 Linux only (this is {sys.platform} " \
               f"{platform.machine()})"
    libc, version = platform.libc_ver()
    if libc == "glibc" and tuple(int(p) for p in version.split(".")[:2]) < (2, 35):
        return f"nvidia-pytriton's Triton needs glibc 2.35+ (manylinux_2_35); this is {version}"
    stub = _stub_path(home)
    if not stub.exists():
        return f"no Python backend stub for Python {sys.version_info.major}." \
               f"{sys.version_info.minor} in {stub.parent.parent}"
    return None


def _stub_path(home: Path) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return home / "pytriton" / "tritonserver" / "python_backend_stubs" / version / \
        "triton_python_backend_stub"


def _dims(shape) -> str:
    return ", ".join(str(d) for d in shape)


def model_config(name: str, inputs: list[tuple], outputs: list[tuple]) -> str:
    """config.pbtxt of a Python-backend model; inputs/outputs are (name, TYPE_x, shape)."""
    def tensors(kind: str, specs: list[tuple]) -> str:
        body = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {_dims(s)} ] }}'
                          for n, t, s in specs)
        return f"{kind} [\n{body}\n]\n"

    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            + tensors("input", inputs) + tensors("output", outputs)
            + "instance_group [ { kind: KIND_CPU count: 1 } ]\n")


class TritonServer(ServerProcess):
    """``tritonserver`` as a child process serving ONNX files through the Python backend.

    ``models`` maps a model name to (onnx file, inputs, outputs) as :func:`model_config` takes
    them. ``start`` returns once every model is ready; a server that exits first raises with
    its log's tail.
    """

    label = "tritonserver"

    def __init__(self, folder: Path, models: dict[str, tuple[Path, list, list]]):
        self.folder = folder
        self.models = models
        self.pick_ports()
        self.log_path = folder / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        # The Python backend's shared-memory regions (/dev/shm/<prefix>...): named per server,
        # so that stop() removes exactly this server's, which a killed server leaves behind.
        self.shm_prefix = f"guard_tests_triton_{uuid.uuid4().hex[:12]}_"
        self._write_repository()
        self._backends = self._write_backends()

    def pick_ports(self) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"

    def _write_repository(self) -> None:
        self.repository = self.folder / "models"
        for name, (onnx_file, inputs, outputs) in self.models.items():
            version = self.repository / name / "1"
            version.mkdir(parents=True)
            shutil.copy(onnx_file, version / "model.onnx")
            shutil.copy(MODEL_PY, version / "model.py")
            (self.repository / name / "config.pbtxt").write_text(
                model_config(name, inputs, outputs))

    def _write_backends(self) -> Path:
        home = triton_home()
        source = home / "pytriton" / "tritonserver" / "backends" / "python"
        backends = self.folder / "backends"
        (backends / "python").mkdir(parents=True)
        for item in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy(source / item, backends / "python" / item)
        shutil.copy(_stub_path(home), backends / "python" / "triton_python_backend_stub")
        return backends

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        libs = [sysconfig.get_config_var("LIBDIR") or "",
                str(triton_home() / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
        return env

    def start(self, timeout: float = 180.0) -> None:
        binary = triton_home() / "pytriton" / "tritonserver" / "bin" / "tritonserver"
        self.launch_on_free_ports(lambda: [
            str(binary), f"--model-repository={self.repository}",
            f"--backend-directory={self._backends}", "--model-control-mode=explicit",
            "--load-model=*", "--allow-http=false", "--allow-metrics=false",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.port}", "--exit-timeout-secs=5",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"],
            self.environment(), timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            try:  # stubs left behind by a server that did not shut down in time
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)
            self._log.close()
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
