"""deploy/kubernetes/llm: guard in front of vLLM, with the model's bf16 deployment as the
reference, built as a user builds it and validated against the Kubernetes 1.29 and 1.33 schemas
(strict), then checked for what the schemas cannot know: the sidecar's HTTP probes are guard's
health routes on the port the config serves, vLLM answers on loopback only and on the port and
name guard's primary block calls, the reference's Service is what the reference and fallback
blocks call, the API key reaches guard and the reference from one Secret and never the
ConfigMap, the network admits clients to guard alone and the reference to guard alone, the
config is valid and its rules are the shipped PrometheusRule. Not run on a cluster here (no GPU
nodes): the Pods' behaviour is what the e2e tests show against vLLM on the CPU.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import yaml
from kustomize_builds import KUBECTL, KUBERNETES_VALIDATE, ROOT, SCHEMA_VERSIONS, build, one, \
    validate

from guard.deploy.fleet import FleetSettings
from guard.deploy.rules import RuleSettings, render, thresholds_from_data
from guard.plan.complete import parse_config

KUSTOMIZATION = "deploy/kubernetes/llm"

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found: its built-in kustomize renders deploy/kubernetes")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build(KUSTOMIZATION, tmp_path_factory.mktemp("kustomize-llm"))


@pytest.fixture(scope="module")
def docs(built):
    return built[1]


@pytest.fixture(scope="module")
def config(docs, tmp_path_factory):
    """The ConfigMap's guard config, parsed and planned as `guard serve` would."""
    text = one(docs, "ConfigMap")["data"]["guard.yaml"]
    path = tmp_path_factory.mktemp("llm-config") / "guard.yaml"
    path.write_text(text)
    return parse_config(yaml.safe_load(text), path.parent), yaml.safe_load(text)


def pod(docs, name: str) -> dict:
    return one(docs, "Deployment", name)["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    return next(c for c in spec.get("initContainers", []) + spec["containers"]
                if c["name"] == name)


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(),
                    reason="kubernetes-validate not installed (it is in the dev extra)")
@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(built, version):
    path, docs = built
    result = validate(path, version)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ERROR" not in output
    minor = version.rsplit(".", 1)[0]
    for document in docs:
        if document["kind"] in ("PodMonitor", "PrometheusRule"):
            continue  # custom resources: no schema there
        resource = f"{document['kind'].lower()}/{document['metadata']['name']}"
        assert f"passed for resource {resource} against version {minor}" in output, resource


def test_guard_is_a_native_sidecar_in_front_of_vllm_on_loopback(docs, config):
    planned, _ = config
    spec = pod(docs, "llm")
    guard = container(spec, "guard")
    assert guard["restartPolicy"] == "Always"
    assert guard["args"] == ["serve", "--config", "/etc/guard/guard.yaml"]
    assert [c["name"] for c in spec["containers"]] == ["model-server"]
    vllm = flags(spec["containers"][0]["args"])
    assert vllm["host"] == "127.0.0.1"  # no client can bypass the guard
    (model,) = planned.models
    target = urlsplit(model.primary.target)
    assert (target.hostname, target.port) == ("127.0.0.1", int(vllm["port"]))
    assert model.primary.model == vllm["served-model-name"]


def test_the_reference_service_is_what_the_reference_and_fallback_call(docs, config):
    planned, _ = config
    (model,) = planned.models
    service = one(docs, "Service", "llm-reference")
    deployment = one(docs, "Deployment", "llm-reference")
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    server = flags(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    (port,) = service["spec"]["ports"]
    for block in (model.reference, model.fallback):
        target = urlsplit(block.target)
        assert (target.hostname, target.port) == ("llm-reference", port["port"])
        assert block.model == server["served-model-name"]
    assert int(server["port"]) == next(
        p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        if p["name"] == port["targetPort"])
    # guard's scoring asks for the top-20 per position: vLLM must allow that many.
    assert int(server["max-logprobs"]) >= model.reference.options["top_logprobs"]


def test_the_api_key_comes_from_one_secret_never_the_configmap(docs, config):
    planned, raw = config
    (model,) = planned.models
    names = {model.reference.options["api_key_env"], model.fallback.options["api_key_env"]}
    guard_env = {e["name"]: e for e in container(pod(docs, "llm"), "guard")["env"]}
    reference_env = {e["name"]: e for e in container(pod(docs, "llm-reference"),
                                                     "model-server")["env"]}
    refs = [guard_env[name]["valueFrom"]["secretKeyRef"] for name in names]
    refs.append(reference_env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"])
    assert all(ref == refs[0] for ref in refs)
    assert "value" not in guard_env[next(iter(names))]
    text = one(docs, "ConfigMap")["data"]["guard.yaml"]
    assert "api_key_env: REFERENCE_API_KEY" in text and "Bearer" not in text


def test_probes_are_guards_health_routes_on_the_configured_port(docs, config):
    _, raw = config
    guard = container(pod(docs, "llm"), "guard")
    ports = {p["name"]: p["containerPort"] for p in guard["ports"]}
    assert ports == {"http": raw["server"]["http_port"], "metrics": raw["server"]["metrics_port"]}
    # Start-up and liveness ask /health, which guard answers before any model is loaded (it
    # waits for vLLM, which the kubelet starts only after this probe): never readiness.
    for probe, path in (("startupProbe", "/health"), ("livenessProbe", "/health"),
                        ("readinessProbe", "/health/ready")):
        assert guard[probe]["httpGet"] == {"path": path, "port": "http"}, probe


def test_service_podmonitor_and_networkpolicies(docs, config):
    _, raw = config
    labels = one(docs, "Deployment", "llm")["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service", "llm")
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == raw["server"]["http_port"]  # by number: a sidecar's port
    monitor = one(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert {"action": "replace", "targetLabel": "job", "replacement": "guard"} in \
        endpoint["relabelings"]
    (clients,) = one(docs, "NetworkPolicy", "llm")["spec"]["ingress"]
    assert sorted(p["port"] for p in clients["ports"]) == sorted(
        [raw["server"]["http_port"], raw["server"]["metrics_port"]])
    (guards,) = one(docs, "NetworkPolicy", "llm-reference")["spec"]["ingress"]
    assert guards["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": labels["app.kubernetes.io/name"]}}}]
    assert [p["port"] for p in guards["ports"]] == [8000]


def test_every_container_is_non_root_read_only_with_requests_and_limits(docs):
    for name in ("llm", "llm-reference"):
        spec = pod(docs, name)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for each in spec.get("initContainers", []) + spec["containers"]:
            context = each["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, each["name"]
            assert context["allowPrivilegeEscalation"] is False, each["name"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(each["resources"][kind]), (each["name"], kind)
        vllm = container(spec, "model-server")
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
        mounts = {m["mountPath"] for m in vllm["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert {"/dev/shm", "/tmp", env["HOME"]} <= mounts  # where vLLM writes


def test_the_config_is_valid_and_the_rules_are_its_own(docs, config):
    planned, raw = config
    (model,) = planned.models
    assert model.task == "generation"
    # With the fleet rules: the replicas' completions pooled (guard/deploy/fleet.py).
    expected = yaml.safe_load(render(thresholds_from_data(raw), RuleSettings(),
                                     "prometheusrule", fleet=FleetSettings()))
    rule = one(docs, "PrometheusRule")
    assert rule["spec"] == expected["spec"], "regenerate deploy/kubernetes/llm/prometheusrule.yaml"
    alerts = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]
              if "alert" in r}
    assert {"GuardGenerationKldHigh", "GuardFleetDrift"} <= alerts


def test_the_guard_image_for_it_installs_no_torch():
    """The image the kustomization names is deploy/Dockerfile with GUARD_EXTRAS=llm-remote,otel:
    those extras (and what they include) name no torch, so its torch step is skipped."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    wanted = {"llm-remote", "otel"}
    assert not any("torch" in requirement or "guard[" in requirement
                   for name in wanted for requirement in extras[name])
    kustomization = yaml.safe_load((ROOT / KUSTOMIZATION / "kustomization.yaml").read_text())
    guard_image = next(i for i in kustomization["images"] if i["name"] == "guard")
    assert guard_image["newTag"].endswith("-llm-remote")


def test_the_dockerfile_installs_torch_first_for_every_extra_that_needs_it():
    """deploy/Dockerfile installs torch from the CPU index before the extras, where one of them
    needs torch (else pip takes PyPI's CUDA build, several GB): its list is pyproject's."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]

    def needs_torch(name: str, seen: frozenset = frozenset()) -> bool:
        for requirement in extras[name]:
            if requirement.startswith("torch") or requirement.startswith("transformers"):
                return True
            included = re.fullmatch(r"guard\[([^\]]+)\]", requirement)
            if included and any(needs_torch(n, seen | {name}) for n in
                                included.group(1).split(",") if n not in seen):
                return True
        return False

    text = (ROOT / "deploy/Dockerfile").read_text()
    listed = set(re.findall(r"\*,([\w-]+),\*", text))
    assert listed == {name for name in extras if needs_torch(name)}
