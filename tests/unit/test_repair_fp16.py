"""Selective op fallback on an fp16 primary: the seeded model of tests/fp16_models.py whose
input LayerNorm overflows fp16, with real ONNX Runtime sessions, the real
fp16 converter, the real tier-2 checker and the model's own tier-1 checks."""

from __future__ import annotations

import onnx
import pytest

import fp16_models
from guard.backends import create_backend
from guard.policy.repair import (
    OpRepair,
    Suspect,
    fp16_ops_not_fp32,
    fp16_rebuildable_ops,
    source_node_names,
)
from repair_cases import failing, make_repair, repair_case


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp16zoo")
    onnx_path = str(fp16_models.export(folder)["onnx"])
    model = {
        "name": "wide",
        "primary": {"backend": "onnxruntime", "path": onnx_path, "precision": "fp16"},
        "reference": {"backend": "onnxruntime", "path": onnx_path},
        "fallback": {"backend": "onnxruntime", "path": onnx_path},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops"},
    }
    return {**repair_case(model, folder, "x", fp16_models.sample_inputs(16, seed=21)),
            "onnx": onnx_path}


def test_fp16_segments_map_back_to_the_fp32_node_names(wide):
    names = source_node_names(wide["onnx"])
    assert {"node_linear", "node_layer_norm"} <= names
    # The converter's Casts (keep_io_types, block list) are no node of the fp32 graph.
    segment = ["x_cast_to_node_layer_norm", "node_layer_norm", "node_linear_input_cast0",
               "node_linear", "node_linear_output_cast0"]
    assert fp16_rebuildable_ops(segment, names) == ["node_layer_norm", "node_linear"]


def test_the_fp16_primary_fails_and_the_repair_keeps_only_the_layer_norm_at_fp32(wide):
    fp16 = create_backend(wide["config"].primary, "primary")
    fp16.load()
    assert failing(wide, fp16) == 16  # the input overflows fp16 on every sample
    assert fp16_ops_not_fp32(fp16.model_path, ["node_layer_norm"]) == ["node_layer_norm"]

    steps = []
    outcome = make_repair(wide, on_step=steps.append).run(wide["samples"])
    assert outcome.ok, outcome.reason
    assert outcome.kept == ["node_layer_norm"], outcome.evidence()
    assert "node_layer_norm" in outcome.suspects[0].ops
    assert [s["step"] for s in steps][:2] == ["suspects", "candidate_ops"]
    # The variant really runs the LayerNorm at fp32 and the rest (fc1, fc2, head) at fp16.
    assert fp16_ops_not_fp32(outcome.backend.model_path, outcome.kept) == []
    assert fp16_ops_not_fp32(outcome.backend.model_path, ["node_linear_1"]) == ["node_linear_1"]
    graph = onnx.load(str(outcome.backend.model_path)).graph
    types = {i.name: i.data_type for i in graph.initializer}
    assert types["fc1.weight"] == onnx.TensorProto.FLOAT16
    (norm,) = [n for n in graph.node if n.name == "node_layer_norm"]
    assert norm.input[0] == "x"  # the raw fp32 input, no Cast to fp16 in front of it
    assert failing(wide, outcome.backend) == 0


def test_keeping_the_wrong_op_is_not_enough(wide):
    outcome = make_repair(wide).run(wide["samples"],
                                    suspects=[Suspect("linear", 1.0, ["node_linear"])])
    assert not outcome.ok and "still fails the checks" in outcome.reason


def test_a_candidate_onnx_runtime_cannot_load_is_a_failed_candidate(wide):
    from guard.errors import BackendError

    calls = []

    def flaky(spec):
        calls.append(list(spec.options["nodes_to_exclude"]))
        if len(calls) == 2:  # the first narrowing step: the rebuild is refused
            raise BackendError("the fp16 variant derived from wide.onnx does not load")
        return OpRepair._build(spec)

    steps = []
    suspects = [Suspect("norm", 1.0, ["node_layer_norm", "node_linear"])]
    outcome = make_repair(wide, build=flaky, on_step=steps.append).run(wide["samples"], suspects)
    assert outcome.ok, outcome.reason
    assert outcome.kept == ["node_layer_norm"]
    assert calls[1] == ["node_linear"]
    refused = [s for s in steps if s.get("error")]
    assert len(refused) == 1 and refused[0]["passed"] is False
    assert "does not load" in refused[0]["error"]
    assert failing(wide, outcome.backend) == 0


def test_a_first_candidate_that_cannot_load_ends_the_repair(wide):
    from guard.errors import BackendError

    def refused(spec):
        raise BackendError("does not load in ONNX Runtime")

    outcome = make_repair(wide, build=refused).run(wide["samples"])
    assert not outcome.ok and "gives no usable variant" in outcome.reason
    assert outcome.backend is None
