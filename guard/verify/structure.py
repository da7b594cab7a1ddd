"""Outputs of any structure, flattened to named arrays so that every leaf gets compared.

Backends return ``dict[str, ndarray]``, but a model (or an offline sweep's factory) may hand back
lists, tuples, dicts, nested, with scalars, strings or None among the leaves. Each leaf becomes
one named output (``boxes``, ``parts.0``, ``meta.label``): a structure that differs between the
two sides shows up as outputs one side lacks, and a leaf that is not a number is compared for
equality. Nothing is passed unseen.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _leaf(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    # A torch tensor, without importing torch.
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            tensor = tensor.float()
        return tensor.numpy()
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):  # a flat list of numbers
        return np.asarray(value)
    if isinstance(value, (str, bytes)) or value is None:
        return np.asarray(value, dtype=object)
    return np.asarray(repr(value), dtype=object)


def flatten_outputs(value: Any, prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    _flatten(value, prefix, out)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(value, dict):
        if not value and prefix:
            out[prefix] = np.asarray("{}", dtype=object)
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, (list, tuple)) and not _is_numeric_sequence(value):
        if not value and prefix:
            out[prefix] = np.asarray("[]", dtype=object)
        for i, item in enumerate(value):
            _flatten(item, f"{prefix}.{i}" if prefix else f"output{i}", out)
    else:
        out[prefix or "output0"] = _leaf(value)


def _is_numeric_sequence(value) -> bool:
    """A flat list of numbers is one tensor-like leaf, not a structure."""
    return bool(value) and all(
        isinstance(v, (bool, int, float, np.generic)) and not isinstance(v, np.ndarray)
        for v in value)


def is_flat(outputs: Any) -> bool:
    return isinstance(outputs, dict) and all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in outputs.items())
