"""Inputs generated from a model's signature (seeded), for whoever needs to run a model with no
request at hand: the noise floor and the matrix (guard/verify/noise.py, guard/matrix/runner.py),
the serving process timing a backend at load, OpenVINO's int8 calibration. Float inputs are
standard normal, integer inputs in [0, 10), booleans at random; ``rows`` along axis 0.
"""

from __future__ import annotations

import numpy as np

from guard.protocol.tensors import OIP_TO_NUMPY, TensorSpec


class CannotGenerate(ValueError):
    """The signature has no datatype or shape for an input, or unknown non-batch dimensions."""


def generate_inputs(specs: tuple[TensorSpec, ...], rows: int,
                    seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs shaped by the signature, ``rows`` along axis 0."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
        if not spec.datatype or spec.datatype not in OIP_TO_NUMPY or not spec.shape:
            raise CannotGenerate(f"input '{spec.name}' has no known datatype/shape")
        if any(d < 0 for d in spec.shape[1:]):
            raise CannotGenerate(f"input '{spec.name}' has unknown dimensions {list(spec.shape)}")
        shape = (rows,) + tuple(spec.shape[1:])
        dtype = OIP_TO_NUMPY[spec.datatype]
        if np.issubdtype(dtype, np.floating):
            out[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            out[spec.name] = rng.random(shape) < 0.5
        else:
            out[spec.name] = rng.integers(0, 10, size=shape).astype(dtype)
    return out
