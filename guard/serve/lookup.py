"""The one way guard.v1 servicers find a model by name: NOT_FOUND when it is not configured."""

from __future__ import annotations

import grpc

from guard.serve.model import GuardedModel


async def model_or_abort(models: dict[str, GuardedModel], name: str, context) -> GuardedModel:
    model = models.get(name)
    if model is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{name}'")
    return model
