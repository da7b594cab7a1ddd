"""A small seeded CNN image classifier, exported as TorchScript and ONNX.

It is built so that the guard has something real to catch: one weight of ``fc1`` is an outlier
(40x the layer's largest), so per-tensor int8 quantisation of that layer spends its whole range
on one value and crushes the rest, the way a real outlier channel does. fp32 ONNX Runtime stays
within ~1e-5 of torch; the int8 variant that the guard derives itself drifts by far more.
Logits are scaled to a realistic spread so the argmax varies across inputs.

Signature: input ``image`` FP32 [-1, 3, 32, 32], output ``logits`` FP32 [-1, 10].
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import numpy as np

from guard.backends.base import TensorSpec

INPUTS = [TensorSpec("image", "FP32", (-1, 3, 32, 32))]
OUTPUTS = [TensorSpec("logits", "FP32", (-1, 10))]


def build(seed: int = 0):
    import torch
    from torch import nn

    class SmallCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.pool = nn.MaxPool2d(2)
            self.fc1 = nn.Linear(32 * 8 * 8, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, image):
            x = self.pool(torch.relu(self.conv1(image)))
            x = self.pool(torch.relu(self.conv2(x)))
            x = torch.relu(self.fc1(torch.flatten(x, 1)))
            return self.fc2(x)

    torch.manual_seed(seed)
    model = SmallCNN().eval()
    with torch.no_grad():
        w = model.fc1.weight
        w[0, 0] = 40.0 * float(w.abs().max())  # the outlier that per-tensor int8 cannot survive
        # Scale the head so logits spread like a trained model's (std of a few units).
        probe = torch.from_numpy(sample_inputs(64, seed=seed + 1))
        spread = float(model(probe).std())
        model.fc2.weight.mul_(3.0 / spread)
        model.fc2.bias.zero_()
    return model


def sample_inputs(n: int, seed: int = 0) -> np.ndarray:
    """Deterministic image-like inputs: smooth random fields plus noise, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(n, 3, 4, 4))
    smooth = np.kron(coarse, np.ones((1, 1, 8, 8)))
    return np.clip(0.6 * smooth + 0.3 * rng.normal(size=(n, 3, 32, 32)), -1, 1).astype(np.float32)


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter warns about torchvision ops and pytree deprecations: not our news."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch._dynamo", "torch.export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export(folder: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``classifier.pt`` (TorchScript with a guard.json signature) and ``classifier.onnx``.

    Returns the paths. Idempotent: files already there for this seed are reused.
    """
    import torch

    from guard.backends.torch import SIGNATURE_FILE, signature_json
    from guard.zoo.export import stamp_text, trace

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"torchscript": folder / "classifier.pt", "onnx": folder / "classifier.onnx"}
    stamp = folder / "classifier.seed"
    if (stamp.exists() and stamp.read_text() == stamp_text(seed)
            and all(p.exists() for p in paths.values())):
        return paths
    model = build(seed)
    example = torch.from_numpy(sample_inputs(2, seed))
    scripted = trace(model, (example,))
    torch.jit.save(scripted, str(paths["torchscript"]),
                   _extra_files={SIGNATURE_FILE: signature_json(INPUTS, OUTPUTS)})
    with _quiet_exporter():
        torch.onnx.export(
            model, (example,), str(paths["onnx"]), dynamo=True, external_data=False,
            input_names=["image"], output_names=["logits"],
            dynamic_shapes={"image": {0: torch.export.Dim("batch", max=4096)}},
            opset_version=20, verbose=False,
        )
    stamp.write_text(stamp_text(seed))
    (folder / "classifier.json").write_text(json.dumps({"seed": seed}))
    return paths
