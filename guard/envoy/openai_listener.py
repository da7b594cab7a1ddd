"""Envoy's OpenAI-compatible HTTP listener (``server.http_port``), for generation models (backend
``openai``): the part of the bootstrap (guard/envoy/bootstrap.py) that forwards LLM calls as the
Python HTTP edge (guard/serve/openai_edge.py) does, with guard beside the path.

What it holds (docs/envoy.md, "Generation models"):

- a listener on ``server.host:http_port`` (HTTP/1.1 and h2c) whose routes send
  ``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` (the checked
  calls, guard/protocol/openai/requests.py ``PATHS``) to the model's primary or fallback
  cluster by the runtime weights guard sets (the same keys as the gRPC routes:
  ``guard.<model>.route.<cluster>``), every answer with the response header
  ``guard-route: primary|fallback``; ``/health``, ``/health/live``, ``/health/ready`` and
  ``/v1/models`` to guard's own HTTP server on loopback (``server.envoy.http_health_port``),
  so readiness on ``http_port`` means Envoy and guard (and the upstreams guard waited for);
- every other ``POST`` (embeddings, vLLM's ``/tokenize``, ``/v1/messages`` ...) to the same
  clusters by the same weights, never observed (the Python edge forwards them alike);
- per model and route a cluster over HTTP/1.1 to the ``openai`` target (TLS for https), and
  for a model that samples a twin of each, the sampled calls' (by the hash of
  ``x-request-id``, as on the gRPC listener): the tap is on for the twins only, its bodies
  buffered up to ``server.max_message_bytes`` each way (Envoy's default is 1 KiB), and the
  twins' calls go without the client's ``Accept-Encoding`` so that the traced answer is the
  events as the upstream wrote them, uncompressed;
- with several generation models, the routing by model name. The name is in the JSON body
  only (the ``openai`` package and every OpenAI client put it there), so Envoy's
  ``json_to_metadata`` filter reads the body's top-level ``model`` into dynamic metadata and the
  model's routes match it; Lua has Envoy choose the route again once the body has been read
  (the gRPC listener's re-route, for the same reason). A body that is not JSON or names no
  model is 400, a model no route knows 404 ``model_not_found``, in OpenAI's error shape, from
  Envoy itself. A header (``x-guard-model``) was the other choice: no body to buffer before
  routing, but every client would have to send it, which the OpenAI clients do not. With one
  generation model (a sidecar's usual case) neither filter runs and no body is read: every
  call goes to that model's upstream, which answers a name it does not serve itself.

Timeouts are the ``openai`` block's: ``timeout_s`` for the whole call (a stream included),
``read_timeout_s`` for a silence (the route's idle timeout), ``connect_timeout_s`` for the
connection; ``max_connections`` caps the cluster's connections.

Envoy forwards the body byte for byte, so each upstream serves the model under the name
clients send (guard/config/envoy.py refuses other names): the Python forwarder's rewrite of
``model`` both ways has no place here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from guard.backends.openai import OpenAIOptions, base_url
from guard.config import GuardConfig, ModelConfig, generation
from guard.envoy.bootstrap import (
    ROUTE_METADATA, SPILL_RETRY, Chain, Layout, Ports, _address, _cluster, can_stand_in,
    cluster_entries, counting_log, model_clusters, roles_of, routed, router_filter, token)
from guard.envoy.process import HTTP_LISTENER
from guard.envoy.stats import HTTP_SCOPE, UNCHECKED_STAT
from guard.protocol import openai as api

LISTENER = HTTP_LISTENER
HEALTH_CLUSTER = "guard_http_health"
JSON_FILTER = "envoy.filters.http.json_to_metadata"
# The calls Envoy forwards (what the Python edge forwards), and what guard answers itself.
CALLS = "^(" + "|".join(path.replace("/", "\\/") for path in api.PATHS) + ")$"
GUARD_PATHS = ("/health", "/health/live", "/health/ready", "/v1/models")
_TYPE = "type.googleapis.com/"
_JSON_TYPES = ["application/json", "application/json; charset=utf-8",
               "application/json;charset=utf-8"]


def generative(model: ModelConfig) -> bool:
    """A generation model: its calls are OpenAI-compatible HTTP, on this listener (the backends
    that serve one forward over HTTP: the plan step holds them to it)."""
    return model.task == generation.TASK


def _options(model: ModelConfig) -> list[OpenAIOptions]:
    return [OpenAIOptions.model_validate(getattr(model, role).options)
            for role in roles_of(model)]


def _target(spec) -> tuple[str, int, bool, str]:
    """(host, port, TLS, base path) of an ``openai`` block's target."""
    url = urlsplit(base_url(spec.target))
    tls = url.scheme == "https"
    return url.hostname or "", url.port or (443 if tls else 80), tls, url.path.rstrip("/")


def _authority(spec) -> str:
    host, port, tls, _ = _target(spec)
    host = f"[{host}]" if ":" in host else host
    return host if port == (443 if tls else 80) else f"{host}:{port}"


def _stands_in(model: ModelConfig) -> bool:
    """Can the primary's endpoint stand in inside the fallback's cluster
    (bootstrap.serving_cluster)? Where both are plain HTTP (TLS settings are a cluster's) and
    resolve alike (addresses, or names: the cluster's type)."""
    if model.fallback is None:
        return False
    return can_stand_in([(host, tls) for host, _, tls, _ in (
        _target(model.primary), _target(model.fallback))])


def _serving(model: ModelConfig, name: str, role: str) -> dict:
    """One of a model's clusters: the role's upstream, and in a fallback's the primary standing
    in where it can (``bootstrap.routed``). Each endpoint carries its authority as its
    hostname: the route rewrites Host to the answering endpoint's (``auto_host_rewrite``)."""
    host, port, _, _ = _target(model.primary)
    return routed(_upstream(name, getattr(model, role)), role, {
        "address": _address(host, port), "hostname": _authority(model.primary)}
        if _stands_in(model) else None)


def _upstream(name: str, spec) -> dict:
    host, port, tls, _ = _target(spec)
    options = OpenAIOptions.model_validate(spec.options)
    context = None
    if tls:
        context = {"sni": host, "common_tls_context": {
            "alpn_protocols": ["http/1.1"],
            "validation_context": {"trusted_ca": {
                "filename": "/etc/ssl/certs/ca-certificates.crt"}}}}
    cluster = _cluster(name, host, port, http2=False, tls=context,
                       connect_timeout_s=options.connect_timeout_s,
                       max_connections=options.max_connections or None)
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["hostname"] = \
        _authority(spec)
    return cluster


def _weighted(model: ModelConfig, chain: Chain, checked: bool = True) -> dict:
    """A generation model's calls: its clusters weighted by the runtime keys (the sampled twins
    by the hash of x-request-id, their answers marked for the tap: bootstrap.Chain), each
    answer named by its route, the Host the upstream's. ``checked=False``: the calls to the
    model's other endpoints, by the same weights (the route word decides, twins included: at
    sample_rate 1 they carry every call) but never observed: no answer marked, the observer
    off on every cluster."""
    clusters = []
    stand_in = _stands_in(model)
    for entry, _, sampled in cluster_entries(model, chain.marked and checked, stand_in):
        if sampled and checked:  # the traced answer must be the events as written, not gzip
            entry["request_headers_to_remove"] = ["accept-encoding"]
        elif chain.observer:
            entry["typed_per_filter_config"] = chain.off()
        clusters.append(entry)
    options = _options(model)
    action: dict = {
        "weighted_clusters": {"runtime_key_prefix": f"guard.{token(model.name)}.route",
                              "use_hash_policy": True, "clusters": clusters},
        "hash_policy": [{"header": {"header_name": "x-request-id"}}],
        "timeout": f"{max(o.timeout_s for o in options)}s",
        "idle_timeout": f"{max(o.read_timeout_s for o in options)}s",
        # Host: the answering endpoint's authority (its hostname, ``_upstream``), the primary's
        # where it stands in for the fallback
        "auto_host_rewrite": True,
    }
    if stand_in:
        action["retry_policy"] = SPILL_RETRY
    base = _target(model.primary)[3]
    if base:  # the same for both routes (guard/config/envoy.py)
        action["regex_rewrite"] = {"pattern": {"regex": "^/"}, "substitution": f"{base}/"}
    return action


def _reply(status: int, message: str, code: str | None, param: str | None) -> dict:
    """A route's answer from Envoy itself, in OpenAI's error shape. (These routes are what a
    call's headers choose before its body is read: the observing filter stays on there,
    bootstrap.Chain; no answer of theirs is marked, so none is traced.)"""
    return {"direct_response": {"status": status, "body": {"inline_string": (
        api.error_body(message, code=code, param=param).decode())}},
        "response_headers_to_add": [{"header": {"key": "content-type",
                                                "value": "application/json"}}]}


def _metadata(key: str, value: str) -> dict:
    return {"filter": JSON_FILTER, "path": [{"key": key}],
            "value": {"string_match": {"exact": value}}}


def _routes(models: list[ModelConfig], chain: Chain) -> list[dict]:
    off = chain.off()
    routes = []
    for path in GUARD_PATHS:
        route = {"name": f"guard{path.replace('/', '_')}", "match": {"path": path},
                 "route": {"cluster": HEALTH_CLUSTER, "timeout": "5s"}}
        if off:
            route["typed_per_filter_config"] = off
        routes.append(route)
    # The checked calls, then any other POST (embeddings, vLLM's /tokenize, /v1/messages
    # ...): forwarded to the model's route unchecked, as the Python edge does. A
    # GET on another path names no model: Envoy's 404.
    posts = {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}
    for kind, match, checked in (("", {"safe_regex": {"regex": CALLS}}, True),
                                 ("other_", posts, False)):
        routes += _model_routes(models, chain, kind, match, checked)
    return routes


def unchecked_stat(model: str) -> str:
    """The stat prefix of ``model``'s route for the calls guard forwards unchecked (Envoy
    counts them as ``vhost.<listener>.route.<prefix>.upstream_rq_total``, guard/envoy/stats.py
    reads them back as ``guard_generation_not_comparable_total{reason="endpoint"}``)."""
    return f"{UNCHECKED_STAT}{token(model)}"


def _model_routes(models: list[ModelConfig], chain: Chain, kind: str, paths: dict,
                  checked: bool) -> list[dict]:
    """The routes of the calls ``paths`` matches: with several models, bad bodies first (400),
    then each model by the name in its body, then an unknown name (404); with one, its route.
    ``kind`` prefixes the refusals' names, ``checked`` is ``_weighted``'s."""
    by_body = chain.by_body
    routes = []
    if by_body:
        # (A body naming no model is the one model's where there is one: no filter then.)
        several = ", ".join(sorted(m.name for m in models))
        for problem, message, param in (
                # (Envoy's JSON parser also refuses numbers beyond a double's range, which
                # the Python edge reads as infinities and forwards for the server to refuse)
                ("not_json", "the body is not a JSON object Envoy can read (not JSON, not an "
                 "object, or a number beyond a double's range)", None),
                ("no_model", f"'model' is required: guard serves several models ({several})",
                 "model")):
            routes.append({"name": f"{kind}body_{problem}",
                           "match": {**paths, "dynamic_metadata": [_metadata("body", problem)]},
                           **_reply(400, message, None, param)})
    for model in models:
        match: dict[str, Any] = dict(paths)
        if by_body:
            match["dynamic_metadata"] = [_metadata("model", model.name)]
        name = f"{token(model.name)}_{'generate' if checked else 'other'}"
        route = {"name": name, "match": match, "route": _weighted(model, chain, checked)}
        if not checked:  # per-route stats: the calls guard never checks, counted by model
            route["stat_prefix"] = unchecked_stat(model.name)
        routes.append(route)
    if by_body:
        routes.append({"name": f"{kind}unknown_model", "match": paths, **_reply(
            404, "The model named in the request is not served here", "model_not_found",
            "model")})
    return routes


def _json_to_metadata() -> dict:
    """The body's top-level ``model`` into dynamic metadata (a body that is not JSON, or names
    no model, marked under ``body`` for the 400 routes). The body is buffered up to the
    listener's per-connection buffer limit (a larger one is 413)."""
    def mark(value: str) -> dict:  # (a google.protobuf.Value's JSON form is the bare value)
        return {"metadata_namespace": JSON_FILTER, "key": "body", "value": value}

    return {"name": JSON_FILTER, "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {"rules": [{
            "selectors": [{"key": "model"}],
            "on_present": {"metadata_namespace": JSON_FILTER, "key": "model",
                           "type": "STRING"},
            "on_missing": mark("no_model"), "on_error": mark("not_json")}],
            "allow_content_types": _JSON_TYPES, "allow_empty_content_type": True}}}


def _call_counter(stand_in: bool) -> dict:
    """The access log that counts every call on the listener, at its end, by its cluster,
    status and Envoy's response flags: guard/envoy/stats.py reads ``guard_http.calls`` back as
    the Python edge counts its calls (a stream the upstream cut short after its 200 headers
    UNAVAILABLE, a stream past its timeout DEADLINE_EXCEEDED: ``http_outcome``), where the
    cluster's ``upstream_rq_200``, counted at the answer's headers, said answered. A call with
    no cluster is one Envoy answered itself (a body that is not JSON or names no model 400, an
    unknown model 404, a body past the buffer 413), counted as the Python edge counts its
    refusals, under ``model="_unknown"``, but for a path no route takes (flag ``NR``).
    ``stand_in``: tagged ``route`` too, as bootstrap's ``_call_counter``."""
    return counting_log(None, f"{HTTP_SCOPE}.calls", cluster="%UPSTREAM_CLUSTER%",
                        code="%RESPONSE_CODE%", flags="%RESPONSE_FLAGS%",
                        **({"route": ROUTE_METADATA} if stand_in else {}))


def listener(config: GuardConfig, ports: Ports, chain: Chain,
             layout: Layout) -> tuple[dict, list[dict]]:
    """The HTTP listener of ``config``'s generation models (at least one) and its clusters
    (added to ``layout``); ``chain``: how it observes (the tap, or nothing when no generation
    model samples) and whether it routes by the body (several models)."""
    models = [m for m in config.models if generative(m)]
    by_body = chain.by_body
    size = config.server.max_message_bytes
    # (guard's HTTP server closes a connection idle for server.http_client_timeout_s)
    clusters = [_cluster(HEALTH_CLUSTER, "127.0.0.1", ports.http_health, http2=False,
                         idle_timeout_s=config.server.http_client_timeout_s / 2)]
    for model in models:
        for name, role, _ in model_clusters(model):
            clusters.append(_serving(model, name, role))
            layout.clusters[name] = (model.name, role)
        layout.unchecked_routes[unchecked_stat(model.name)] = model.name
    filters = chain.filters(_json_to_metadata()) + [router_filter()]
    manager = {
        "@type": _TYPE + "envoy.extensions.filters.network.http_connection_manager.v3."
                         "HttpConnectionManager",
        "stat_prefix": LISTENER,
        "codec_type": "AUTO",
        "preserve_external_request_id": True,
        "generate_request_id": True,
        "route_config": {"name": LISTENER, "virtual_hosts": [
            {"name": LISTENER, "domains": ["*"],
             "routes": _routes(models, chain)}]},
        "http_filters": filters,
        "access_log": [_call_counter(any(_stands_in(m) for m in models))],
    }
    built: dict = {"name": LISTENER, "address": _address(config.server.host, ports.http_listener),
                   "filter_chains": [{"filters": [{
                       "name": "envoy.filters.network.http_connection_manager",
                       "typed_config": manager}]}]}
    if by_body:  # the body is buffered before routing: as large a body as the Python edge takes
        built["per_connection_buffer_limit_bytes"] = size
    return built, clusters
