"""Torch factories for the matrix tests: outputs with structure (dicts, lists, nesting).

``structured(bump=0.0, shape_change=False, flat=False)`` returns ``{"sum": [B], "parts": (x*2,
x-1)}``; ``bump`` shifts one nested leaf (``parts.1``), ``shape_change`` makes ``parts.0``
another shape, and ``flat`` returns the parts as one tensor instead of a tuple (other nesting).
Signature: input ``x`` FP32 [-1, 4].
"""

from __future__ import annotations

import torch
from torch import nn

SIGNATURE = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}], "outputs": []}


class Structured(nn.Module):
    def __init__(self, bump=0.0, shape_change=False, flat=False):
        super().__init__()
        self.bump, self.shape_change, self.flat = bump, shape_change, flat
        self.guard_signature = SIGNATURE

    def forward(self, x):
        first = x * 2
        if self.shape_change:
            first = first[:, :3]
        parts = (first, x - 1 + self.bump)
        if self.flat:
            return {"sum": x.sum(dim=1), "parts": torch.cat(parts, dim=1)}
        return {"sum": x.sum(dim=1), "parts": parts}


def structured(**kwargs) -> Structured:
    return Structured(**kwargs)
