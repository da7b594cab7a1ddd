"""Every `guard deploy` kind on every example config the repository ships: exit 0, or a clean
exit 2 (one `guard: ...` message, no traceback). `deploy envoy` on a config with local backends
raised AttributeError in guard/envoy/bootstrap.py (issue 28, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from guard.cli import main

ROOT = Path(__file__).resolve().parents[2]
KINDS = {
    "rules": ["deploy", "rules"],
    "rules-prometheusrule": ["deploy", "rules", "--format", "prometheusrule"],
    "rollout-argo": ["deploy", "rollout", "--kind", "argo"],
    "rollout-flagger": ["deploy", "rollout", "--kind", "flagger"],
    "envoy": ["deploy", "envoy"],
    "istio": ["deploy", "istio", "--selector", "app=model"],
}


def example_configs() -> dict[str, dict]:
    """Every guard config shipped: configs/*.yaml, the Kubernetes ones, the Istio example's."""
    found = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        found[str(path.relative_to(ROOT))] = yaml.safe_load(path.read_text())
    for path in sorted((ROOT / "deploy/kubernetes").rglob("guard.yaml")):
        found[str(path.relative_to(ROOT))] = yaml.safe_load(path.read_text())
    for doc in yaml.safe_load_all((ROOT / "deploy/istio/example.yaml").read_text()):
        if doc and doc.get("kind") == "ConfigMap" and "guard.yaml" in doc.get("data", {}):
            found["deploy/istio/example.yaml (ConfigMap)"] = yaml.safe_load(
                doc["data"]["guard.yaml"])
    return found


CONFIGS = example_configs()


def with_placeholder_models(data: dict, folder: Path) -> Path:
    """The config with each model file replaced by an empty one of the same suffix in
    ``folder`` (the examples name the user's files; the deploy commands read none of them)."""
    for model in data.get("models", []):
        for role in ("primary", "reference", "fallback"):
            block = model.get(role) or {}
            if block.get("path") and ":" not in block["path"]:
                name = f"{model['name']}-{role}{Path(block['path']).suffix}"
                (folder / name).touch()
                block["path"] = name
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_examples_include_local_and_envoy_configs():
    backends = {block["backend"] for data in CONFIGS.values() for model in data["models"]
                for role, block in model.items() if role in ("primary", "fallback")}
    assert {"onnxruntime", "upstream"} <= backends
    assert any(data.get("server", {}).get("data_plane") == "envoy" for data in CONFIGS.values())


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_deploy_kind_exits_cleanly_on_every_example(kind, name, tmp_path, capsys):
    config = with_placeholder_models(yaml.safe_load(yaml.safe_dump(CONFIGS[name])), tmp_path)
    code = main([*KINDS[kind], "--config", str(config), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code in (0, 2), err
    if code == 2:
        assert err.startswith("guard: "), err
    else:
        assert (tmp_path / "out").read_text().strip()


def test_deploy_envoy_on_local_backends_says_why_as_deploy_istio_does(tmp_path, capsys):
    config = with_placeholder_models(yaml.safe_load((ROOT / "configs/local.yaml").read_text()),
                                     tmp_path)
    errors = []
    for kind in ("envoy", "istio"):
        assert main([*KINDS[kind], str(config)]) == 2
        errors.append(capsys.readouterr().err)
    assert errors[0] == errors[1]
    assert errors[0].startswith("guard: not servable through Envoy:\n  models[0].primary.backend: "
                                "Envoy mode forwards to upstream servers only; 'onnxruntime'")


# The reference's file is the Pod's: where manifests are built it does not exist.
POD_ONLY = {"version": 1, "server": {"grpc_port": 8001, "data_plane": "envoy", "envoy": {
    "attach_admin_port": 15000, "observer": "tap", "health_port": 8006}}, "models": [{
        "name": "cnn",
        "primary": {"backend": "upstream", "target": "127.0.0.1:9001", "model": "cnn"},
        "fallback": {"backend": "upstream", "target": "cnn-fallback:9001", "model": "cnn"},
        "reference": {"backend": "onnxruntime", "path": "/models/not-on-this-machine.onnx"},
        "mirror": {"sample_rate": 0.05}}]}


@pytest.mark.parametrize("kind", ["envoy", "istio"])
def test_envoy_and_istio_print_a_config_whose_files_live_in_the_pod(kind, tmp_path, capsys):
    """The bootstrap and the EnvoyFilter read none of the files the config names (the model
    artifacts are the Pod's): their absence here is no error, as for `deploy rules`."""
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump(POD_ONLY))
    assert main([*KINDS[kind], "--config", str(config), "-o", str(tmp_path / "out")]) == 0, \
        capsys.readouterr().err
    assert "cnn" in (tmp_path / "out").read_text()


@pytest.mark.parametrize("kind", ["envoy", "istio"])
def test_envoy_and_istio_still_validate_everything_but_the_files(kind, tmp_path, capsys):
    data = yaml.safe_load(yaml.safe_dump(POD_ONLY))
    data["models"][0]["reference"]["options"] = {"bogus": 1}
    config = tmp_path / "guard.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main([*KINDS[kind], "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "models[0].reference.options" in err and "file not found" not in err, err
