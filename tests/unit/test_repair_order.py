"""The op repair's search order (guard/policy/repair.py): the candidates that cost most to keep
back and contribute least to the drift are put back first, costs from the real ONNX graph
(guard/policy/onnx_ops.py ``op_costs``: a product's weight elements, 0 for a lookup)."""

from __future__ import annotations

import onnx

from guard.config import BackendConfig, RepairConfig
from guard.policy.onnx_ops import op_costs
from guard.policy.repair import OpRepair, Suspect


def test_costs_are_weight_elements_of_products_and_nothing_for_the_rest(zoo_classifier):
    path = zoo_classifier["onnx"]
    graph = onnx.load(str(path)).graph
    sizes = {i.name: len(onnx.numpy_helper.to_array(i).reshape(-1)) for i in graph.initializer}
    costs = op_costs(path)
    products = [n for n in graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert products
    for node in products:
        assert costs[node.name] == sum(sizes.get(name, 0) for name in node.input) > 0
    assert all(costs[n.name] == 0 for n in graph.node
               if n.op_type not in ("Conv", "Gemm", "MatMul") and n.name)


def test_candidates_are_ordered_dearest_per_unit_of_drift_first(zoo_classifier):
    path = str(zoo_classifier["onnx"])
    spec = BackendConfig(backend="onnxruntime", path=path, precision="int8")
    steps = []
    repair = OpRepair(spec, None, lambda *a: True, RepairConfig(), on_step=steps.append)
    costs = op_costs(path)
    products = sorted((n for n, c in costs.items() if c > 0), key=costs.get)
    cheap, dear = products[0], products[-1]
    assert costs[dear] > costs[cheap]
    # The dear op contributes a little more drift, but not in proportion to its cost: it goes
    # back first; an op that costs nothing to keep (a lookup) goes back last.
    free = next(n for n, c in costs.items() if c == 0 and n)
    suspects = [Suspect("a", 0.02, [cheap]), Suspect("b", 0.03, [dear]),
                Suspect("c", 0.5, [free])]
    ordered = repair._by_cost_over_contribution([cheap, free, dear], suspects)
    assert ordered == [dear, cheap, free]
    (step,) = [s for s in steps if s["step"] == "search_order"]
    assert step["ops"] == ordered and step["contribution"] == [0.03, 0.02, 0.5]
