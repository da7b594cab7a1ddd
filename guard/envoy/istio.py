"""A guard config as an Istio ``EnvoyFilter``: the same ext_proc and runtime-driven routes as
guard's own Envoy bootstrap (guard/envoy/bootstrap.py), patched into an existing Istio sidecar.

In an Istio pod the model server's inbound traffic already crosses a C++ proxy, istio-proxy.
Rather than put a second Envoy in the path, the EnvoyFilter adds guard's pieces to istio-proxy's
inbound listener for the model server's port (docs/deploy.md, "Istio"):

- clusters (``CLUSTER`` / ``ADD``): guard's observer on loopback, and per model its primary and
  fallback clusters and, for a model that samples, their sampled twins, built by the
  bootstrap's own cluster code;
- HTTP filters (``HTTP_FILTER`` / ``INSERT_BEFORE`` the router): ext_proc toward the observer
  (observability mode, ``failure_mode_allow``, STREAMED bodies), grpc_stats, and with several
  models the model-name extraction and the Lua re-route, the bootstrap's filters verbatim;
- routes (``HTTP_ROUTE`` / ``INSERT_FIRST`` in the inbound virtual host ``inbound|http|PORT``):
  each model's ModelInfer route, weighted by the runtime keys ``guard.<model>.route.<cluster>``
  and sampled by the hash of ``x-request-id``, as in the bootstrap; and Istio's own ``default``
  route of that virtual host merged with ext_proc off, so that the calls guard's routes do not
  take (ServerLive, metadata, anything else) never reach the observer.

Istio's bootstrap has an admin runtime layer (named ``admin``) and its admin API on
127.0.0.1:15000, so the routes switch there as in guard's own Envoy (``POST /runtime_modify``).
The weights a route starts with are the primary's, the route's own defaults: the runtime keys
need no static layer.

Unlike guard's own bootstrap, no primary stands in for a fallback that is down
(``bootstrap.serving_cluster``: Envoy's retry priority, which istio-proxy's build is not known to
carry): there a fallback that is down answers UNAVAILABLE until it is back or the route is
handed back.

Why patches to the inbound listener of the model server's port: that is where a call from any
client in the mesh arrives (after mTLS, authorisation and Istio's telemetry), so guard sees and
steers exactly what the model server would have answered, whichever client called.
"""

from __future__ import annotations

import ipaddress

from guard.config import GuardConfig
from guard.envoy import bootstrap
from guard.envoy.openai_listener import generative
from guard.envoy.servable import require_servable
from guard.errors import GuardError

API_VERSION = "networking.istio.io/v1alpha3"
INBOUND = "SIDECAR_INBOUND"
HCM = "envoy.filters.network.http_connection_manager"
ROUTER = "envoy.filters.http.router"
ISTIO_ADMIN_PORT = 15000  # istio-proxy's admin API (ProxyAdminPort), loopback only
# istio-proxy keeps only the stats its stats matcher names: guard's metrics read these.
STATS_PREFIXES = ("cluster.guard_",)


def observer_of(config: GuardConfig) -> str:
    """The observing filter the EnvoyFilter inserts: the config's (``server.envoy.observer``).
    A tap is attached through the istio-proxy's admin API, so only a guard serve attached to it
    (``server.envoy.attach_admin_port``) can use one; ext_proc copies reach guard's observer
    port by Envoy's own connection, attached or not."""
    envoy = config.server.envoy
    if envoy.observer == "tap" and not envoy.attach_admin_port:
        raise GuardError("server.envoy.observer: tap needs server.envoy.attach_admin_port (the "
                         f"istio-proxy's admin, {ISTIO_ADMIN_PORT}) to attach the tap there; or "
                         "set ext_proc, so that guard serve in the Pod listens on observer_port "
                         "for the EnvoyFilter's ext_proc copies")
    return envoy.observer


def inbound_vhost(port: int) -> str:
    """The name Istio gives the inbound virtual host of ``port``."""
    return f"inbound|http|{port}"


def _local_port(config: GuardConfig) -> int:
    """The model server's port in the pod: every model's primary must be it, on loopback."""
    ports = set()
    for i, model in enumerate(config.models):
        host, port = bootstrap._split_target(model.primary.target)
        if host != "localhost":
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise GuardError(
                    f"models[{i}].primary.target: '{model.primary.target}' is not on loopback; "
                    "behind an Istio sidecar the primary is the model server in the same pod, "
                    "whose inbound traffic istio-proxy carries (127.0.0.1:PORT)")
        ports.add(port)
    if len(ports) != 1:
        raise GuardError(f"models[].primary.target: the models' primaries use ports "
                         f"{sorted(ports)}; the EnvoyFilter patches one inbound port: serve "
                         "them from one model server")
    return ports.pop()


def _listener_match(port: int) -> dict:
    return {"context": INBOUND, "listener": {"portNumber": port, "filterChain": {
        "filter": {"name": HCM, "subFilter": {"name": ROUTER}}}}}


def _route_match(port: int, route: str | None = None) -> dict:
    vhost: dict = {"name": inbound_vhost(port)}
    if route is not None:
        vhost["route"] = {"name": route}
    return {"context": INBOUND, "routeConfiguration": {"portNumber": port, "vhost": vhost}}


def config_patches(config: GuardConfig, observer_port: int, port: int | None = None) -> list:
    """The EnvoyFilter's ``configPatches`` for ``config`` (its models on the inbound ``port``,
    default: their primaries' port), guard's observer on 127.0.0.1:``observer_port``."""
    require_servable(config)
    if not config.models:
        raise GuardError("models: none to route")
    generating = [i for i, m in enumerate(config.models) if generative(m)]
    if generating:
        raise GuardError(f"models[{generating[0]}]: a generation model's calls are HTTP on "
                         "server.http_port, which this EnvoyFilter (guard's gRPC pieces on the "
                         "sidecar's inbound listener) does not carry: serve it with guard's "
                         "own Envoy (`guard deploy envoy`) or server.data_plane: python")
    observer = observer_of(config)
    if observer == "ext_proc" and not observer_port:
        raise GuardError("server.envoy.observer_port: 0 (a free port chosen when guard starts) "
                         "cannot go into an EnvoyFilter printed ahead of time: set a port")
    local = _local_port(config)
    port = port or local
    by_body = len(config.models) > 1

    patches: list[dict] = []

    def cluster(value: dict) -> None:
        patches.append({"applyTo": "CLUSTER", "match": {"context": INBOUND},
                        "patch": {"operation": "ADD", "value": value}})

    if observer == "ext_proc":
        cluster(bootstrap._cluster(bootstrap.OBSERVER_CLUSTER, "127.0.0.1", observer_port))
    for model in config.models:
        for name, role, _ in bootstrap.model_clusters(model):
            cluster(bootstrap._upstream_cluster(name, getattr(model, role)))

    chain = bootstrap.Chain(observer, by_body)
    filters = chain.filters(bootstrap._extraction_filter() if by_body else None) + [
        bootstrap._grpc_stats_filter()]
    for value in filters:  # each before the router, so in this order
        patches.append({"applyTo": "HTTP_FILTER", "match": _listener_match(port),
                        "patch": {"operation": "INSERT_BEFORE", "value": value}})

    routes = [r for model in config.models
              for r in bootstrap._model_routes(model, chain)]
    for route in reversed(routes):  # each INSERT_FIRST goes before the last: reversed, in order
        patches.append({"applyTo": "HTTP_ROUTE", "match": _route_match(port),
                        "patch": {"operation": "INSERT_FIRST", "value": route}})
    # Istio's own route for the port: everything guard's routes do not take (and, with several
    # models, every call until its body is read), the observer off where that holds.
    off = chain.off_before_body()
    if off:
        patches.append({"applyTo": "HTTP_ROUTE", "match": _route_match(port, "default"),
                        "patch": {"operation": "MERGE", "value": {"typed_per_filter_config": off}}})
    return patches


def envoy_filter(config: GuardConfig, selector: dict[str, str], *, name: str = "guard",
                 namespace: str | None = None, port: int | None = None) -> dict:
    """The EnvoyFilter resource: ``config``'s patches on the pods ``selector`` picks."""
    if not selector:
        raise GuardError("--selector: at least one LABEL=VALUE (an EnvoyFilter without a "
                         "workloadSelector patches every sidecar in its namespace)")
    metadata: dict = {"name": name, "labels": {"app.kubernetes.io/managed-by": "guard"}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": "EnvoyFilter", "metadata": metadata,
            "spec": {"workloadSelector": {"labels": dict(selector)},
                     "configPatches": config_patches(config, config.server.envoy.observer_port,
                                                     port)}}


def pod_annotations() -> dict[str, str]:
    """What the model server's Pod needs beside the EnvoyFilter: istio-proxy keeps guard's
    cluster stats (its stats matcher drops them otherwise)."""
    import json

    return {"proxy.istio.io/config": json.dumps(
        {"proxyStatsMatcher": {"inclusionPrefixes": list(STATS_PREFIXES)}})}


def _observing(resource: dict) -> str | None:
    """The observing filter an EnvoyFilter inserts (the tap's or ext_proc's name)."""
    for patch in resource["spec"]["configPatches"]:
        name = patch["patch"]["value"].get("name") if patch["applyTo"] == "HTTP_FILTER" else None
        if name in (bootstrap.TAP_FILTER, bootstrap.EXT_PROC_FILTER):
            return name
    return None


def dump(resource: dict, as_json: bool = False) -> str:
    """The EnvoyFilter as YAML (with a header saying what else the pod needs) or JSON."""
    import json

    if as_json:
        return json.dumps(resource, indent=1) + "\n"
    import yaml

    annotations = yaml.safe_dump({"annotations": pod_annotations()}, sort_keys=False)
    tapped = _observing(resource) == bootstrap.TAP_FILTER
    header = [f"# guard's {'tap' if tapped else 'ext_proc'} and runtime routes for an Istio "
              "sidecar (docs/deploy.md).", "# The Pod beside it needs, in its metadata:"]
    header += [f"#   {line}" for line in annotations.splitlines()]
    header += ["# and guard serve attached to istio-proxy's admin (server.envoy.attach_admin_port"
               f": {ISTIO_ADMIN_PORT}), which holds the tap there." if tapped else
               "# and guard's observer on 127.0.0.1:server.envoy.observer_port.",
               "# The routes follow the runtime keys guard.<model>.route.* of istio-proxy's "
               f"admin runtime layer (POST 127.0.0.1:{ISTIO_ADMIN_PORT}/runtime_modify)."]
    return "\n".join(header) + "\n" + yaml.safe_dump(resource, sort_keys=False)
