"""A user's own model, exported by hand as the README's first-hours walkthrough does (not guard's
zoo): a small torch MLP saved as TorchScript with ``torch.jit.trace`` (no guard.json, so its output
is ``output0``) and as ONNX with the output named ``scores``."""

from __future__ import annotations

import warnings
from pathlib import Path

FEATURES, CLASSES = 8, 4


def build(seed: int = 0, outputs: int = 1):
    import torch

    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(),
                                            torch.nn.Linear(16, CLASSES))

        def forward(self, x):
            scores = self.body(x)
            return scores if outputs == 1 else (scores, scores.argmax(dim=1))

    return Net().eval()


def export(folder: Path, seed: int = 0, outputs: int = 1) -> dict[str, Path]:
    """``{'torchscript': net.pt, 'onnx': net.onnx}`` of the same weights."""
    import torch

    model = build(seed, outputs)
    example = torch.randn(2, FEATURES)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"torchscript": folder / f"net{outputs}.pt", "onnx": folder / f"net{outputs}.onnx"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript-based exporter
        torch.jit.save(torch.jit.trace(model, example), str(paths["torchscript"]))
        torch.onnx.export(model, (example,), str(paths["onnx"]), dynamo=False,
                          input_names=["x"],
                          output_names=["scores"] if outputs == 1 else ["scores", "label"],
                          dynamic_axes={"x": {0: "batch"}}, opset_version=17)
    return paths
