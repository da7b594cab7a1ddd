"""Open Inference Protocol messages <-> named numpy arrays.

The stubs are tritonclient's (``tritonclient.grpc.service_pb2``), on purpose: a second copy of
the ``inference`` proto package in one process clashes in protobuf's descriptor pool, and guard
must live beside ``tritonclient.grpc`` (tests, demo, and users' own tooling). tritonclient's
``grpc_service.proto`` is the KServe v2 protocol plus Triton's extensions; guard serves the
KServe v2 subset, and unimplemented Triton RPCs answer UNIMPLEMENTED.

Inputs come as ``raw_input_contents`` (little-endian bytes, one entry per input, all or none) or
as typed ``contents``. Outputs go back as raw contents, as Triton does. Arrays decoded from raw
bytes are read-only views on the request (no copy). BYTES tensors decode to object arrays of
``bytes`` (Triton's raw encoding, a u32 length before each element, or typed
``bytes_contents``); BF16 (raw only) is widened exactly to float32, the one form numpy computes
with.

Every malformed tensor is INVALID_ARGUMENT before anything is allocated for it: at most
``MAX_RANK`` dimensions, none negative, at most ``MAX_ELEMENTS`` elements (a zero-sized tensor's
other dimensions too), and contents that match the shape exactly (guard/backends/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from guard.protocol.tensors import (
    OIP_TO_NUMPY,
    decode_bytes_elements,
    element_count,
    widen_bf16,
    wire_contents,
)

# Typed-contents field per datatype. FP16 and BF16 have none in the protocol: they are sent raw.
_TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# The wire's byte order per datatype, made once (not a new dtype object per tensor).
_LITTLE_ENDIAN = {name: dtype.newbyteorder("<") for name, dtype in OIP_TO_NUMPY.items()}


class InferenceError(Exception):
    """A request the data plane refuses; ``status`` names the gRPC status code to answer."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # "INVALID_ARGUMENT" | "NOT_FOUND" | "INTERNAL" | "UNAVAILABLE"


def invalid(message: str) -> InferenceError:
    return InferenceError("INVALID_ARGUMENT", message)


@dataclass
class InferenceRequest:
    model_name: str
    model_version: str
    id: str
    inputs: dict[str, np.ndarray]
    requested_outputs: list[str] = field(default_factory=list)
    # The request as received: an upstream backend forwards it unchanged (parameters, id,
    # requested outputs, raw or typed contents).
    message: pb.ModelInferRequest | None = None
    # The client's gRPC metadata (auth, trace context...), forwarded to an upstream.
    metadata: tuple[tuple[str, str], ...] = ()


def _numpy_dtype(name: str, datatype: str, what: str) -> np.dtype:
    try:
        return OIP_TO_NUMPY[datatype]
    except KeyError:
        raise invalid(f"{what} '{name}': unknown datatype '{datatype}'") from None


def _typed_values(name: str, datatype: str, contents, count: int, what: str):
    field_name = _TYPED_FIELD.get(datatype)
    if field_name is None:
        raise invalid(f"{what} '{name}': datatype {datatype} has no typed contents in the "
                      "protocol; send it in raw contents")
    values = getattr(contents, field_name)
    if len(values) != count:
        sent = [field.name for field, _ in contents.ListFields() if field.name != field_name]
        if not values and sent:  # the values are there, in another datatype's field
            raise invalid(f"{what} '{name}': datatype {datatype} takes {field_name}; the "
                          f"values came in {', '.join(sent)}")
        raise invalid(f"{what} '{name}': {len(values)} values in {field_name}, shape needs "
                      f"{count}")
    return values


def _typed(name: str, datatype: str, dtype: np.dtype, contents, count: int,
           what: str) -> np.ndarray:
    values = _typed_values(name, datatype, contents, count, what)
    if dtype.kind in "iu":
        wide = np.asarray(values, dtype=np.uint64 if dtype == np.uint64 else np.int64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise invalid(f"{what} '{name}': values out of range for {datatype}")
        return wide.astype(dtype)
    return np.asarray(values, dtype=dtype)


def _decode_tensor(name: str, datatype: str, shape, raw: bytes | None, contents,
                   has_contents: bool, what: str = "input") -> np.ndarray:
    """One tensor; every malformed one (shape, size, contents) is INVALID_ARGUMENT, checked
    before anything is allocated for it."""
    shape = tuple(shape)
    try:
        count = element_count(shape)
    except ValueError as exc:
        raise invalid(f"{what} '{name}': {exc}") from None
    if datatype == "BYTES":
        if raw is not None:
            try:
                flat = decode_bytes_elements(raw, count)
            except ValueError as exc:
                raise invalid(f"{what} '{name}': {exc}") from None
        else:
            if not has_contents and count:
                raise invalid(f"{what} '{name}': no contents (neither raw nor typed)")
            flat = np.empty(count, dtype=object)
            flat[:] = list(_typed_values(name, datatype, contents, count, what))
        return flat.reshape(shape)
    if datatype == "BF16":  # no typed field in the protocol: raw only, widened to float32
        if raw is None and count:
            raise invalid(f"{what} '{name}': datatype BF16 has no typed contents in the "
                          "protocol; send it in raw contents")
        raw = raw or b""
        if len(raw) != count * 2:
            raise invalid(f"{what} '{name}': raw contents are {len(raw)} bytes, shape "
                          f"{list(shape)} x BF16 needs {count * 2}")
        return widen_bf16(raw).reshape(shape)
    dtype = _numpy_dtype(name, datatype, what)
    if raw is not None:
        expected = count * dtype.itemsize
        if len(raw) != expected:
            raise invalid(f"{what} '{name}': raw contents are {len(raw)} bytes, shape "
                          f"{list(shape)} x {datatype} needs {expected}")
        return np.frombuffer(raw, dtype=_LITTLE_ENDIAN[datatype]).reshape(shape)
    if not has_contents and count:
        raise invalid(f"{what} '{name}': no contents (neither raw nor typed)")
    return _typed(name, datatype, dtype, contents, count, what).reshape(shape)


def decode_request(request: pb.ModelInferRequest) -> InferenceRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: "
                      "send all inputs raw or none")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name  # each field read is a call into protobuf: read once
        if name in inputs:
            raise invalid(f"input '{name}' appears twice")
        if raw:
            if tensor.HasField("contents"):  # which would be the input? (Triton refuses too)
                raise invalid(f"input '{name}': typed contents given with "
                              "raw_input_contents: send each input one way")
            inputs[name] = _decode_tensor(name, tensor.datatype, tensor.shape, raw[index],
                                          None, False)
        else:
            inputs[name] = _decode_tensor(name, tensor.datatype, tensor.shape, None,
                                          tensor.contents, tensor.HasField("contents"))
    return InferenceRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=inputs,
        requested_outputs=[o.name for o in request.outputs],
        message=request,
    )


def decode_response(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Outputs of a response from another OIP server (raw or typed contents)."""
    raw = response.raw_output_contents
    if raw and len(raw) != len(response.outputs):
        raise invalid(f"{len(raw)} raw_output_contents for {len(response.outputs)} outputs")
    return {
        tensor.name: _decode_tensor(tensor.name, tensor.datatype, tensor.shape,
                                    raw[index] if raw else None, tensor.contents,
                                    tensor.HasField("contents"), what="output")
        for index, tensor in enumerate(response.outputs)
    }


def encode_request(model_name: str, inputs: dict[str, np.ndarray], request_id: str = "",
                   model_version: str = "") -> pb.ModelInferRequest:
    """A raw-contents request, as tritonclient would send it."""
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version,
                                   id=request_id)
    _add_raw(request.inputs, request.raw_input_contents, inputs)
    return request


def encode_response(
    request: InferenceRequest, outputs: dict[str, np.ndarray], route: str
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    stamp_route(response, route)
    _add_raw(response.outputs, response.raw_output_contents, outputs)
    return response


def stamp_route(response: pb.ModelInferResponse, route: str) -> None:
    """Which backend answered (``guard_route``: ``primary`` or ``fallback``), on every answer
    guard gives: lets clients and tests tell primary from fallback answers. The one place the
    parameter is written (a forwarded answer gets it as a serialized suffix built here too)."""
    response.parameters["guard_route"].string_param = route


def _add_raw(tensors, raw_contents, arrays: dict[str, np.ndarray]) -> None:
    """Each array as a tensor entry (name, datatype, shape) and its raw little-endian bytes."""
    for name, array in arrays.items():
        array = np.asarray(array)
        datatype, raw = wire_contents(array)
        tensor = tensors.add(name=name, datatype=datatype)
        tensor.shape.extend(array.shape)
        raw_contents.append(raw)
