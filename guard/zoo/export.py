"""Export a seeded zoo model to TorchScript (with its guard.json signature) and ONNX, cached.

Every zoo model is exported the same way: ``NAME.pt`` (``torch.jit.trace``, the signature saved
inside as ``guard.json``) and ``NAME.onnx`` (the dynamo exporter, opset 20, one file, a dynamic
batch axis on every input). A stamp file records the seed; an export already there for the same
seed is reused.
"""

from __future__ import annotations

import json
from pathlib import Path

from guard.backends.base import TensorSpec


def export_pair(
    name: str,
    model,
    example: tuple,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    folder: str | Path,
    seed: int,
) -> dict[str, Path]:
    import torch

    from guard.backends.torch import SIGNATURE_FILE, signature_json
    from guard.zoo.classifier import _quiet_exporter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"torchscript": folder / f"{name}.pt", "onnx": folder / f"{name}.onnx"}
    stamp = folder / f"{name}.seed"
    if (stamp.exists() and stamp.read_text() == str(seed)
            and all(p.exists() for p in paths.values())):
        return paths
    with _quiet_exporter(), torch.no_grad():
        scripted = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(scripted, str(paths["torchscript"]),
                       _extra_files={SIGNATURE_FILE: signature_json(inputs, outputs)})
        batch = torch.export.Dim("batch", min=1, max=4096)
        torch.onnx.export(
            model, example, str(paths["onnx"]), dynamo=True, external_data=False,
            input_names=[s.name for s in inputs], output_names=[s.name for s in outputs],
            dynamic_shapes=tuple({0: batch} for _ in inputs),
            opset_version=20, verbose=False,
        )
    stamp.write_text(str(seed))
    (folder / f"{name}.json").write_text(json.dumps({"seed": seed}))
    return paths


def spread_logits(linear, model, probe, target_std: float = 3.0, output=None) -> None:
    """Scale a head so its logits spread like a trained model's (std ``target_std``).

    Seeded random networks give near-constant logits, so every input gets the same argmax and
    task-level checks test nothing; a realistic spread makes the argmax vary across inputs.
    """
    import torch

    with torch.no_grad():
        result = model(probe)
        if output is not None:
            result = output(result)
        # Centre per class (a random head prefers one class for every input), then scale.
        linear.bias.sub_(result.mean(dim=tuple(i for i in range(result.ndim) if i != 1)))
        spread = float(model(probe).std() if output is None else output(model(probe)).std())
        linear.weight.mul_(target_std / spread)
        linear.bias.mul_(target_std / spread)
