"""The guard.v1 admin API: model status and manual route override."""

from __future__ import annotations

import time

import grpc

from guard import __version__
from guard.serve.lookup import model_or_abort
from guard.serve.model import GuardedModel
from guard.v1 import admin_pb2 as pb
from guard.v1 import admin_pb2_grpc as pb_grpc

_OVERRIDES = {pb.AUTO: "auto", pb.PRIMARY: "primary", pb.FALLBACK: "fallback"}


def _sample_counts(metric, model: str, label: str) -> dict[str, int]:
    """Current values of a counter's children for one model, read from the registry."""
    counts: dict[str, int] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == model:
                counts[sample.labels[label]] = int(sample.value)
    return counts


def model_status(model: GuardedModel) -> pb.ModelStatus:
    policy = model.policy
    status = pb.ModelStatus(
        name=model.name, route=policy.route, override=policy.override,
        action=model.config.policy.action, probing=policy.probing,
    )
    for w in policy.windows():
        status.windows.add(tier=w.tier, samples=w.samples, failures=w.failures,
                           drift_ratio=w.ratio, window=model.config.policy.window,
                           min_samples=model.config.policy.min_samples)
    last = policy.last_transition
    if last is not None:
        status.has_last_transition = True
        status.last_transition.CopyFrom(pb.Transition(
            from_route=last.from_route, to_route=last.to_route, trigger=last.trigger,
            reason=last.reason, unix_time=last.unix_time))
    for role, backend in model.backends.items():
        info = backend.describe()
        status.backends.add(role=role, backend=info.backend, precision=info.precision,
                            device=info.device, artifact=info.artifact)
    if model.ops is not None:
        status.ops_kept_back.extend(model.ops.kept)
        status.repairing = model.ops.repairing
    status.mirror.update(_sample_counts(model.metrics.mirror, model.name, "outcome"))
    status.requests.update(_sample_counts(model.metrics.requests, model.name, "route"))
    return status


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, models: dict[str, GuardedModel]):
        self.models = models

    async def GetStatus(self, request, context):
        if request.model:
            models = [await model_or_abort(self.models, request.model, context)]
        else:
            models = list(self.models.values())
        return pb.GetStatusResponse(guard_version=__version__,
                                    models=[model_status(m) for m in models])

    async def SetRoute(self, request, context):
        model = await model_or_abort(self.models, request.model, context)
        override = _OVERRIDES.get(request.route)
        if override is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "route must be AUTO, PRIMARY or FALLBACK")
        if override == "fallback" and "fallback" not in model.backends:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model '{model.name}' has no fallback backend")
        reason = request.reason or f"set by admin API at {time.strftime('%H:%M:%S')}"
        model.set_override(override, reason)
        return pb.SetRouteResponse(status=model_status(model))
