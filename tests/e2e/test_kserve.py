"""guard in front of KServe's Python ModelServer, tritonclient in front of guard.

One ModelServer per module (tests/kserve_server.py: KServe 0.21 from its own virtualenv, real
``kserve.Model`` subclasses running ONNX Runtime, tests/upstream_runtime/kserve_onnx.py) serving
three models from the zoo CNN's ONNX file: ``cnn_fp32``, ``cnn_int8`` (the int8 variant guard
derives, which drifts against the fp32 reference) and ``cnn_spare`` (fp32, the one a test
unloads through KServe's repository API). guard's primary and fallback are ``upstream``
backends on that server (the Python forwarder); its reference runs locally.

The last test kills the server: it runs last in this file, and the module's fixture tolerates
a dead server at teardown.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from guard.backends.derive import derive_onnx
from guard.zoo.classifier import sample_inputs
from kserve_server import KServeServer, unavailable_reason
from support import image_input, metric, running, scrape, wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kserve(request, tmp_path_factory):
    reason = unavailable_reason()
    if reason:  # before the zoo export: a machine without KServe skips at once
        pytest.skip(f"KServe's ModelServer cannot run here: {reason}")
    fp32 = request.getfixturevalue("zoo_classifier")["onnx"]
    folder = tmp_path_factory.mktemp("kserve")
    models = {"cnn_fp32": fp32, "cnn_int8": derive_onnx(fp32, "int8"), "cnn_spare": fp32}
    server = KServeServer(folder, models)
    try:
        server.start()
        client = grpcclient.InferenceServerClient(server.target)
        yield server, client
        client.close()
    finally:
        server.stop()


def guard_model(target: str, zoo_classifier, primary: str = "cnn_fp32", **overrides) -> dict:
    block = {
        "name": "cnn",
        "task": "classification",
        "primary": {"backend": "upstream", "target": target, "model": primary},
        "reference": {"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])},
        "fallback": {"backend": "upstream", "target": target, "model": "cnn_fp32"},
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-3}},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    block.update(overrides)
    return block


def _kserve_error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value


def test_answers_pass_through_and_samples_match_the_local_reference(tmp_path, kserve,
                                                                     zoo_classifier):
    server, direct = kserve
    images = sample_inputs(4, seed=3)
    expected = direct.infer("cnn_fp32", [image_input(images)]).as_numpy("logits")
    with running(tmp_path, [guard_model(server.target, zoo_classifier)]) as (srv, client):
        meta = client.get_model_metadata("cnn")
        assert meta.platform == "guard/upstream"
        assert [(i.name, i.datatype, list(i.shape)) for i in meta.inputs] == \
            [("image", "FP32", [-1, 3, 32, 32])]
        for i in range(4):
            result = client.infer("cnn", [image_input(images[i:i + 1])], request_id=f"r{i}")
            np.testing.assert_array_equal(result.as_numpy("logits"), expected[i:i + 1])
            response = result.get_response()
            assert (response.id, response.model_name) == (f"r{i}", "cnn")
            assert response.parameters["guard_route"].string_param == "primary"
        # Every answer was mirrored to the local ONNX Runtime reference, compared, and passed.
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="cnn", outcome="compared") == 4 and v)
        assert metric(values, "guard_checks_total", model="cnn", tier="tensor",
                      result="pass") == 4
        assert metric(values, "guard_checks_total", model="cnn", tier="tensor",
                      result="fail") == 0


def test_a_drifting_kserve_model_is_switched_to_the_fallback_kserve_model(tmp_path, kserve,
                                                                         zoo_classifier):
    server, direct = kserve
    policy = {"action": "fallback_model", "detector": "window", "window": 10, "min_samples": 5,
              "trip_ratio": 0.2, "recover_ratio": 0.05, "dwell_s": 60}
    block = guard_model(server.target, zoo_classifier, primary="cnn_int8", policy=policy)
    images = sample_inputs(12, seed=9)
    with running(tmp_path, [block]) as (srv, client):
        first = client.infer("cnn", [image_input(images[:1])])
        assert first.get_response().parameters["guard_route"].string_param == "primary"
        np.testing.assert_array_equal(
            first.as_numpy("logits"),
            direct.infer("cnn_int8", [image_input(images[:1])]).as_numpy("logits"))
        for i in range(1, 6):
            client.infer("cnn", [image_input(images[i:i + 1])])
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="cnn", scope="model") == 1 and v)
        assert metric(values, "guard_checks_total", model="cnn", tier="tensor",
                      result="fail") >= 5
        result = client.infer("cnn", [image_input(images[10:11])])
        assert result.get_response().parameters["guard_route"].string_param == "fallback"
        np.testing.assert_array_equal(
            result.as_numpy("logits"),
            direct.infer("cnn_fp32", [image_input(images[10:11])]).as_numpy("logits"))


def test_a_wrong_shape_comes_back_with_kserves_status(tmp_path, kserve, zoo_classifier):
    server, direct = kserve
    small = np.zeros((1, 3, 16, 16), np.float32)
    kserve_said = _kserve_error(lambda: direct.infer("cnn_fp32", [image_input(small)]))
    assert kserve_said.status() == "StatusCode.INVALID_ARGUMENT"
    with running(tmp_path, [guard_model(server.target, zoo_classifier)]) as (srv, client):
        guard_said = _kserve_error(lambda: client.infer("cnn", [image_input(small)]))
        # kserve.errors.InvalidInput from the model, mapped by KServe's gRPC interceptor.
        assert guard_said.status() == kserve_said.status()
        assert "input 'image': expected FP32 [-1, 3, 32, 32]" in kserve_said.message()
        assert kserve_said.message() in guard_said.message()
        good = client.infer("cnn", [image_input(sample_inputs(1, seed=1))])
        assert good.as_numpy("logits").shape == (1, 10)


def test_a_model_unloaded_through_kserves_repository_api_is_unknown(tmp_path, kserve,
                                                                    zoo_classifier):
    """KServe's v2 repository API (REST) takes the model out of its registry; its gRPC
    endpoint then answers NOT_FOUND for it, and so does guard, with KServe's words."""
    server, direct = kserve
    images = sample_inputs(1, seed=5)
    block = guard_model(server.target, zoo_classifier, primary="cnn_spare")
    with running(tmp_path, [block]) as (srv, client):
        assert client.infer("cnn", [image_input(images)]).as_numpy("logits").shape == (1, 10)
        url = f"http://127.0.0.1:{server.http_port}/v2/repository/models/cnn_spare/unload"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                    timeout=60) as reply:
            assert json.load(reply) == {"name": "cnn_spare", "unload": True}
        kserve_said = _kserve_error(lambda: direct.infer("cnn_spare", [image_input(images)]))
        guard_said = _kserve_error(lambda: client.infer("cnn", [image_input(images)]))
        assert kserve_said.status() == "StatusCode.NOT_FOUND"
        assert "Model with name cnn_spare does not exist" in kserve_said.message()
        assert guard_said.status() == kserve_said.status()
        assert kserve_said.message() in guard_said.message()
        assert client.is_server_live()


def test_an_unknown_kserve_model_is_a_clear_startup_error(tmp_path, kserve, zoo_classifier):
    """KServe answers ModelReady for a model it does not have with NOT_FOUND (Triton answers
    ready=false); guard refuses to start, naming the model, the server and KServe's words."""
    from guard.config import load_config
    from guard.errors import BackendError
    from guard.serve.app import GuardServer
    from support import write_config

    server, direct = kserve
    said = _kserve_error(lambda: direct.is_model_ready("cnn_absent"))
    assert said.status() == "StatusCode.NOT_FOUND"
    block = guard_model(server.target, zoo_classifier, primary="cnn_absent")
    block["primary"]["options"] = {"ready_timeout_s": 0.5}
    guard = GuardServer(load_config(write_config(tmp_path, [block])))
    with pytest.raises(BackendError, match=rf"cnn_absent@{server.target} not ready after .*"
                       r"\(NOT_FOUND: Model with name cnn_absent does not exist"):
        guard.load_models()


def test_kserve_killed_is_unavailable_and_guard_stays_up(tmp_path, kserve, zoo_classifier):
    """Runs last: it kills the module's server."""
    server, _ = kserve
    images = sample_inputs(1, seed=2)
    with running(tmp_path, [guard_model(server.target, zoo_classifier)]) as (srv, client):
        assert client.infer("cnn", [image_input(images)]).as_numpy("logits").shape == (1, 10)
        server.kill()
        with pytest.raises(InferenceServerException) as error:
            client.infer("cnn", [image_input(images)], client_timeout=30)
        assert error.value.status() == f"StatusCode.{grpc.StatusCode.UNAVAILABLE.name}"
        assert client.is_server_live()
        assert client.get_model_metadata("cnn").name == "cnn"
