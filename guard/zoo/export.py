"""Export a seeded zoo model to TorchScript (with its guard.json signature) and ONNX, cached.

Every zoo model is exported the same way: ``NAME.pt`` (``torch.jit.trace``, the signature saved
inside as ``guard.json``) and ``NAME.onnx`` (the dynamo exporter, opset 20, one file, a dynamic
batch axis on every input). A stamp file records the seed and the export's format; an export
already there for the same seed and format is reused.

The trace is made under torch's default cuDNN flags whatever this process has set (a reference
may have pinned TF32 off before a model is first exported): ``torch.jit.trace`` bakes them into
each convolution (guard/backends/traced_flags.py), so without this the file's behaviour on a
GPU would depend on what ran before the export. The defaults make it the file a user who traced
with torch's defaults would have: convolutions with TF32 allowed.
"""

from __future__ import annotations

import json
from pathlib import Path

from guard.backends.base import TensorSpec

# In the stamp beside the seed: an export from before the trace's flags were fixed is redone.
FORMAT = "trace-cudnn-defaults"


def stamp_text(seed: int) -> str:
    return f"{seed} {FORMAT}"


def trace(model, example: tuple, **kwargs):
    """``torch.jit.trace`` under torch's default cuDNN flags (see the module's docstring)."""
    import torch

    from guard.backends.traced_flags import TORCH_DEFAULTS, tracing_flags

    with tracing_flags(TORCH_DEFAULTS):
        return torch.jit.trace(model, example, **kwargs)


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
    if (stamp.exists() and stamp.read_text() == stamp_text(seed)
            and all(p.exists() for p in paths.values())):
        return paths
    with _quiet_exporter(), torch.no_grad():
        scripted = trace(model, example, check_trace=False)
        torch.jit.save(scripted, str(paths["torchscript"]),
                       _extra_files={SIGNATURE_FILE: signature_json(inputs, outputs)})
        batch = torch.export.Dim("batch", min=1, max=4096)
        torch.onnx.export(
            model, example, str(paths["onnx"]), dynamo=True, external_data=False,
            input_names=[s.name for s in inputs], output_names=[s.name for s in outputs],
            dynamic_shapes=tuple({0: batch} for _ in inputs),
            opset_version=20, verbose=False,
        )
    stamp.write_text(stamp_text(seed))
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
