"""guard/serve/codec.py: Open Inference Protocol messages <-> named numpy arrays."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import serialize_byte_tensor

from guard.protocol.codec import (
    InferenceError,
    InferenceRequest,
    decode_request,
    decode_response,
    encode_response,
)

# datatype -> sample values covering the type's extremes
RAW_CASES = {
    "BOOL": np.array([[True, False, True], [False, False, True]], dtype=np.bool_),
    "UINT8": np.array([[0, 1, 255], [7, 128, 254]], dtype=np.uint8),
    "UINT16": np.array([[0, 1, 65535], [300, 40000, 2]], dtype=np.uint16),
    "UINT32": np.array([[0, 1, 2**32 - 1], [70000, 2**31, 5]], dtype=np.uint32),
    "UINT64": np.array([[0, 1, 2**64 - 1], [2**40, 2**63, 9]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127], [-1, 1, 64]], dtype=np.int8),
    "INT16": np.array([[-32768, 0, 32767], [-300, 300, 1]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1], [-70000, 70000, 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1], [-(2**40), 2**40, 1]], dtype=np.int64),
    "FP16": np.array([[0.5, -2.0, 65504.0], [np.inf, -0.0, 1e-3]], dtype=np.float16),
    "FP32": np.array([[0.1, -2.5, 3.4e38], [np.inf, -np.inf, 1e-30]], dtype=np.float32),
    "FP64": np.array([[0.1, -2.5, 1.7e308], [np.inf, 5e-324, -1e-300]], dtype=np.float64),
}

TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def request(*tensors, raw=None, **fields) -> pb.ModelInferRequest:
    """tensors: (name, datatype, shape) tuples; raw: list of bytes, one per tensor."""
    req = pb.ModelInferRequest(model_name=fields.get("model_name", "m"),
                               model_version=fields.get("model_version", ""),
                               id=fields.get("id", ""))
    for name, datatype, shape in tensors:
        req.inputs.add(name=name, datatype=datatype, shape=list(shape))
    for blob in raw or []:
        req.raw_input_contents.append(blob)
    return req


def typed_request(name: str, datatype: str, array: np.ndarray, field: str | None = None):
    req = request((name, datatype, array.shape))
    values = array.ravel().tolist()
    getattr(req.inputs[0].contents, field or TYPED_FIELD[datatype]).extend(values)
    return req


def rejected(req) -> str:
    with pytest.raises(InferenceError) as info:
        decode_request(req)
    assert info.value.status == "INVALID_ARGUMENT"
    return str(info.value)


# -- raw contents --------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", sorted(RAW_CASES))
def test_raw_round_trip_every_datatype(datatype):
    array = RAW_CASES[datatype]
    req = request(("x", datatype, array.shape), raw=[array.astype(array.dtype.newbyteorder("<"))
                                                     .tobytes()])
    decoded = decode_request(req)
    x = decoded.inputs["x"]
    assert x.dtype == array.dtype
    assert x.shape == array.shape
    np.testing.assert_array_equal(x, array)


def test_raw_multiple_inputs_keep_order_and_names():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1, 2], dtype=np.int64)
    req = request(("a", "FP32", a.shape), ("b", "INT64", b.shape),
                  raw=[a.tobytes(), b.tobytes()], model_name="net", model_version="3", id="r1")
    req.outputs.add(name="y")
    req.outputs.add(name="z")
    decoded = decode_request(req)
    assert isinstance(decoded, InferenceRequest)
    assert list(decoded.inputs) == ["a", "b"]
    np.testing.assert_array_equal(decoded.inputs["a"], a)
    np.testing.assert_array_equal(decoded.inputs["b"], b)
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("net", "3", "r1")
    assert decoded.requested_outputs == ["y", "z"]


def test_raw_decoding_is_a_read_only_view():
    a = np.ones((2, 2), np.float32)
    decoded = decode_request(request(("a", "FP32", a.shape), raw=[a.tobytes()]))
    assert not decoded.inputs["a"].flags.writeable


def test_raw_scalar_and_empty_tensors():
    scalar = np.array(3.5, np.float64)
    empty = np.zeros((0, 4), np.float32)
    decoded = decode_request(request(("s", "FP64", ()), ("e", "FP32", (0, 4)),
                                     raw=[scalar.tobytes(), empty.tobytes()]))
    assert decoded.inputs["s"].shape == () and decoded.inputs["s"] == 3.5
    assert decoded.inputs["e"].shape == (0, 4) and decoded.inputs["e"].dtype == np.float32


def test_raw_length_mismatch_names_tensor_and_both_byte_counts():
    message = rejected(request(("pixels", "FP32", (2, 3)), raw=[b"\x00" * 20]))
    assert "pixels" in message
    assert "20" in message and "24" in message


def test_raw_length_mismatch_in_second_input():
    ok = np.zeros(2, np.int8)
    message = rejected(request(("a", "INT8", (2,)), ("b", "INT16", (3,)),
                               raw=[ok.tobytes(), b"\x00" * 3]))
    assert "'b'" in message and "3 bytes" in message and "6" in message


def test_raw_count_differs_from_inputs_count():
    a = np.zeros(2, np.float32)
    message = rejected(request(("a", "FP32", (2,)), ("b", "FP32", (2,)), raw=[a.tobytes()]))
    assert "1 raw_input_contents" in message and "2 inputs" in message


def test_more_raw_than_inputs():
    a = np.zeros(2, np.float32)
    message = rejected(request(("a", "FP32", (2,)), raw=[a.tobytes(), a.tobytes()]))
    assert "2 raw_input_contents" in message and "1 inputs" in message


def test_typed_contents_beside_raw_contents_are_refused():
    """Which would be the input? Triton refuses it; guard answered from the raw bytes."""
    msg = request(("a", "FP32", (2,)), raw=[np.zeros(2, np.float32).tobytes()])
    msg.inputs[0].contents.fp32_contents.extend([9.0, 9.0])
    message = rejected(msg)
    assert "'a'" in message and "raw_input_contents" in message


# -- typed contents ------------------------------------------------------------------------------
TYPED_CASES = {k: v for k, v in RAW_CASES.items() if k != "FP16"}


@pytest.mark.parametrize("datatype", sorted(TYPED_CASES))
def test_typed_round_trip_every_datatype(datatype):
    array = TYPED_CASES[datatype]
    decoded = decode_request(typed_request("x", datatype, array))
    x = decoded.inputs["x"]
    assert x.dtype == array.dtype
    assert x.shape == array.shape
    np.testing.assert_array_equal(x, array)


@pytest.mark.parametrize(
    ("datatype", "field", "values"),
    [
        ("BOOL", "bool_contents", [True, False]),
        ("INT8", "int_contents", [-5, 5]),
        ("INT16", "int_contents", [-500, 500]),
        ("INT32", "int_contents", [-(2**31), 2**31 - 1]),
        ("INT64", "int64_contents", [-(2**63), 2**63 - 1]),
        ("UINT8", "uint_contents", [0, 255]),
        ("UINT16", "uint_contents", [0, 65535]),
        ("UINT32", "uint_contents", [0, 2**32 - 1]),
        ("UINT64", "uint64_contents", [0, 2**64 - 1]),
        ("FP32", "fp32_contents", [1.5, -0.25]),
        ("FP64", "fp64_contents", [1e300, -1e-300]),
    ],
)
def test_typed_field_per_datatype(datatype, field, values):
    req = request(("x", datatype, (2,)))
    getattr(req.inputs[0].contents, field).extend(values)
    x = decode_request(req).inputs["x"]
    assert x.tolist() == values


def test_typed_fp16_is_rejected_and_points_to_raw():
    req = request(("half", "FP16", (2,)))
    req.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    message = rejected(req)
    assert "half" in message
    assert "raw" in message


def test_typed_scalar():
    req = request(("s", "INT32", ()))
    req.inputs[0].contents.int_contents.append(42)
    x = decode_request(req).inputs["s"]
    assert x.shape == () and int(x) == 42 and x.dtype == np.int32


def test_typed_empty_tensor_without_contents():
    x = decode_request(request(("e", "FP32", (0, 3)))).inputs["e"]
    assert x.shape == (0, 3) and x.dtype == np.float32


def test_no_contents_at_all():
    message = rejected(request(("x", "FP32", (2,))))
    assert "'x'" in message and "no contents" in message


def test_typed_count_mismatch():
    req = request(("x", "FP32", (2, 3)))
    req.inputs[0].contents.fp32_contents.extend([1.0] * 5)
    message = rejected(req)
    assert "'x'" in message and "5" in message and "6" in message


def test_typed_wrong_field_for_datatype():
    req = request(("x", "INT32", (2,)))
    req.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    message = rejected(req)
    assert message.endswith("input 'x': datatype INT32 takes int_contents; the values came in "
                            "fp32_contents"), message


@pytest.mark.parametrize(
    ("datatype", "field", "bad"),
    [
        ("INT8", "int_contents", 128),
        ("INT8", "int_contents", -129),
        ("UINT8", "uint_contents", 256),
        ("INT16", "int_contents", 40000),
        ("UINT16", "uint_contents", 70000),
    ],
)
def test_typed_out_of_range(datatype, field, bad):
    req = request(("x", datatype, (2,)))
    getattr(req.inputs[0].contents, field).extend([1, bad])
    message = rejected(req)
    assert "'x'" in message and "out of range" in message and datatype in message


# -- datatype and shape problems ------------------------------------------------------------------
def test_unknown_datatype():
    message = rejected(request(("x", "FP8", (1,)), raw=[b"\x00"]))
    assert "'x'" in message and "FP8" in message


def test_duplicate_input_names():
    a = np.zeros(2, np.float32)
    message = rejected(request(("x", "FP32", (2,)), ("x", "FP32", (2,)),
                               raw=[a.tobytes(), a.tobytes()]))
    assert "'x'" in message and "twice" in message


def test_negative_shape_dimension():
    message = rejected(request(("x", "FP32", (-1, 4)), raw=[b"\x00" * 16]))
    assert "'x'" in message and "negative" in message and "-1" in message


def test_inference_error_status_and_message():
    err = InferenceError("NOT_FOUND", "model 'z' not found")
    assert err.status == "NOT_FOUND" and str(err) == "model 'z' not found"


# -- encode_response -------------------------------------------------------------------------------
def req_for(id_="abc", name="net", version="2") -> InferenceRequest:
    return InferenceRequest(model_name=name, model_version=version, id=id_, inputs={})


def decode_output(response: pb.ModelInferResponse, index: int) -> np.ndarray:
    from guard.backends.base import OIP_TO_NUMPY

    tensor = response.outputs[index]
    dtype = OIP_TO_NUMPY[tensor.datatype].newbyteorder("<")
    return np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(
        tuple(tensor.shape))


def test_encode_response_fields():
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    response = encode_response(req_for(), {"y": y}, "primary")
    assert isinstance(response, pb.ModelInferResponse)
    assert (response.model_name, response.model_version, response.id) == ("net", "2", "abc")
    assert response.parameters["guard_route"].string_param == "primary"
    assert len(response.outputs) == 1 and len(response.raw_output_contents) == 1
    out = response.outputs[0]
    assert out.name == "y" and out.datatype == "FP32" and list(out.shape) == [2, 3]
    assert response.raw_output_contents[0] == y.tobytes()


def test_encode_response_route_fallback_and_empty_id():
    response = encode_response(req_for(id_=""), {"y": np.zeros(1, np.float32)}, "fallback")
    assert response.parameters["guard_route"].string_param == "fallback"
    assert response.id == ""


@pytest.mark.parametrize("datatype", sorted(RAW_CASES))
def test_encode_response_every_datatype_round_trips(datatype):
    array = RAW_CASES[datatype]
    response = encode_response(req_for(), {"out": array}, "primary")
    assert response.outputs[0].datatype == datatype
    assert list(response.outputs[0].shape) == list(array.shape)
    np.testing.assert_array_equal(decode_output(response, 0), array)


def test_encode_response_several_outputs_in_order():
    outputs = {"boxes": np.ones((1, 4), np.float32), "labels": np.array([3], np.int64),
               "mask": np.array([[True]])}
    response = encode_response(req_for(), outputs, "primary")
    assert [o.name for o in response.outputs] == ["boxes", "labels", "mask"]
    assert [o.datatype for o in response.outputs] == ["FP32", "INT64", "BOOL"]
    for i, array in enumerate(outputs.values()):
        np.testing.assert_array_equal(decode_output(response, i), array)


def test_encode_response_big_endian_is_sent_little_endian():
    y = np.array([1.5, -2.0, 3.25], dtype=">f4")
    response = encode_response(req_for(), {"y": y}, "primary")
    assert response.outputs[0].datatype == "FP32"
    assert response.raw_output_contents[0] == y.astype("<f4").tobytes()


def test_encode_response_non_contiguous_array():
    base = np.arange(12, dtype=np.int32).reshape(3, 4)
    y = base.T  # Fortran-ordered view
    response = encode_response(req_for(), {"y": y}, "primary")
    assert list(response.outputs[0].shape) == [4, 3]
    np.testing.assert_array_equal(decode_output(response, 0), y)


def test_encode_response_scalar_and_empty():
    response = encode_response(req_for(), {"s": np.float64(2.5), "e": np.zeros((0, 2), np.int8)},
                               "primary")
    assert list(response.outputs[0].shape) == [] and decode_output(response, 0) == 2.5
    assert list(response.outputs[1].shape) == [0, 2]
    assert response.raw_output_contents[1] == b""


def test_encode_response_unsupported_dtype():
    with pytest.raises(TypeError):
        encode_response(req_for(), {"c": np.array([1 + 2j], dtype=np.complex64)}, "primary")


def test_decode_encode_round_trip():
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    decoded = decode_request(request(("x", "FP32", x.shape), raw=[x.tobytes()], id="req-7",
                                     model_name="affine"))
    response = encode_response(decoded, {"y": decoded.inputs["x"] * 2}, "primary")
    assert response.id == "req-7" and response.model_name == "affine"
    np.testing.assert_array_equal(decode_output(response, 0), x * 2)


# -- absurd shapes: INVALID_ARGUMENT before anything is allocated ---------------------------------
@pytest.mark.parametrize("shape", [
    (0, 2**62, 2**62),  # zero elements, but numpy cannot even describe the other dimensions
    (2**62, 2**62),
    (2**31 + 1,),
    (0, 2**32),
    (1,) * 33,  # more dimensions than MAX_RANK
])
@pytest.mark.parametrize("contents", ["none", "raw", "typed"])
def test_absurd_shapes_are_invalid_argument(shape, contents):
    req = request(("x", "FP32", shape), raw=[b""] if contents == "raw" else None)
    if contents == "typed":
        req.inputs[0].contents.fp32_contents.append(1.0)
    message = rejected(req)
    assert "'x'" in message
    assert ("elements" in message) or ("dimensions" in message)


def test_absurd_shape_of_bytes_and_bf16_inputs_too():
    for datatype in ("BYTES", "BF16"):
        message = rejected(request(("x", datatype, (0, 2**62, 2**62)), raw=[b""]))
        assert "'x'" in message and "elements" in message


def test_absurd_shape_in_an_upstream_response_is_invalid_argument():
    response = pb.ModelInferResponse(model_name="m")
    response.outputs.add(name="y", datatype="FP32", shape=[0, 2**62, 2**62])
    with pytest.raises(InferenceError) as info:
        decode_response(response)
    assert info.value.status == "INVALID_ARGUMENT" and "'y'" in str(info.value)


def test_largest_allowed_zero_size_shape_still_decodes():
    x = decode_request(request(("x", "FP32", (0, 2**31)))).inputs["x"]
    assert x.shape == (0, 2**31) and x.size == 0


# -- BYTES and BF16, as tritonclient builds them ---------------------------------------------------
def client_request(*inputs) -> pb.ModelInferRequest:
    """A request as tritonclient.grpc sends it: each InferInput's tensor and raw contents."""
    req = pb.ModelInferRequest(model_name="m")
    for item in inputs:
        req.inputs.extend([item._get_tensor()])
        req.raw_input_contents.append(item._get_content())
    return req


def test_bytes_input_raw_as_tritonclient_sends_it():
    text = np.array([[b"hello", b""], [b"\x00\xffbin", "caf\u00e9".encode()]], dtype=object)
    item = grpcclient.InferInput("text", list(text.shape), "BYTES")
    item.set_data_from_numpy(text)
    x = decode_request(client_request(item)).inputs["text"]
    assert x.dtype == object and x.shape == (2, 2)
    assert x.tolist() == text.tolist()


def test_bytes_input_typed_bytes_contents():
    req = request(("text", "BYTES", (3,)))
    req.inputs[0].contents.bytes_contents.extend([b"a", b"", b"xyz"])
    x = decode_request(req).inputs["text"]
    assert x.dtype == object and x.tolist() == [b"a", b"", b"xyz"]


@pytest.mark.parametrize("count, raw, why", [
    (1, b"\x05\x00\x00\x00ab", "runs past"),  # element longer than what is left
    (2, b"\x01\x00\x00\x00a\x01\x00\x00", "end before"),  # second length cut short
    (2, b"\x01\x00\x00\x00a\x01\x00\x00\x00bEXTRA", "left after"),
    (2, b"\x00\x00\x00", "cannot hold"),
    (2**31, b"\x00" * 8, "cannot hold"),  # checked before 2**31 slots are allocated
])
def test_malformed_bytes_contents(count, raw, why):
    message = rejected(request(("text", "BYTES", (count,)), raw=[raw]))
    assert "'text'" in message and why in message


def test_bytes_typed_count_mismatch():
    req = request(("text", "BYTES", (2,)))
    req.inputs[0].contents.bytes_contents.append(b"only one")
    assert "1 values in bytes_contents" in rejected(req)


def test_bf16_input_widens_exactly_to_float32():
    values = np.array([[1.5, -2.0, 3.140625], [np.inf, -0.0, 1e-38]], dtype=ml_dtypes.bfloat16)
    item = grpcclient.InferInput("act", list(values.shape), "BF16")
    item.set_data_from_numpy(values)
    x = decode_request(client_request(item)).inputs["act"]
    assert x.dtype == np.float32 and x.shape == (2, 3)
    np.testing.assert_array_equal(x, values.astype(np.float32))  # exact: bf16 -> fp32 widening
    assert np.signbit(x[1, 1])


def test_bf16_raw_size_and_typed_contents_are_checked():
    assert "needs 4" in rejected(request(("act", "BF16", (2,)), raw=[b"\x00" * 3]))
    assert "raw contents" in rejected(request(("act", "BF16", (2,))))


def upstream_response(outputs: dict[str, tuple[str, np.ndarray]]) -> pb.ModelInferResponse:
    """An upstream's answer with raw contents built by tritonclient's own serialisers."""
    response = pb.ModelInferResponse(model_name="m")
    for name, (datatype, array) in outputs.items():
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":
            raw = serialize_byte_tensor(array).item() if array.size else b""
        else:
            raw = array.tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_decode_response_bytes_output_like_tritons_classification():
    # Triton's classification extension answers "value:index:label" strings as BYTES.
    labels = np.array([[b"0.91:3:cat", b"0.05:1:dog"]], dtype=object)
    scores = np.array([[0.25, 0.75]], dtype=ml_dtypes.bfloat16)
    outputs = decode_response(upstream_response({"labels": ("BYTES", labels),
                                                 "scores": ("BF16", scores)}))
    assert outputs["labels"].dtype == object and outputs["labels"].tolist() == labels.tolist()
    assert outputs["scores"].dtype == np.float32
    np.testing.assert_array_equal(outputs["scores"], scores.astype(np.float32))


def test_decode_response_typed_bytes_and_empty_bytes_tensor():
    response = pb.ModelInferResponse(model_name="m")
    out = response.outputs.add(name="s", datatype="BYTES", shape=[2])
    out.contents.bytes_contents.extend([b"x", b"yz"])
    response.outputs.add(name="e", datatype="BYTES", shape=[0, 3])
    outputs = decode_response(response)
    assert outputs["s"].tolist() == [b"x", b"yz"] and outputs["e"].shape == (0, 3)


def test_encode_response_bytes_reads_back_in_tritonclient():
    request_ = decode_request(request(("x", "FP32", (1,)), raw=[b"\x00" * 4], id="r"))
    text = np.array([["a", "bb"], ["", "caf\u00e9"]])  # numpy unicode: sent as UTF-8 BYTES
    response = encode_response(request_, {"text": text,
                                          "raw": np.array([b"\x00\x01"], dtype=object)},
                               "primary")
    result = grpcclient.InferResult(response)
    assert result.as_numpy("text").tolist() == [[b"a", b"bb"], [b"", "caf\u00e9".encode()]]
    assert result.as_numpy("raw").tolist() == [b"\x00\x01"]
    assert decode_response(response)["text"].tolist() == result.as_numpy("text").tolist()


def test_tier1_compares_decoded_bytes_outputs_for_equality_and_bf16_numerically():
    from guard.config import ChecksConfig
    from guard.verify.pipeline import Comparator

    comparator = Comparator(ChecksConfig.model_validate({"tensor": {"atol": 0.01, "rtol": 0.0}}))

    def answer(label: bytes, score: float):
        return decode_response(upstream_response({
            "labels": ("BYTES", np.array([[label, b"0.05:1:dog"]], dtype=object)),
            "scores": ("BF16", np.array([[score]], dtype=ml_dtypes.bfloat16))}))

    reference = answer(b"0.91:3:cat", 0.5)
    same = comparator.check(reference, answer(b"0.91:3:cat", 0.50390625))  # next bf16 up
    assert same.passed, same.tiers["tensor"].summary()
    flipped = comparator.check(reference, answer(b"0.91:4:fox", 0.5))
    by_name = {o.name: o for o in flipped.tiers["tensor"].outputs}
    assert not by_name["labels"].passed and "non-numeric values differ" in by_name["labels"].reason
    assert by_name["scores"].passed and not flipped.passed
