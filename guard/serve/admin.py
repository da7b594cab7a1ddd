"""The guard.v1 admin API: model status, manual route override, and a reload of the config.

Served by the serving process (its port outlives verifier restarts); the route policy lives in
the verifier, so each call is forwarded there over the control channel and merged with what
this process knows (the backends that answer, requests per route). While the verifier is
restarting, GetStatus still answers (route from the route word, no windows) and SetRoute is
UNAVAILABLE.

Who may call: loopback only, unless ``server.admin_tls`` sets mutual TLS with an allow-list of
client identities (``guard config validate`` refuses a non-loopback ``admin_host`` without
them); a caller outside the allow-list gets PERMISSION_DENIED and an ``access_denied`` event.
Every change is an event naming the caller (its certificate identity and address).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from guard import __version__
from guard.ipc import routes
from guard.ipc.messages import Failed, RouteSet, SetRoute
from guard.observe.events import emit
from guard.serve.lookup import abort, model_or_abort
from guard.serve.model import ServedModel
from guard.serve.reload import ConfigReloader
from guard.serve.verifier_link import VerifierLink, VerifierUnavailable
from guard.serve.tls import CallerCheck
from guard.observe.metrics import counts
from guard.v1 import admin_pb2 as pb
from guard.v1 import admin_pb2_grpc as pb_grpc

_OVERRIDES = {pb.AUTO: "auto", pb.PRIMARY: "primary", pb.FALLBACK: "fallback"}


@dataclass(frozen=True)
class Seen:
    """Counts as the merged /metrics holds them (every serving process and the verifier, or
    Envoy in Envoy mode, where the serving process counts no request), per model."""

    requests: dict[str, dict[str, int]]  # {model: {route: count}}
    not_comparable: dict[str, dict[str, int]]  # {model: {reason: count}}


def served_status(model: ServedModel, verified: bytes | None,
                  seen: Seen | None = None) -> pb.ModelStatus:
    """The verifier's half (``verified``, serialized) merged with this process's half;
    ``seen``: the counts the merged /metrics holds (default: requests per route as this
    process counts them, no reasons)."""
    status = pb.ModelStatus()
    if verified is not None:
        status.ParseFromString(verified)
    else:  # the verifier is restarting: what the route word says
        word = model.table.get(model.slot, routes.ROUTE)
        route, probing, _ = routes.unpack(word)
        status.name, status.route, status.probing = model.name, route, probing
        status.action, status.override = model.config.policy.action, routes.override_of(word)
        status.tier_actions.update(model.config.policy.actions)
    reference = list(status.backends)
    del status.backends[:]
    for role, backend in model.backends.items():
        info = backend.describe()
        status.backends.add(role=role, backend=info.backend, precision=info.precision,
                            device=info.device, artifact=info.artifact)
    status.backends.extend(reference)
    status.requests.update(counts(model.metrics.requests, model.name, "route")
                           if seen is None else seen.requests.get(model.name, {}))
    if status.has_generation and seen is not None:
        status.generation.not_comparable_by_reason.update(
            seen.not_comparable.get(model.name, {}))
    status.mirror["dropped"] = status.mirror.get("dropped", 0) + int(
        model.metrics.mirror.labels(model.name, "dropped")._value.get())
    return status


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, models: dict[str, ServedModel], verifier: VerifierLink,
                 callers: CallerCheck | None = None, seen: Callable[[], Seen] | None = None,
                 reloader: Callable[[], ConfigReloader | None] = lambda: None):
        """``seen()``: the counts of the merged /metrics (a Seen); default: this process's
        request counters. ``reloader()``: what Reload runs, None where guard has no config
        file or is still starting."""
        self.models = models
        self.verifier = verifier
        self.callers = callers or CallerCheck("admin API")  # server.admin_tls's allow-list
        self.seen = seen
        self.reloader = reloader

    async def GetStatus(self, request, context):
        await self.callers.check(context, "GetStatus")
        if request.model:
            models = [await model_or_abort(self.models, request.model, context)]
        else:
            models = list(self.models.values())
        loop = asyncio.get_running_loop()
        try:
            verified = await loop.run_in_executor(None, self.verifier.status, request.model)
        except VerifierUnavailable:
            verified = {}
        seen = (await loop.run_in_executor(None, self.seen)
                if self.seen is not None else None)
        return pb.GetStatusResponse(guard_version=__version__, models=[
            served_status(m, verified.get(m.name), seen) for m in models])

    async def SetRoute(self, request, context):
        caller = await self.callers.check(context, "SetRoute")
        model = await model_or_abort(self.models, request.model, context)
        override = _OVERRIDES.get(request.route)
        if override is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        "route must be AUTO, PRIMARY or FALLBACK")
        if override == "fallback" and "fallback" not in model.backends:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model '{model.name}' has no fallback backend")
        reason = request.reason or f"set by admin API at {time.strftime('%H:%M:%S')}"
        message = SetRoute(model.name, override, reason)
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.run_in_executor(None, self.verifier.call, message)
        except VerifierUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not isinstance(reply, RouteSet):
            error = reply.error if isinstance(reply, Failed) else f"unexpected reply {reply}"
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, error)
        emit("admin_route_set", model=model.name, override=override, reason=reason,
             caller=caller)
        return pb.SetRouteResponse(
            status=served_status(model, base64.b64decode(reply.status)))

    async def Reload(self, request, context):
        """The config file read again and applied, as SIGHUP does; the answer says what the
        reload did (its events say it too, with ``trigger`` naming the caller)."""
        caller = await self.callers.check(context, "Reload")
        reloader = self.reloader()
        if reloader is None:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        "no config file to read again (guard was started from a config "
                        "object), or guard is starting or stopping: retry once it is ready")
        trigger = f"admin API ({caller})" + (f": {request.reason}" if request.reason else "")
        outcome = await reloader.reload(trigger)
        return pb.ReloadResponse(
            result=outcome.result, problems=outcome.problems, changed=outcome.changed,
            added=outcome.added, removed=outcome.removed, failed=dict(outcome.failed),
            config_hash=outcome.config_hash)
