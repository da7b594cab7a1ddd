"""The one way guard.v1 servicers find a model by name: NOT_FOUND when it is not configured."""

from __future__ import annotations

from typing import NoReturn

import grpc

from guard.serve.model import ServedModel


async def model_or_abort(models: dict[str, ServedModel], name: str, context) -> ServedModel:
    model = models.get(name)
    if model is None:
        await abort(context, grpc.StatusCode.NOT_FOUND, f"unknown model '{name}'")
    return model


async def abort(context, code, details: str) -> NoReturn:
    """``context.abort``: it ends the call by raising (said here, as grpc has no type
    information)."""
    await context.abort(code, details)
    raise AssertionError("grpc's context.abort returned")
