"""A Triton Python-backend model that runs an ONNX file with ONNX Runtime.

Copied by tests/triton_server.py into each model's version folder beside its ``model.onnx``.
No onnxruntime backend for Triton exists on PyPI or Debian, so the e2e tests serve ONNX this
way; Triton itself still parses the request, checks names, types and shapes against
``config.pbtxt``, batches, and answers with its own status codes.

Tensors cross the stub through DLPack, never through its numpy bridge: the stub shipped with
nvidia-pytriton 0.7.0 reads numpy 1's array-descriptor layout, and with numpy 2 (this venv's)
``pb_utils.Tensor(name, ndarray)`` yields an output of 0 bytes ("output tensor shape does not
match size of output") and ``as_numpy()`` returns an input with wrong strides (right for an
all-ones tensor, wrong for anything else; seen as logits off by 4). ``np.from_dlpack`` and
``Tensor.from_dlpack`` give the exact bytes.
"""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import onnxruntime as ort

        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # the test machine's cores are shared
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {name: np.from_dlpack(pb_utils.get_input_tensor_by_name(request, name))
                     for name in self.inputs}
            results = self.session.run(self.outputs, feeds)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack(name, np.ascontiguousarray(result))
                for name, result in zip(self.outputs, results)]))
        return responses
