"""A container isolated on the reference's tensors where only some of its children have a
counterpart: those that do are replaced, the others compute (an unknown child once broke the
whole isolation, and the container got no isolated error)."""

import numpy as np
import torch

from guard.backends.activations.torch import TorchSide
from guard.verify.activation.align import _substitutes


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.1)  # eval: identity; no counterpart on the other side
        self.out = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.drop(self.inner(x))) + 1.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def _side() -> TorchSide:
    torch.manual_seed(0)
    return TorchSide(Net(), ["x"])


def test_unknown_children_compute_and_known_ones_are_replaced():
    side = _side()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    capture = side.capture({"x": x})
    (block,) = [c for c in capture.calls if c.path == "block"]
    replaced = np.full((2, 3), 5.0, np.float32)
    # The other side knows block.out's tensors only (block.inner and block.drop have none).
    known = {"block.out#0": [replaced]}
    substitutes = _substitutes(capture, block, known.get)
    assert substitutes is not None
    assert substitutes["block.inner"] == [[]] and substitutes["block.drop"] == [[]]

    (result,) = side.run_module("block", [x], substitutes)
    # block.out answered the reference's tensor, and the block's own code (+1) ran on it.
    np.testing.assert_allclose(result, replaced + 1.0)


def test_no_known_child_means_no_substitution():
    side = _side()
    x = np.ones((1, 4), np.float32)
    capture = side.capture({"x": x})
    (block,) = [c for c in capture.calls if c.path == "block"]
    assert _substitutes(capture, block, {}.get) is None
    (result,) = side.run_module("block", [x], None)
    (expected,) = [c.outputs for c in capture.calls if c.path == "block"]
    np.testing.assert_allclose(result, expected[0], rtol=1e-6)
