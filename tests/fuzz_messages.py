"""Property-based fuzzing of guard's wire surfaces (hypothesis): ModelInferRequest and friends
on the data plane, Tap (Observe, WatchRoute) and Admin (GetStatus, SetRoute).

The property, per call: guard answers with OK or a deliberate status (INVALID_ARGUMENT,
NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...), never UNKNOWN or INTERNAL (an
unhandled exception or a backend crash on input that should have been refused), and never
stops answering. Shared by tests/e2e/test_fuzz.py (a seeded sample) and
benchmarks/reliability.py (10,000+ cases against a `guard serve` process).

The target config (``target_models``): 'm', an Affine model (inputs x: FP32 [-1, 4], output y
[-1, 3]) served in the path with a reference and a fallback; 't', the same model tapped.
"""

from __future__ import annotations

import grpc
import numpy as np
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as oip
from tritonclient.grpc import service_pb2_grpc as oip_grpc

from guard.v1 import admin_pb2, admin_pb2_grpc, tap_pb2, tap_pb2_grpc

FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
MODEL_NAMES = ["m", "t", "", "nope", "m\x00", "../m", "M"]
DATATYPES = ["FP32", "FP16", "BF16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8",
             "UINT16", "UINT32", "UINT64", "BOOL", "BYTES", "", "FP8", "fp32", "COMPLEX64"]
_WIDTH = {"FP32": 4, "FP16": 2, "BF16": 2, "FP64": 8, "INT8": 1, "INT16": 2, "INT32": 4,
          "INT64": 8, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "BOOL": 1}
_TYPED_FIELD = {"FP32": "fp32_contents", "FP64": "fp64_contents", "INT8": "int_contents",
                "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
                "UINT64": "uint64_contents", "BOOL": "bool_contents",
                "BYTES": "bytes_contents"}


def target_models(reference: dict) -> list[dict]:
    """Model blocks of the fuzz target; ``reference``: the Affine backend block."""
    policy = {"action": "fallback_model", "detector": "window", "window": 20,
              "min_samples": 10}
    common = {"primary": reference, "reference": reference,
              "mirror": {"sample_rate": 0.1, "queue_size": 64},
              "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-4}}}
    return [{"name": "m", "fallback": reference, "policy": policy, **common},
            {"name": "t", "tap": True, "policy": {"action": "alert"}, **common}]


# -- strategies -----------------------------------------------------------------------------------
shapes = st.one_of(
    st.lists(st.integers(-2, 6), min_size=0, max_size=4),
    st.just([1, 4]), st.just([2, 4]),
    st.lists(st.sampled_from([0, 1, 4, 2**31, 2**62, -(2**62)]), min_size=1, max_size=3))
parameters = st.dictionaries(
    st.sampled_from(["binary_data_size", "classification", "priority", "timeout",
                     "sequence_id", "x"]),
    st.one_of(st.builds(lambda v: oip.InferParameter(int64_param=v),
                        st.integers(-(2**63), 2**63 - 1)),
              st.builds(lambda v: oip.InferParameter(string_param=v), st.text(max_size=8)),
              st.builds(lambda v: oip.InferParameter(bool_param=v), st.booleans())),
    max_size=2)


@st.composite
def input_tensors(draw):
    tensor = oip.ModelInferRequest.InferInputTensor(
        name=draw(st.sampled_from(["x", "x", "y", "", "X", "x "])),
        datatype=draw(st.sampled_from(DATATYPES)), shape=draw(shapes))
    for key, value in draw(parameters).items():
        tensor.parameters[key].CopyFrom(value)
    count = 1
    for dim in tensor.shape:
        count *= max(dim, 0)
    kind = draw(st.sampled_from(["raw_exact", "raw_random", "typed", "none"]))
    width = _WIDTH.get(tensor.datatype, 1)
    if kind == "raw_exact" and count * width <= 4096:
        raw = draw(st.binary(min_size=count * width, max_size=count * width))
        return tensor, raw
    if kind == "raw_random":
        return tensor, draw(st.binary(max_size=64))
    if kind == "typed":
        field = _TYPED_FIELD.get(tensor.datatype, "fp32_contents")
        n = draw(st.integers(0, min(max(count, 0), 32) + 2))
        contents = tensor.contents
        if field == "fp32_contents":
            values = draw(st.lists(st.floats(width=32, allow_nan=True), min_size=n, max_size=n))
        elif field == "fp64_contents":
            values = draw(st.lists(st.floats(allow_nan=True), min_size=n, max_size=n))
        elif field == "bool_contents":
            values = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        elif field == "bytes_contents":
            values = draw(st.lists(st.binary(max_size=8), min_size=n, max_size=n))
        elif field in ("uint_contents", "uint64_contents"):
            top = 2**32 - 1 if field == "uint_contents" else 2**64 - 1
            values = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
        else:
            top = 2**31 - 1 if field == "int_contents" else 2**63 - 1
            values = draw(st.lists(st.integers(-top - 1, top), min_size=n, max_size=n))
        getattr(contents, field).extend(values)
    return tensor, None


@st.composite
def infer_requests(draw) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name=draw(st.sampled_from(MODEL_NAMES)),
                                    model_version=draw(st.sampled_from(["", "1", "x"])),
                                    id=draw(st.text(max_size=12)))
    tensors = draw(st.lists(input_tensors(), max_size=3))
    raws = [raw for _, raw in tensors]
    for tensor, _ in tensors:
        request.inputs.append(tensor)
    # Raw contents go all-or-none in the protocol; the fuzzer also breaks that rule.
    if any(r is not None for r in raws) and draw(st.booleans()):
        request.raw_input_contents.extend(r or b"" for r in raws)
    elif draw(st.booleans()):
        request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=32), max_size=3)))
    for name in draw(st.lists(st.sampled_from(["y", "z", ""]), max_size=2)):
        request.outputs.add(name=name)
    for key, value in draw(parameters).items():
        request.parameters[key].CopyFrom(value)
    return request


def _valid_rows(draw) -> np.ndarray:
    rows = draw(st.integers(1, 3))
    values = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=rows * 4,
                           max_size=rows * 4))
    return np.asarray(values, np.float32).reshape(rows, 4)


@st.composite
def valid_infer_requests(draw) -> oip.ModelInferRequest:
    rows = _valid_rows(draw)
    request = oip.ModelInferRequest(model_name="m", id=draw(st.text(max_size=12)))
    request.inputs.add(name="x", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    return request


@st.composite
def infer_responses(draw) -> oip.ModelInferResponse:
    response = oip.ModelInferResponse(model_name=draw(st.sampled_from(MODEL_NAMES)),
                                      id=draw(st.text(max_size=8)))
    for tensor, raw in draw(st.lists(input_tensors(), max_size=2)):
        out = response.outputs.add(name=tensor.name.replace("x", "y"), datatype=tensor.datatype,
                                   shape=tensor.shape)
        out.contents.CopyFrom(tensor.contents)
        if raw is not None:
            response.raw_output_contents.append(raw)
    return response


def _serialized(strategy):
    return st.one_of(strategy.map(lambda m: m.SerializeToString()), st.binary(max_size=96))


observe_requests = st.builds(
    tap_pb2.ObserveRequest,
    request=_serialized(st.one_of(infer_requests(), valid_infer_requests().map(
        lambda r: _renamed(r, "t")))),
    response=_serialized(infer_responses()),
    served_by=st.sampled_from(["", "primary", "fallback", "elsewhere", "\x00"]))


def _renamed(request: oip.ModelInferRequest, name: str) -> oip.ModelInferRequest:
    request.model_name = name
    return request


set_route_requests = st.builds(
    admin_pb2.SetRouteRequest, model=st.sampled_from(MODEL_NAMES),
    route=st.integers(-3, 5), reason=st.text(max_size=40))

# One case: (surface, message).
cases = st.one_of(
    st.tuples(st.just("ModelInfer"), infer_requests()),
    st.tuples(st.just("ModelInfer"), valid_infer_requests()),
    st.tuples(st.just("ModelMetadata"), st.builds(oip.ModelMetadataRequest,
                                                  name=st.sampled_from(MODEL_NAMES),
                                                  version=st.text(max_size=4))),
    st.tuples(st.just("ModelReady"), st.builds(oip.ModelReadyRequest,
                                               name=st.sampled_from(MODEL_NAMES))),
    st.tuples(st.just("Observe"), observe_requests),
    st.tuples(st.just("WatchRoute"), st.builds(tap_pb2.WatchRouteRequest,
                                               model=st.sampled_from(MODEL_NAMES))),
    st.tuples(st.just("GetStatus"), st.builds(admin_pb2.GetStatusRequest,
                                              model=st.sampled_from(MODEL_NAMES))),
    st.tuples(st.just("SetRoute"), set_route_requests),
    st.tuples(st.just("Raw"), st.tuples(st.sampled_from(
        ["/inference.GRPCInferenceService/ModelInfer", "/guard.v1.Tap/Observe",
         "/guard.v1.Admin/SetRoute"]), st.binary(max_size=128))),
)


# -- the driver -----------------------------------------------------------------------------------
class Target:
    """Channels to a running guard; ``send(case)`` returns the status code's name."""

    def __init__(self, grpc_port: int, tap_port: int, admin_port: int, timeout: float = 10.0):
        self.channels = {port: grpc.insecure_channel(f"127.0.0.1:{port}")
                         for port in (grpc_port, tap_port, admin_port)}
        self.infer = oip_grpc.GRPCInferenceServiceStub(self.channels[grpc_port])
        self.tap = tap_pb2_grpc.TapStub(self.channels[tap_port])
        self.admin = admin_pb2_grpc.AdminStub(self.channels[admin_port])
        self.ports = {"/inference.GRPCInferenceService/ModelInfer": grpc_port,
                      "/guard.v1.Tap/Observe": tap_port, "/guard.v1.Admin/SetRoute": admin_port}
        self.timeout = timeout
        self.codes: dict[str, int] = {}

    def send(self, case) -> str:
        surface, message = case
        try:
            if surface == "ModelInfer":
                self.infer.ModelInfer(message, timeout=self.timeout)
            elif surface == "ModelMetadata":
                self.infer.ModelMetadata(message, timeout=self.timeout)
            elif surface == "ModelReady":
                self.infer.ModelReady(message, timeout=self.timeout)
            elif surface == "Observe":
                self.tap.Observe(message, timeout=self.timeout)
            elif surface == "WatchRoute":
                stream = self.tap.WatchRoute(message, timeout=self.timeout)
                try:
                    next(stream)
                finally:
                    stream.cancel()
            elif surface == "GetStatus":
                self.admin.GetStatus(message, timeout=self.timeout)
            elif surface == "SetRoute":
                self.admin.SetRoute(message, timeout=self.timeout)
            else:  # bytes that need not be a message at all
                method, payload = message
                call = self.channels[self.ports[method]].unary_unary(
                    method, request_serializer=None, response_deserializer=None)
                call(payload, timeout=self.timeout)
            code = "OK"
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and surface == "WatchRoute":
                code = "OK"
            else:
                code = exc.code().name
                if exc.code() in FORBIDDEN:
                    raise AssertionError(f"{surface} answered {code}: {exc.details()} "
                                         f"(message: {message!r:.300})") from None
        self.codes[f"{surface} {code}"] = self.codes.get(f"{surface} {code}", 0) + 1
        return code

    def answers_correctly(self, model) -> bool:
        """Afterwards: model 'm' answers a fresh request with the Affine model's own output."""
        import torch

        rows = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
        request = oip.ModelInferRequest(model_name="m", id="after-fuzz")
        request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
        request.raw_input_contents.append(rows.tobytes())
        response = self.infer.ModelInfer(request, timeout=self.timeout)
        got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, 3)
        with torch.inference_mode():
            want = model(torch.from_numpy(rows)).numpy()
        return bool(np.allclose(got, want, atol=1e-5))

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def reset_routes(target: Target) -> None:
    target.admin.SetRoute(admin_pb2.SetRouteRequest(model="m", route=admin_pb2.AUTO),
                          timeout=target.timeout)
