"""Tier 2 for an ``openvino`` block: the ONNX side of tier 2, run by OpenVINO.

The graph (alignment, scopes, segments) is the ONNX file's; what runs is OpenVINO's: the capture
copy (every comparable value added as a graph output, which OpenVINO turns into a Result each)
and each isolated segment are compiled by OpenVINO's CPU plugin with the block's own compile
properties (same inference precision hint). The production compiled model is never touched.
OpenVINO IR (.xml) has no ONNX graph to align by: not captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from guard.backends.activations.onnx import OnnxSide
from guard.backends.activations.torch import CaptureUnsupported


@dataclass(frozen=True)
class _Output:
    name: str


class _OvSession:
    """An ONNX model compiled by OpenVINO behind ONNX Runtime's ``run``/``get_outputs``."""

    def __init__(self, model_bytes: bytes, properties: dict[str, str]):
        import onnx
        import openvino as ov

        self._names = [o.name for o in onnx.load_from_string(model_bytes).graph.output]
        core = ov.Core()
        self._compiled = core.compile_model(core.read_model(model_bytes), "CPU", properties)
        self._request = self._compiled.create_infer_request()
        # A result carries every ONNX name of its tensor (an Identity's input and output are one
        # tensor to OpenVINO): look each graph output up by name, never by position.
        self._index = {name: i for i, port in enumerate(self._compiled.outputs)
                       for name in port.get_names()}
        self._names = [n for n in self._names if n in self._index]

    def get_outputs(self) -> list[_Output]:
        return [_Output(n) for n in self._names]

    def run(self, names, feeds):
        results = self._request.infer(dict(feeds)).to_tuple()
        return [np.array(results[self._index[n]], copy=True) for n in names]


class OpenVinoSide(OnnxSide):
    kind = "onnx"  # aligned as an ONNX graph

    def __init__(self, path, properties: dict[str, str], threads: int = 1,
                 label: str = "openvino"):
        super().__init__(path, threads=threads, label=label)
        self.properties = properties

    def _new_session(self, model_bytes: bytes, threads: int):
        return _OvSession(model_bytes, {**self.properties, "INFERENCE_NUM_THREADS": str(threads)})


def openvino_side(spec, role: str, config, threads: int = 1, run_path=None,
                  label: str = "openvino") -> OpenVinoSide:
    from guard.backends.openvino import OpenVinoOptions, compile_properties

    path = str(run_path or spec.path)
    if spec.precision == "int8":
        raise CaptureUnsupported(f"{label}: tier 2 cannot capture an NNCF-quantised model by "
                                 "the ONNX graph (its quantisation nodes are OpenVINO's)")
    if not path.endswith(".onnx"):
        raise CaptureUnsupported(f"{label}: tier 2 aligns OpenVINO by the ONNX graph; "
                                 f"{path} is not an .onnx file")
    # Compiled as the block is (same precision hint), with tier 2's thread budget.
    props = compile_properties(spec, OpenVinoOptions.model_validate(spec.options), role,
                               threads)
    return OpenVinoSide(path, props, threads=threads, label=label)
