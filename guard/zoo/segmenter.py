"""A small seeded UNet-style segmenter: two encoder stages, a bottleneck, two decoder stages
with transposed-convolution upsampling and skip connections, a 1x1 head over 4 classes scaled
to a realistic logit spread (the argmax varies across each image).

Signature: input ``image`` FP32 [-1, 3, 32, 32], output ``mask`` FP32 [-1, 4, 32, 32] (class
scores; tier 3 takes the argmax over axis 1).
"""

from __future__ import annotations

from pathlib import Path

from guard.backends.base import TensorSpec
from guard.zoo.classifier import sample_inputs

NAME = "segmenter"
TASK = "segmentation"
CLASSES = 4
INPUTS = [TensorSpec("image", "FP32", (-1, 3, 32, 32))]
OUTPUTS = [TensorSpec("mask", "FP32", (-1, CLASSES, 32, 32))]

__all__ = ["NAME", "TASK", "INPUTS", "OUTPUTS", "build", "sample_inputs", "export"]


def build(seed: int = 0):
    import torch
    from torch import nn

    def double_conv(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, 1, 1), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc1 = double_conv(3, 16)
            self.enc2 = double_conv(16, 32)
            self.bottleneck = double_conv(32, 64)
            self.pool = nn.MaxPool2d(2)
            self.up2 = nn.ConvTranspose2d(64, 32, 2, 2)
            self.dec2 = double_conv(64, 32)
            self.up1 = nn.ConvTranspose2d(32, 16, 2, 2)
            self.dec1 = double_conv(32, 16)
            self.head = nn.Conv2d(16, CLASSES, 1)

        def forward(self, image):
            e1 = self.enc1(image)
            e2 = self.enc2(self.pool(e1))
            b = self.bottleneck(self.pool(e2))
            d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
            d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
            return self.head(d1)

    from guard.zoo.export import spread_logits

    torch.manual_seed(seed)
    model = UNet().eval()
    probe = torch.from_numpy(sample_inputs(16, seed=seed + 1))
    spread_logits(model.head, model, probe)
    return model


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from guard.zoo.export import export_pair

    example = (torch.from_numpy(sample_inputs(2, seed)),)
    return export_pair(NAME, build(seed), example, INPUTS, OUTPUTS, folder, seed)
