"""A small seeded torch model whose fp16 ``torch_compile`` primary breaks in one submodule.

A sequence classifier: 6 tokens of 8 features, an ``embed`` Linear to width 32 whose activations
are ~100 each (as un-normalised residual streams are), a single-head cosine self-attention
``attn`` (softmax of 10 x cos(q_i, k_j), as Swin v2's) and a linear ``head`` over the mean
token. ``attn`` computes the cosine as the product ``q @ k^T`` divided by the outer product of
the norms, instead of normalising q and k first: with |q|, |k| ~ 500 both reach ~1e5, past
fp16's largest finite value (65504), so in fp16 they are inf, inf/inf is NaN, and so is the
answer. Measured on ``sample_inputs(16, seed=21)``: the compiled fp16 primary fails tier 1
(rtol 0.05) on 10 of 16 sequences (9 NaN; on 112 sequences of three seeds, 93 fail), eager fp16
on 16 (inductor's fused kernels overflow on fewer rows than eager, but still the matmul writes
its result in fp16). What goes into ``attn`` (~100) and what comes out of it (a convex
combination of values) is well inside fp16, and the softmax over cosines x 10 is smooth, so
running ``attn`` alone eagerly in fp32 (``options.eager_fp32_modules: [attn]``) leaves the
compiled fp16 graph around it unchanged and restores every answer (relative error at most
1.4e-3 vs fp32 on those 16, 2.2e-3 on the 112: the fp16 rounding of ``embed`` and ``head``).
Keeping ``head`` instead changes nothing (10 of 16 still fail).

``attn`` is a leaf module (its projections are parameters, not Linear children), so tier 2
names it, and keeping it back is the whole repair. The weights come from a generator of the
model's own (see ``build``).

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
EMBED_GAIN = 150.0  # embed activations ~100 each, |q| and |k| ~500: q . k past 65504
LOGIT_SCALE = 10.0  # the attention temperature (as a cosine attention's learned scale)


def build(seed: int = 0):
    import torch
    from torch import nn

    # A generator of its own, not torch's global one: the sidecar builds the primary, the
    # reference and the fallback on parallel threads, and with a shared RNG their draws would
    # interleave into three different models.
    generator = torch.Generator().manual_seed(seed)

    def uniform(*shape: int, bound: float):
        return (torch.rand(*shape, generator=generator) * 2 - 1) * bound

    def linear(fan_in: int, fan_out: int, gain: float = 1.0):
        layer = nn.Linear(fan_in, fan_out)
        with torch.no_grad():  # torch's default init, drawn from the model's own generator
            layer.weight.copy_(uniform(fan_out, fan_in, bound=gain / math.sqrt(fan_in)))
            layer.bias.copy_(uniform(fan_out, bound=gain / math.sqrt(fan_in)))
        return layer

    class SelfAttention(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            scale = 1.0 / math.sqrt(width)  # keeps |q| ~ |h|
            self.wq = nn.Parameter(torch.randn(width, width, generator=generator) * scale)
            self.wk = nn.Parameter(torch.randn(width, width, generator=generator) * scale)
            self.wv = nn.Parameter(torch.randn(width, width, generator=generator) * scale)

        def forward(self, h):
            q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
            # Cosine similarity as the product over the norms, not of normalised q and k:
            # the product (and the norms' outer product) overflow fp16.
            norms = q.norm(dim=-1, keepdim=True) * k.norm(dim=-1).unsqueeze(-2)
            cosine = (q @ k.transpose(-1, -2)) / norms
            return torch.softmax(cosine * LOGIT_SCALE, dim=-1) @ v

    class SequenceClassifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = linear(FEATURES, WIDTH, gain=EMBED_GAIN)
            self.attn = SelfAttention(WIDTH)
            self.head = linear(WIDTH, 10)
            self.guard_signature = SIGNATURE

        def forward(self, x):
            return self.head(self.attn(self.embed(x)).mean(dim=1))

    from guard.zoo.export import spread_logits

    model = SequenceClassifier().eval()
    spread_logits(model.head, model, torch.from_numpy(sample_inputs(64, seed + 1)))
    return model


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, TOKENS, FEATURES)).astype(np.float32)
