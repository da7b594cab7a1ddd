"""A request's input tensors against a model's signature: the check the serving path and
``guard replay`` both run before a backend sees the arrays."""

from __future__ import annotations

import numpy as np

from guard.protocol.codec import invalid
from guard.protocol.tensors import TensorSpec, oip_datatype


def check_inputs(inputs: dict[str, np.ndarray], known: dict[str, TensorSpec]) -> None:
    """Names, datatypes and shapes against the model's signature, each error naming the tensor
    (INVALID_ARGUMENT). A backend that cannot name its inputs (empty ``known``) is left to
    complain itself."""
    if known and inputs.keys() != known.keys():  # names checked one by one only when they differ
        unknown = [n for n in inputs if n not in known]
        if unknown:
            raise invalid(f"unknown input '{unknown[0]}' (the model takes: {', '.join(known)})")
        missing = [n for n in known if n not in inputs]
        if missing:
            raise invalid(f"missing input '{missing[0]}' (the model takes: {', '.join(known)})")
    for name, array in inputs.items():
        spec = known.get(name)
        if spec is None:
            continue
        if spec.datatype and oip_datatype(array.dtype) != spec.datatype:
            raise invalid(f"input '{name}': datatype {oip_datatype(array.dtype)}, the model "
                          f"expects {spec.datatype}")
        if spec.shape and not _shape_fits(spec.shape, array.shape):
            raise invalid(f"input '{name}': shape {list(array.shape)} does not match the "
                          f"model's {list(spec.shape)} (-1 = any)")


def _shape_fits(want: tuple, got: tuple) -> bool:
    """``got`` matches the signature's ``want`` (same rank; -1 in ``want`` matches any)."""
    if len(want) != len(got):
        return False
    for w, g in zip(want, got):
        if w != g and w != -1:
            return False
    return True
