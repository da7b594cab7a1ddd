"""A small MLServer custom runtime: serves an ONNX model with ONNX Runtime.

Used by the upstream e2e tests, which start a real MLServer (``mlserver start``) as a subprocess
with this folder on PYTHONPATH, then put guard in front of it.
"""

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        import onnxruntime as ort

        self.session = ort.InferenceSession(self.settings.parameters.uri)
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        if any(float(x.flat[0]) == -999.0 for x in feeds.values() if x.size):
            raise ValueError("runtime refuses the trigger input")  # an upstream error path
        results = self.session.run(self.output_names, feeds)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[NumpyCodec.encode_output(n, r) for n, r in zip(self.output_names, results)],
        )
