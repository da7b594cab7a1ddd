"""Why CUDA eager at fp32 (TF32 off) drifts on the conv zoo models and torch.compile does not.

The first GPU matrix (benchmarks/results/matrix-gpu, an H200, torch 2.11+cu130) found
`cuda_eager` 7e-3 from the CPU reference on resnet's logits with TF32 off, where
`cuda_compile` was 4.6e-5 and the ViT's eager 1.2e-5; on the detector and the segmenter TF32 on
and off gave the same figures to the last bit. Candidate causes, each one column here:

- TorchScript: the matrix's eager column runs the traced ``.pt`` (torch.compile gets the eager
  module); on CUDA the profiling executor fuses elementwise ops with its own kernels.
- cuDNN under ``deterministic=True`` (the reference's pin is process-wide): the algorithms it
  may pick then (Winograd or FFT for a 3x3 conv) round differently from implicit GEMM.
- memory layout: inductor may run convs channels-last, where cuDNN picks other kernels.

Each column is compared with the CPU fp32 reference (what guard's matrix compares with) and with
an fp64 CPU run (the truth both approximate), so it also says which side is off.

    python benchmarks/gpu_conv_cause.py [--models resnet,segmenter,detector,vit] [--out DIR]
    python benchmarks/gpu_conv_cause.py --device cpu --out /tmp/x   # a dry run, anywhere

Needs a CUDA torch (benchmarks/gpu_check.sh runs it); prints a table, writes
gpu_conv_cause.{md,json}. Not yet run on a GPU."""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MODELS = ("resnet", "segmenter", "detector", "vit")
SAMPLES = 8


def outputs(result) -> list[np.ndarray]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [t.detach().double().cpu().numpy() for t in items]


def max_abs(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@contextmanager
def cudnn(deterministic: bool):
    """cuDNN's algorithm choice as guard's reference pin leaves it (deterministic, no
    benchmarking, torch's deterministic algorithms in warn-only mode), or free."""
    import torch

    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, False
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[:2]
        torch.use_deterministic_algorithms(before[2], warn_only=True)


@contextmanager
def jit_fusers(enabled: bool):
    import torch

    before = torch._C._jit_texpr_fuser_enabled()
    torch._C._jit_set_texpr_fuser_enabled(enabled)
    torch._C._jit_override_can_fuse_on_gpu(enabled)
    try:
        yield
    finally:
        torch._C._jit_set_texpr_fuser_enabled(before)
        torch._C._jit_override_can_fuse_on_gpu(True)


def run_on(device: str, module, image, channels_last: bool = False) -> list[np.ndarray]:
    import torch

    x = torch.from_numpy(image).to(device)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(2):  # the profiling executor optimises after its first runs
            module(x)
        return outputs(module(x))


def columns(name: str, workdir: Path, device: str) -> dict:
    import torch

    from guard.zoo import eager, zoo_entry

    entry = zoo_entry(name)
    image = next(iter(entry.sample_inputs(SAMPLES, 0).values()))
    paths = entry.export(workdir, 0)
    module = eager(name).eval()
    with torch.no_grad():
        cpu32 = outputs(module(torch.from_numpy(image)))
        cpu64 = outputs(eager(name).eval().double()(torch.from_numpy(image).double()))
    on_device = module.to(device)  # after the CPU runs: .to moves the module itself

    def load_traced():  # a fresh one per column: the profiling executor keeps what it optimised
        return torch.jit.load(str(paths["torchscript"]), map_location=device).eval()

    runs = {"cpu fp32 (the reference)": cpu32}
    with cudnn(True):
        runs["TorchScript, cuDNN deterministic (the matrix's cuda_eager)"] = run_on(
            device, load_traced(), image)
        with jit_fusers(False):
            runs["TorchScript, JIT fusers off, deterministic"] = run_on(device, load_traced(),
                                                                        image)
        runs["eager module, deterministic"] = run_on(device, on_device, image)
    with cudnn(False):
        runs["TorchScript, cuDNN free to choose"] = run_on(device, load_traced(), image)
        runs["eager module, cuDNN free to choose"] = run_on(device, on_device, image)
        runs["eager module, channels-last"] = run_on(device, eager(name).eval().to(device), image,
                                                     channels_last=True)
    return {label: {"vs_cpu_fp32": max_abs(out, cpu32), "vs_fp64": max_abs(out, cpu64)}
            for label, out in runs.items()}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--device", default="cuda",
                        help="cpu: the same columns on the CPU, a dry run of the script "
                        "(every column near 0 against the CPU fp32)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU machine (benchmarks/gpu_check.sh)")
    # TF32 off both ways, as guard's torch backend sets it for a TF32-off column.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    machine = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "cudnn": torch.backends.cudnn.version()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = columns(name, Path(tmp), args.device)
    lines = ["# CUDA eager at fp32 on the conv zoo: which column drifts", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             "max |difference| of the outputs, 8 samples, TF32 off", "",
             "| model | column | vs CPU fp32 | vs CPU fp64 |", "| --- | --- | --- | --- |"]
    for name, table in results.items():
        for label, row in table.items():
            lines.append(f"| {name} | {label} | {row['vs_cpu_fp32']:.2e} | {row['vs_fp64']:.2e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_conv_cause.md").write_text(text)
    (args.out / "gpu_conv_cause.json").write_text(
        json.dumps({"machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
