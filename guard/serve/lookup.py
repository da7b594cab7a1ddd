"""The one way guard.v1 servicers find a model by name: NOT_FOUND when it is not configured."""

from __future__ import annotations

import grpc

from guard.serve.model import ServedModel


async def model_or_abort(models: dict[str, ServedModel], name: str, context) -> ServedModel:
    model = models.get(name)
    if model is None:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{name}'")
    return model
