"""guard in front of a real model server: MLServer (from pip) as the upstream, tritonclient in
front.

MLServer runs as a subprocess (its own `inference` protobuf symbols clash with tritonclient's in
one process) with ``parallel_workers: 0`` (its default worker pool crashes under uvloop 0.22+),
serving two models from one ONNX file: ``cnn_int8`` (the int8 variant guard derives) and
``cnn_fp32``. guard's primary is ``cnn_int8``, its fallback ``cnn_fp32`` on the same server, its
reference local torch eager.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from guard.backends.derive import derive_onnx
from guard.zoo.classifier import sample_inputs
from support import metric, running, scrape, wait_for
import upstream_scenarios
from free_ports import free_port

RUNTIME_DIR = Path(__file__).resolve().parents[1] / "upstream_runtime"
MLSERVER = Path(sys.executable).with_name("mlserver")
pytestmark = pytest.mark.skipif(not MLSERVER.exists(),
                                reason="mlserver is not installed: pip install -e '.[dev]'")


def image_input(images: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("image", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    return tensor


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory, zoo_classifier):
    folder = tmp_path_factory.mktemp("mlserver")
    ports = {"grpc_port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    (folder / "settings.json").write_text(json.dumps(
        {"parallel_workers": 0, "load_models_at_startup": True, **ports}))
    signature = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 32, 32]}],
                 "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}
    artifacts = {"cnn_fp32": Path(zoo_classifier["onnx"]),
                 "cnn_int8": derive_onnx(zoo_classifier["onnx"], "int8")}
    for name, artifact in artifacts.items():
        (folder / name).mkdir()
        shutil.copy(artifact, folder / name / "model.onnx")
        (folder / name / "model-settings.json").write_text(json.dumps({
            "name": name, "implementation": "ort_runtime.OnnxModel",
            "parameters": {"uri": str(folder / name / "model.onnx")}, **signature}))
    env = dict(os.environ, PYTHONPATH=str(RUNTIME_DIR))
    log = (folder / "mlserver.log").open("w")
    process = subprocess.Popen([str(MLSERVER), "start", str(folder)], stdout=log,
                               stderr=subprocess.STDOUT, env=env, cwd=folder)
    target = f"127.0.0.1:{ports['grpc_port']}"
    client = grpcclient.InferenceServerClient(target)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"mlserver exited: {(folder / 'mlserver.log').read_text()[-2000:]}")
            try:
                if all(client.is_model_ready(n) for n in artifacts):
                    break
            except InferenceServerException:
                pass
            if time.monotonic() > deadline:
                pytest.fail("mlserver not ready in 120 s")
            time.sleep(0.3)
        yield target, client
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def guard_model(target: str, zoo_classifier, **overrides) -> dict:
    """The model servers' shared block (tests/e2e/upstream_scenarios.py) with MLServer's int8
    model as the primary and the TorchScript export as the reference."""
    reference = {"backend": "torch", "path": str(zoo_classifier["torchscript"])}
    return upstream_scenarios.guard_model(target, zoo_classifier, primary="cnn_int8",
                                          **{"reference": reference, **overrides})


def test_requests_pass_through_unchanged(tmp_path, mlserver, zoo_classifier):
    target, direct = mlserver
    images = sample_inputs(3, seed=7)
    expected = direct.infer("cnn_int8", [image_input(images)]).as_numpy("logits")
    with running(tmp_path, [guard_model(target, zoo_classifier)]) as (srv, client):
        # Ready means connected: the request path's channels to the upstream are open before
        # the first request, which does not pay for the handshake.
        backends = srv.models["cnn"].backends
        assert backends["primary"].connected and backends["fallback"].connected
        meta = client.get_model_metadata("cnn")
        assert meta.platform == "guard/upstream"
        assert [(i.name, i.datatype) for i in meta.inputs] == [("image", "FP32")]
        result = client.infer("cnn", [image_input(images)], request_id="abc-1",
                              outputs=[grpcclient.InferRequestedOutput("logits")])
        np.testing.assert_array_equal(result.as_numpy("logits"), expected)
        response = result.get_response()
        assert (response.id, response.model_name) == ("abc-1", "cnn")
        assert response.parameters["guard_route"].string_param == "primary"
        # The mirrored sample saw the int8 drift against the local torch reference.
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="cnn", outcome="compared") == 1 and v)
        assert metric(values, "guard_checks_total", model="cnn", tier="tensor",
                      result="fail") == 1


def test_upstream_errors_keep_their_status(tmp_path, mlserver, zoo_classifier):
    target, direct = mlserver
    bad = np.full((1, 3, 32, 32), -999.0, np.float32)
    with pytest.raises(InferenceServerException) as direct_error:
        direct.infer("cnn_int8", [image_input(bad)])
    with running(tmp_path, [guard_model(target, zoo_classifier)]) as (srv, client):
        with pytest.raises(InferenceServerException) as guarded_error:
            client.infer("cnn", [image_input(bad)])
        assert guarded_error.value.status() == direct_error.value.status()
        assert "refuses the trigger input" in guarded_error.value.message()
        good = sample_inputs(1, seed=1)
        assert client.infer("cnn", [image_input(good)]).as_numpy("logits").shape == (1, 10)


def test_drift_switches_to_another_model_on_the_same_server(tmp_path, mlserver, zoo_classifier):
    target, direct = mlserver
    policy = {"action": "fallback_model", "detector": "window", "window": 10, "min_samples": 5,
              "trip_ratio": 0.2,
              "recover_ratio": 0.05, "dwell_s": 60}
    images = sample_inputs(12, seed=9)
    with running(tmp_path, [guard_model(target, zoo_classifier, policy=policy)]) as (srv, client):
        for i in range(5):
            client.infer("cnn", [image_input(images[i:i + 1])])
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_fallback_active", model="cnn",
                                scope="model") == 1)
        result = client.infer("cnn", [image_input(images[10:11])])
        assert result.get_response().parameters["guard_route"].string_param == "fallback"
        expected = direct.infer("cnn_fp32", [image_input(images[10:11])]).as_numpy("logits")
        np.testing.assert_array_equal(result.as_numpy("logits"), expected)


def test_upstream_not_ready_is_a_clear_startup_error(tmp_path, zoo_classifier):
    from guard.plan.complete import load_config
    from guard.errors import BackendError
    from guard.serve.app import GuardServer
    from support import write_config

    block = guard_model(f"127.0.0.1:{free_port()}", zoo_classifier)
    for role in ("primary", "fallback"):
        block[role]["options"] = {"ready_timeout_s": 0.5}
    server = GuardServer(load_config(write_config(tmp_path, [block])))
    with pytest.raises(BackendError, match=r"cnn_int8@127\.0\.0\.1:\d+ not ready after 0\.5s "):
        server.load_models()
