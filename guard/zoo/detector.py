"""A small seeded single-stage detector whose head ends in score/box outputs and NMS.

Backbone: three stride-2 convolutions (64x64 -> 8x8 grid). Head: per cell a box (centre offset,
log size around a 24 px anchor), an objectness and 3 class logits. Scores are objectness x class
probability, scaled and capped at 1.0 (a calibration that saturates, as confident detectors'
scores do), so several candidates score exactly 1.0: ties that a sort orders as the backend
pleases (torch and ONNX Runtime do differ here). The graph sorts the 64 candidates by score and
runs a class-aware matrix ("fast") NMS: a candidate is suppressed (score 0) when a higher-ranked
one of its class overlaps it above IoU 0.5. The ``stable_nms`` adapter drops the suppressed,
re-sorts by (score desc, x1, y1) and re-runs NMS deterministically in numpy, on both sides. What
it cannot undo (a tie between two overlapping boxes of one class, suppressed the other way round
inside the graph) is a real difference in the answer, and tier 3 reports it.

Signature: input ``image`` FP32 [-1, 3, 64, 64]; outputs ``boxes`` FP32 [-1, 64, 4] (x1, y1,
x2, y2 in pixels), ``scores`` FP32 [-1, 64], ``labels`` INT64 [-1, 64].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from guard.backends.base import TensorSpec

NAME = "detector"
TASK = "detection"
SIZE, GRID, CLASSES = 64, 8, 3
TOP_K = GRID * GRID  # every candidate is kept in the output (suppressed ones score 0)
INPUTS = [TensorSpec("image", "FP32", (-1, 3, SIZE, SIZE))]
OUTPUTS = [TensorSpec("boxes", "FP32", (-1, TOP_K, 4)), TensorSpec("scores", "FP32", (-1, TOP_K)),
           TensorSpec("labels", "INT64", (-1, TOP_K))]
ADAPTERS = [{"stable_nms": {"score_threshold": 0.05}}]


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    """Image-like inputs at 64x64: smooth random fields plus noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(n, 3, 8, 8))
    smooth = np.kron(coarse, np.ones((1, 1, 8, 8)))
    return np.clip(0.6 * smooth + 0.3 * rng.normal(size=(n, 3, SIZE, SIZE)), -1, 1).astype(
        np.float32)


def build(seed: int = 0):
    import torch
    from torch import nn

    stride = SIZE // GRID

    class Detector(nn.Module):
        grid: torch.Tensor  # (buffers, registered below)
        upper: torch.Tensor

        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(
                nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(),
                nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(),
            )
            self.head = nn.Conv2d(32, 5 + CLASSES, 1)
            ys, xs = torch.meshgrid(torch.arange(GRID), torch.arange(GRID), indexing="ij")
            self.register_buffer("grid", torch.stack([xs, ys], -1).reshape(-1, 2).float())
            self.register_buffer("upper", torch.triu(torch.ones(TOP_K, TOP_K), diagonal=1))

        def forward(self, image):
            p = self.head(self.backbone(image)).flatten(2).transpose(1, 2)  # [B, 64, 5 + C]
            centre = (self.grid + 0.5 + 0.5 * torch.tanh(p[..., 0:2])) * stride
            size = 24.0 * torch.exp(torch.clamp(p[..., 2:4], -1.0, 1.0))
            boxes = torch.cat([centre - size / 2, centre + size / 2], dim=-1)
            probs, labels = torch.softmax(p[..., 5:], dim=-1).max(dim=-1)
            scores = torch.clamp(1.5 * torch.sigmoid(p[..., 4]) * probs, max=1.0)
            top, idx = torch.sort(scores, dim=1, descending=True)
            boxes = torch.gather(boxes, 1, idx.unsqueeze(-1).expand(-1, -1, 4))
            labels = torch.gather(labels, 1, idx)
            # Matrix NMS: suppress j if a higher-ranked i < j of its class overlaps > 0.5.
            lt = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
            rb = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
            inter = torch.clamp(rb - lt, min=0.0).prod(-1)
            area = (boxes[..., 2:] - boxes[..., :2]).prod(-1)
            iou = inter / (area[:, :, None] + area[:, None, :] - inter)
            same = (labels[:, :, None] == labels[:, None, :]).float()
            overlap = (iou * same * self.upper).max(dim=1).values
            return boxes, top * (overlap <= 0.5).float(), labels

    torch.manual_seed(seed)
    model = Detector().eval()
    with torch.no_grad():
        # A spread like a trained head's: objectness from clearly off to clearly on, and
        # class logits far enough apart that the class probability is not always ~1/3.
        probe = model.head(model.backbone(torch.from_numpy(sample_inputs(16, seed + 1))))
        obj, cls = probe[:, 4], probe[:, 5:]
        model.head.weight[4].mul_(4.0 / float(obj.std()))
        bias = model.head.bias
        assert bias is not None  # (a Conv2d's, with bias)
        bias[4].fill_(-4.0 * float(obj.mean()) / float(obj.std()) - 1.5)
        model.head.weight[5:].mul_(2.0 / float(cls.std()))
    return model


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    import torch

    from guard.zoo.export import export_pair

    example = (torch.from_numpy(sample_inputs(2, seed)),)
    return export_pair(NAME, build(seed), example, INPUTS, OUTPUTS, folder, seed)
