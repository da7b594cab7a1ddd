"""A seeded ResNet-style CNN classifier: stem, three residual stages with batch norm, global
pooling, a linear head scaled to a realistic logit spread (the argmax varies across inputs).

Signature: input ``image`` FP32 [-1, 3, 32, 32], output ``logits`` FP32 [-1, 10].
"""

from __future__ import annotations

from pathlib import Path

from guard.backends.base import TensorSpec
from guard.zoo.classifier import sample_inputs

NAME = "resnet"
TASK = "classification"
INPUTS = [TensorSpec("image", "FP32", (-1, 3, 32, 32))]
OUTPUTS = [TensorSpec("logits", "FP32", (-1, 10))]

__all__ = ["NAME", "TASK", "INPUTS", "OUTPUTS", "build", "sample_inputs", "export"]


def build(seed: int = 0):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = (nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                      nn.ReLU())
            self.layer1 = Block(16, 16, 1)
            self.layer2 = Block(16, 32, 2)
            self.layer3 = Block(32, 64, 2)
            self.fc = nn.Linear(64, 10)

        def forward(self, image):
            x = self.layer3(self.layer2(self.layer1(self.stem(image))))
            return self.fc(torch.flatten(torch.mean(x, dim=(2, 3)), 1))

    from guard.zoo.export import spread_logits

    torch.manual_seed(seed)
    model = ResNet()
    # Batch-norm statistics as after training (not the identity of a fresh layer).
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            n, mean, var = module.num_features, module.running_mean, module.running_var
            assert mean is not None and var is not None  # (track_running_stats)
            mean.copy_(0.1 * torch.randn(n, generator=generator))
            var.copy_(0.5 + torch.rand(n, generator=generator))
            module.weight.data.copy_(0.8 + 0.4 * torch.rand(n, generator=generator))
    model.eval()
    probe = torch.from_numpy(sample_inputs(64, seed=seed + 1))
    spread_logits(model.fc, model, probe)
    return model


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from guard.zoo.export import export_pair

    example = (torch.from_numpy(sample_inputs(2, seed)),)
    return export_pair(NAME, build(seed), example, INPUTS, OUTPUTS, folder, seed)
