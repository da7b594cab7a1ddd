"""Open Inference Protocol messages <-> named numpy arrays.

The stubs are tritonclient's (``tritonclient.grpc.service_pb2``), on purpose: a second copy of
the ``inference`` proto package in one process clashes in protobuf's descriptor pool, and guard
must live beside ``tritonclient.grpc`` (tests, demo, and users' own tooling). tritonclient's
``grpc_service.proto`` is the KServe v2 protocol plus Triton's extensions; guard serves the
KServe v2 subset, and unimplemented Triton RPCs answer UNIMPLEMENTED.

Inputs come as ``raw_input_contents`` (little-endian bytes, one entry per input, all or none) or
as typed ``contents``. Outputs go back as raw contents, as Triton does. Arrays decoded from raw
bytes are read-only views on the request (no copy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from guard.backends.base import OIP_TO_NUMPY, oip_datatype

# Typed-contents field per datatype. FP16 has none in the protocol: it must be sent raw.
_TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


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


def _numpy_dtype(name: str, datatype: str) -> np.dtype:
    if datatype == "BYTES":
        raise invalid(f"input '{name}': datatype BYTES is not supported: guard serves tensor "
                      "models (numeric and BOOL tensors)")
    if datatype == "BF16":
        raise invalid(f"input '{name}': datatype BF16 has no numpy dtype; send FP32 or FP16")
    try:
        return OIP_TO_NUMPY[datatype]
    except KeyError:
        raise invalid(f"input '{name}': unknown datatype '{datatype}'") from None


def _typed(name: str, datatype: str, dtype: np.dtype, contents, count: int) -> np.ndarray:
    field_name = _TYPED_FIELD.get(datatype)
    if field_name is None:
        raise invalid(f"input '{name}': datatype {datatype} has no typed contents in the "
                      "protocol; send it in raw_input_contents")
    values = getattr(contents, field_name)
    if len(values) != count:
        raise invalid(f"input '{name}': {len(values)} values in {field_name}, shape needs {count}")
    if dtype.kind in "iu":
        wide = np.asarray(values, dtype=np.uint64 if dtype == np.uint64 else np.int64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise invalid(f"input '{name}': values out of range for {datatype}")
        return wide.astype(dtype)
    return np.asarray(values, dtype=dtype)


def decode_request(request: pb.ModelInferRequest) -> InferenceRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: "
                      "send all inputs raw or none")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise invalid(f"input '{name}' appears twice")
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise invalid(f"input '{name}': shape {list(shape)} has a negative dimension")
        dtype = _numpy_dtype(name, tensor.datatype)
        count = math.prod(shape)
        if raw:
            data = raw[index]
            expected = count * dtype.itemsize
            if len(data) != expected:
                raise invalid(f"input '{name}': raw contents are {len(data)} bytes, shape "
                              f"{list(shape)} x {tensor.datatype} needs {expected}")
            array = np.frombuffer(data, dtype=dtype.newbyteorder("<")).reshape(shape)
        else:
            if not tensor.HasField("contents") and count:
                raise invalid(f"input '{name}': no contents (neither raw nor typed)")
            array = _typed(name, tensor.datatype, dtype, tensor.contents, count).reshape(shape)
        inputs[name] = array
    return InferenceRequest(
        model_name=request.model_name,
        model_version=request.model_version,
        id=request.id,
        inputs=inputs,
        requested_outputs=[o.name for o in request.outputs],
    )


def encode_response(
    request: InferenceRequest, outputs: dict[str, np.ndarray], route: str
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    # Which backend answered: lets clients and tests tell primary from fallback answers.
    response.parameters["guard_route"].string_param = route
    for name, array in outputs.items():
        array = np.asarray(array)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        tensor = response.outputs.add(name=name, datatype=oip_datatype(array.dtype))
        tensor.shape.extend(array.shape)
        response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
    return response
