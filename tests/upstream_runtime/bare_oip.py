"""A bare Open Inference Protocol server: one grpc.aio servicer, ONNX Runtime inline.

The smallest real model server a proxy can stand in front of (what the Envoy tests and the hop
benchmarks put behind Envoy): ``ModelInfer`` and ``ModelStreamInfer`` on FP32 raw inputs, the
liveness and readiness calls, nothing else. It serves one model, ``affine``: ``y = 2x + 1`` over an
FP32 matrix ``x`` of any size, an ONNX graph run by ONNX Runtime, so the answer is as large as the
request (large calls are large both ways). An input whose first element is -999 is refused with
INVALID_ARGUMENT (an error answer, trailers only).

Run: ``python bare_oip.py --port 0 --port-file FILE`` (the bound port is written to FILE).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

MODEL = "affine"


def affine_model() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "columns"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "columns"])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["x2"]),
         helper.make_node("Add", ["x2", "one"], ["y"])],
        "affine", [x], [y], initializer=[two, one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(affine_model(), options)

    def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        if request.model_name != MODEL:
            raise LookupError(f"unknown model '{request.model_name}'")
        shape = list(request.inputs[0].shape)
        x = np.frombuffer(request.raw_input_contents[0], dtype="<f4").reshape(shape)
        if x.size and x.flat[0] == -999.0:
            raise ValueError("the trigger input is refused")
        (y,) = self.session.run(["y"], {"x": x})
        response = pb.ModelInferResponse(model_name=MODEL, id=request.id)
        response.outputs.add(name="y", datatype="FP32", shape=shape)
        response.raw_output_contents.append(y.astype("<f4").tobytes())
        return response

    async def ModelInfer(self, request, context):  # noqa: N802 (the gRPC names)
        try:
            return self._infer(request)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def ModelStreamInfer(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            yield pb.ModelStreamInferResponse(infer_response=self._infer(request))

    async def ServerLive(self, request, context):  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):  # noqa: N802
        return pb.ModelReadyResponse(ready=request.name == MODEL)


async def serve(host: str, port: int, port_file: Path | None) -> None:
    size = 64 * 1024 * 1024
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                      ("grpc.max_send_message_length", size)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    if port_file is not None:
        port_file.write_text(str(bound))
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.port_file))


if __name__ == "__main__":
    main()
