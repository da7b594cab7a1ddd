"""A bare Open Inference Protocol server (grpc.aio, ONNX Runtime inline) for the Envoy-mode tests:
one ONNX model under one or more names, its metadata from the ONNX file, and answer
parameters ``server`` (``--tag``, so that a test can tell which server answered) and
``traceparent`` (the caller's header, so that a test can see it pass through a proxy).

    python oip_server.py --name cnn [--name other] --onnx model.onnx --tag primary [--port 0]

Prints ``PORT <n>`` once it listens; stops on SIGTERM. An input whose first value is -999
is refused with INVALID_ARGUMENT (an upstream error path), -998 with INTERNAL (a server error).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
OIP = {np.dtype(v): k for k, v in NUMPY.items()}
ORT = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(int64)": "INT64",
       "tensor(int32)": "INT32"}


def make_servicer(names: list[str], onnx: str, tag: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]

    def tensors(items):
        return [pb.ModelMetadataResponse.TensorMetadata(
            name=i.name, datatype=ORT.get(i.type, "FP32"),
            shape=[d if isinstance(d, int) else -1 for d in i.shape]) for i in items]

    def metadata(name: str):
        return pb.ModelMetadataResponse(name=name, platform="onnxruntime", versions=["1"],
                                        inputs=tensors(session.get_inputs()),
                                        outputs=tensors(session.get_outputs()))

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=request.name in names)

        async def ModelMetadata(self, request, context):
            if request.name not in names:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name}")
            return metadata(request.name)

        async def ModelInfer(self, request, context):
            if request.model_name not in names:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"unknown model {request.model_name}")
            feeds = {t.name: np.frombuffer(raw, dtype=NUMPY[t.datatype]).reshape(tuple(t.shape))
                     for t, raw in zip(request.inputs, request.raw_input_contents)}
            if any(x.size and float(x.flat[0]) == -999.0 for x in feeds.values()):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "runtime refuses the trigger input")
            if any(x.size and float(x.flat[0]) == -998.0 for x in feeds.values()):
                await context.abort(grpc.StatusCode.INTERNAL, f"{tag} fails the trigger input")
            outputs = session.run(output_names, feeds)
            response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.parameters["server"].string_param = tag
            headers = dict(context.invocation_metadata() or ())
            response.parameters["traceparent"].string_param = headers.get("traceparent", "")
            for output, array in zip(output_names, outputs):
                tensor = response.outputs.add(name=output, datatype=OIP[array.dtype])
                tensor.shape.extend(array.shape)
                response.raw_output_contents.append(array.tobytes())
            return response

    return Servicer()


async def main(args) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        make_servicer(args.name, args.onnx, args.tag), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    print(f"PORT {port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True, action="append")
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--tag", default="")
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
