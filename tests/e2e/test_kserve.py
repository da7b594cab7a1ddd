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

import pytest
import tritonclient.grpc as grpcclient

from guard.backends.derive import derive_onnx
from guard.zoo.classifier import sample_inputs
from kserve_server import KServeServer, unavailable_reason
from support import image_input, running
from upstream_scenarios import (a_drifting_model_is_switched_to_the_fallback_model,
                                a_killed_server_is_unavailable_and_guard_stays_up,
                                a_wrong_shape_comes_back_with_the_servers_status,
                                answers_pass_through_and_samples_match_the_local_reference,
                                guard_model, server_error)

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


def test_answers_pass_through_and_samples_match_the_local_reference(tmp_path, kserve,
                                                                     zoo_classifier):
    answers_pass_through_and_samples_match_the_local_reference(tmp_path, *kserve,
                                                               zoo_classifier)


def test_a_drifting_kserve_model_is_switched_to_the_fallback_kserve_model(tmp_path, kserve,
                                                                          zoo_classifier):
    a_drifting_model_is_switched_to_the_fallback_model(tmp_path, *kserve, zoo_classifier)


def test_a_wrong_shape_comes_back_with_kserves_status(tmp_path, kserve, zoo_classifier):
    # kserve.errors.InvalidInput from the model, mapped by KServe's gRPC interceptor.
    a_wrong_shape_comes_back_with_the_servers_status(
        tmp_path, *kserve, zoo_classifier, "input 'image': expected FP32 [-1, 3, 32, 32]")


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
        kserve_said = server_error(lambda: direct.infer("cnn_spare", [image_input(images)]))
        guard_said = server_error(lambda: client.infer("cnn", [image_input(images)]))
        assert kserve_said.status() == "StatusCode.NOT_FOUND"
        assert "Model with name cnn_spare does not exist" in kserve_said.message()
        assert guard_said.status() == kserve_said.status()
        assert kserve_said.message() in guard_said.message()
        assert client.is_server_live()


def test_an_unknown_kserve_model_is_a_clear_startup_error(tmp_path, kserve, zoo_classifier):
    """KServe answers ModelReady for a model it does not have with NOT_FOUND (Triton answers
    ready=false); guard refuses to start, naming the model, the server and KServe's words."""
    from guard.plan.complete import load_config
    from guard.errors import BackendError
    from guard.serve.app import GuardServer
    from support import write_config

    server, direct = kserve
    said = server_error(lambda: direct.is_model_ready("cnn_absent"))
    assert said.status() == "StatusCode.NOT_FOUND"
    block = guard_model(server.target, zoo_classifier, primary="cnn_absent")
    block["primary"]["options"] = {"ready_timeout_s": 0.5}
    guard = GuardServer(load_config(write_config(tmp_path, [block])))
    with pytest.raises(BackendError, match=rf"cnn_absent@{server.target} not ready after .*"
                       r"\(NOT_FOUND: Model with name cnn_absent does not exist"):
        guard.load_models()


def test_kserve_killed_is_unavailable_and_guard_stays_up(tmp_path, kserve, zoo_classifier):
    """Runs last: it kills the module's server."""
    a_killed_server_is_unavailable_and_guard_stays_up(tmp_path, kserve[0], zoo_classifier)
