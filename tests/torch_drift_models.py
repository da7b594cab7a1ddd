"""A small seeded torch model whose fp16 ``torch_compile`` primary breaks in one submodule.

A sequence classifier: 6 tokens of 8 features, an ``embed`` Linear to width 32 whose activations
reach a few hundred (as un-normalised residual streams do), a single-head self-attention
``attn`` and a linear ``head`` over the mean token. ``attn`` computes its scores as ``q @ k^T``
and only then scales them by 1/sqrt(32), the textbook order: ``q . k`` reaches ~1.6e5, past
fp16's largest finite value (65504), so in fp16 the scores are inf and the softmax answers NaN
on most sequences (9 of ``sample_inputs(16, seed=21)``). Eager fp16 and inductor's compiled fp16 both
overflow there: the matmul writes its result in fp16 before any scaling. What goes into ``attn``
(~300) and what comes out of it (a convex combination of values, ~300) is well inside fp16, so
running ``attn`` alone eagerly in fp32 (``options.eager_fp32_modules: [attn]``) leaves the
compiled fp16 graph around it unchanged and restores the answers (relative error ~1e-3 vs
fp32, the fp16 rounding of ``embed`` and ``head``).

``attn`` is a leaf module (its projections are parameters, not Linear children), so tier 2
names it, and keeping it back is the whole repair.

Signature: input ``x`` FP32 [-1, 6, 8] (~N(0, 1)), output ``logits`` FP32 [-1, 10].
Factory: ``torch_drift_models:build`` (a ``module:factory`` path for the torch backends).
"""

from __future__ import annotations

import math

import numpy as np

SIGNATURE = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 6, 8]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
}
TOKENS, FEATURES, WIDTH = 6, 8, 32
EMBED_GAIN = 150.0  # embed activations up to ~300: the scores q . k reach ~1.6e5 > 65504


def build(seed: int = 0):
    import torch
    from torch import nn

    class SelfAttention(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            scale = 1.0 / math.sqrt(width)
            self.wq = nn.Parameter(torch.randn(width, width) * scale)
            self.wk = nn.Parameter(torch.randn(width, width) * scale)
            self.wv = nn.Parameter(torch.randn(width, width) * scale)

        def forward(self, h):
            q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
            scores = q @ k.transpose(-1, -2)  # scaled after the product: overflows fp16
            return torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v

    class SequenceClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(FEATURES, WIDTH)
            self.attn = SelfAttention(WIDTH)
            self.head = nn.Linear(WIDTH, 10)
            self.guard_signature = SIGNATURE

        def forward(self, x):
            return self.head(self.attn(self.embed(x)).mean(dim=1))

    from guard.zoo.export import spread_logits

    torch.manual_seed(seed)
    model = SequenceClassifier().eval()
    with torch.no_grad():
        model.embed.weight.mul_(EMBED_GAIN)
        model.embed.bias.mul_(EMBED_GAIN)
    spread_logits(model.head, model, torch.from_numpy(sample_inputs(64, seed + 1)))
    return model


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, TOKENS, FEATURES)).astype(np.float32)
