"""guard in Envoy mode (``server.data_plane: envoy``) in front of real Triton servers.

Envoy forwards the request body as it is, so a fallback must serve the model under the name
clients send (docs/envoy.md): two Tritons (tests/triton_server.py), each serving ``cnn``, the
primary the int8 variant of the zoo CNN (it drifts against the fp32 reference), the fallback
the fp32 ONNX. guard's reference (ONNX Runtime, fp32) runs in its verifier, which sees the
sampled calls through Envoy's ext_proc. tritonclient in front of Envoy. The Envoy-mode guard
is started as in tests/e2e/test_envoy.py, with the helpers of tests/e2e/envoy_support.py.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from guard.backends.derive import derive_onnx
from guard.zoo.classifier import sample_inputs
from envoy_support import Guard, needs_envoy, raw_call, write
from support import image_input, metric, wait_for
from triton_server import TritonServer, unavailable_reason

pytestmark = [pytest.mark.timeout(300), needs_envoy]

SIGNATURE = ([("image", "TYPE_FP32", [-1, 3, 32, 32])], [("logits", "TYPE_FP32", [-1, 10])])


@pytest.fixture(scope="module")
def tritons(request, tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"Triton cannot run here: {reason}")
    fp32 = request.getfixturevalue("zoo_classifier")["onnx"]
    servers = {"primary": TritonServer(tmp_path_factory.mktemp("triton-primary"),
                                       {"cnn": (derive_onnx(fp32, "int8"), *SIGNATURE)}),
               "fallback": TritonServer(tmp_path_factory.mktemp("triton-fallback"),
                                        {"cnn": (fp32, *SIGNATURE)})}
    clients = {}
    try:
        for role, server in servers.items():
            server.start()
            clients[role] = grpcclient.InferenceServerClient(server.target)
        yield servers, clients
    finally:
        for client in clients.values():
            client.close()
        for server in servers.values():
            server.stop()


def model_block(servers, zoo_classifier, **overrides) -> dict:
    block = {
        "name": "cnn",
        "task": "classification",
        "primary": {"backend": "upstream", "target": servers["primary"].target, "model": "cnn"},
        "fallback": {"backend": "upstream", "target": servers["fallback"].target,
                     "model": "cnn"},
        "reference": {"backend": "onnxruntime", "path": str(zoo_classifier["onnx"])},
        "mirror": {"sample_rate": 1.0, "queue_size": 256},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-3}},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    block.update(overrides)
    return block


@pytest.fixture(scope="module")
def watching(tmp_path_factory, tritons, zoo_classifier):
    """guard in Envoy mode, policy alert: every call sampled, the route moved only by pins."""
    servers, _ = tritons
    guard = Guard(write(tmp_path_factory.mktemp("triton-envoy"),
                        [model_block(servers, zoo_classifier)]))
    yield guard
    guard.close()


def logits(client, images: np.ndarray, **kwargs) -> np.ndarray:
    return client.infer("cnn", [image_input(images)], **kwargs).as_numpy("logits")


def test_tritons_answers_come_through_envoy_and_sampled_calls_are_compared(watching, tritons):
    _, direct = tritons
    assert watching.srv.envoy is not None and watching.srv.envoy.process.serving
    images = sample_inputs(3, seed=7)
    before = metric(watching.metrics(), "guard_mirror_total", model="cnn", outcome="compared")
    for i in range(3):
        result = watching.client.infer("cnn", [image_input(images[i:i + 1])],
                                       request_id=f"t{i}")
        np.testing.assert_array_equal(result.as_numpy("logits"),
                                      logits(direct["primary"], images[i:i + 1]))
        assert (result.get_response().id, result.get_response().model_name) == (f"t{i}", "cnn")
    _, headers = raw_call(watching.srv.grpc_port, "cnn", images[:1])
    assert headers["guard-route"] == "primary"
    # The verifier decoded Triton's answers from Envoy's copies and compared them with the
    # fp32 reference: the int8 primary drifts.
    values = wait_for(lambda: (v := watching.metrics()) and metric(
        v, "guard_mirror_total", model="cnn", outcome="compared") >= before + 4 and v)
    assert metric(values, "guard_checks_total", model="cnn", tier="tensor", result="fail") >= 1
    assert metric(values, "guard_observer_calls_total", outcome="complete") >= 4


def test_tritons_errors_come_through_envoy_with_tritons_status(watching, tritons):
    _, direct = tritons
    small = np.zeros((1, 3, 16, 16), np.float32)
    with pytest.raises(InferenceServerException) as triton_said:
        logits(direct["primary"], small)
    with pytest.raises(InferenceServerException) as guard_said:
        logits(watching.client, small)
    assert triton_said.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert guard_said.value.status() == triton_said.value.status()
    assert "unexpected shape for input 'image'" in guard_said.value.message()
    wait_for(lambda: metric(watching.metrics(), "guard_request_errors_total", model="cnn",
                            code="INVALID_ARGUMENT") >= 1)


def test_an_admin_pin_moves_envoy_to_the_fallback_triton(watching, tritons):
    from guard.v1 import admin_pb2, admin_pb2_grpc

    _, direct = tritons
    images = sample_inputs(1, seed=6)
    primary, fallback = logits(direct["primary"], images), logits(direct["fallback"], images)
    assert not np.array_equal(primary, fallback)  # int8 and fp32 answer apart
    with grpc.insecure_channel(f"127.0.0.1:{watching.srv.admin_port}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        try:
            admin.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=admin_pb2.FALLBACK),
                           timeout=10)
            wait_for(lambda: np.array_equal(logits(watching.client, images), fallback))
            assert raw_call(watching.srv.grpc_port, "cnn", images)[1]["guard-route"] \
                == "fallback"
        finally:  # back to the primary, then to the policy
            for route in (admin_pb2.PRIMARY, admin_pb2.AUTO):
                admin.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=route), timeout=10)
        wait_for(lambda: np.array_equal(logits(watching.client, images), primary))
    assert metric(watching.metrics(), "guard_requests_total", model="cnn", route="fallback") >= 1


def test_a_drifting_triton_is_switched_to_the_fallback_triton(tmp_path, tritons, zoo_classifier):
    servers, direct = tritons
    policy = {"action": "fallback_model", "detector": "window", "window": 10, "min_samples": 5,
              "trip_ratio": 0.2, "recover_ratio": 0.05, "dwell_s": 600}
    guard = Guard(write(tmp_path, [model_block(servers, zoo_classifier, policy=policy)]))
    try:
        images = sample_inputs(12, seed=9)
        for i in range(5):
            np.testing.assert_array_equal(logits(guard.client, images[i:i + 1]),
                                          logits(direct["primary"], images[i:i + 1]))
        wait_for(lambda: metric(guard.metrics(), "guard_fallback_active", model="cnn",
                                scope="model") == 1)
        expected = logits(direct["fallback"], images[10:11])
        wait_for(lambda: np.array_equal(logits(guard.client, images[10:11]), expected))
        assert raw_call(guard.srv.grpc_port, "cnn", images[:1])[1]["guard-route"] == "fallback"
    finally:
        guard.close()
