"""A guard config as an Envoy bootstrap: Envoy forwards, guard watches and steers.

What the bootstrap holds (docs/envoy.md):

- one listener on ``server.host:grpc_port`` (TLS from ``server.tls``) with an HTTP connection
  manager whose filters are, in order: grpc_field_extraction and the Lua re-route (only when
  the config has several models: the model name is inside the request body), the Lua that
  takes the sampled twins' mark out of answers (with the tap: ``Chain``), the observing filter
  (the tap, or ext_proc in observability mode toward guard's observer), the router; and one
  access log, Envoy's stats logger, that counts each ModelInfer call by its cluster and gRPC
  status (``CALLS_SCOPE``: guard_requests_total and guard_request_errors_total read it);
- for generation models (backend ``openai``), a second listener on ``server.http_port``:
  guard/envoy/openai_listener.py;
- per model, a cluster per serving upstream (``guard_<model>_primary``, ``guard_<model>_fallback``;
  HTTP/2), and for a model that samples a twin of each (``..._sampled``, the same upstream);
  the model's ModelInfer route is a ``weighted_clusters`` whose weights come from Envoy's
  runtime (``guard.<model>.route.<cluster>``): guard switches a model by setting them through
  the admin API (``POST /runtime_modify``), and every answer carries the response header
  ``guard-route: primary|fallback``;
- sampling decided in Envoy, stable on ``x-request-id``: the cluster is chosen by the hash of the
  call's x-request-id (``use_hash_policy``), the sampled twin weighing the model's sample rate (its
  mirror rate, or capture rate for capture mode "all", the larger one) in a million; the observing
  filter is off on every cluster's entry but the sampled twins' (and the tap keeps only the calls
  whose answer a twin marked, ``Chain``), so an unsampled call never reaches guard, and an id is
  sampled, or not, on every replica alike. (A route ``runtime_fraction`` would draw a random number
  per call: measured, the same id was sampled on some calls and not on others);
- ``/grpc.health.v1.Health/`` routed to guard's own health server on loopback: readiness on
  grpc_port means Envoy's listener, guard and (guard's readiness) the upstreams are up;
- the admin API on 127.0.0.1 only, a runtime with an admin layer, and the duration histogram's
  buckets set to guard's (in ms) so that the merged /metrics keeps guard's bucket bounds.

Why the calls are counted by an access log and not by the grpc_stats filter: the count is the
same (ModelInfer calls per cluster and gRPC status, Envoy's own local replies included), and it
is the largest part of what guard's bootstrap costs Envoy per call. Counted by callgrind
(benchmarks/envoy_instructions.py, a one-model config with mirroring off, 400 calls): a plain
pass-through 210k instructions per call, guard's bootstrap with grpc_stats 236k (1.12x), of which
grpc_stats 21k (a stream filter on every call, every gRPC message framed both ways, five
counters charged through names joined per call); the stats logger 4.5k, run once at the
call's end. Its extension (``envoy.access_loggers.stats``) is marked work-in-progress by Envoy,
whose warning is about stats without bound when tags come from request data; here they take
values only from guard's own cluster names and the gRPC status number (empty for a call its
client cancelled, which is not counted: guard/envoy/stats.py). It needs Envoy 1.39 or later
(``stats_scope``). istio-proxy's build is not known to carry it, so guard's EnvoyFilter
(guard/envoy/istio.py) keeps grpc_stats; guard/envoy/stats.py reads either.

Why the model name is read with grpc_field_extraction when several models share the listener:
it is Envoy's own extension for exactly that (a field of the first request message into dynamic
metadata, which a route matches), it needs only the protocol's descriptors (from tritonclient,
already a dependency), and a one-model config (a sidecar's usual case) skips the filter and its
parse. A listener per model would make clients address a port per model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from guard.backends.base import SKIP_S
from guard.config import GuardConfig, ModelConfig
from guard.envoy.process import GRPC_LISTENER
from guard.observe.metrics import LATENCY_BUCKETS

SERVICE = "inference.GRPCInferenceService"
MODEL_INFER = f"/{SERVICE}/ModelInfer"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
ROUTE_HEADER = "guard-route"
SAMPLED_HEADER = "guard-sampled"  # a sampled twin's answers, for the tap's match (Chain)
LUA_FILTER = "envoy.filters.http.lua"
OBSERVER_CLUSTER = "guard_observer"
HEALTH_CLUSTER = "guard_health"
EXTRACTION_FILTER = "envoy.filters.http.grpc_field_extraction"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
TAP_FILTER = "envoy.filters.http.tap"
TAP_CONFIG_ID = "guard"  # the tap guard/envoy/tap_filter.py attaches through the admin API
CALLS_SCOPE = "guard_calls"  # the stats logger's counter: guard_calls.grpc.cluster.<c>.code.<n>
ROLES = ("primary", "fallback")
SAMPLED = "_sampled"
WEIGHTS = 1_000_000  # the weights of a model's clusters add up to this (a sample rate in ppm)
# Each upstream endpoint's route, in its host metadata (``guard: {route: ...}``): what the
# ``guard-route`` header and the call counter say of the endpoint that answered.
ROUTE_METADATA = "%UPSTREAM_METADATA(guard:route)%"
_TYPE = "type.googleapis.com/"
# Methods whose first field names the model (ModelInfer's model_name, the others' name).
_NAMED_METHODS = {"ModelInfer": "model_name", "ModelMetadata": "name", "ModelReady": "name"}


def token(name: str) -> str:
    """A model name as a part of Envoy names without dots (Envoy's stat names split on dots):
    '_' doubled, '.' as '_d'; different names never give the same token."""
    return name.replace("_", "__").replace(".", "_d")


def cluster_name(model: str, role: str, sampled: bool = False) -> str:
    """A model's cluster for ``role``; ``sampled``: its twin that the sampled calls take (the
    same upstream; ext_proc stays on for it)."""
    return f"guard_{token(model)}_{role}{SAMPLED if sampled else ''}"


def route_key(model: str, role: str, sampled: bool = False) -> str:
    """The runtime key of the weight of a cluster of ``model``."""
    return f"guard.{token(model)}.route.{cluster_name(model, role, sampled)}"


def route_values(model: str, route: str, roles: tuple[str, ...] | list[str],
                 rate: float) -> dict[str, int]:
    """The runtime weights that put ``model`` on ``route``: ``rate`` of its calls (by the hash
    of their x-request-id) to the route's sampled cluster, the rest to its other one; 0 for the
    other role's."""
    sampled = round(rate * WEIGHTS)
    values = {}
    for role in roles:
        on = role == route or (route not in roles and role == "primary")
        values[route_key(model, role)] = (WEIGHTS - sampled if on else 0) if sampled else int(on)
        if sampled:
            values[route_key(model, role, True)] = sampled if on else 0
    return values


def sample_rate(model: ModelConfig) -> float:
    """The share of a model's calls Envoy copies to the observer: what the mirror and capture
    mode "all" sample (one fraction for both in Envoy mode: the larger)."""
    mirror = model.mirror.sample_rate if model.reference is not None else 0.0
    capture = model.capture
    recorded = capture.sample_rate if capture is not None and capture.mode == "all" else 0.0
    return max(mirror, recorded)


@dataclass
class Ports:
    """Where things listen: Envoy's listener and admin, and guard's loopback servers."""

    listener: int
    admin: int
    observer: int
    health: int
    http_listener: int = 0  # Envoy's HTTP listener (server.http_port; generation models)
    http_health: int = 0  # guard's HTTP health and model list (server.envoy.http_health_port)


@dataclass
class Layout:
    """What the rest of guard needs to know of a bootstrap: its clusters (cluster -> (model,
    route), to read Envoy's stats back; ``unchecked_routes``: the stat prefix of each
    generation model's route for the calls guard forwards unchecked -> the model) and its
    observing filter ("tap", "ext_proc", or None when no model samples)."""

    clusters: dict[str, tuple[str, str]] = field(default_factory=dict)
    unchecked_routes: dict[str, str] = field(default_factory=dict)
    observer: str | None = None


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host.strip("[]"), "port_value": port}}


def _cluster(name: str, host: str, port: int, *, http2: bool = True, tls: dict | None = None,
             dns: bool | None = None, connect_timeout_s: float = 1.0,
             max_connections: int | None = None, idle_timeout_s: float | None = None) -> dict:
    """A cluster of one endpoint, over HTTP/2 (gRPC) or HTTP/1.1 (``http2=False``: the
    OpenAI-compatible servers, most of which speak no h2c); ``dns``: resolve ``host`` (default:
    when it is not an IP address); ``idle_timeout_s``: how long Envoy keeps an idle upstream
    connection (its default: an hour), below the endpoint's own keep-alive, so that Envoy
    never sends a call on a connection the endpoint is closing."""
    if dns is None:
        dns = not _is_ip(host)
    protocol: dict = ({"http2_protocol_options": {}} if http2
                      else {"http_protocol_options": {}})
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STRICT_DNS" if dns else "STATIC",
        "connect_timeout": f"{connect_timeout_s:g}s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(host, port)}}]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": protocol,
                **({"common_http_protocol_options": {"idle_timeout": f"{idle_timeout_s:g}s"}}
                   if idle_timeout_s is not None else {})}},
        # Envoy's defaults (1024 pending / in flight) would refuse a burst that guard's own
        # max_concurrent_requests admits; the model server is the limit, not the proxy.
        "circuit_breakers": {"thresholds": [{"max_connections": max_connections or 100000,
                                             "max_pending_requests": 100000,
                                             "max_requests": 100000}]},
    }
    if dns:
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if tls is not None:
        cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            **tls}}
    return cluster


def _split_target(target: str | None) -> tuple[str, int]:
    if target is None:  # (the config's Envoy-mode checks require it of every upstream)
        raise ValueError("an upstream block needs 'target' (host:port)")
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _upstream_cluster(name: str, spec) -> dict:
    host, port = _split_target(spec.target)
    tls = None
    options = spec.options
    if options.get("tls"):
        roots = options.get("root_ca_file") or "/etc/ssl/certs/ca-certificates.crt"
        tls = {"sni": host, "common_tls_context": {
            "alpn_protocols": ["h2"],
            "validation_context": {"trusted_ca": {"filename": roots}}}}
    return _cluster(name, host, port, tls=tls)


def serving_cluster(model: ModelConfig, name: str, role: str) -> dict:
    """One of a model's clusters in guard's bootstrap: the role's upstream, its endpoint named
    by its route in the host metadata (``ROUTE_METADATA``). A fallback's cluster also holds the
    primary's endpoint, one priority lower (``_stands_in``): where no connection can be made to
    the fallback, the call goes to the primary (the route's retry policy, ``SPILL_RETRY``), and
    Envoy's outlier detection then leaves the fallback out for ``SKIP_S`` and tries it again,
    as the Python data planes skip a fallback that is down. A drifting answer beats none, and
    probes ride on answered calls: without it a trip to a fallback that is down was an outage
    for as long as the route stayed there."""
    host, port = _split_target(model.primary.target)
    return routed(_upstream_cluster(name, getattr(model, role)), role,
                  {"address": _address(host, port)} if _stands_in(model) else None)


def routed(cluster: dict, role: str, stand_in: dict | None) -> dict:
    """``cluster``, its endpoint's route (``role``) in its host metadata; and, for a fallback
    whose primary can stand in (``stand_in``: the primary's ``Endpoint``), that endpoint one
    priority lower and the outlier detection that leaves a fallback no connection can be made
    to out for ``SKIP_S``. Guard's two listeners' clusters alike (``serving_cluster``,
    openai_listener)."""
    endpoints = cluster["load_assignment"]["endpoints"]
    endpoints[0]["lb_endpoints"][0]["metadata"] = _route_metadata(role)
    if role != "fallback" or stand_in is None:
        return cluster
    endpoints.append({"priority": 1, "lb_endpoints": [{
        "endpoint": stand_in, "metadata": _route_metadata("primary")}]})
    cluster["outlier_detection"] = {
        # a connection refused or timed out (guard's own side of the call) ejects the host at
        # once; the upstream's own errors never do (Envoy's defaults would eject on five 5xx
        # in a row, gRPC statuses among them: an erring fallback's calls would go to the
        # primary, their errors hidden)
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_5xx": 0, "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0, "enforcing_failure_percentage": 0,
        "enforcing_local_origin_success_rate": 0,
        "enforcing_failure_percentage_local_origin": 0,
        "base_ejection_time": f"{SKIP_S:g}s", "max_ejection_time": f"{SKIP_S:g}s",
        "max_ejection_percent": 100, "interval": "1s"}
    return cluster


def _stands_in(model: ModelConfig) -> bool:
    """Can the primary's endpoint stand in inside the fallback's cluster (``can_stand_in``)?"""
    if model.fallback is None:
        return False
    return can_stand_in([(_split_target(side.target)[0], bool(side.options.get("tls")))
                         for side in (model.primary, model.fallback)])


def can_stand_in(sides: list[tuple[str, bool]]) -> bool:
    """Can one side's endpoint stand in inside the other's cluster, ``sides`` (host, TLS)?
    Where both are plain (TLS settings, SNI among them, are a cluster's, not an endpoint's)
    and resolve alike (addresses, or names: a STATIC cluster, or a STRICT_DNS one that
    resolves each endpoint itself)."""
    return not any(tls for _, tls in sides) and len({_is_ip(host) for host, _ in sides}) == 1


def _route_metadata(route: str) -> dict:
    return {"filter_metadata": {"guard": {"route": route}}}


# Where no connection can be made to the endpoint chosen (the fallback that is down), one retry
# on the next priority (the primary standing in: ``serving_cluster``). A cluster with one
# priority retries its one endpoint once: a dead primary costs one more connection attempt.
SPILL_RETRY = {
    "retry_on": "connect-failure,reset-before-request", "num_retries": 1,
    "retry_priority": {"name": "envoy.retry_priorities.previous_priorities", "typed_config": {
        "@type": _TYPE + "envoy.extensions.retry.priority.previous_priorities.v3."
                         "PreviousPrioritiesConfig",
        "update_frequency": 1}}}


def roles_of(model: ModelConfig) -> tuple[str, ...]:
    return tuple(r for r in ROLES if getattr(model, r) is not None)


def model_clusters(model: ModelConfig) -> list[tuple[str, str, bool]]:
    """(cluster name, role, sampled) of each of a model's clusters: one per serving role, and
    for a model that samples the sampled twin of each."""
    twins = (False, True) if round(sample_rate(model) * WEIGHTS) else (False,)
    return [(cluster_name(model.name, role, sampled), role, sampled)
            for role in roles_of(model) for sampled in twins]


def cluster_entries(model: ModelConfig, marked: bool = False,
                    stand_in: bool = False) -> list[tuple[dict, str, bool]]:
    """The ``weighted_clusters`` entries of a model's route (with the weights it starts on,
    its primary's, until the runtime says otherwise), each answer named by its route in the
    ``guard-route`` header (``stand_in``: the fallback's clusters hold the primary standing
    in, ``serving_cluster``: the answering endpoint says it), and (``marked``) a sampled
    twin's answers marked for the tap (``Chain``); beside each, its role and whether it is a
    sampled twin."""
    defaults = route_values(model.name, "primary", roles_of(model), sample_rate(model))
    entries = []
    for name, role, sampled in model_clusters(model):
        # (a fallback's cluster may answer from the primary standing in: the endpoint says)
        route = ROUTE_METADATA if stand_in and role == "fallback" else role
        headers = [{"header": {"key": ROUTE_HEADER, "value": route},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
        if sampled and marked:
            headers.append({"header": {"key": SAMPLED_HEADER, "value": "1"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
        entries.append(({"name": name, "weight": defaults[route_key(model.name, role, sampled)],
                         "response_headers_to_add": headers}, role, sampled))
    return entries


def router_filter() -> dict:
    return {"name": "envoy.filters.http.router", "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.router.v3.Router"}}


@dataclass(frozen=True)
class Chain:
    """How a listener's filter chain observes the sampled calls: its observing filter
    (``observer``: "tap", "ext_proc", or None when none of its models samples), and whether
    its routes are chosen again once the body has been read (``by_body``: several models).

    Envoy creates a call's filters once, for the route chosen at its headers: a filter turned
    off there (the generic ``FilterConfig.disabled``, the tap's only off switch) does not exist
    for the call, whatever route is chosen afterwards. So in a chain that routes by the body
    the tap must exist for every call, and which calls it keeps is said by the sampled twins
    themselves: their answers carry the header ``guard-sampled`` (``SAMPLED_HEADER``), the
    tap keeps only calls whose answer has it (guard/envoy/tap_filter.py), and a Lua filter
    takes it out of the answer before the client sees it. A one-model chain's route is final
    at the headers, so there the tap and that Lua exist only for the sampled twins' calls.
    ext_proc reads its per-route switch per call, after any re-route: no marker needed."""

    observer: str | None
    by_body: bool = False

    @property
    def marked(self) -> bool:
        """Sampled twins mark their answers (for the tap's match)."""
        return self.observer == "tap"

    def off(self) -> dict:
        """``typed_per_filter_config`` that turns the observing filter off on a route or a
        cluster entry (and the marker's Lua, in a one-model chain); {} with no observer."""
        off = _off(self.observer)
        if self.marked and not self.by_body:
            off[LUA_FILTER] = {"@type": _TYPE + "envoy.config.route.v3.FilterConfig",
                               "disabled": True}
        return off

    def off_before_body(self) -> dict:
        """``off`` for a route that may be chosen at the headers and then again once the body
        is read: in a tap chain that routes by the body, none (see the class)."""
        return {} if self.by_body and self.marked else self.off()

    def filters(self, body_filter: dict | None = None) -> list[dict]:
        """The chain's filters up to its observing filter: the body's reader
        (``body_filter``) and the re-route when ``by_body``, the marker's Lua, the observer."""
        out = [body_filter] if self.by_body and body_filter is not None else []
        if self.by_body or self.marked:
            out.append(_lua_filter(reroute=self.by_body, strip=self.marked))
        if self.observer:
            out.append(observing_filter(self.observer))
        return out


def _weighted(model: ModelConfig, chain: Chain, compared: bool = True,
              spill: bool = False) -> dict:
    """The route action of a model's calls: its clusters weighted by runtime keys (defaults:
    the primary), chosen by the hash of the call's x-request-id (Envoy makes one for a call
    without), so that a given id is sampled, or not, on every replica. The unsampled clusters
    turn the chain's observing filter off; the sampled twins mark the answers of the calls
    that are ``compared`` (ModelInfer's, not the metadata calls that share the clusters).
    ``spill``: the clusters are ``serving_cluster``'s (guard's bootstrap, not Istio's), whose
    fallback's may answer from the primary standing in (``SPILL_RETRY``)."""
    clusters, hashed = [], False
    stand_in = spill and _stands_in(model)
    for entry, _, sampled in cluster_entries(model, chain.marked and compared, stand_in):
        if not sampled and chain.observer:
            entry["typed_per_filter_config"] = chain.off()
        hashed = hashed or sampled
        clusters.append(entry)
    timeout = float(model.primary.options.get("timeout_s", 10.0))
    weighted: dict = {"runtime_key_prefix": f"guard.{token(model.name)}.route",
                      "clusters": clusters}
    action: dict = {
        "weighted_clusters": weighted,
        # The client's deadline (grpc-timeout) is honoured as it is; without one, the
        # upstream's options.timeout_s, as in the Python data plane.
        "timeout": f"{timeout}s",
        "max_stream_duration": {"grpc_timeout_header_max": "0s"},
    }
    if stand_in:
        action["retry_policy"] = SPILL_RETRY
    if hashed:  # only a model with a sampled twin needs the id's hash (mirroring off: no cost)
        weighted["use_hash_policy"] = True
        action["hash_policy"] = [{"header": {"header_name": "x-request-id"}}]
    return action


def _off(observer: str | None) -> dict:
    """The observing filter turned off for a route or a cluster's entry (the tap filter has no
    per-route config of its own: the generic FilterConfig disables it); {} when the chain has
    no observing filter (``observer`` None)."""
    if observer is None:
        return {}
    if observer == "tap":
        return {TAP_FILTER: {"@type": _TYPE + "envoy.config.route.v3.FilterConfig",
                             "disabled": True}}
    return {EXT_PROC_FILTER: {
        "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "disabled": True}}


def _model_routes(model: ModelConfig, chain: Chain, spill: bool = False) -> list[dict]:
    """A model's routes: its ModelInfer calls, and its other per-model methods (metadata,
    readiness); ``spill``: as ``_weighted``'s."""
    def match(path: str | None = None, prefix: str | None = None) -> dict:
        out: dict = {"path": path} if path else {"prefix": prefix}
        if chain.by_body:
            # The extraction files a value under its field's name.
            key = "model_name" if path == MODEL_INFER else "name"
            out["dynamic_metadata"] = [{
                "filter": EXTRACTION_FILTER, "path": [{"key": key}],
                # The extraction stores a field's values as a list.
                "value": {"list_match": {"one_of": {"string_match": {"exact": model.name}}}}}]
        return out

    # ModelInfer: the observing filter is on for the sampled clusters only (their entries do
    # not turn it off); every other call has it off on the route itself, and its answers are
    # not marked.
    routes = [{"name": f"{token(model.name)}_infer", "match": match(path=MODEL_INFER),
               "route": _weighted(model, chain, spill=spill)}]
    if chain.by_body:
        other = {"name": f"{token(model.name)}_other", "match": match(prefix=f"/{SERVICE}/"),
                 "route": _weighted(model, chain, compared=False, spill=spill)}
        if chain.observer:
            other["typed_per_filter_config"] = chain.off()
        routes.append(other)
    return routes


def descriptor_set() -> bytes:
    """The Open Inference Protocol's descriptors (grpc_service.proto and what it imports), for
    grpc_field_extraction: taken from tritonclient's generated module."""
    from google.protobuf import descriptor_pb2
    from tritonclient.grpc import service_pb2

    files, seen = descriptor_pb2.FileDescriptorSet(), set()

    def add(descriptor) -> None:
        if descriptor.name in seen:
            return
        seen.add(descriptor.name)
        for dependency in descriptor.dependencies:
            add(dependency)
        descriptor.CopyToProto(files.file.add())

    add(service_pb2.DESCRIPTOR)
    return files.SerializeToString()


def _extraction_filter() -> dict:
    import base64

    return {"name": EXTRACTION_FILTER, "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.grpc_field_extraction.v3."
                         "GrpcFieldExtractionConfig",
        "descriptor_set": {"inline_bytes": base64.b64encode(descriptor_set()).decode()},
        "extractions_by_method": {
            f"{SERVICE}.{method}": {"request_field_extractions": {
                field_name: {"dynamic_metadata": field_name}}}
            for method, field_name in _NAMED_METHODS.items()}}}


def _lua_filter(reroute: bool, strip: bool) -> dict:
    """One line of Lua per job. ``reroute``: routes are chosen when the headers arrive, before
    the body's reader has read the body; on the headers (which reach Lua only once the reader
    let them go) Envoy chooses the route again, now with the model name in the dynamic
    metadata. ``strip``: the sampled-twin marker (``Chain``) leaves the answer here, after the
    tap (earlier in the encoding) has seen it."""
    lines = []
    if reroute:
        lines.append("function envoy_on_request(handle) handle:clearRouteCache() end")
    if strip:
        lines.append("function envoy_on_response(handle) "
                     f'handle:headers():remove("{SAMPLED_HEADER}") end')
    return {"name": LUA_FILTER, "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": "\n".join(lines)}}}


def _reroute_filter() -> dict:
    """The re-route alone (see ``_lua_filter``)."""
    return _lua_filter(reroute=True, strip=False)


def _ext_proc_filter() -> dict:
    return {"name": EXT_PROC_FILTER, "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": OBSERVER_CLUSTER}},
        # Copies, never waited for; a dead observer must not fail clients (with false, Envoy
        # fails them with UNKNOWN even in observability mode).
        "observability_mode": True,
        "failure_mode_allow": True,
        # STREAMED is the only body mode that sends bodies in observability mode.
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": "STREAMED", "response_body_mode": "STREAMED",
            "request_trailer_mode": "SKIP", "response_trailer_mode": "SEND"}}}


def _tap_filter() -> dict:
    """Envoy's tap, controlled through the admin API: it taps nothing until guard's reader
    (guard/envoy/tap_filter.py) attaches a match and an output to config id ``guard``."""
    return {"name": TAP_FILTER, "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.tap.v3.Tap",
        "common_config": {"admin_config": {"config_id": TAP_CONFIG_ID}}}}


def observing_filter(observer: str) -> dict:
    return _tap_filter() if observer == "tap" else _ext_proc_filter()


def _call_counter(stand_in: bool) -> dict:
    """The access log that counts every ModelInfer call by its cluster and gRPC status (see the
    module's docstring for why not grpc_stats): ``guard_calls.grpc`` tagged ``cluster`` and
    ``code`` (the status number; Envoy's local replies carry one too, e.g. 14 UNAVAILABLE for an
    upstream that refuses connections). Only ModelInfer: metadata and readiness calls share the
    clusters and are not inference requests. ``stand_in``: some fallback's cluster holds the
    primary standing in (``serving_cluster``): tagged ``route`` too, the answering endpoint's
    (a lookup of its metadata per call, 2.2k instructions: only where it can differ)."""
    return counting_log({"header_filter": {"header": {
        "name": ":path", "string_match": {"exact": MODEL_INFER}}}},
        f"{CALLS_SCOPE}.grpc", cluster="%UPSTREAM_CLUSTER%", code="%GRPC_STATUS_NUMBER%",
        **({"route": ROUTE_METADATA} if stand_in else {}))


def counting_log(when: dict | None, stat: str, **tags: str) -> dict:
    """Envoy's stats access logger: the counter ``stat`` (``scope.name``) + 1 at the end of each
    call that the access-log filter ``when`` passes (every call: None), tagged with ``tags``
    (name -> an access-log format string such as ``%RESPONSE_CODE%``; Envoy's Prometheus output
    makes them labels)."""
    scope, name = stat.split(".")
    log: dict[str, Any] = {"name": "envoy.access_loggers.stats", "typed_config": {
        "@type": _TYPE + "envoy.extensions.access_loggers.stats.v3.Config",
        "stats_scope": {"prefix": scope},
        "counters": [{"stat": {"name": name, "tags": [
            {"name": tag, "value_format": value} for tag, value in tags.items()]},
            "value_fixed": 1}]}}
    if when is not None:
        log["filter"] = when
    return log


def _grpc_stats_filter() -> dict:
    """The gRPC status count as a filter, for istio-proxy (guard/envoy/istio.py), whose build
    may not carry the stats logger of ``_call_counter``."""
    return {"name": "envoy.filters.http.grpc_stats", "typed_config": {
        "@type": _TYPE + "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
        "emit_filter_state": False,
        "individual_method_stats_allowlist": {"services": [
            {"name": SERVICE, "method_names": ["ModelInfer"]}]},
        "replace_dots_in_grpc_service_name": True}}


def _downstream_tls(config: GuardConfig) -> dict | None:
    tls = config.server.tls
    if tls is None:
        return None
    context: dict = {"common_tls_context": {
        "alpn_protocols": ["h2"],
        "tls_certificates": [{"certificate_chain": {"filename": tls.cert_file},
                              "private_key": {"filename": tls.key_file}}]}}
    if tls.client_ca_file:
        context["require_client_certificate"] = True
        context["common_tls_context"]["validation_context"] = {
            "trusted_ca": {"filename": tls.client_ca_file}}
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": _TYPE + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        **context}}


def build(config: GuardConfig, ports: Ports, routes: dict[str, str] | None = None,
          spill: bool = True) -> tuple[dict, Layout]:
    """The bootstrap for ``config`` (a dict, dumped as YAML or JSON) and its layout.
    ``routes``: model -> "primary"/"fallback" to start on (the runtime's static layer), so
    that an Envoy started again begins where the last one was. ``spill=False``: no primary
    standing in for a fallback that is down (``serving_cluster``), as guard's Istio
    EnvoyFilter builds its pieces (istio-proxy's build may not carry the retry priority)."""
    from guard.envoy import openai_listener  # it builds on this module's pieces

    routes = routes or {}
    layout = Layout()
    served = [m for m in config.models if not openai_listener.generative(m)]  # gRPC (OIP)
    generating = [m for m in config.models if openai_listener.generative(m)]  # HTTP (OpenAI)
    # No model samples: no observing filter at all (and nothing for it to skip per call); a
    # listener whose models do not sample has none either.
    observing = {kind: any(round(sample_rate(m) * WEIGHTS) for m in models)
                 for kind, models in (("grpc", served), ("http", generating))}
    observer = config.server.envoy.observer if any(observing.values()) else None
    layout.observer = observer
    chain = Chain(observer if observing["grpc"] else None, by_body=len(served) > 1)
    off = chain.off()
    clusters = [_cluster(HEALTH_CLUSTER, "127.0.0.1", ports.health)]
    if chain.observer == "ext_proc":
        clusters.insert(0, _cluster(OBSERVER_CLUSTER, "127.0.0.1", ports.observer))
    health = {"name": "health", "match": {"prefix": HEALTH_PREFIX},
              "route": {"cluster": HEALTH_CLUSTER, "timeout": "5s"}}
    if off:
        health["typed_per_filter_config"] = off
    virtual_routes: list[dict] = [health]
    static: dict[str, float] = {}
    for model in config.models:
        static.update(route_values(model.name, routes.get(model.name, "primary"),
                                   roles_of(model), sample_rate(model)))
    for model in served:
        for name, role, _ in model_clusters(model):
            clusters.append(serving_cluster(model, name, role) if spill
                            else _upstream_cluster(name, getattr(model, role)))
            layout.clusters[name] = (model.name, role)
        virtual_routes += _model_routes(model, chain, spill=spill)
    if served:
        # Server-wide calls (ServerLive, ServerReady, ModelConfig...) go to the first model's
        # server, on its current route. With several models, every ModelInfer's route too
        # until its body is read.
        server = {"name": "server", "match": {"prefix": f"/{SERVICE}/"},
                  "route": _weighted(served[0], chain, compared=False, spill=spill)}
        if chain.off_before_body():
            server["typed_per_filter_config"] = chain.off_before_body()
        virtual_routes.append(server)
    filters = chain.filters(_extraction_filter() if chain.by_body else None) + [router_filter()]
    listeners = []
    if generating:  # the OpenAI-compatible HTTP listener (server.http_port)
        http_chain = Chain(observer if observing["http"] else None,
                           by_body=len(generating) > 1)
        http, http_clusters = openai_listener.listener(config, ports, http_chain, layout)
        listeners.append(http)
        clusters += http_clusters
    size = config.server.max_message_bytes
    manager = {
        "@type": _TYPE + "envoy.extensions.filters.network.http_connection_manager.v3."
                         "HttpConnectionManager",
        "stat_prefix": "guard",
        "codec_type": "AUTO",
        # A client's x-request-id is kept (it is what samples are known by); one is made for a
        # call without. traceparent/tracestate pass through untouched (no tracer here).
        "preserve_external_request_id": True,
        "generate_request_id": True,
        "http2_protocol_options": {"initial_stream_window_size": min(size, 2 ** 31 - 1),
                                   "initial_connection_window_size": min(size, 2 ** 31 - 1)},
        "route_config": {"name": "guard", "virtual_hosts": [
            {"name": "guard", "domains": ["*"], "routes": virtual_routes}]},
        "http_filters": filters,
        "access_log": [_call_counter(spill and any(_stands_in(m) for m in served))],
    }
    filter_chain: dict = {"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                       "typed_config": manager}]}
    tls = _downstream_tls(config)
    if tls is not None:
        filter_chain["transport_socket"] = tls
    bootstrap = {
        "node": {"id": "guard", "cluster": "guard"},
        "admin": {"address": _address("127.0.0.1", ports.admin)},
        "layered_runtime": {"layers": [
            {"name": "guard_static", "static_layer": static},
            {"name": "guard_admin", "admin_layer": {}}]},
        # Histograms are merged from the worker threads at each flush: 1 s keeps the duration
        # histogram on /metrics at most a second behind the counters.
        "stats_flush_interval": "1s",
        "stats_config": {"histogram_bucket_settings": [{
            "match": {"safe_regex": {"regex": r"^cluster\.guard_.*\.upstream_rq_time$"}},
            "buckets": [b * 1000 for b in LATENCY_BUCKETS]}]},
        "static_resources": {
            "listeners": [{"name": GRPC_LISTENER,
                           "address": _address(config.server.host, ports.listener),
                           "filter_chains": [filter_chain]}, *listeners],
            "clusters": clusters},
    }
    return bootstrap, layout


def dump(bootstrap: dict, as_json: bool = False) -> str:
    """The bootstrap as YAML (for people: ``guard deploy envoy``) or JSON (for Envoy)."""
    if as_json:
        return json.dumps(bootstrap, indent=1)
    import yaml

    class Plain(yaml.SafeDumper):  # every value written out: no &anchors for repeated parts
        def ignore_aliases(self, data) -> bool:
            return True

    return yaml.dump(bootstrap, Dumper=Plain, sort_keys=False)


def ports_of(config: GuardConfig) -> Ports:
    """The ports as configured (``guard deploy envoy``): 0 stays 0 (Envoy picks)."""
    server = config.server
    return Ports(server.grpc_port, server.envoy.admin_port, server.envoy.observer_port,
                 server.envoy.health_port, server.http_port or 0,
                 server.envoy.http_health_port)
