"""``fixture_models.affine`` as an ONNX file, for the e2e tests whose sidecar only needs a model
that answers, and drifts or changes class where the input says so.

Why: a verifier process of a torch model imports torch (about 1-2 s of CPU per start, most of
a verifier's start), and the e2e tests start about a hundred verifiers; one of an ONNX model
imports ONNX Runtime (about 0.1 s). benchmarks/suite_cpu.py prices it. The sleep and failure
triggers (a hung or failing backend) have no ONNX form: those configs keep the torch model
(tests/e2e/support.py ``affine_backend`` chooses).

The graph is the same computation as ``Affine.forward`` on the same weights (``Gemm`` for
``nn.Linear``), with the drift trigger (``>= 1000`` adds 1.0 to the row) and the roll trigger
(``<= -1000`` rolls the row by one class) as ``GreaterOrEqual``/``LessOrEqual`` masks, in the
torch module's order (drift, then roll). Built with ``onnx.helper`` (no exporter: the graph is
five nodes), written once per session where ``GUARD_CACHE_DIR`` points (tests/conftest.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from fixture_models import DRIFT_TRIGGER, ROLL_TRIGGER, Affine

OPSET = 17


def affine_onnx(drift_on_trigger: bool = False, roll_on_trigger: bool = False) -> Path:
    """The ONNX file of ``affine(drift_on_trigger=..., roll_on_trigger=...)``, written on first
    use into the session's cache folder (atomically: xdist workers may race for it)."""
    folder = Path(os.environ.get("GUARD_CACHE_DIR") or tempfile.gettempdir()) / "fixture-onnx"
    name = "affine" + ("-drift" if drift_on_trigger else "") + ("-roll" if roll_on_trigger else "")
    path = folder / f"{name}.onnx"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        model = _graph(drift_on_trigger, roll_on_trigger)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as handle:
            handle.write(model.SerializeToString())
        os.replace(handle.name, path)
    return path


def _graph(drift_on_trigger: bool, roll_on_trigger: bool):
    from onnx import TensorProto, helper, numpy_helper

    linear = Affine().linear
    weight = linear.weight.detach().numpy().astype(np.float32)
    bias = linear.bias.detach().numpy().astype(np.float32)
    constants = [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")]
    nodes = [helper.make_node("Gemm", ["x", "weight", "bias"], ["linear"], transB=1)]
    y = "linear"
    if drift_on_trigger or roll_on_trigger:
        # x[:, :1]: the first feature, kept 2-D so that it broadcasts over the row
        constants.append(numpy_helper.from_array(np.array([0], np.int64), "first_column"))
        nodes.append(helper.make_node("Gather", ["x", "first_column"], ["first"], axis=1))
    if drift_on_trigger:
        constants.append(numpy_helper.from_array(np.array(DRIFT_TRIGGER, np.float32), "drift_at"))
        nodes += [helper.make_node("GreaterOrEqual", ["first", "drift_at"], ["drifts"]),
                  helper.make_node("Cast", ["drifts"], ["shift"], to=TensorProto.FLOAT),
                  helper.make_node("Add", [y, "shift"], ["drifted"])]
        y = "drifted"
    if roll_on_trigger:  # y.roll(1, dims=1) over 3 classes: [y2, y0, y1]
        constants += [numpy_helper.from_array(np.array(ROLL_TRIGGER, np.float32), "roll_at"),
                      numpy_helper.from_array(np.array([2, 0, 1], np.int64), "rolled_order")]
        nodes += [helper.make_node("LessOrEqual", ["first", "roll_at"], ["rolls"]),
                  helper.make_node("Gather", [y, "rolled_order"], ["rolled"], axis=1),
                  helper.make_node("Where", ["rolls", "rolled", y], ["rolled_or_not"])]
        y = "rolled_or_not"
    nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(
        nodes, "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="guard-tests")
    model.ir_version = 8  # what every ONNX Runtime since 1.10 reads
    return model
