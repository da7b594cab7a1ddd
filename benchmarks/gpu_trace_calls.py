"""Call by call: when does a traced TorchScript model on CUDA drift from the CPU reference?

The GPU matrix (benchmarks/results/matrix-gpu) found its `cuda_eager` column (guard's torch
backend on the zoo's ``torch.jit.trace`` artifact) 7e-3 from the CPU on resnet and the same to
the last bit with TF32 on and off on the detector and segmenter, while a first probe of the same
models, which traced them after switching TF32 off, found 3e-5, as the eager module. Candidates:
guard calls under ``inference_mode`` and 16 times (the profiling executor optimises and fuses
after its first runs); and ``torch.jit.trace`` records each convolution as
``aten::_convolution`` with cuDNN's flags of the tracing process (benchmark, deterministic,
enabled, allow_tf32) as constants, where eager ``conv2d`` reads the process's flags on every
call: a trace made with torch's defaults carries ``allow_tf32=True``.

Each row: one way to run it, the max |difference| from the CPU eager fp32 output on each of 16
calls (batches as the GPU matrix feeds them), TF32 off in the process.

    python benchmarks/gpu_trace_calls.py [--models resnet,detector] [--out DIR]
    python benchmarks/gpu_trace_calls.py --device cpu --out /tmp/x    # a dry run, anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import numpy as np

CALLS = 16
BATCH = {"resnet": 8, "vit": 8, "detector": 4, "segmenter": 4}


def conv_flags(module) -> list:
    """(benchmark, deterministic, cudnn_enabled, allow_tf32) of each traced convolution."""
    return sorted({tuple(bool(v.toIValue()) for v in list(n.inputs())[9:13])
                   for n in module.inlined_graph.nodes() if n.kind() == "aten::_convolution"})


def as_arrays(result) -> list[np.ndarray]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [t.detach().double().cpu().numpy() for t in items]


def errors(run, batches, expected) -> list[float]:
    out = []
    for batch, want in zip(batches, expected):
        got = run(batch)
        out.append(max(float(np.abs(g - w).max()) for g, w in zip(got, want)))
    return out


def rows_for(name: str, workdir: Path, device: str) -> tuple[dict, dict]:
    import torch

    from guard.backends import create_backend
    from guard.config import BackendConfig
    from guard.zoo import eager, zoo_entry
    from guard.backends.torch import SIGNATURE_FILE, signature_json
    from guard.backends.traced_flags import TORCH_DEFAULTS, tracing_flags

    entry = zoo_entry(name)
    n = BATCH[name]
    images = next(iter(entry.sample_inputs(CALLS * n, 0).values()))
    batches = [images[i * n:(i + 1) * n] for i in range(CALLS)]
    # The zoo's export: traced under torch's default cuDNN flags (guard/zoo/export.py).
    paths = entry.export(workdir / "default", 0)
    module = eager(name).eval()
    with torch.no_grad():
        expected = [as_arrays(module(torch.from_numpy(b))) for b in batches]
    # The same model traced with cuDNN's TF32 off: the constant the trace bakes in is False.
    off = workdir / "tf32_off.pt"
    with tracing_flags(TORCH_DEFAULTS._replace(allow_tf32=False)), torch.no_grad():
        traced = torch.jit.trace(eager(name).eval(), (torch.from_numpy(batches[0]),),
                                 check_trace=False)
    torch.jit.save(traced, str(off), _extra_files={SIGNATURE_FILE: signature_json(
        entry.inputs, entry.outputs)})

    def raw(path, mode, fusers=True, optimized=True):
        traced = torch.jit.load(str(path), map_location="cpu").eval().to(device)

        def run(batch):
            x = torch.from_numpy(batch).to(device)
            with mode(), torch.jit.optimized_execution(optimized), fusion(fusers):
                return as_arrays(traced(x))
        return run

    def guard_backend(path, options=None):
        backend = create_backend(BackendConfig(backend="torch", path=str(path), device=device,
                                               options=options or {}), "primary")
        backend.load()
        return lambda batch: list(
            np.asarray(v, dtype=np.float64) for v in backend.infer({"image": batch}).values())

    table = {
        "guard's torch backend (the matrix's cuda_eager)": guard_backend(paths["torchscript"]),
        "TorchScript, inference_mode": raw(paths["torchscript"], torch.inference_mode),
        "TorchScript, no_grad": raw(paths["torchscript"], torch.no_grad),
        "TorchScript, no_grad, fusers off": raw(paths["torchscript"], torch.no_grad, fusers=False),
        "TorchScript, inference_mode, optimisation off": raw(paths["torchscript"],
                                                             torch.inference_mode,
                                                             optimized=False),
        "guard's torch backend, traced_conv_flags: process": guard_backend(
            paths["torchscript"], {"traced_conv_flags": "process"}),
        "traced with cuDNN TF32 off, guard's backend": guard_backend(off),
        "eager module, inference_mode": eager_run(name, device, torch.inference_mode),
    }
    flags = {"default trace": conv_flags(torch.jit.load(str(paths["torchscript"]))),
             "trace with TF32 off": conv_flags(torch.jit.load(str(off)))}
    return {label: errors(run, batches, expected) for label, run in table.items()}, flags


def eager_run(name, device, mode):
    import torch

    from guard.zoo import eager

    module = eager(name).eval().to(device)

    def run(batch):
        with mode():
            return as_arrays(module(torch.from_numpy(batch).to(device)))
    return run


@contextlib.contextmanager
def fusion(enabled: bool):
    import torch

    before = torch._C._jit_texpr_fuser_enabled()
    torch._C._jit_set_texpr_fuser_enabled(enabled and before)
    try:
        yield
    finally:
        torch._C._jit_set_texpr_fuser_enabled(before)


def main() -> None:
    import torch

    from guard.backends.determinism import pin_torch_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,vit,detector,segmenter")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU machine (benchmarks/gpu_check.sh)")
    pin_torch_reference(2)  # as the matrix's process: its reference pins determinism, TF32 off
    machine = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               "torch": torch.__version__, "cuda": torch.version.cuda}
    results, flags = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name], flags[name] = rows_for(name, Path(tmp) / name, args.device)
    lines = ["# A traced model on CUDA, call by call", "",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
             f"max |difference| from CPU eager fp32 on each of {CALLS} calls; TF32 off in the "
             "process (guard's reference pin)", ""]
    for name in results:
        lines += [f"## {name}", "", "cuDNN flags baked into the traced convolutions "
                  "(benchmark, deterministic, enabled, allow_tf32): "
                  + "; ".join(f"{k}: {v}" for k, v in flags[name].items()), "",
                  "| run | call 1 | call 2 | call 3 | calls 4-16 (max) |",
                  "| --- | --- | --- | --- | --- |"]
        for label, errs in results[name].items():
            lines.append(f"| {label} | " + " | ".join(f"{e:.1e}" for e in errs[:3])
                         + f" | {max(errs[3:]):.1e} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_trace_calls.md").write_text(text)
    (args.out / "gpu_trace_calls.json").write_text(json.dumps(
        {"machine": machine, "flags": {k: {a: [list(t) for t in b] for a, b in v.items()}
                                       for k, v in flags.items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
