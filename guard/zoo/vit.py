"""A small seeded ViT-style classifier: 4x4 patches of a 32x32 image (64 tokens + a class
token), learned positions, two pre-norm transformer blocks (multi-head attention written out
with matmul/softmax, GELU MLP), LayerNorm, a linear head scaled to a realistic logit spread.

Signature: input ``image`` FP32 [-1, 3, 32, 32], output ``logits`` FP32 [-1, 10].
"""

from __future__ import annotations

import math
from pathlib import Path

from guard.backends.base import TensorSpec
from guard.zoo.classifier import sample_inputs

NAME = "vit"
TASK = "classification"
INPUTS = [TensorSpec("image", "FP32", (-1, 3, 32, 32))]
OUTPUTS = [TensorSpec("logits", "FP32", (-1, 10))]
DIM, HEADS, DEPTH, PATCH = 64, 4, 2, 4

__all__ = ["NAME", "TASK", "INPUTS", "OUTPUTS", "build", "sample_inputs", "export"]


def build(seed: int = 0):
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(DIM, 3 * DIM)
            self.proj = nn.Linear(DIM, DIM)

        def forward(self, x):
            b, n, _ = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS), dim=-1)
            return self.proj((weights @ v).transpose(1, 2).reshape(b, n, DIM))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(DIM)
            self.attn = Attention()
            self.norm2 = nn.LayerNorm(DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, DIM, PATCH, PATCH)
            tokens = (32 // PATCH) ** 2
            self.cls = nn.Parameter(0.02 * torch.randn(1, 1, DIM))
            self.pos = nn.Parameter(0.02 * torch.randn(1, tokens + 1, DIM))
            self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, 10)

        def forward(self, image):
            x = self.patch(image).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
            x = self.norm(self.blocks(x))
            return self.head(x[:, 0])

    from guard.zoo.export import spread_logits

    torch.manual_seed(seed)
    model = ViT().eval()
    probe = torch.from_numpy(sample_inputs(64, seed=seed + 1))
    spread_logits(model.head, model, probe)
    return model


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from guard.zoo.export import export_pair

    example = (torch.from_numpy(sample_inputs(2, seed)),)
    return export_pair(NAME, build(seed), example, INPUTS, OUTPUTS, folder, seed)
