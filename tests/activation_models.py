"""Models for tier-2 tests: a nested torch module (blocks with residuals, a shared layer) and
hand-built ONNX graphs whose names clash or carry no module scopes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

NESTED_SIGNATURE = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.lin(x)) + x


class Nested(nn.Module):
    """Two residual blocks, a LayerNorm used twice, a head: parents, children and reuse."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        self.guard_signature = NESTED_SIGNATURE

    def forward(self, x):
        x = self.norm(x)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def nested() -> Nested:
    return Nested().eval()


def export_nested(folder: Path, dynamo: bool = True) -> Path:
    import contextlib
    import io
    import warnings

    path = folder / ("nested_dynamo.onnx" if dynamo else "nested_ts.onnx")
    example = torch.randn(2, 8)
    kwargs = dict(input_names=["x"], output_names=["y"])
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(nested(), (example,), str(path), dynamo=True, external_data=False,
                              dynamic_shapes={"x": {0: torch.export.Dim("batch", max=1024)}},
                              **kwargs)
        else:
            torch.onnx.export(nested(), (example,), str(path), dynamo=False,
                              dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, **kwargs)
    return path


def two_layer_onnx(path: Path, hidden: int, seed: int = 0, names: tuple[str, str] = ("h", "y"),
                   scoped: bool = False) -> Path:
    """x [N,4] -> MatMul -> h [N,hidden] -> Relu -> MatMul -> y [N,3], built with onnx.helper.
    Two of these with different ``hidden`` share value names but not shapes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.normal(size=(4, hidden)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(hidden, 3)).astype(np.float32), "w2")
    prefix = "/fc1/" if scoped else ""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], [names[0]], name=f"{prefix}MatMul"),
        helper.make_node("Relu", [names[0]], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], [names[1]], name="out"),
    ]
    graph = helper.make_graph(
        nodes, "two_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info(names[1], TensorProto.FLOAT, ["N", 3])],
        initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
