"""guard in front of a real Triton Inference Server, tritonclient in front of guard.

One Triton per module (tests/triton_server.py: nvidia-pytriton's server binary, a temporary
model repository of Python-backend models running ONNX Runtime) serving three models from the
zoo CNN's ONNX file: ``cnn_fp32``, ``cnn_int8`` (the int8 variant guard derives, which drifts
against the fp32 reference) and ``cnn_spare`` (fp32, the one the repository-API test unloads).
guard's primary and fallback are ``upstream`` backends on that server (the Python forwarder);
its reference runs locally.

The last test kills the server: it runs last in this file, and the module's fixture tolerates
a dead server at teardown.
"""

from __future__ import annotations

import pytest
import tritonclient.grpc as grpcclient

from guard.backends.derive import derive_onnx
from guard.zoo.classifier import sample_inputs
from support import image_input, running, wait_for
from upstream_scenarios import (a_drifting_model_is_switched_to_the_fallback_model,
                                a_killed_server_is_unavailable_and_guard_stays_up,
                                a_wrong_shape_comes_back_with_the_servers_status,
                                answers_pass_through_and_samples_match_the_local_reference,
                                guard_model, server_error)
from triton_server import TritonServer, unavailable_reason

pytestmark = pytest.mark.timeout(300)

SIGNATURE = ([("image", "TYPE_FP32", [-1, 3, 32, 32])], [("logits", "TYPE_FP32", [-1, 10])])


@pytest.fixture(scope="module")
def triton(request, tmp_path_factory):
    reason = unavailable_reason()
    if reason:  # before the zoo export: a machine without Triton skips at once
        pytest.skip(f"Triton cannot run here: {reason}")
    fp32 = request.getfixturevalue("zoo_classifier")["onnx"]
    models = {"cnn_fp32": (fp32, *SIGNATURE),
              "cnn_int8": (derive_onnx(fp32, "int8"), *SIGNATURE),
              "cnn_spare": (fp32, *SIGNATURE)}
    server = TritonServer(tmp_path_factory.mktemp("triton"), models)
    try:
        server.start()
        client = grpcclient.InferenceServerClient(server.target)
        yield server, client
        client.close()
    finally:
        server.stop()


def test_answers_pass_through_and_samples_match_the_local_reference(tmp_path, triton,
                                                                     zoo_classifier):
    answers_pass_through_and_samples_match_the_local_reference(tmp_path, *triton,
                                                               zoo_classifier)


def test_a_drifting_triton_model_is_switched_to_the_fallback_triton_model(tmp_path, triton,
                                                                          zoo_classifier):
    a_drifting_model_is_switched_to_the_fallback_model(tmp_path, *triton, zoo_classifier)


def test_a_wrong_shape_comes_back_with_tritons_status(tmp_path, triton, zoo_classifier):
    # Triton's own check of the shape against config.pbtxt, its status and its words.
    a_wrong_shape_comes_back_with_the_servers_status(
        tmp_path, *triton, zoo_classifier, "unexpected shape for input 'image'")


def test_a_model_unloaded_through_tritons_repository_api(tmp_path, triton, zoo_classifier):
    server, direct = triton
    images = sample_inputs(1, seed=5)
    block = guard_model(server.target, zoo_classifier, primary="cnn_spare")
    with running(tmp_path, [block]) as (srv, client):
        assert client.infer("cnn", [image_input(images)]).as_numpy("logits").shape == (1, 10)
        direct.unload_model("cnn_spare")
        wait_for(lambda: not direct.is_model_ready("cnn_spare"))
        try:
            triton_said = server_error(lambda: direct.infer("cnn_spare", [image_input(images)]))
            guard_said = server_error(lambda: client.infer("cnn", [image_input(images)]))
            assert triton_said.status() == "StatusCode.NOT_FOUND"
            assert guard_said.status() == triton_said.status()
            assert triton_said.message() in guard_said.message()
            assert client.is_server_live()
        finally:
            direct.load_model("cnn_spare")
        # Loaded again through the same API, it answers through guard again.
        wait_for(lambda: direct.is_model_ready("cnn_spare"))
        assert client.infer("cnn", [image_input(images)]).as_numpy("logits").shape == (1, 10)


def test_an_unknown_triton_model_is_a_clear_startup_error(tmp_path, triton, zoo_classifier):
    """Triton answers ModelReady for a model it does not have with ready=false (no error
    status) and ModelMetadata with NOT_FOUND; guard waits ready_timeout_s, then refuses to
    start, naming the model and the server."""
    from guard.plan.complete import load_config
    from guard.errors import BackendError
    from guard.serve.app import GuardServer
    from support import write_config

    server, direct = triton
    assert not direct.is_model_ready("cnn_absent")
    assert server_error(lambda: direct.get_model_metadata("cnn_absent")).status() == \
        "StatusCode.NOT_FOUND"
    block = guard_model(server.target, zoo_classifier, primary="cnn_absent")
    block["primary"]["options"] = {"ready_timeout_s": 0.5}
    guard = GuardServer(load_config(write_config(tmp_path, [block])))
    with pytest.raises(BackendError, match=rf"cnn_absent@{server.target} not ready after .*"
                       r"\(model not ready\)"):
        guard.load_models()


def test_triton_killed_is_unavailable_and_guard_stays_up(tmp_path, triton, zoo_classifier):
    """Runs last: it kills the module's server."""
    a_killed_server_is_unavailable_and_guard_stays_up(tmp_path, triton[0], zoo_classifier)
