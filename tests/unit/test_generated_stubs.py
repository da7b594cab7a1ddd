"""guard/{v1,xds}/*_pb2*.py are grpcio-tools' output for proto/guard/*/*.proto, not code of ours.

Their base servicers answer every RPC with ``NotImplementedError`` (gRPC UNIMPLEMENTED): the
generator's way of declaring the service's abstract methods. Two things keep that honest: the
files are exactly what ``make proto`` generates (nobody edits them, and a changed .proto that was
not regenerated is caught), and guard's servicers override every RPC of their base, so no
generated placeholder ever answers a request.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from guard.serve.admin import AdminServicer
from guard.serve.tap_service import TapService
from guard.envoy.observer import Observer
from guard.v1 import admin_pb2_grpc, tap_pb2_grpc
from guard.xds import ext_proc_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "proto/guard").glob("*/*.proto"))  # guard/v1 and guard/xds


def test_generated_files_are_what_make_proto_generates(tmp_path):
    pytest.importorskip("grpc_tools.protoc")
    # In a process of its own, as `make proto` runs it: protoc's C++ protobuf in the test process
    # crashed it (SIGSEGV) once TensorFlow, with a protobuf runtime of its own, had been imported.
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            *map(str, PROTOS)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "guard").glob("*/*")
                       if p.is_file())
    assert generated, "protoc wrote nothing"
    for relative in generated:
        assert (tmp_path / relative).read_text() == (ROOT / relative).read_text(), (
            f"{relative} differs from grpcio-tools' output: run `make proto`")


@pytest.mark.parametrize("servicer,base", [
    (AdminServicer, admin_pb2_grpc.AdminServicer),
    (TapService, tap_pb2_grpc.TapServicer),
    (Observer, ext_proc_pb2_grpc.ExternalProcessorServicer),
])
def test_guard_servicers_override_every_generated_rpc(servicer, base):
    rpcs = [name for name, _ in inspect.getmembers(base, inspect.isfunction)
            if not name.startswith("_")]
    assert rpcs
    for name in rpcs:
        assert getattr(servicer, name) is not getattr(base, name), (
            f"{servicer.__name__}.{name} falls back to the generated UNIMPLEMENTED placeholder")
