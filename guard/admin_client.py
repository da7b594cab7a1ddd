"""Client side of the guard.v1 admin API, for ``guard admin`` and the demo."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass

import grpc
from google.protobuf.json_format import MessageToDict

from guard.errors import GuardError
from guard.protocol.generation import divergent_token_phrase
from guard.v1 import admin_pb2 as pb
from guard.v1 import admin_pb2_grpc as pb_grpc

_ROUTES = {"auto": pb.AUTO, "primary": pb.PRIMARY, "fallback": pb.FALLBACK}


@dataclass(frozen=True)
class ClientTls:
    """TLS toward the admin API (``server.admin_tls``): the CA that signed the server's
    certificate, and for mutual TLS this client's certificate and key (PEM files)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # when the address is not a name in the server's cert

    @property
    def enabled(self) -> bool:
        return any((self.ca_file, self.cert_file, self.key_file))

    def channel(self, address: str) -> grpc.Channel:
        if (self.cert_file is None) != (self.key_file is None):
            raise GuardError("admin TLS: --tls-cert and --tls-key go together")

        def read(path: str | None, flag: str) -> bytes | None:
            if path is None:
                return None
            try:
                return open(path, "rb").read()
            except OSError as exc:
                raise GuardError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None

        credentials = grpc.ssl_channel_credentials(
            read(self.ca_file, "--tls-ca"), read(self.key_file, "--tls-key"),
            read(self.cert_file, "--tls-cert"))
        options = ([("grpc.ssl_target_name_override", self.server_name)]
                   if self.server_name else [])
        return grpc.secure_channel(address, credentials, options=options)


def _call(address: str, method: str, request, timeout: float = 10.0,
          tls: ClientTls | None = None):
    channel = tls.channel(address) if tls and tls.enabled else grpc.insecure_channel(address)
    with channel:
        stub = pb_grpc.AdminStub(channel)
        try:
            return getattr(stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise GuardError(f"admin API at {address}: {exc.code().name}: "
                             f"{exc.details()}") from None


def admin_address_of(path: str) -> str:
    """The admin API's address in a guard config: server.admin_host (a wildcard host is reached
    on loopback) and server.admin_port. Only the server block is validated."""
    from pydantic import ValidationError

    from guard.config.document import format_validation_error, read_yaml
    from guard.config.server import ServerConfig
    from guard.errors import ConfigError

    _, data = read_yaml(path)
    server = data.get("server") if isinstance(data, dict) else None
    try:
        config = ServerConfig.model_validate(server or {})
    except ValidationError as exc:
        raise ConfigError([f"server.{line}" for line in format_validation_error(exc)],
                          str(path)) from None
    if not config.admin_port:
        raise GuardError(f"{path}: server.admin_port is 0 (a free port chosen at start): "
                         "give the address with --admin HOST:PORT")
    host = config.admin_host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{config.admin_port}"


def get_status(address: str, model: str = "", tls: ClientTls | None = None
               ) -> pb.GetStatusResponse:
    return _call(address, "GetStatus", pb.GetStatusRequest(model=model), tls=tls)


def _clock(unix_time: float) -> str:
    """A time of day in the status text (the machine's local time)."""
    return time.strftime("%H:%M:%S", time.localtime(unix_time))


def format_model_status(status: pb.ModelStatus) -> str:
    per_tier = "".join(f", {tier}: {action}" for tier, action in
                       sorted(status.tier_actions.items()))
    action = f"{status.action} ({per_tier[2:]})" if per_tier else status.action
    lines = [f"{status.name}: route={status.route} override={status.override} "
             f"action={action}{' (probing primary)' if status.probing else ''}"]
    for b in status.backends:
        lines.append(f"  {b.role:<9} {b.backend} {b.precision} {b.device} {b.artifact}")
    for w in status.windows:
        # (0: a guard that does not say)
        since = f" since {_clock(w.since_unix_time)}" if w.since_unix_time else ""
        lines.append(f"  window {w.tier}: {w.failures}/{w.samples} failing{since} "
                     f"(drift ratio {w.drift_ratio:.2f}; window {w.window}, "
                     f"decides from {w.min_samples})")
    if status.has_generation:
        g = status.generation
        kld = (f"{g.completions} of the last {g.window} completions, mean KLD "
               f"{g.mean_kld:.4f} nats/token (p99 {g.kld_p99:.4f})" if g.completions else
               "no completion with the primary's logprobs yet (sampled and greedy ones are "
               "checked without a KLD)")
        top1 = "n/a" if math.isnan(g.top1_agreement) else f"{g.top1_agreement:.1%}"
        lines.append(f"  KLD window: {kld}; same top-1 {top1}; not comparable "
                     f"{g.not_comparable}")
        if g.sampled_completions:
            lines.append(f"  sampled without logprobs: {g.sampled_completions} of the last "
                         f"{g.window}, pooled z {g.z_pooled:.2f} (about N(0, 1) while they "
                         "agree)")
        if g.not_comparable_by_reason:
            lines.append("  never compared, by reason (all processes, since start): " + ", ".join(
                f"{k}={v}" for k, v in sorted(g.not_comparable_by_reason.items())))
        if g.last_divergence_json:
            first = json.loads(g.last_divergence_json)
            top = ", ".join(f"{t!r} {p:.2f}" for t, p in first.get("reference_top", [])[:3])
            lines.append(f"  last divergence: at token {first.get('position')}, after "
                         f"{first.get('text_before', '')[-40:]!r} "
                         f"{divergent_token_phrase(first)} (reference: {top})")
    lines.append("  requests: " + ", ".join(f"{k}={v}" for k, v in sorted(status.requests.items())))
    lines.append("  mirror:   " + ", ".join(f"{k}={v}" for k, v in sorted(status.mirror.items())))
    if status.outputs_matched:
        lines.append("  outputs matched by position (reference -> primary): " + ", ".join(
            f"{k} -> {v}" for k, v in sorted(status.outputs_matched.items())))
    if status.ops_kept_back or status.repairing:
        lines.append(f"  ops kept at fp32: {', '.join(status.ops_kept_back) or 'none yet'}"
                     f"{' (repair running)' if status.repairing else ''}")
    if status.has_last_transition:
        t = status.last_transition
        when = _clock(t.unix_time)
        lines.append(f"  last transition {when}: {t.from_route} -> {t.to_route} ({t.trigger}): "
                     f"{t.reason}")
    return "\n".join(lines)


_COUNTS = ("requests", "mirror")  # ModelStatus's map<string, uint64> fields


# GenerationWindow's figures that are NaN where nothing was measured yet (no completion with
# the primary's logprobs, none sampled without): protobuf's JSON mapping writes "NaN".
_FIGURES = ("mean_kld", "kld_p99", "top1_agreement", "z_pooled")


def status_json(response: pb.GetStatusResponse) -> dict:
    """The status as JSON: every field, zeros and empty maps included (a script reads one
    shape), counts as numbers (protobuf's JSON mapping writes 64-bit integers as strings, for
    JavaScript's doubles; a count of requests is well within 2**53), and a figure not measured
    yet as null (JSON has no NaN; protobuf writes the string "NaN")."""
    data = MessageToDict(response, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
    for status in data.get("models", []):
        for field in _COUNTS:
            _numbers(status, field)
        generation = status.get("generation", {})
        _numbers(generation, "not_comparable_by_reason")
        for figure in _FIGURES:
            if isinstance(generation.get(figure), str):  # "NaN", "Infinity"
                generation[figure] = None
    return data


def _numbers(block: dict, field: str) -> None:
    """``block[field]``, a map of counts, with numbers for protobuf's JSON strings."""
    if field in block:
        block[field] = {k: int(v) for k, v in block[field].items()}


def print_status(address: str, model: str, as_json: bool, tls: ClientTls | None = None) -> int:
    response = get_status(address, model, tls)
    if as_json:
        print(json.dumps(status_json(response), indent=2))
    else:
        print(f"guard {response.guard_version} at {address}")
        for status in response.models:
            print(format_model_status(status))
    return 0


def set_route(address: str, model: str, route: str, reason: str,
              tls: ClientTls | None = None) -> int:
    response = _call(address, "SetRoute",
                     pb.SetRouteRequest(model=model, route=_ROUTES[route], reason=reason),
                     tls=tls)
    print(format_model_status(response.status))
    return 0


def reload_config(address: str, reason: str, tls: ClientTls | None = None) -> int:
    """Reload: what the reload did, one line each; exit 0 applied, 1 where a model kept its
    old version (failed), 2 where the file was rejected (a bad config: the config in force
    stays)."""
    # A reload loads the changed models (seconds to minutes for a large one): wait for it.
    response = _call(address, "Reload", pb.ReloadRequest(reason=reason), timeout=600.0, tls=tls)
    if response.result == "rejected":
        for problem in response.problems:
            print(f"guard: {problem}", file=sys.stderr)
        print("guard: the config was rejected; the one in force stays", file=sys.stderr)
        return 2
    parts = [f"{what} {', '.join(names)}" for what, names in (
        ("changed", response.changed), ("added", response.added),
        ("removed", response.removed)) if names]
    print(f"reload {response.result} (config {response.config_hash}): "
          + ("; ".join(parts) if parts else "no model changed"))
    for name, why in sorted(response.failed.items()):
        print(f"  {name}: kept its old version: {why}")
    return 0 if response.result == "applied" else 1
