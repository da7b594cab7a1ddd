"""A small seeded model that fp16 breaks in one place: a LayerNorm fed large raw readings.

The input is 16 raw sensor readings in pascal (atmospheric pressure, ~1.0e5 with a spread of
~1e3 between sensors), and the model's first layer is a LayerNorm over them, the common way to
standardise raw features inside the model. fp32 does this well (its resolution at 1e5 is 0.008,
far below the spread). fp16 cannot even hold the input: its largest finite value is 65504, so
the fp16 variant's input Cast makes every reading inf and the LayerNorm (which ONNX Runtime runs
with a real fp16 kernel) answers NaN, and every logit with it. ONNX Runtime's own graph
optimisations hide such an overflow for ops it has no fp16 kernel for (it runs them in fp32 and
drops the Cast pair), so the overflow is placed where it really happens. Keeping the LayerNorm
at fp32 (the fp16 converter's node block list) restores it; the Linear layers after it run
fine in fp16.

Signature: input ``x`` FP32 [-1, 16] (~1e5), output ``logits`` FP32 [-1, 10].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from guard.backends.base import TensorSpec

NAME = "pressure"
INPUTS = [TensorSpec("x", "FP32", (-1, 16))]
OUTPUTS = [TensorSpec("logits", "FP32", (-1, 10))]
ATMOSPHERE_PA = 101_325.0  # past fp16's largest finite value, 65504
SENSOR_SPREAD_PA = 1_000.0


def build(seed: int = 0):
    import torch
    from torch import nn

    class PressureNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.fc1 = nn.Linear(16, 64)
            self.fc2 = nn.Linear(64, 64)
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            x = torch.relu(self.fc1(self.norm(x)))
            return self.head(torch.relu(self.fc2(x)))

    from guard.zoo.export import spread_logits

    torch.manual_seed(seed)
    model = PressureNet().eval()
    spread_logits(model.head, model, torch.from_numpy(sample_inputs(64, seed + 1)))
    return model


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    """Readings around one atmosphere: a per-sample level plus a per-sensor spread."""
    rng = np.random.default_rng(seed)
    level = ATMOSPHERE_PA + rng.normal(0, 2_000.0, size=(n, 1))
    return (level + rng.normal(0, SENSOR_SPREAD_PA, size=(n, 16))).astype(np.float32)


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from guard.zoo.export import export_pair

    example = (torch.from_numpy(sample_inputs(2, seed)),)
    return export_pair(NAME, build(seed), example, INPUTS, OUTPUTS, folder, seed)
