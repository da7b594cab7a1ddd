"""Small real torch models for tests, loaded through guard's ``module:factory`` path (``affine``
has an ONNX form too: tests/affine_onnx.py).

They are genuine ``nn.Module``s run by the real torch backend; their only test-specific trait
is a data-dependent behaviour, so that a test can make a primary drift, a reference hang or a
backend raise by choosing the input, while everything between client and backend is real.

Signature: input ``x`` FP32 [-1, 4]; output ``y`` FP32 [-1, 3].

Triggers (first feature of any row):
- ``>= 1000``: ``affine(drift_on_trigger=True)`` adds 1.0 to that row's answer (drift: every
  logit moves alike, so the top-1 class stays; row by row, so that a batch of several requests
  drifts only where a request does).
- ``<= -1000``: ``affine(roll_on_trigger=True)`` rolls that row's answer by one class (the top-1
  class changes: what a task check sees).
- ``== 77``: ``affine(sleep_on_trigger=S)`` sleeps S seconds before answering (slow/hung).
- ``== -999``: ``affine(fail_on_trigger=True)`` raises RuntimeError (backend failure).
"""

from __future__ import annotations

import time

import torch
from torch import nn

SIGNATURE = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
}
DRIFT_TRIGGER = 1000.0
ROLL_TRIGGER = -1000.0
SLEEP_TRIGGER = 77.0
FAIL_TRIGGER = -999.0


class Affine(nn.Module):
    def __init__(self, drift_on_trigger=False, sleep_on_trigger=0.0, fail_on_trigger=False,
                 repeat=1, roll_on_trigger=False):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.linear = nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(3, 4, generator=generator))
            self.linear.bias.copy_(torch.randn(3, generator=generator))
        self.drift_on_trigger = drift_on_trigger
        self.sleep_on_trigger = sleep_on_trigger
        self.fail_on_trigger = fail_on_trigger
        self.repeat = repeat
        self.roll_on_trigger = roll_on_trigger
        self.guard_signature = SIGNATURE

    def forward(self, x):
        first = x[:, 0]
        if self.fail_on_trigger and bool((first == FAIL_TRIGGER).any()):
            raise RuntimeError("fixture model failure on trigger input")
        if self.sleep_on_trigger and bool((first == SLEEP_TRIGGER).any()):
            time.sleep(self.sleep_on_trigger)
        y = self.linear(x)
        for _ in range(self.repeat - 1):
            y = self.linear(x)
        if self.drift_on_trigger:
            y = y + (first >= DRIFT_TRIGGER).to(y.dtype)[:, None]
        if self.roll_on_trigger:
            rolled = (first <= ROLL_TRIGGER)[:, None]
            y = torch.where(rolled, y.roll(1, dims=1), y)
        return y


def affine(**kwargs) -> Affine:
    return Affine(**kwargs)


class Nested(nn.Module):
    """Returns a dict with a tuple inside: every leaf must become a named output."""

    def forward(self, x):
        return {"sum": x.sum(dim=1), "parts": (x * 2, x - 1)}


def nested() -> Nested:
    return Nested()


class WithParameterOutput(nn.Module):
    """Returns one of its parameters as is beside a computed output: a tensor made outside
    inference mode, which still requires grad (numpy() refuses it unless detached)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return {"y": x[:, :3] * self.scale, "scale": self.scale}


def with_parameter_output() -> WithParameterOutput:
    return WithParameterOutput()


def noisy_affine(**kwargs) -> Affine:
    """``affine``, saying so in the log (logger ``fixture.noisy``, WARNING) when it is built: a
    log line of whichever process loads it (the serving process, the verifier)."""
    import logging

    logging.getLogger("fixture.noisy").warning("built an affine model")
    return Affine(**kwargs)
