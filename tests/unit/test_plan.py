"""The plan step (guard/plan/): config/ validates its own schema, the plan holds a config
against what the layers above declare, and a serving process loads one without importing a
check or the repair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from guard.errors import ConfigError
from guard.plan import complete, serving

ROOT = Path(__file__).resolve().parents[2]

# The example configs the repository ships (the deploy examples hold theirs inline, in a
# ConfigMap) and one that enables every cross-layer block: the repair, tier 2, adapters.
EXAMPLES = sorted([*ROOT.glob("configs/*.yaml"), *ROOT.glob("guard/configs/*.yaml"),
                   *ROOT.glob("deploy/**/guard.yaml"), ROOT / "deploy/istio/example.yaml"])

EVERYTHING = {
    "version": 1,
    "models": [{
        "name": "m", "task": "classification",
        "primary": {"backend": "onnxruntime", "path": "m.onnx", "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": "m.onnx"},
        "fallback": {"backend": "onnxruntime", "path": "m.onnx"},
        "adapters": ["float64_softmax"],
        "checks": {"activation": {"sample_rate": 0.1}},
        "policy": {"action": "fallback_ops"},
    }],
}


def _guard_configs(path: Path) -> list[dict]:
    """The guard configs in a file: the document itself, or a ConfigMap's ``guard.yaml``."""
    found = []
    for doc in yaml.safe_load_all(path.read_text()):
        if isinstance(doc, dict) and "models" in doc:
            found.append(doc)
        elif isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
            found += [yaml.safe_load(text) for key, text in (doc.get("data") or {}).items()
                      if key.endswith((".yaml", ".yml"))]
    return found


def test_there_are_examples_to_load():
    assert all(_guard_configs(path) for path in EXAMPLES), EXAMPLES


_LOAD_ALL = """
import json, sys
from pathlib import Path
from guard.errors import ConfigError
from guard.plan.serving import parse_config

seen = []
for data, base in json.loads(sys.argv[1]):
    try:
        parse_config(data, Path(base), "example")
    except ConfigError as exc:  # an artifact the example mounts in its Pod: still planned
        if not all("file not found" in line for line in exc.problems):
            raise
    seen.append(data["models"][0]["name"])
print(json.dumps({"loaded": seen, "modules": sorted(sys.modules)}))
"""


def test_a_serving_process_plans_every_example_without_a_check_or_the_repair(tmp_path):
    (tmp_path / "m.onnx").touch()
    configs = [(data, str(path.parent)) for path in EXAMPLES for data in _guard_configs(path)]
    configs.append((EVERYTHING, str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    result = subprocess.run([sys.executable, "-c", _LOAD_ALL, json.dumps(configs)], env=env,
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert len(report["loaded"]) == len(configs)
    reached = [m for m in report["modules"]
               if m.startswith(("guard.verify", "guard.policy", "guard.plan.complete"))]
    assert reached == [], reached
    assert "guard.backends.onnxruntime" in report["modules"]  # the declarations were read


def test_the_complete_plan_holds_what_serving_does_not_check(tmp_path):
    (tmp_path / "m.onnx").touch()
    bad = json.loads(json.dumps(EVERYTHING))
    bad["models"][0]["adapters"] = ["no_such_adapter"]
    bad["models"][0]["primary"]["precision"] = "fp32"
    assert serving.parse_config(bad, tmp_path).models[0].adapters[0].name == "no_such_adapter"
    with pytest.raises(ConfigError) as info:
        complete.parse_config(bad, tmp_path)
    lines = info.value.problems
    assert lines[0].startswith("models[0].adapters[0]: unknown adapter 'no_such_adapter'")
    assert lines[1].startswith("models[0]: policy.action 'fallback_ops' rebuilds the primary")
    assert len(lines) == 2


def test_checks_of_the_registries_wait_for_the_backends_to_hold(tmp_path):
    """A block naming no registered backend is named once; what relies on the name (the
    repair's strategy for it) is not guessed at."""
    (tmp_path / "m.onnx").touch()
    bad = json.loads(json.dumps(EVERYTHING))
    bad["models"][0]["primary"]["backend"] = "tflite"
    with pytest.raises(ConfigError) as info:
        complete.parse_config(bad, tmp_path)
    (line,) = info.value.problems
    assert line.startswith("models[0].primary.backend: unknown backend 'tflite' (registered: ")
    assert "onnxruntime" in line


def test_a_rebuilt_block_is_held_against_its_declaration(tmp_path):
    from guard.config import ConfigContext

    with pytest.raises(ConfigError) as info:
        serving.backend_block({"backend": "torch", "path": "x.pt", "precision": "int8"},
                              ConfigContext(base_dir=tmp_path), "a block")
    assert "precision 'int8' cannot be derived by backend 'torch'" in info.value.problems[0]
    spec = serving.backend_block({"backend": "tensorrt", "path": "m.onnx", "precision": "fp16"},
                                 ConfigContext(base_dir=tmp_path), "a block")
    assert spec.device == "cuda"  # the declaration's check normalises it (TensorRT: a GPU)


def test_the_schema_lists_the_registered_backends():
    from guard.backends import BACKEND_NAMES
    from guard.plan.schema import config_json_schema

    backend = config_json_schema()["$defs"]["BackendConfig"]["properties"]["backend"]
    assert backend["enum"] == list(BACKEND_NAMES)


def test_policy_actions_name_tiers_that_trip(tmp_path):
    """policy.actions: keys are registered tiers that feed the detectors; an action per tier
    shows in the schema `guard config schema` prints."""
    from guard.plan.schema import config_json_schema

    (tmp_path / "m.onnx").touch()
    good = {"version": 1, "models": [{
        "name": "m", "task": "classification",
        "primary": {"backend": "onnxruntime", "path": "m.onnx", "precision": "int8"},
        "reference": {"backend": "onnxruntime", "path": "m.onnx"},
        "fallback": {"backend": "onnxruntime", "path": "m.onnx"},
        "policy": {"action": "fallback_model",
                   "actions": {"tensor": "alert", "task": "fallback_model"}}}]}
    policy = complete.parse_config(good, tmp_path).models[0].policy
    assert (policy.action_for("tensor"), policy.action_for("task")) == ("alert", "fallback_model")
    bad = json.loads(json.dumps(good))
    bad["models"][0]["policy"]["actions"] = {"activation": "fallback_model"}
    with pytest.raises(ConfigError) as info:
        complete.parse_config(bad, tmp_path)
    assert info.value.problems == [
        "models[0]: policy.actions.activation: the activation tier is evidence only, its "
        "failures feed no detector and trip nothing (tiers that do: tensor, task, generation)"]
    bad["models"][0]["policy"]["actions"] = {"tier3": "alert"}
    with pytest.raises(ConfigError) as info:
        complete.parse_config(bad, tmp_path)
    assert info.value.problems[0].startswith("models[0]: policy.actions.tier3: unknown tier")
    schema = config_json_schema()["$defs"]["PolicyConfig"]["properties"]["actions"]
    assert schema["additionalProperties"]["enum"] == ["alert", "fallback_model", "fallback_ops"]
    assert "tensor: alert, task: fallback_model" in schema["description"]
