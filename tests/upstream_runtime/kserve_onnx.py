"""KServe's Python ModelServer serving ONNX files with ONNX Runtime, for the e2e tests.

Run by tests/kserve_server.py with the interpreter of KServe's own virtualenv (kserve cannot be
installed beside guard's pins, docs/model-servers.md), never imported by guard's tests:

    python kserve_onnx.py --grpc_port P --http_port Q --model NAME=FILE.onnx [--model ...]

Each ``--model`` is a real ``kserve.Model`` whose ``predict`` runs an ``InferenceSession``; the
ModelServer does the rest (its gRPC v2 endpoint, model registry, error statuses). Two things
differ from a stock ModelServer, both for the tests' machine:

- Both listeners bind 127.0.0.1 (KServe binds gRPC to ``[::]`` and HTTP to ``0.0.0.0``, with no
  flag to change either).
- A request whose input does not fit the ONNX signature gets ``kserve.errors.InvalidInput``,
  which KServe's gRPC interceptor answers with INVALID_ARGUMENT; without this check ONNX Runtime's
  own exception would come back as a bare UNKNOWN.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from grpc.aio._server import Server as _AioServer

import kserve
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.protocol.rest import server as _rest_server
from kserve.utils.numpy_codec import from_np_dtype

LOOPBACK = "127.0.0.1"


def _bind_loopback() -> None:
    """Rewrite KServe's wildcard listen addresses to the loopback interface."""
    add_port = _AioServer.add_insecure_port

    def add_insecure_port(self, address: str) -> int:
        return add_port(self, address.replace("[::]", LOOPBACK, 1))

    _AioServer.add_insecure_port = add_insecure_port
    rest_init = _rest_server.RESTServer.__init__

    def init(self, *args, **kwargs):
        rest_init(self, *args, **kwargs)
        self.config.host = LOOPBACK  # read by uvicorn when it binds, after __init__

    _rest_server.RESTServer.__init__ = init


_ORT_TYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(int64)": "INT64",
              "tensor(int32)": "INT32", "tensor(float16)": "FP16", "tensor(uint8)": "UINT8",
              "tensor(int8)": "INT8", "tensor(bool)": "BOOL"}


def _signature(args) -> list[dict]:
    return [{"name": a.name, "datatype": _ORT_TYPES.get(a.type, a.type),
             "shape": [d if isinstance(d, int) else -1 for d in a.shape]} for a in args]


class OnnxModel(kserve.Model):
    def __init__(self, name: str, path: str):
        super().__init__(name)
        self.path = path

    def load(self) -> bool:
        self.session = ort.InferenceSession(self.path, providers=["CPUExecutionProvider"])
        self.inputs = _signature(self.session.get_inputs())
        self.outputs = _signature(self.session.get_outputs())
        self.ready = True
        return self.ready

    def get_input_types(self) -> list[dict]:
        return self.inputs

    def get_output_types(self) -> list[dict]:
        return self.outputs

    def _feeds(self, request: InferRequest) -> dict[str, np.ndarray]:
        feeds = {}
        for spec in self.inputs:
            given = request.get_input_by_name(spec["name"])
            if given is None:
                raise InvalidInput(f"model '{self.name}' expects input '{spec['name']}'")
            shape = list(given.shape)
            fits = len(shape) == len(spec["shape"]) and all(
                want in (-1, got) for want, got in zip(spec["shape"], shape))
            if given.datatype != spec["datatype"] or not fits:
                raise InvalidInput(
                    f"model '{self.name}' input '{spec['name']}': expected {spec['datatype']} "
                    f"{spec['shape']}, got {given.datatype} {shape}")
            feeds[spec["name"]] = given.as_numpy()
        return feeds

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        names = [o["name"] for o in self.outputs]
        results = self.session.run(names, self._feeds(payload))
        outputs = []
        for name, value in zip(names, results):
            output = InferOutput(name, list(value.shape), from_np_dtype(value.dtype))
            output.set_data_from_numpy(value)
            outputs.append(output)
        return InferResponse(payload.id, self.name, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc_port", type=int, required=True)
    parser.add_argument("--http_port", type=int, required=True)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=FILE")
    args, _ = parser.parse_known_args()
    _bind_loopback()
    models = []
    for item in args.model:
        name, _, path = item.partition("=")
        model = OnnxModel(name, path)
        model.load()
        models.append(model)
    kserve.ModelServer(http_port=args.http_port, grpc_port=args.grpc_port,
                       grace_period=5).start(models)


if __name__ == "__main__":
    main()
