"""A user's own torch network, exported by hand to ONNX (output ``scores``) and TorchScript
(``output0``), served by ``guard serve`` as the README pairs them: a naming difference is matched
at load, never drift (issue 28, item 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

import own_model
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.verify.pair import CheckedPair
from support import metric, scrape, wait_for, x_input
from test_cli import free_port, run_guard, start_serve

REQUESTS = 40


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("own")
    return {1: own_model.export(folder, outputs=1), 2: own_model.export(folder, outputs=2)}


def own_config(folder, paths, **server) -> tuple:
    ports = {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()}
    data = {
        "version": 1,
        "server": {"host": "127.0.0.1", **ports, **server},
        "models": [{
            "name": "net",
            "task": "classification",
            "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
            "reference": {"backend": "torch", "path": str(paths["torchscript"])},
            "fallback": {"backend": "onnxruntime", "path": str(paths["onnx"])},
            "mirror": {"sample_rate": 1.0, "queue_size": 256},
            "checks": {"tensor": {"atol": 1.0e-4, "rtol": 1.0e-3}},
            "policy": {"action": "fallback_model", "detector": "window", "window": 20,
                       "min_samples": 5},
        }],
    }
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, ports


def test_outputs_named_differently_are_matched_by_position_and_never_drift(tmp_path, exports):
    config, ports = own_config(tmp_path, exports[1])
    process, client = start_serve(config, ports["grpc_port"], timeout=120)
    try:
        rows = np.random.default_rng(0).standard_normal((REQUESTS, own_model.FEATURES))
        routes = []
        for i in range(REQUESTS):
            result = client.infer("net", [x_input(rows[i:i + 1])])
            assert result.as_numpy("scores").shape == (1, own_model.CLASSES)
            routes.append(result.get_response().parameters["guard_route"].string_param)
        values = wait_for(lambda: (v := scrape(ports["metrics_port"])) and metric(
            v, "guard_mirror_total", model="net", outcome="compared") == REQUESTS and v)
        assert set(routes) == {"primary"}
        for tier in ("tensor", "task"):
            assert metric(values, "guard_checks_total", model="net", tier=tier,
                          result="pass") == REQUESTS
            assert metric(values, "guard_checks_total", model="net", tier=tier,
                          result="fail") == 0
        assert metric(values, "guard_mirror_total", model="net", outcome="error") == 0
        assert metric(values, "guard_fallback_active", model="net", scope="model") == 0
        status = run_guard("admin", "--admin", f"127.0.0.1:{ports['admin_port']}", "status",
                           "--json")
        assert status.returncode == 0, status.stderr
        (model,) = json.loads(status.stdout)["models"]
        assert model["outputs_matched"] == {"output0": "scores"}
        assert model["route"] == "primary"
        text = run_guard("admin", "--config", str(config), "status")  # its address from the file
        assert "outputs matched by position (reference -> primary): output0 -> scores" \
            in text.stdout
    finally:
        client.close()
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    matched = [json.loads(line[line.index("{"):]) for line in stderr.splitlines()
               if '"outputs_matched_by_position"' in line]
    assert matched and matched[0]["renamed"] == {"output0": "scores"}
    assert matched[0]["observed"] == ["reference"]


def test_outputs_that_cannot_be_matched_refuse_with_one_line_naming_both_sides(exports):
    config = ModelConfig.model_validate({
        "name": "net",
        "primary": {"backend": "onnxruntime", "path": str(exports[1]["onnx"])},
        "reference": {"backend": "torch", "path": str(exports[2]["torchscript"])},
    })
    pair = CheckedPair(config)
    try:
        with pytest.raises(BackendError) as info:
            pair.load_backends()
    finally:
        pair.close()
    message = str(info.value)
    assert "\n" not in message
    assert "models[net]: the reference's outputs [output0, output1] (torch) cannot be matched " \
           "to the primary's [scores] (onnxruntime): 2 outputs against 1" in message


def _tensorrt_runs() -> bool:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


def test_validate_load_says_what_would_fail_at_serve(tmp_path, exports):
    """`guard config validate` checks the schema; `--load` loads every side as serve would."""
    paths = exports[1]
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "models": [
        {"name": "good", "task": "classification",
         "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
         "reference": {"backend": "torch", "path": str(paths["torchscript"])},
         "fallback": {"backend": "onnxruntime", "path": str(paths["onnx"])}},
        {"name": "trt", "primary": {"backend": "tensorrt", "path": str(paths["onnx"])},
         "reference": {"backend": "torch", "path": str(paths["torchscript"])}},
        {"name": "wrongfile", "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
         "reference": {"backend": "torch", "path": str(paths["onnx"])}},
        {"name": "unmatched", "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
         "reference": {"backend": "torch", "path": str(exports[2]["torchscript"])}},
        {"name": "renamed", "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
         "fallback": {"backend": "onnxruntime",
                      "path": str(renamed_output(paths["onnx"], tmp_path / "logits.onnx"))}},
        {"name": "typo", "primary": {"backend": "onnxruntime", "path": str(paths["onnx"])},
         "reference": {"backend": "torch", "path": str(paths["torchscript"])},
         "checks": {"tensor": {"outputs": {"score": {"atol": 1.0e-3}}}}},
    ]}))
    assert run_guard("config", "validate", str(config)).returncode == 0  # the schema holds
    result = run_guard("config", "validate", "--load", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "models[good]: loads (reference torch/fp32/cpu" in result.stdout
    assert "outputs matched by position (reference -> primary): output0 -> scores" \
        in result.stdout
    errors = result.stderr.splitlines()
    assert any(line.startswith("models[wrongfile].reference: torch cannot load") and
               "(a .onnx file is for backend onnxruntime or openvino or tensorrt, not torch)"
               in line for line in errors), errors
    assert any(line.startswith("models[unmatched]: the reference's outputs [output0, output1]")
               for line in errors), errors
    # A fallback exported under other output names would break clients when guard switches.
    assert any(line.startswith("models[renamed].fallback: outputs ['logits'] differ from the "
                               "primary's ['scores']") for line in errors), errors
    # A tolerance for an output the model does not have was never applied, silently.
    assert any(line.startswith("models[typo].checks.tensor.outputs.score: the model has no "
                               "output 'score'") for line in errors), errors
    failing = 5
    if not _tensorrt_runs():
        assert any(line.startswith("models[trt].primary: ") for line in errors), errors
    else:
        failing = 4
    assert errors[-1] == f"{config}: {failing} of 6 model(s) would fail at serve"


def renamed_output(source, target):
    """``source``'s ONNX model with its one output named ``logits`` (an Identity after it)."""
    import onnx

    model = onnx.load(str(source))
    (output,) = model.graph.output
    model.graph.node.append(onnx.helper.make_node("Identity", [output.name], ["logits"]))
    output.name = "logits"
    onnx.save(model, str(target))
    return target


def test_noise_floor_of_a_torchscript_reference_uses_the_primarys_signature(exports):
    """A TorchScript reference without guard.json declares no datatypes or shapes: its noise
    floor is measured on inputs generated from the primary's signature (it was skipped)."""
    config = ModelConfig.model_validate({
        "name": "net",
        "primary": {"backend": "onnxruntime", "path": str(exports[1]["onnx"])},
        "reference": {"backend": "torch", "path": str(exports[1]["torchscript"])},
    })
    pair = CheckedPair(config).load()
    try:
        floor = pair.noise_floor
        assert floor.skipped == "" and floor.samples > 1
        assert set(floor.per_output) == {"scores"}  # under the primary's name
        assert "inputs generated from the primary's signature" in floor.notes[-1]
        assert "scores" in pair.comparator.per_output
    finally:
        pair.close()
