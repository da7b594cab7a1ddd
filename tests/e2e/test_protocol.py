"""Wire protocol end to end: every datatype, raw and typed contents, and every bad input."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, save
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from support import metric, model_block, running, scrape, x_input

# OIP datatype -> (numpy dtype, ONNX element type)
DATATYPES = {
    "BOOL": (np.bool_, TensorProto.BOOL),
    "UINT8": (np.uint8, TensorProto.UINT8),
    "UINT16": (np.uint16, TensorProto.UINT16),
    "UINT32": (np.uint32, TensorProto.UINT32),
    "UINT64": (np.uint64, TensorProto.UINT64),
    "INT8": (np.int8, TensorProto.INT8),
    "INT16": (np.int16, TensorProto.INT16),
    "INT32": (np.int32, TensorProto.INT32),
    "INT64": (np.int64, TensorProto.INT64),
    "FP16": (np.float16, TensorProto.FLOAT16),
    "FP32": (np.float32, TensorProto.FLOAT),
    "FP64": (np.float64, TensorProto.DOUBLE),
}
TYPED_FIELD = {
    "BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
    "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}


@pytest.fixture(scope="module")
def identity_onnx(tmp_path_factory):
    """One ONNX Runtime model echoing one input of every datatype (in_T -> out_T)."""
    nodes, inputs, outputs = [], [], []
    for name, (_, onnx_type) in DATATYPES.items():
        inputs.append(helper.make_tensor_value_info(f"in_{name}", onnx_type, ["n", 3]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", onnx_type, ["n", 3]))
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
    graph = helper.make_graph(nodes, "identity_all", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("onnx") / "identity.onnx"
    save(model, str(path))
    return path


def values_for(name: str) -> np.ndarray:
    dtype = DATATYPES[name][0]
    if dtype is np.bool_:
        return np.array([[True, False, True], [False, False, True]])
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else np.finfo(dtype)
    return np.array([[info.min, 0, 1], [info.max, 2, 3]], dtype=dtype)


@pytest.fixture(scope="module")
def identity_server(identity_onnx, tmp_path_factory):
    model = {"name": "identity", "primary": {"backend": "onnxruntime", "path": str(identity_onnx)},
             "mirror": {"sample_rate": 0.0}}
    with running(tmp_path_factory.mktemp("srv"), [model], max_message_bytes=1 << 20) as served:
        yield served


def test_every_datatype_round_trips_raw(identity_server):
    srv, client = identity_server
    tensors = []
    for name in DATATYPES:
        t = grpcclient.InferInput(f"in_{name}", [2, 3], name)
        t.set_data_from_numpy(values_for(name))
        tensors.append(t)
    result = client.infer("identity", tensors)
    for name in DATATYPES:
        got = result.as_numpy(f"out_{name}")
        assert got.dtype == DATATYPES[name][0]
        np.testing.assert_array_equal(got, values_for(name))


def _stub_request(srv, request):
    with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)


def _typed_request(names) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="identity")
    for name in names:
        tensor = request.inputs.add(name=f"in_{name}", datatype=name, shape=[2, 3])
        getattr(tensor.contents, TYPED_FIELD[name]).extend(values_for(name).ravel().tolist())
    return request


def test_missing_input_and_typed_fp16_are_refused_by_name(identity_server):
    srv, _ = identity_server
    request = _typed_request(TYPED_FIELD)  # every input but in_FP16
    with pytest.raises(grpc.RpcError) as err:
        _stub_request(srv, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "missing input 'in_FP16'" in err.value.details()

    # FP16 has no typed contents field in the protocol: it must come raw.
    fp16 = request.inputs.add(name="in_FP16", datatype="FP16", shape=[2, 3])
    fp16.contents.fp32_contents.extend([0.0] * 6)
    with pytest.raises(grpc.RpcError) as err:
        _stub_request(srv, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "in_FP16" in err.value.details() and "raw" in err.value.details()


def test_typed_contents_round_trip(tmp_path, identity_onnx):
    """A model taking only typed-capable datatypes: typed in, raw out, values intact."""
    from onnx import load

    model = load(str(identity_onnx))
    graph = model.graph
    keep = [i for i, n in enumerate(graph.input) if n.name != "in_FP16"]
    inputs = [graph.input[i] for i in keep]
    outputs = [graph.output[i] for i in keep]
    nodes = [graph.node[i] for i in keep]
    typed_model = helper.make_model(helper.make_graph(nodes, "typed", inputs, outputs),
                                    opset_imports=[helper.make_opsetid("", 17)])
    typed_model.ir_version = 8
    path = tmp_path / "typed.onnx"
    save(typed_model, str(path))
    block = {"name": "identity", "primary": {"backend": "onnxruntime", "path": str(path)},
             "mirror": {"sample_rate": 0.0}}
    with running(tmp_path, [block]) as (srv, _):
        response = _stub_request(srv, _typed_request(TYPED_FIELD))
        for index, tensor in enumerate(response.outputs):
            name = tensor.name.removeprefix("out_")
            got = np.frombuffer(response.raw_output_contents[index],
                                dtype=DATATYPES[name][0]).reshape(tensor.shape)
            np.testing.assert_array_equal(got, values_for(name))


def _expect(client_call, code: str, *fragments: str):
    with pytest.raises(InferenceServerException) as err:
        client_call()
    assert err.value.status() == f"StatusCode.{code}", err.value.message()
    for fragment in fragments:
        assert fragment in err.value.message()


def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(tmp_path, rng):
    with running(tmp_path, [model_block()], max_message_bytes=64 * 1024) as (srv, client):
        good = rng.normal(size=(1, 4)).astype(np.float32)
        _expect(lambda: client.infer("nope", [x_input(good)]), "NOT_FOUND", "unknown model 'nope'")
        _expect(lambda: client.infer("m", [x_input(good, name="z")]), "INVALID_ARGUMENT",
                "unknown input 'z'")
        wrong_dtype = grpcclient.InferInput("x", [1, 4], "FP64")
        wrong_dtype.set_data_from_numpy(good.astype(np.float64))
        _expect(lambda: client.infer("m", [wrong_dtype]), "INVALID_ARGUMENT",
                "input 'x'", "FP64", "FP32")
        _expect(lambda: client.infer("m", [x_input(np.zeros((1, 5)))]), "INVALID_ARGUMENT",
                "input 'x'", "shape [1, 5]")
        big = np.zeros((5000, 4), np.float32)  # 80 kB > 64 KiB limit
        _expect(lambda: client.infer("m", [x_input(big)]), "RESOURCE_EXHAUSTED")
        strings = grpcclient.InferInput("x", [1], "BYTES")
        strings.set_data_from_numpy(np.array([b"hello"], dtype=np.object_))
        _expect(lambda: client.infer("m", [strings]), "INVALID_ARGUMENT", "input 'x'", "BYTES")

        # Raw contents whose length does not match shape x dtype (sent below tritonclient,
        # which would refuse to build such a request).
        request = pb.ModelInferRequest(model_name="m")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(good.tobytes()[:-4])
        with pytest.raises(grpc.RpcError) as err:
            _stub_request(srv, request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input 'x'" in err.value.details() and "12 bytes" in err.value.details()

        # Bytes that are no ModelInferRequest at all (ModelInfer is registered on bytes).
        with grpc.insecure_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(grpc.RpcError) as err:
                infer(b"\x0a\xff\xff\xff\xff\x0f garbage", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a ModelInferRequest" in err.value.details()

        # A version guard does not serve: NOT_FOUND, as Triton answers one it does not have
        # (guard serves version 1; "" is the latest). It was served and echoed back.
        _expect(lambda: client.infer("m", [x_input(good)], model_version="99"), "NOT_FOUND",
                "model 'm' has no version '99'")
        assert client.infer("m", [x_input(good)], model_version="1").as_numpy("y").shape == (1, 3)
        assert not client.is_model_ready("m", "99") and client.is_model_ready("m", "1")
        _expect(lambda: client.get_model_metadata("m", "99"), "NOT_FOUND", "no version '99'")

        # After all that, the server still answers correctly.
        result = client.infer("m", [x_input(good)])
        assert result.as_numpy("y").shape == (1, 3)
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_request_errors_total", model="m", code="NOT_FOUND") == 1
        assert metric(values, "guard_request_errors_total", model="_unknown",
                      code="NOT_FOUND") == 1
        assert metric(values, "guard_request_errors_total", model="m",
                      code="INVALID_ARGUMENT") == 5
        assert metric(values, "guard_requests_total", model="m", route="primary") == 2


def test_requested_outputs_are_honoured(identity_server):
    srv, client = identity_server
    tensors = []
    for name in DATATYPES:
        t = grpcclient.InferInput(f"in_{name}", [2, 3], name)
        t.set_data_from_numpy(values_for(name))
        tensors.append(t)
    result = client.infer("identity", tensors,
                          outputs=[grpcclient.InferRequestedOutput("out_INT8")])
    assert [o.name for o in result.get_response().outputs] == ["out_INT8"]
    _expect(lambda: client.infer("identity", tensors,
                                 outputs=[grpcclient.InferRequestedOutput("nope")]),
            "INVALID_ARGUMENT", "unknown output 'nope' requested (the model gives: out_BOOL,")


def test_a_version_guard_does_not_serve_is_not_found_on_the_forwarding_path_too(tmp_path):
    """A model whose every backend forwards is answered from the request's bytes (no parse):
    the version is read from them as the name is, and refused alike."""
    from free_ports import free_port
    from test_fallback_spill import oip_server

    port = free_port()
    with oip_server(tmp_path / "upstream", port), running(tmp_path, [model_block(
            primary={"backend": "upstream", "target": f"127.0.0.1:{port}", "model": "m"},
            mirror={"sample_rate": 0.0})]) as (srv, client):
        good = np.zeros((1, 4), np.float32)
        _expect(lambda: client.infer("m", [x_input(good)], model_version="2"), "NOT_FOUND",
                "model 'm' has no version '2'")
        assert client.infer("m", [x_input(good)]).as_numpy("y").shape == (1, 3)
        assert metric(scrape(srv.metrics_port), "guard_request_errors_total", model="m",
                      code="NOT_FOUND") == 1
