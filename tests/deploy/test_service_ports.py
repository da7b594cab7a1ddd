"""Every Service of deploy/kubernetes reaches the container it names, on every Kubernetes the
docs support (1.29 or newer).

guard runs as a native sidecar: an init container with ``restartPolicy: Always``. Kubernetes
looks a Service's named ``targetPort`` up in a Pod's ``containers`` only, and in its sidecars
from 1.32 on (kubernetes/kubernetes#127958): on 1.29-1.31 a Service naming a port of guard's
gets no endpoints, and clients reach nothing. So a Service in front of guard gives its port by
number, the port guard's container declares; a name is only for a port of a main container.
"""

from __future__ import annotations

import pytest
from kustomize_builds import KUBECTL, build

KUSTOMIZATIONS = ["deploy/kubernetes/base", "deploy/kubernetes/overlays/example",
                  "deploy/kubernetes/llm"]

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not found: its built-in kustomize renders deploy/kubernetes")


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def docs(request, tmp_path_factory) -> list[dict]:
    return build(request.param, tmp_path_factory.mktemp("kustomize-services"))[1]


def selected_pods(docs: list[dict], service: dict) -> list[dict]:
    """The Pod specs of the Deployments whose Pods the Service selects."""
    selector = service["spec"]["selector"].items()
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"
            and selector <= d["spec"]["template"]["metadata"]["labels"].items()]


def sidecars(spec: dict) -> list[dict]:
    return [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]


def test_services_in_front_of_guard_target_its_port_by_number(docs):
    fronting = 0
    for service in (d for d in docs if d["kind"] == "Service"):
        for spec in selected_pods(docs, service):
            guard = [c for c in sidecars(spec) if c["name"] == "guard"]
            if not guard:
                continue
            fronting += 1
            guard_ports = {p["containerPort"] for p in guard[0]["ports"]}
            for port in service["spec"]["ports"]:
                assert isinstance(port["targetPort"], int), (
                    f"Service {service['metadata']['name']}: targetPort {port['targetPort']!r} "
                    "must be guard's port number (a name resolves on a sidecar only from "
                    "Kubernetes 1.32)")
                assert port["targetPort"] in guard_ports, service["metadata"]["name"]
    assert fronting, "each kustomization has a Service in front of guard"


def test_a_named_target_port_is_a_main_containers(docs):
    """A name resolves before 1.32 only where a container of ``containers`` declares it."""
    for service in (d for d in docs if d["kind"] == "Service"):
        pods = selected_pods(docs, service)
        assert pods, f"Service {service['metadata']['name']} selects no Deployment's Pods"
        for port in service["spec"]["ports"]:
            if isinstance(port["targetPort"], int):
                continue
            for spec in pods:
                names = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
                assert port["targetPort"] in names, (
                    f"Service {service['metadata']['name']}: targetPort {port['targetPort']!r} "
                    "is no main container's port")
