"""Envoy mode for generation models without Envoy: what validate refuses, the OpenAI-compatible
listener of the bootstrap, Envoy's HTTP stats under guard's names, and a traced call (the tap's
JSON trace of an SSE or a whole answer) into a real sample ring as a GenerationSample. What a
real Envoy in front of a real llama-cpp-python server does is tests/e2e/test_envoy_llm.py's."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field

from test_envoy_mode import config as envoy_config
from test_envoy_mode import problems as envoy_problems

from guard.envoy import bootstrap, openai_listener
from guard.envoy.hand_off import HandOff
from guard.envoy.stats import http_outcome, translate
from guard.envoy.tap_filter import observe_trace
from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.observe.metrics import GuardMetrics
from guard.protocol import openai as api

PORTS = bootstrap.Ports(8001, 0, 8005, 8006, 8080, 8008)


def llm(name: str, target: str = "http://127.0.0.1:8081", served: str | None = None,
        **options) -> dict:
    block = {"backend": "openai", "target": target, "model": served or name}
    if options:
        block["options"] = options
    return block


def generation(name: str = "smol", rate: float = 0.05, fallback: dict | None = None,
               **primary) -> dict:
    model = {"name": name, "task": "generation", "primary": llm(name, **primary),
             "reference": llm(name), "mirror": {"sample_rate": rate}}
    if fallback is not None:
        model["fallback"] = fallback
    return model


def config(tmp_path, models: list[dict], **server):
    """An Envoy-mode config (tests/unit/test_envoy_mode.py's) with the HTTP port set."""
    return envoy_config(tmp_path, models, **{"http_port": 8080, **server})


def problems(tmp_path, models, **server) -> list[str]:
    return envoy_problems(tmp_path, models, **{"http_port": 8080, **server})


# -- validate ------------------------------------------------------------------------------------
def test_an_upstream_serving_another_name_is_refused_and_python_mode_takes_it(tmp_path):
    model = generation(fallback=llm("smol", "http://127.0.0.1:8082", served="smol-q8"))
    (line,) = problems(tmp_path, [model])
    assert line.startswith("models[0].fallback.model: 'smol-q8' differs from the name clients "
                           "send ('smol'); Envoy forwards \"model\" in the JSON body unchanged")
    assert "server.data_plane: python" in line  # the forwarder that rewrites it both ways
    assert config(tmp_path, [model], data_plane="python").models[0].fallback.model == "smol-q8"


def test_what_envoy_cannot_do_to_an_llm_call_is_refused_by_key(tmp_path):
    lines = problems(tmp_path, [generation(sample_logprobs=5, sample_token_ids=True,
                                           api_key_env="KEY")])
    assert [line.split(":")[0] for line in lines] == [
        "models[0].primary.options.sample_logprobs", "models[0].primary.options.sample_token_ids",
        "models[0].primary.options.api_key_env"]
    (line,) = problems(tmp_path, [generation(fallback=llm("smol", "http://h:1/other/v1"))])
    assert line.startswith("models[0].fallback.target: its path ('/other') differs from the "
                           "primary's ('')")
    (line,) = problems(tmp_path, [generation()], envoy={"observer": "ext_proc"})
    assert line.startswith("models[0]: generation models are observed through Envoy's tap")
    (line,) = problems(tmp_path, [generation()], envoy={"attach_admin_port": 15000})
    assert line.startswith("models[0]: an attached Envoy (server.envoy.attach_admin_port)")


# -- the bootstrap ---------------------------------------------------------------------------------
def listeners(built: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in built["static_resources"]["listeners"]}


def manager(listener: dict) -> dict:
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def http_routes(built: dict) -> dict[str, dict]:
    routes = manager(listeners(built)["guard_http"])["route_config"]["virtual_hosts"][0]
    return {route["name"]: route for route in routes["routes"]}


def clusters(built: dict) -> dict[str, dict]:
    return {c["name"]: c for c in built["static_resources"]["clusters"]}


def test_one_generation_model_is_forwarded_without_a_body_parse_and_sampled_by_request_id(
        tmp_path):
    loaded = config(tmp_path, [generation(
        fallback=llm("smol", "http://127.0.0.1:8082/v1", timeout_s=20, read_timeout_s=9),
        timeout_s=30, read_timeout_s=7,
        connect_timeout_s=2, max_connections=4)])
    built, layout = bootstrap.build(loaded, PORTS, {"smol": "fallback"})
    http = listeners(built)["guard_http"]
    assert http["address"]["socket_address"]["port_value"] == 8080
    filters = [f["name"] for f in manager(http)["http_filters"]]
    # No body read; the tap, and the Lua that takes the sampled twins' mark out of answers.
    assert filters == [bootstrap.LUA_FILTER, bootstrap.TAP_FILTER, "envoy.filters.http.router"]
    assert "per_connection_buffer_limit_bytes" not in http
    # The gRPC listener keeps guard's health and has nothing of the generation model's.
    grpc = manager(listeners(built)["guard_grpc"])
    assert [r["name"] for r in grpc["route_config"]["virtual_hosts"][0]["routes"]] == ["health"]
    assert [f["name"] for f in grpc["http_filters"]] == ["envoy.filters.http.router"]
    routes = http_routes(built)
    for path in openai_listener.GUARD_PATHS:  # health and the model list: guard's own server
        (route,) = [r for r in routes.values() if r["match"] == {"path": path}]
        assert route["route"]["cluster"] == openai_listener.HEALTH_CLUSTER
        assert route["typed_per_filter_config"][bootstrap.TAP_FILTER]["disabled"] is True
    health = clusters(built)[openai_listener.HEALTH_CLUSTER]
    assert health["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8008}
    action = routes["smol_generate"]["route"]
    assert routes["smol_generate"]["match"] == {"safe_regex": {"regex": openai_listener.CALLS}}
    # One route for both upstreams: the longer of their limits.
    assert action["timeout"] == "30.0s" and action["idle_timeout"] == "9.0s"
    assert action["hash_policy"] == [{"header": {"header_name": "x-request-id"}}]
    entries = {c["name"]: c for c in action["weighted_clusters"]["clusters"]}
    # Each answer names the endpoint that answered: in the fallback's cluster the primary
    # stands in (one priority lower, the route's one retry) while the fallback is down.
    assert {name: c["response_headers_to_add"][0]["header"]["value"]
            for name, c in entries.items()} == {
        "guard_smol_primary": "primary", "guard_smol_primary_sampled": "primary",
        "guard_smol_fallback": bootstrap.ROUTE_METADATA,
        "guard_smol_fallback_sampled": bootstrap.ROUTE_METADATA}
    assert action["retry_policy"] == bootstrap.SPILL_RETRY
    # The Host the answering endpoint's authority (its hostname), the primary's standing in.
    assert action["auto_host_rewrite"] is True
    endpoints = [(e.get("priority", 0), lb["endpoint"]["hostname"],
                  lb["metadata"]["filter_metadata"]["guard"]["route"])
                 for e in clusters(built)["guard_smol_fallback"]["load_assignment"]["endpoints"]
                 for lb in e["lb_endpoints"]]
    assert endpoints == [(0, "127.0.0.1:8082", "fallback"), (1, "127.0.0.1:8081", "primary")]
    # The tap (and the mark's Lua) only on the sampled twins, whose answers come uncompressed
    # and marked for the tap.
    for name, entry in entries.items():
        sampled = name.endswith("_sampled")
        assert set(entry.get("typed_per_filter_config", {})) == (
            set() if sampled else {bootstrap.TAP_FILTER, bootstrap.LUA_FILTER})
        assert entry.get("request_headers_to_remove") == (["accept-encoding"] if sampled
                                                          else None)
        marks = [h["header"] for h in entry["response_headers_to_add"]
                 if h["header"]["key"] == bootstrap.SAMPLED_HEADER]
        assert marks == ([{"key": "guard-sampled", "value": "1"}] if sampled else [])
    # Started on the fallback, 5% on its sampled twin: the gRPC listener's runtime keys.
    static = built["layered_runtime"]["layers"][0]["static_layer"]
    assert static == {"guard.smol.route.guard_smol_primary": 0,
                      "guard.smol.route.guard_smol_primary_sampled": 0,
                      "guard.smol.route.guard_smol_fallback": 950_000,
                      "guard.smol.route.guard_smol_fallback_sampled": 50_000}
    primary = clusters(built)["guard_smol_primary"]
    assert primary["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"] == {
        "http_protocol_options": {}}  # HTTP/1.1: what every OpenAI-compatible server speaks
    assert primary["connect_timeout"] == "2s"
    assert primary["circuit_breakers"]["thresholds"][0]["max_connections"] == 4
    assert set(entries) <= set(layout.clusters) and layout.observer == "tap"
    assert layout.clusters["guard_smol_fallback_sampled"] == ("smol", "fallback")


def test_several_models_are_routed_by_the_model_name_in_the_json_body(tmp_path):
    loaded = config(tmp_path, [
        generation("smol"),
        generation("big.one", rate=0.0, target="https://llm.example.com/api/v1"),
        {"name": "cnn", "primary": {"backend": "upstream", "target": "127.0.0.1:9001",
                                    "model": "cnn"}}])
    built, layout = bootstrap.build(loaded, PORTS)
    http = listeners(built)["guard_http"]
    filters = manager(http)["http_filters"]
    assert [f["name"] for f in filters] == [openai_listener.JSON_FILTER, bootstrap.LUA_FILTER,
                                            bootstrap.TAP_FILTER, "envoy.filters.http.router"]
    lua = filters[1]["typed_config"]["default_source_code"]["inline_string"]
    assert "clearRouteCache" in lua and 'remove("guard-sampled")' in lua
    # A call's filters are made for the route its headers choose (here, before the body is
    # read: a 400/404 route), so the tap must stay on there; the mark says what it keeps.
    for name in ("body_not_json", "body_no_model", "unknown_model"):
        assert "typed_per_filter_config" not in http_routes(built)[name]
    rules = filters[0]["typed_config"]["request_rules"]
    assert rules["rules"][0]["selectors"] == [{"key": "model"}]
    assert "application/json" in rules["allow_content_types"]
    assert http["per_connection_buffer_limit_bytes"] == loaded.server.max_message_bytes
    routes = http_routes(built)
    names = list(routes)
    # Bad bodies first, then each model by the name in its body, then an unknown name.
    assert names.index("body_not_json") < names.index("smol_generate") < \
        names.index("unknown_model")
    assert routes["smol_generate"]["match"]["dynamic_metadata"] == [{
        "filter": openai_listener.JSON_FILTER, "path": [{"key": "model"}],
        "value": {"string_match": {"exact": "smol"}}}]
    unknown = routes["unknown_model"]["direct_response"]
    assert unknown["status"] == 404
    assert json.loads(unknown["body"]["inline_string"])["error"]["code"] == "model_not_found"
    assert routes["body_no_model"]["direct_response"]["status"] == 400
    # An https upstream under a path: TLS with its name, the Host it expects, the path kept.
    big = routes["big_done_generate"]["route"]
    assert big["auto_host_rewrite"] is True
    assert clusters(built)["guard_big_done_primary"]["load_assignment"]["endpoints"][0][
        "lb_endpoints"][0]["endpoint"]["hostname"] == "llm.example.com"
    assert big["regex_rewrite"] == {"pattern": {"regex": "^/"}, "substitution": "/api/"}
    # Any other POST: the same clusters by the same weights, refused alike, never observed.
    assert names.index("unknown_model") < names.index("other_body_not_json") < \
        names.index("smol_other") < names.index("other_unknown_model")
    other = routes["smol_other"]
    assert other["match"]["headers"] == [{"name": ":method",
                                          "string_match": {"exact": "POST"}}]
    assert other["match"]["dynamic_metadata"] == routes["smol_generate"]["match"][
        "dynamic_metadata"]
    checked = routes["smol_generate"]["route"]["weighted_clusters"]["clusters"]
    unchecked = other["route"]["weighted_clusters"]["clusters"]
    assert [(c["name"], c["weight"]) for c in unchecked] == [(c["name"], c["weight"])
                                                             for c in checked]
    assert all("guard-sampled" not in json.dumps(c) and c.get("typed_per_filter_config")
               for c in unchecked)
    assert routes["big_done_other"]["route"]["regex_rewrite"] == big["regex_rewrite"]
    assert other["stat_prefix"] == "guard_other_smol"  # its calls counted (stats.py)
    tls = clusters(built)["guard_big_done_primary"]
    assert tls["transport_socket"]["typed_config"]["sni"] == "llm.example.com"
    assert tls["type"] == "STRICT_DNS"
    assert tls["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"] == {"address": "llm.example.com", "port_value": 443}
    # The OIP model keeps its gRPC listener, with no observing filter (it does not sample).
    grpc = manager(listeners(built)["guard_grpc"])
    assert [f["name"] for f in grpc["http_filters"]] == ["envoy.filters.http.router"]
    assert layout.clusters["guard_cnn_primary"] == ("cnn", "primary")


ENVOY_HTTP = """\
# TYPE envoy_guard_http_calls counter
envoy_guard_http_calls{cluster="guard_smol_primary",code="200",flags="-"} 5
envoy_guard_http_calls{cluster="guard_smol_primary_sampled",code="200",flags="-"} 2
envoy_guard_http_calls{cluster="guard_smol_primary",code="404",flags="-"} 1
envoy_guard_http_calls{cluster="guard_smol_fallback",code="503",flags="UF,URX"} 3
envoy_guard_http_calls{cluster="guard_smol_primary",code="200",flags="UC"} 2
envoy_guard_http_calls{cluster="guard_smol_primary_sampled",code="200",flags="DC"} 1
envoy_guard_http_calls{cluster="guard_smol_primary",code="200",flags="UC,DC"} 1
envoy_guard_http_calls{cluster="guard_smol_primary",code="200",flags="SI"} 1
envoy_guard_http_calls{cluster="guard_http_health",code="200",flags="-"} 7
envoy_guard_http_calls{cluster="",code="404",flags="NR"} 4
envoy_guard_http_calls{cluster="",code="404",flags="-"} 2
envoy_guard_http_calls{cluster="",code="413",flags="-"} 1
# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="guard_smol_primary"} 9
# TYPE envoy_vhost_route_upstream_rq counter
envoy_vhost_route_upstream_rq{envoy_response_code="200",envoy_virtual_host="guard_http",envoy_route="guard_other_smol"} 3
# TYPE envoy_vhost_route_upstream_rq_total counter
envoy_vhost_route_upstream_rq_total{envoy_virtual_host="guard_http",envoy_route="guard_other_smol"} 4
envoy_vhost_route_upstream_rq_total{envoy_virtual_host="guard_http",envoy_route="elsewhere"} 9
"""


def test_envoy_http_stats_become_guards_request_metrics_by_how_each_call_ended():
    """Each call counted once, at its end, as the Python edge counts it: a 200 whose stream
    the upstream cut short UNAVAILABLE (Envoy's cluster counts it answered, at its headers), a
    stream idle past its timeout DEADLINE_EXCEEDED; Envoy's own refusals (no cluster) under
    ``_unknown``; calls of guard's health routes and of no route (NR) not at all."""
    from prometheus_client.parser import text_string_to_metric_families

    layout = {"guard_smol_primary": ("smol", "primary"),
              "guard_smol_primary_sampled": ("smol", "primary"),
              "guard_smol_fallback": ("smol", "fallback")}
    text = translate(ENVOY_HTTP, layout, {"guard_other_smol": "smol"})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    requests = {dict(k[1])["route"]: v for k, v in samples.items()
                if k[0] == "guard_requests_total"}
    assert requests == {"primary": 9}  # a client that left counts answered (stats.py)
    errors = {(dict(k[1])["model"], dict(k[1])["code"]): v for k, v in samples.items()
              if k[0] == "guard_request_errors_total"}
    assert errors == {("smol", "NOT_FOUND"): 1, ("smol", "UNAVAILABLE"): 5,
                      ("smol", "DEADLINE_EXCEEDED"): 1,
                      ("_unknown", "NOT_FOUND"): 2, ("_unknown", "RESOURCE_EXHAUSTED"): 1}
    # The calls its route for other endpoints sent upstream: forwarded, never checked.
    unchecked = {dict(k[1])["model"]: v for k, v in samples.items()
                 if k[0] == "guard_generation_not_comparable_total"
                 and dict(k[1])["reason"] == "endpoint"}
    assert unchecked == {"smol": 4}


def test_an_http_call_is_answered_with_a_2xx_and_no_flag_of_an_answer_cut_short():
    assert http_outcome(200, "-") is None
    assert http_outcome(206, "-") is None
    assert http_outcome(200, "UC") == "UNAVAILABLE"
    assert http_outcome(200, "DC") is None  # maybe right after [DONE]: stats.py
    assert http_outcome(200, "UC,DC") is None
    assert http_outcome(200, "UT") == "DEADLINE_EXCEEDED"
    assert http_outcome(503, "UF") == "UNAVAILABLE"
    assert http_outcome(429, "-") == "RESOURCE_EXHAUSTED"


# -- a traced call into the ring --------------------------------------------------------------
@dataclass
class Model:
    """What the hand-off reads of a served model."""

    slot: int
    mirror_rate: float = 1.0
    capture_rate: float = 0.0
    route: str = "primary"
    config: object = field(default_factory=lambda: _Config())

    def route_word(self):
        return self.route, 7, False


@dataclass
class _Config:
    task: str = "generation"


def chunk(text: str, finish: str | None = None) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "smol",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def sse(chunks: list[dict], done: bool = True, line_end: bytes = b"\n") -> bytes:
    events = [b"data: " + json.dumps(c).encode() + line_end * 2 for c in chunks]
    return b"".join(events) + (b"data: [DONE]" + line_end * 2 if done else b"")


def trace(body: dict, answer: bytes, *, status: str = "200",
          content_type: str = "text/event-stream", path: str = "/v1/chat/completions",
          truncated: bool = False) -> dict:
    def headers(values: dict) -> list[dict]:
        return [{"key": k, "value": v} for k, v in values.items()]

    return {"http_buffered_trace": {
        "request": {"headers": headers({":path": path, ":method": "POST",
                                        "x-request-id": "req-9", "traceparent": "00-aa-bb-01"}),
                    "body": {"as_bytes": base64.b64encode(json.dumps(body).encode()).decode(),
                             "truncated": False}},
        "response": {"headers": headers({":status": status, "content-type": content_type,
                                         "guard-route": "primary",
                                         "x-envoy-upstream-service-time": "40"}),
                     "body": {"as_bytes": base64.b64encode(answer).decode(),
                              "truncated": truncated}}}}


CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Capital of France?"}],
        "temperature": 0, "stream": True}


def handed(traces: list[dict], models: dict) -> tuple[list[wire.Sample], GuardMetrics, list]:
    ring, metrics = SampleRing(1 << 20), GuardMetrics("test")
    hand_off = HandOff(lambda: models, ring, metrics)
    outcomes = [observe_trace(t, hand_off.on_call) for t in traces]
    records = []
    while (record := ring.take()) is not None:
        records.append(wire.decode(bytes(record)))
    ring.close()
    return records, metrics, outcomes


def test_a_traced_stream_becomes_the_sample_the_python_edge_would_make():
    chunks = [{"id": "c1", "model": "smol", "choices": [{"delta": {"role": "assistant"}}]},
              chunk(" Paris"), chunk(" is"), chunk("", finish="stop")]
    body = sse(chunks, line_end=b"\r\n")
    (record,), _, outcomes = handed([trace(CHAT, body)], {"smol": Model(slot=3)})
    assert outcomes == ["complete"]
    assert (record.model, record.slot, record.route, record.epoch, record.flags) == (
        "smol", 3, "primary", 7, wire.MIRROR)
    assert (record.request_id, record.traceparent) == ("req-9", "00-aa-bb-01")
    sample = record.payload.call
    assert sample.completion_text == " Paris is" and sample.finish_reason == "stop"
    assert sample.streamed and sample.sampling.greedy and sample.request_seconds == 0.04
    assert sample.messages[0]["content"] == "Capital of France?"
    # The edge gathers the same events as they pass, cut wherever the connection cut them.
    rng, completion = random.Random(5), api.Completion()
    splitter, at = api.EventSplitter(), 0
    while at < len(body):
        step = rng.randrange(1, 40)
        for event in splitter.feed(body[at:at + step]):
            data = api.event_data(event)
            if data is not None and data != api.DONE:
                api.gather_event(completion, "chat", data)
        at += step
    assert "".join(completion.text) == sample.completion_text


def test_a_whole_answer_is_sampled_and_what_cannot_be_compared_is_counted():
    whole = {"id": "c2", "model": "smol", "choices": [{"index": 0, "finish_reason": "length",
                                                        "text": " Paris."}]}
    completion = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 3}
    traces = [
        trace(completion, json.dumps(whole).encode(), content_type="application/json",
              path="/v1/completions?x=1"),
        trace(dict(CHAT, best_of=2), sse([chunk("a")])),  # the best of two: no sample
        trace(CHAT, sse([chunk("cut")], done=False)),  # the client went away mid-stream
        trace(CHAT, b'{"error": {"message": "busy"}}', status="503",
              content_type="application/json"),
        trace(dict(CHAT, model="cnn"), sse([chunk("a")])),  # not a generation model
        trace(CHAT, b"data: {", truncated=True),  # over the tap's body limit
    ]
    models = {"smol": Model(slot=0),
              "cnn": Model(slot=1, config=_Config("classification"))}
    records, metrics, outcomes = handed(traces, models)
    assert [r.payload.call.completion_text for r in records] == [" Paris."]
    assert not records[0].payload.call.streamed
    assert outcomes == ["complete"] * 5 + ["too_large"]
    value = metrics.registry.get_sample_value
    assert {reason: value("guard_generation_not_comparable_total",
                          {"model": "smol", "reason": reason})
            for reason in ("n", "incomplete", "upstream_error")} == {
        "n": 1, "incomplete": 1, "upstream_error": 1}


def test_a_traced_call_naming_no_model_is_the_one_generation_models_sample():
    """A client of a one-model server may leave ``model`` out (vLLM and llama.cpp's servers
    answer it): Envoy routes it to the one generation model without reading the body, and the
    hand-off samples it as that model's, as the Python edge does. With several generation
    models Envoy answers it 400 itself, and nothing is handed on."""
    unnamed = {k: v for k, v in CHAT.items() if k != "model"}
    answer = sse([chunk(" Paris"), chunk("", finish="stop")])
    one = {"smol": Model(slot=2), "cnn": Model(slot=1, config=_Config("classification"))}
    records, _, _ = handed([trace(unnamed, answer), trace(dict(unnamed, model=None), answer)],
                           one)
    assert [(r.model, r.slot, r.payload.call.model) for r in records] == [("smol", 2, "smol")] * 2
    assert records[0].payload.call.completion_text == " Paris"
    records, _, outcomes = handed([trace(unnamed, answer)],
                                  {"smol": Model(slot=0), "big": Model(slot=1)})
    assert records == [] and outcomes == ["complete"]


def test_an_echo_call_traced_through_envoy_is_sampled_as_the_edge_samples_it():
    """lm-eval's loglikelihood call seen through Envoy's tap: vLLM's echo answer makes the
    sample the Python edge makes; llama-cpp-python's (its tokens stop at the prompt, a
    position off) is counted not comparable ``echo``."""
    from test_openai_protocol import LLAMA_CPP_PYTHON_ECHO, VLLM_ECHO

    body = {"model": "smol", "prompt": "The capital of France is Paris", "max_tokens": 1,
            "logprobs": 1, "echo": True, "temperature": 0}
    traces = [trace(body, json.dumps(answer).encode(), content_type="application/json",
                    path="/v1/completions")
              for answer in (VLLM_ECHO, LLAMA_CPP_PYTHON_ECHO)]
    (record,), metrics, outcomes = handed(traces, {"smol": Model(slot=0)})
    sample = record.payload.call
    assert sample.echo and sample.completion_text == " capital of France is Paris."
    assert outcomes == ["complete", "complete"]
    assert metrics.registry.get_sample_value("guard_generation_not_comparable_total",
                                             {"model": "smol", "reason": "echo"}) == 1


def test_deploy_envoy_prints_the_http_listener_and_needs_a_fixed_http_health_port(tmp_path,
                                                                                   capsys):
    from guard.cli import main

    config(tmp_path, [generation()])
    path = str(tmp_path / "guard.yaml")
    assert main(["deploy", "envoy", path, "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(listeners(printed)) == {"guard_grpc", "guard_http"}
    config(tmp_path, [generation()], envoy={"http_health_port": 0})
    assert main(["deploy", "envoy", path]) == 2
    assert "server.envoy.http_health_port: 0" in capsys.readouterr().err
