"""What a torch reference's forward costs with its linear layers run by oneDNN (the default
``options.onednn_linear``) and by torch's own kernels (MKL), side by side.

Why: torch's CPU wheel hands fp32 matrix products to MKL, which on AMD CPUs takes its AVX2 path
whatever the CPU has; oneDNN, shipped in the same wheel, picks its kernels by the CPU's features
(guard/backends/onednn_linear.py). A reference's forward is most of what the verifier spends on
a compared sample of a transformer-like model, so at a high mirroring rate it bounds how many
samples the verifier can check.

Each model is loaded twice as guard's ``torch`` reference (``create_backend(...,
"reference")``: determinism pinned, one thread), oneDNN's and torch's kernels, and each infers
the same inputs in interleaved rounds (``--rounds`` of at least ``--calls`` calls per batch
size, and enough for half a second of CPU: /proc counts in 10 ms ticks). CPU
seconds of this process from /proc/self/stat (user + system), per call: the median over rounds.
Models: the zoo's MiniLM (a factory's ``nn.Module``, 37 linear layers; sentence embeddings) and
the zoo's CNN as TorchScript (convolutions, which torch runs by oneDNN already, and two linear
layers). The outputs of the two are compared (largest absolute difference).

    .venv/bin/python benchmarks/reference_kernels.py [--rounds 5] [--calls 20] [--out DIR]

Writes reference_kernels.{json,md} under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def models(folder: Path) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
    """name -> (the torch block's path, inputs of 8 rows)."""
    import torch

    from guard.zoo import classifier, minilm

    cnn = folder / "cnn.pt"
    images = classifier.sample_inputs(8)
    torch.jit.save(torch.jit.trace(classifier.build(), (torch.from_numpy(images),)), str(cnn))
    return {"MiniLM (factory nn.Module)": ("guard.zoo.minilm:build", minilm.sample_inputs(8)),
            "zoo CNN (TorchScript)": (str(cnn), {"image": images})}


def measure(path: str, inputs: dict[str, np.ndarray], rounds: int, calls: int) -> dict:
    from guard.backends import create_backend
    from guard.config.backend import BackendConfig

    backends = {}
    for kernels, on in (("onednn", True), ("torch", False)):
        backend = create_backend(BackendConfig(backend="torch", path=path,
                                               options={"onednn_linear": on}), "reference", 1)
        backend.load()
        backends[kernels] = backend
    out: dict = {"details": {k: b.describe().details for k, b in backends.items()}}
    for batch in (1, 8):
        rows = {name: value[:batch] for name, value in inputs.items()}
        per_round: dict[str, list[float]] = {k: [] for k in backends}
        for backend in backends.values():
            for _ in range(3):
                backend.infer(rows)  # warm
        # At least ``calls`` a round, and enough for half a second of CPU (/proc counts in
        # ticks of 10 ms: a small model's call is far below one).
        started = time.perf_counter()
        for _ in range(5):
            backends["torch"].infer(rows)
        per_call = (time.perf_counter() - started) / 5
        calls = max(calls, int(0.5 / max(per_call, 1e-6)))
        for _ in range(rounds):
            for kernels, backend in backends.items():
                start = cpu_seconds()
                for _ in range(calls):
                    backend.infer(rows)
                per_round[kernels].append((cpu_seconds() - start) / calls)
        answers = {k: b.infer(rows) for k, b in backends.items()}
        difference = max(float(np.abs(answers["onednn"][name] - answers["torch"][name]).max())
                         for name in answers["torch"])
        medians = {k: statistics.median(v) for k, v in per_round.items()}
        out[f"batch_{batch}"] = {"calls_per_round": calls,
                                 "cpu_ms_median": {k: v * 1e3 for k, v in medians.items()},
                                 "cpu_ms_rounds": {k: [x * 1e3 for x in v]
                                                   for k, v in per_round.items()},
                                 "torch_over_onednn": medians["torch"] / medians["onednn"],
                                 "largest_difference": difference}
    for backend in backends.values():
        backend.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    started = time.time()
    report: dict = {"machine": bench.machine_info(), "rounds": args.rounds,
                    "calls": args.calls, "models": {}}
    with tempfile.TemporaryDirectory(prefix="guard-kernels-") as tmp:
        for name, (path, inputs) in models(Path(tmp)).items():
            bench.log(f"{name}: {path}")
            report["models"][name] = measure(path, inputs, args.rounds, args.calls)
    report["seconds"] = round(time.time() - started, 1)
    head = ["model", "batch", "oneDNN (default), CPU ms/call", "torch's kernels, CPU ms/call",
            "torch / oneDNN", "largest |difference|"]
    rows = []
    for name, figures in report["models"].items():
        for batch in (1, 8):
            f = figures[f"batch_{batch}"]
            rows.append([name, str(batch), f"{f['cpu_ms_median']['onednn']:.2f}",
                         f"{f['cpu_ms_median']['torch']:.2f}",
                         f"{f['torch_over_onednn']:.2f}x", f"{f['largest_difference']:.1e}"])
    machine = bench.machine_line(report["machine"], ("torch",))
    context = [f"`benchmarks/reference_kernels.py --rounds {args.rounds} --calls {args.calls}` "
               f"({report['seconds']} s). guard's torch reference (one thread, determinism "
               "pinned), its linear layers by oneDNN (`options.onednn_linear`, the default) "
               "and by torch's own kernels, interleaved; CPU of this process from /proc per "
               "call, the median over rounds.", "", machine]
    md = "\n".join(["# A torch reference's forward: oneDNN's linear kernels or torch's", "",
                    *context, "", bench.md_table(head, rows), ""])
    bench.write_results(args.out, "reference_kernels", report, md,
                        bench.plain_table(head, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
