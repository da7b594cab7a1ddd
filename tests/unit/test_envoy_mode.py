"""Envoy mode without Envoy: the config's refusals, the bootstrap's shape, Envoy's stats under
guard's names, and the hand-off of an observed call into a real sample ring."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import yaml
from tritonclient.grpc import service_pb2 as pb

from guard.plan.complete import load_config
from guard.envoy import bootstrap
from guard.envoy.hand_off import MODEL_INFER, HandOff
from guard.envoy.observer import ObservedCall
from guard.envoy.stats import translate
from guard.errors import ConfigError
from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.observe.metrics import GuardMetrics


def upstream(model: str, target: str = "127.0.0.1:9001", **options) -> dict:
    block = {"backend": "upstream", "target": target, "model": model}
    if options:
        block["options"] = options
    return block


def config(tmp_path, models: list[dict], observer: str | None = None, **server):
    if observer is not None:
        server["envoy"] = {**server.get("envoy", {}), "observer": observer}
    data = {"version": 1, "server": {"data_plane": "envoy", **server}, "models": models}
    path = tmp_path / "guard.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def problems(tmp_path, models, **server) -> list[str]:
    with pytest.raises(ConfigError) as error:
        config(tmp_path, models, **server)
    return error.value.problems


# -- config ---------------------------------------------------------------------------------------
def test_a_fallback_that_needs_the_body_readdressed_is_refused(tmp_path):
    lines = problems(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                 "fallback": upstream("cnn_fp32", "127.0.0.1:9002")}])
    assert len(lines) == 1
    assert lines[0].startswith("models[0].fallback.model: 'cnn_fp32' differs from the name "
                               "clients send ('cnn')")
    assert "cannot re-address" in lines[0]


def test_local_backends_and_versions_are_refused_in_envoy_mode(tmp_path):
    local = {"backend": "torch", "path": "fixture_models:affine"}
    lines = problems(tmp_path, [
        {"name": "a", "primary": local},
        {"name": "b", "primary": upstream("b", model_version="2")},
    ], processes=2)
    assert any(line.startswith("models[0].primary.backend: Envoy mode forwards to upstream "
                               "servers only") for line in lines)
    assert any(line.startswith("models[1].primary.options.model_version:") for line in lines)
    assert any(line.startswith("server.processes:") for line in lines)


def test_python_mode_takes_what_envoy_mode_refuses(tmp_path):
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn_int8"),
                                "fallback": upstream("cnn_fp32")}], data_plane="python")
    assert loaded.server.data_plane == "python"
    assert loaded.server.envoy.concurrency == 1


# -- bootstrap ------------------------------------------------------------------------------------
def routes_of(built: dict) -> list[dict]:
    manager = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]


def filters_of(built: dict) -> list[str]:
    manager = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return [f["name"] for f in manager["typed_config"]["http_filters"]]


def clusters_of(built: dict) -> list[str]:
    return [c["name"] for c in built["static_resources"]["clusters"]]


def test_one_model_is_routed_by_path_and_sampled_in_envoy_by_request_id(tmp_path):
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                "fallback": upstream("cnn", "127.0.0.1:9002"),
                                "reference": upstream("ref"), "mirror": {"sample_rate": 0.05}}])
    built, layout = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006),
                                    {"cnn": "fallback"})
    assert bootstrap.EXTRACTION_FILTER not in filters_of(built)  # no body parse for one model
    assert filters_of(built)[-1] == "envoy.filters.http.router"
    routes = {r["name"]: r for r in routes_of(built)}
    infer = routes["cnn_infer"]
    assert "typed_per_filter_config" not in infer  # ext_proc decided per cluster
    assert routes["health"]["route"]["cluster"] == bootstrap.HEALTH_CLUSTER
    weighted = infer["route"]["weighted_clusters"]
    assert weighted["use_hash_policy"] is True
    assert infer["route"]["hash_policy"] == [{"header": {"header_name": "x-request-id"}}]
    entries = {c["name"]: c for c in weighted["clusters"]}
    # A fallback's answer names the endpoint that answered: the primary stands in there
    # while the fallback is down (its cluster's second priority, the route's one retry).
    assert {name: c["response_headers_to_add"][0]["header"]["value"]
            for name, c in entries.items()} == {
        "guard_cnn_primary": "primary", "guard_cnn_primary_sampled": "primary",
        "guard_cnn_fallback": bootstrap.ROUTE_METADATA,
        "guard_cnn_fallback_sampled": bootstrap.ROUTE_METADATA}
    assert infer["route"]["retry_policy"]["retry_on"] == "connect-failure,reset-before-request"
    clusters = {c["name"]: c for c in built["static_resources"]["clusters"]}
    for name in ("guard_cnn_fallback", "guard_cnn_fallback_sampled"):
        priorities = clusters[name]["load_assignment"]["endpoints"]
        assert [(e.get("priority", 0), e["lb_endpoints"][0]["endpoint"]["address"]
                 ["socket_address"]["port_value"],
                 e["lb_endpoints"][0]["metadata"]["filter_metadata"]["guard"]["route"])
                for e in priorities] == [(0, 9002, "fallback"), (1, 9001, "primary")]
        assert clusters[name]["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert len(clusters["guard_cnn_primary"]["load_assignment"]["endpoints"]) == 1
    # The tap (the default observer) is off on every cluster but the sampled twins.
    assert bootstrap.TAP_FILTER in filters_of(built)
    assert bootstrap.EXT_PROC_FILTER not in filters_of(built)
    assert bootstrap.OBSERVER_CLUSTER not in clusters_of(built)
    assert [name for name, c in entries.items() if "typed_per_filter_config" not in c] == [
        "guard_cnn_primary_sampled", "guard_cnn_fallback_sampled"]
    assert entries["guard_cnn_primary"]["typed_per_filter_config"][
        bootstrap.TAP_FILTER]["disabled"] is True
    # Started on the fallback: the runtime's static layer says so from the first request,
    # 5% of the weight (in a million) on the sampled twin.
    static = built["layered_runtime"]["layers"][0]["static_layer"]
    assert static == {"guard.cnn.route.guard_cnn_primary": 0,
                      "guard.cnn.route.guard_cnn_primary_sampled": 0,
                      "guard.cnn.route.guard_cnn_fallback": 950_000,
                      "guard.cnn.route.guard_cnn_fallback_sampled": 50_000}
    assert "admin_layer" in built["layered_runtime"]["layers"][1]
    assert built["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert layout.clusters == {"guard_cnn_primary": ("cnn", "primary"),
                               "guard_cnn_primary_sampled": ("cnn", "primary"),
                               "guard_cnn_fallback": ("cnn", "fallback"),
                               "guard_cnn_fallback_sampled": ("cnn", "fallback")}


def test_a_fallback_over_tls_gets_no_stand_in(tmp_path):
    """TLS settings (SNI among them) are a cluster's: the primary cannot stand in inside a
    TLS fallback's cluster. Its answers keep a fixed route header and no retry is added."""
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                "fallback": upstream("cnn", "127.0.0.1:9002", tls=True)}])
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    infer = {r["name"]: r for r in routes_of(built)}["cnn_infer"]
    entries = {c["name"]: c for c in infer["route"]["weighted_clusters"]["clusters"]}
    assert entries["guard_cnn_fallback"]["response_headers_to_add"][0]["header"][
        "value"] == "fallback"
    assert "retry_policy" not in infer["route"]
    clusters = {c["name"]: c for c in built["static_resources"]["clusters"]}
    assert len(clusters["guard_cnn_fallback"]["load_assignment"]["endpoints"]) == 1


def test_ext_proc_observer_is_off_on_unsampled_clusters_and_has_its_cluster(tmp_path):
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                "reference": upstream("ref"), "mirror": {"sample_rate": 0.05}}],
                    observer="ext_proc")
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    assert bootstrap.EXT_PROC_FILTER in filters_of(built)
    assert bootstrap.TAP_FILTER not in filters_of(built)
    assert bootstrap.OBSERVER_CLUSTER in clusters_of(built)
    routes = {r["name"]: r for r in routes_of(built)}
    entries = {c["name"]: c for c in routes["cnn_infer"]["route"]["weighted_clusters"]["clusters"]}
    assert "typed_per_filter_config" not in entries["guard_cnn_primary_sampled"]
    assert entries["guard_cnn_primary"]["typed_per_filter_config"][
        bootstrap.EXT_PROC_FILTER]["disabled"] is True
    assert routes["health"]["typed_per_filter_config"][bootstrap.EXT_PROC_FILTER]["disabled"]


def test_without_sampling_the_chain_has_no_observing_filter(tmp_path):
    """Mirroring off: nothing to observe, so nothing per call for an observer to skip."""
    for observer in ("tap", "ext_proc"):
        loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                    "reference": upstream("ref"),
                                    "mirror": {"sample_rate": 0.0}}], observer=observer)
        built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
        assert filters_of(built) == ["envoy.filters.http.router"]
        assert bootstrap.OBSERVER_CLUSTER not in clusters_of(built)
        assert "typed_per_filter_config" not in json.dumps(built)


def test_several_models_are_routed_by_the_model_name_in_the_body(tmp_path):
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn")},
                               {"name": "v.2", "primary": upstream("v.2")}])
    built, layout = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    assert filters_of(built)[:2] == [bootstrap.EXTRACTION_FILTER, "envoy.filters.http.lua"]
    routes = {r["name"]: r for r in routes_of(built)}
    # No reference: nothing to observe, no sampled twin, ext_proc off everywhere.
    assert [c["name"] for c in routes["cnn_infer"]["route"]["weighted_clusters"]["clusters"]] \
        == ["guard_cnn_primary"]
    matcher = routes["v_d2_infer"]["match"]["dynamic_metadata"][0]
    assert matcher["path"] == [{"key": "model_name"}]
    assert matcher["value"]["list_match"]["one_of"]["string_match"]["exact"] == "v.2"
    assert set(layout.clusters) == {"guard_cnn_primary", "guard_v_d2_primary"}


def test_several_sampled_models_keep_the_tap_for_the_route_chosen_from_the_body(tmp_path):
    """Envoy makes a call's filters for the route its headers choose, before the body names
    the model: there (the server-wide route) the tap must not be off, or no call is ever
    traced; the sampled twins mark their answers and the tap keeps only those."""
    sampled = {"reference": upstream("ref"), "mirror": {"sample_rate": 0.5}}
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"), **sampled},
                               {"name": "rec", "primary": upstream("rec"), **sampled}])
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    assert filters_of(built)[:3] == [bootstrap.EXTRACTION_FILTER, bootstrap.LUA_FILTER,
                                     bootstrap.TAP_FILTER]
    routes = {r["name"]: r for r in routes_of(built)}
    assert "typed_per_filter_config" not in routes["server"]
    entries = {c["name"]: c for c in routes["cnn_infer"]["route"]["weighted_clusters"]["clusters"]}
    assert [h["header"]["key"] for h in entries["guard_cnn_primary_sampled"][
        "response_headers_to_add"]] == ["guard-route", bootstrap.SAMPLED_HEADER]
    # Metadata calls share the clusters but are never compared: unmarked.
    for route in ("cnn_other", "server"):
        assert bootstrap.SAMPLED_HEADER not in json.dumps(routes[route])


def test_tokens_keep_different_names_apart():
    names = ["a.b", "a_b", "a_db", "a__b", "a-b"]
    assert len({bootstrap.token(n) for n in names}) == len(names)
    assert all("." not in bootstrap.token(n) for n in names)


def test_tls_on_the_listener(tmp_path):
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("-")
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn")}],
                    tls={"cert_file": "cert.pem", "key_file": "key.pem",
                         "client_ca_file": "ca.pem"})
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    socket = built["static_resources"]["listeners"][0]["filter_chains"][0]["transport_socket"]
    context = socket["typed_config"]
    assert context["require_client_certificate"] is True
    assert context["common_tls_context"]["alpn_protocols"] == ["h2"]
    assert context["common_tls_context"]["tls_certificates"][0]["certificate_chain"][
        "filename"] == str(tmp_path / "cert.pem")


def test_calls_are_counted_by_an_access_log_on_modelinfer_only(tmp_path):
    """The gRPC status count of guard's request metrics: Envoy's stats logger at each call's
    end (not the grpc_stats filter: guard/envoy/bootstrap.py says why), tagged by cluster and
    status number, for ModelInfer calls only (metadata and readiness share the clusters)."""
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn")}])
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    manager = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert "envoy.filters.http.grpc_stats" not in filters_of(built)
    (counter,) = manager["access_log"]
    assert counter["name"] == "envoy.access_loggers.stats"
    assert counter["filter"]["header_filter"]["header"] == {
        "name": ":path", "string_match": {"exact": bootstrap.MODEL_INFER}}
    (stat,) = counter["typed_config"]["counters"]
    assert {t["name"]: t["value_format"] for t in stat["stat"]["tags"]} == {
        "cluster": "%UPSTREAM_CLUSTER%", "code": "%GRPC_STATUS_NUMBER%"}
    # With a fallback the primary can stand in for: the answering endpoint's route too.
    loaded = config(tmp_path, [{"name": "cnn", "primary": upstream("cnn"),
                                "fallback": upstream("cnn", "127.0.0.1:9002")}])
    built, _ = bootstrap.build(loaded, bootstrap.Ports(8001, 0, 8005, 8006))
    (counter,) = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["access_log"]
    (stat,) = counter["typed_config"]["counters"]
    assert {t["name"]: t["value_format"] for t in stat["stat"]["tags"]}["route"] == \
        bootstrap.ROUTE_METADATA


# -- stats ----------------------------------------------------------------------------------------
ENVOY_TEXT = """\
# TYPE envoy_cluster_grpc_ModelInfer_0 counter
envoy_cluster_grpc_ModelInfer_0{envoy_grpc_bridge_method="GRPCInferenceService",envoy_grpc_bridge_service="inference",envoy_cluster_name="guard_cnn_primary"} 4
# TYPE envoy_cluster_grpc_ModelInfer_5 counter
envoy_cluster_grpc_ModelInfer_5{envoy_grpc_bridge_method="GRPCInferenceService",envoy_grpc_bridge_service="inference",envoy_cluster_name="guard_cnn_fallback"} 2
# TYPE envoy_cluster_upstream_rq_time histogram
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="guard_cnn_primary",le="1"} 1
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="guard_cnn_primary",le="10"} 3
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="guard_cnn_primary",le="+Inf"} 4
envoy_cluster_upstream_rq_time_sum{envoy_cluster_name="guard_cnn_primary"} 8.5
envoy_cluster_upstream_rq_time_count{envoy_cluster_name="guard_cnn_primary"} 4
envoy_cluster_upstream_rq_time_bucket{envoy_cluster_name="guard_cnn_primary_sampled",le="10"} 2
envoy_cluster_upstream_rq_time_count{envoy_cluster_name="guard_cnn_primary_sampled"} 2
envoy_cluster_upstream_rq_time_count{envoy_cluster_name="someone_elses"} 9
"""


def translated(envoy_text: str) -> dict:
    """guard's metrics from ``envoy_text`` for model cnn's three clusters: (name, sorted label
    pairs) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = translate(envoy_text, {"guard_cnn_primary": ("cnn", "primary"),
                                  "guard_cnn_primary_sampled": ("cnn", "primary"),
                                  "guard_cnn_fallback": ("cnn", "fallback")})
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_envoy_stats_become_guards_request_metrics():
    samples = translated(ENVOY_TEXT)
    assert samples[("guard_requests_total", (("model", "cnn"), ("route", "primary")))] == 4
    assert samples[("guard_request_errors_total", (("code", "NOT_FOUND"), ("model", "cnn")))] \
        == 2
    bucket = ("guard_request_duration_seconds_bucket",
              (("le", "0.01"), ("model", "cnn"), ("route", "primary")))
    assert samples[bucket] == 3 + 2  # 10 ms in Envoy's buckets: 0.01 s in guard's; both
    # clusters of the route (the sampled twin and the other) add up
    assert samples[("guard_request_duration_seconds_count",
                    (("model", "cnn"), ("route", "primary")))] == 4 + 2
    assert samples[("guard_request_duration_seconds_sum",
                    (("model", "cnn"), ("route", "primary")))] == pytest.approx(0.0085)
    assert not any("someone" in str(key) for key in samples)


# guard's own Envoy counts calls with its access log (tags as labels); istio-proxy with grpc_stats
# (ENVOY_TEXT above). A call its client cancelled ends with no status: code "", not counted (the
# Python data plane counts no error for it either); one past its deadline is Envoy's 4.
ACCESS_LOG_TEXT = """\
# TYPE envoy_guard_calls_grpc counter
envoy_guard_calls_grpc{cluster="guard_cnn_primary",code="0"} 4
envoy_guard_calls_grpc{cluster="guard_cnn_primary_sampled",code="0"} 1
envoy_guard_calls_grpc{cluster="guard_cnn_primary",code="14"} 2
envoy_guard_calls_grpc{cluster="guard_cnn_fallback",code="3"} 1
envoy_guard_calls_grpc{cluster="guard_cnn_fallback",code=""} 1
envoy_guard_calls_grpc{cluster="guard_cnn_fallback",code="4"} 1
envoy_guard_calls_grpc{cluster="guard_cnn_fallback",code="0",route="fallback"} 3
envoy_guard_calls_grpc{cluster="guard_cnn_fallback",code="0",route="primary"} 7
envoy_guard_calls_grpc{cluster="someone_elses",code="0"} 9
"""


def test_the_access_logs_call_counts_become_guards_request_metrics():
    """By the endpoint that answered where the counter says it: the fallback's cluster answers
    from the primary standing in while the fallback is down (bootstrap.serving_cluster)."""
    samples = translated(ACCESS_LOG_TEXT)
    assert samples[("guard_requests_total", (("model", "cnn"), ("route", "primary")))] == \
        4 + 1 + 7
    assert samples[("guard_requests_total", (("model", "cnn"), ("route", "fallback")))] == 3
    errors = {dict(labels)["code"]: value for (name, labels), value in samples.items()
              if name == "guard_request_errors_total"}
    assert errors == {"UNAVAILABLE": 2, "INVALID_ARGUMENT": 1, "DEADLINE_EXCEEDED": 1}
    assert not any("someone" in str(key) for key in samples)


# -- hand-off --------------------------------------------------------------------------------
@dataclass
class Model:
    """The three things the hand-off reads of a served model."""

    slot: int
    mirror_rate: float
    capture_rate: float
    route: str = "primary"
    probing: bool = False

    def route_word(self):
        return self.route, 3, self.probing


def observed(model: str, route: str = "primary", status: int | None = 0) -> ObservedCall:
    request = pb.ModelInferRequest(model_name=model, id="r-1").SerializeToString()
    response = pb.ModelInferResponse(model_name=model, id="r-1").SerializeToString()
    return ObservedCall(path=MODEL_INFER, request_id="r-1", traceparent="00-ab-cd-01",
                        route=route, request=request, response=response, grpc_status=status,
                        seconds=0.002)


def test_an_observed_call_goes_into_the_ring_as_the_upstream_path_would_put_it():
    ring = SampleRing(1 << 20)
    models = {"cnn": Model(slot=2, mirror_rate=0.1, capture_rate=0.0),
              "rec": Model(slot=4, mirror_rate=0.0, capture_rate=1.0, route="fallback")}
    hand_off = HandOff(lambda: models, ring, GuardMetrics("test"))
    call = observed("cnn")
    hand_off.on_call(call)
    hand_off.on_call(observed("cnn", status=5))  # an error answer: nothing to compare
    hand_off.on_call(observed("unknown"))
    hand_off.on_call(observed("rec", route="fallback"))  # capture only, also on the fallback
    records = []
    while (record := ring.take()) is not None:
        records.append(wire.decode(bytes(record)))
    assert [(r.model, r.flags, r.route, r.slot, r.epoch) for r in records] == [
        ("cnn", wire.MIRROR, "primary", 2, 3), ("rec", wire.CAPTURE, "fallback", 4, 3)]
    first = records[0]
    assert first.payload == wire.Messages(call.request, call.response)
    assert (first.request_id, first.traceparent) == ("r-1", "00-ab-cd-01")
    ring.close()


def test_on_the_fallback_only_probing_calls_are_mirrored():
    ring = SampleRing(1 << 20)
    model = Model(slot=0, mirror_rate=1.0, capture_rate=0.0, route="fallback")
    hand_off = HandOff(lambda: {"cnn": model}, ring, GuardMetrics("test"))
    hand_off.on_call(observed("cnn", route="fallback"))
    assert ring.take() is None
    model.probing = True
    hand_off.on_call(observed("cnn", route="fallback"))
    assert wire.decode(bytes(ring.take())).route == "fallback"
    ring.close()


def test_the_primary_standing_in_for_a_fallback_that_is_down_is_a_probe_while_probing():
    """The primary's answers while the route is the fallback (its endpoint said
    ``guard-route: primary``: a fallback that is down) are sampled as the fallback's calls are:
    mirrored only while the route probes, then as the primary's (probes as it answered, the
    only ones there are while the fallback is down); captured at the capture rate."""
    ring = SampleRing(1 << 20)
    model = Model(slot=0, mirror_rate=1.0, capture_rate=0.0, route="fallback")
    hand_off = HandOff(lambda: {"cnn": model}, ring, GuardMetrics("test"))
    hand_off.on_call(observed("cnn", route="primary"))  # the dwell: nothing mirrored
    assert ring.take() is None
    model.probing = True
    hand_off.on_call(observed("cnn", route="primary"))
    record = wire.decode(bytes(ring.take()))
    assert (record.route, record.flags) == ("primary", wire.MIRROR)
    ring.close()


def test_a_full_ring_drops_the_observed_call_and_counts_it_as_the_request_path_does():
    ring = SampleRing(64)  # smaller than any record: every put is refused
    metrics = GuardMetrics("test")
    models = {"cnn": Model(slot=0, mirror_rate=1.0, capture_rate=0.0),
              "rec": Model(slot=1, mirror_rate=1.0, capture_rate=1.0)}
    hand_off = HandOff(lambda: models, ring, metrics)
    for _ in range(2):
        hand_off.on_call(observed("cnn"))
    hand_off.on_call(observed("rec"))
    value = metrics.registry.get_sample_value
    assert value("guard_mirror_total", {"model": "cnn", "outcome": "dropped"}) == 2
    assert value("guard_mirror_total", {"model": "rec", "outcome": "dropped"}) == 1
    assert value("guard_capture_records_total", {"model": "rec", "outcome": "dropped"}) == 1
    # a model that does not capture gets no capture series
    assert value("guard_capture_records_total", {"model": "cnn", "outcome": "dropped"}) is None
    assert hand_off.handed == 0 and ring.take() is None
    ring.close()


# -- guard deploy envoy ---------------------------------------------------------------------------
def test_deploy_envoy_prints_the_bootstrap_and_refuses_ports_chosen_at_start(tmp_path, capsys):
    from guard.cli import main

    sampled = {"name": "cnn", "primary": upstream("cnn"), "reference": upstream("ref"),
               "mirror": {"sample_rate": 0.1}}
    config(tmp_path, [sampled], observer="ext_proc")
    path = str(tmp_path / "guard.yaml")
    assert main(["deploy", "envoy", path, "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    clusters = {c["name"]: c for c in printed["static_resources"]["clusters"]}
    observer = clusters[bootstrap.OBSERVER_CLUSTER]["load_assignment"]["endpoints"][0]
    assert observer["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": 8005}

    config(tmp_path, [sampled], envoy={"observer_port": 0, "observer": "ext_proc"})
    assert main(["deploy", "envoy", path]) == 2
    assert "server.envoy.observer_port: 0" in capsys.readouterr().err
    # The tap needs no port of guard's: Envoy's admin API is where guard attaches it.
    config(tmp_path, [sampled], envoy={"observer_port": 0})
    assert main(["deploy", "envoy", path]) == 0
    assert bootstrap.TAP_FILTER in capsys.readouterr().out


def test_envoy_modes_listeners_share_no_port_with_guards(tmp_path):
    """Envoy's admin API and guard's loopback servers beside it are listeners too: the same
    port as another is refused at validation (serve failed at start, blaming another
    process)."""
    lines = problems(tmp_path, [{"name": "cnn", "primary": upstream("cnn")}],
                     admin_port=18003, envoy={"health_port": 18003})
    assert lines == ["server.envoy.health_port: 18003 is server.admin_port too; each "
                     "listener needs a port of its own"]
