"""Scenarios every OIP model server behind guard's Python forwarder must pass, written once for
the e2e modules that run a real server (tests/e2e/test_triton.py, test_kserve.py). Each server's
fixture serves ``cnn_fp32`` (the zoo classifier), ``cnn_int8`` (its int8 variant, which drifts)
and gives ``(server, direct)``: the server (``.target``) and a tritonclient talking to it
directly."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from guard.zoo.classifier import sample_inputs
from support import image_input, metric, running, scrape, wait_for


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


def server_error(call) -> InferenceServerException:
    """The error a call through guard ends with (the server's status, passed through)."""
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value


def answers_pass_through_and_samples_match_the_local_reference(tmp_path, server, direct,
                                                               zoo_classifier) -> None:
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


def a_drifting_model_is_switched_to_the_fallback_model(tmp_path, server, direct,
                                                       zoo_classifier) -> None:
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


def a_wrong_shape_comes_back_with_the_servers_status(tmp_path, server, direct, zoo_classifier,
                                                     servers_words: str) -> None:
    """An input of the wrong shape: the model server's own status and words come back through
    guard, and guard goes on answering."""
    small = np.zeros((1, 3, 16, 16), np.float32)
    server_said = server_error(lambda: direct.infer("cnn_fp32", [image_input(small)]))
    assert server_said.status() == "StatusCode.INVALID_ARGUMENT"
    with running(tmp_path, [guard_model(server.target, zoo_classifier)]) as (srv, client):
        guard_said = server_error(lambda: client.infer("cnn", [image_input(small)]))
        assert guard_said.status() == server_said.status()
        assert servers_words in server_said.message()
        assert server_said.message() in guard_said.message()
        good = client.infer("cnn", [image_input(sample_inputs(1, seed=1))])
        assert good.as_numpy("logits").shape == (1, 10)


def a_killed_server_is_unavailable_and_guard_stays_up(tmp_path, server, zoo_classifier) -> None:
    """Kills ``server``: run it last in its module."""
    images = sample_inputs(1, seed=2)
    with running(tmp_path, [guard_model(server.target, zoo_classifier)]) as (srv, client):
        assert client.infer("cnn", [image_input(images)]).as_numpy("logits").shape == (1, 10)
        server.kill()
        with pytest.raises(InferenceServerException) as error:
            client.infer("cnn", [image_input(images)], client_timeout=30)
        assert error.value.status() == f"StatusCode.{grpc.StatusCode.UNAVAILABLE.name}"
        assert client.is_server_live()
        assert client.get_model_metadata("cnn").name == "cnn"
