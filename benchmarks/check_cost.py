"""What the checks cost: tier-1 throughput against a plain copy, tier-3 against an inference.

1. Tier 1 (``compare_output``) on float32 outputs of 1 KB, 4 KB, 1 MB and 64 MB, in GB/s of
   reference bytes, next to numpy's own copy of the same array (the memory-bandwidth yardstick),
   with the C kernel (guard/verify/_verdict.c) and, in the same run, with the numpy path an
   install without a compiler takes. Targets: within 3x of one copy at 1 MB and above; a small
   output (<= 4 KB) in <= 20 us.
2. Tier 3 per sample for the seeded zoo models (adapters included), relative to one reference
   inference (TorchScript, 1 thread) of the same sample. Target: under 5%.

Usage: .venv/bin/python benchmarks/check_cost.py [--repeat N]
Writes benchmarks/results/check_cost.json and .md with the machine noted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from guard.config import ModelConfig
from guard.machine import cpu_model
from guard.verify.pipeline import Comparator
from guard.verify import tensor
from guard.verify.tensor import PASS_STATS_EVERY, Tolerance, compare_output

RESULTS = Path(__file__).resolve().parent / "results"


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def machine() -> str:
    cpu = cpu_model(platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, {platform.platform()}"


def tier1(repeat: int) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for label, nbytes in (("1 KB", 1 << 10), ("4 KB", 4 << 10), ("1 MB", 1 << 20),
                          ("64 MB", 64 << 20)):
        ref = rng.standard_normal(nbytes // 4).astype(np.float32)
        out = ref + np.float32(1e-6) * rng.standard_normal(ref.size).astype(np.float32)
        reps = repeat if nbytes < (32 << 20) else max(2, repeat // 10)
        copy_s = best_of(lambda: ref.copy(), reps)
        tol = Tolerance(1e-5, 1e-5)
        # A pass decided in one pass (no statistics), and one with the full statistics (every
        # failure, and the sampled passes: one in PASS_STATS_EVERY).
        check_s = best_of(lambda: compare_output("y", ref, out, tol, stats=False), reps)
        stats_s = best_of(lambda: compare_output("y", ref, out, tol, stats=True), reps)
        kernel, tensor._kernel = tensor._kernel, None  # the numpy path, same arrays, same run
        try:
            numpy_s = best_of(lambda: compare_output("y", ref, out, tol, stats=False), reps)
        finally:
            tensor._kernel = kernel
        every = PASS_STATS_EVERY
        mean_s = ((every - 1) * check_s + stats_s) / every
        rows.append({"size": label, "bytes": nbytes, "copy_gb_s": nbytes / copy_s / 1e9,
                     "tier1_gb_s": nbytes / check_s / 1e9, "tier1_over_copy": check_s / copy_s,
                     "tier1_us": check_s * 1e6, "stats_over_copy": stats_s / copy_s,
                     "kernel": kernel is not None, "numpy_us": numpy_s * 1e6,
                     "numpy_over_copy": numpy_s / copy_s,
                     "sampled_mean_over_copy": mean_s / copy_s})
        print(f"tier 1 {label:>6}: {check_s * 1e6:.1f} us, {rows[-1]['tier1_over_copy']:.1f}x a "
              f"copy (with statistics {rows[-1]['stats_over_copy']:.1f}x, mean at 1 in {every} "
              f"{rows[-1]['sampled_mean_over_copy']:.1f}x); numpy path {numpy_s * 1e6:.1f} us, "
              f"{rows[-1]['numpy_over_copy']:.1f}x")
    return rows


def tier3(repeat: int) -> list[dict]:
    import torch

    from guard.zoo import zoo_entry

    torch.set_num_threads(1)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="guard-bench-"))
    for name in ("resnet", "vit", "detector", "segmenter"):
        entry = zoo_entry(name)
        module = torch.jit.load(str(entry.export(folder, 0)["torchscript"]))
        inputs = entry.sample_inputs(1, 3)
        args = [torch.from_numpy(v) for v in inputs.values()]

        def infer():
            with torch.inference_mode():
                result = module(*args)
            result = (result,) if isinstance(result, torch.Tensor) else result
            return {s.name: t.numpy() for s, t in zip(entry.outputs, result)}

        ref = infer()
        out = {k: v.copy() for k, v in ref.items()}
        config = ModelConfig.model_validate({
            "name": name, "task": entry.task, "adapters": entry.adapters,
            "primary": {"backend": "torch", "path": "pkg:fn"}})
        comparator = Comparator.for_model(config)
        adapters, checker = comparator.adapters, comparator.task_checker
        infer_s = best_of(infer, repeat)
        task_s = best_of(lambda: checker.check(adapters.apply(ref), adapters.apply(out)), repeat)
        rows.append({"model": name, "task": entry.task, "inference_ms": 1000 * infer_s,
                     "tier3_ms": 1000 * task_s, "tier3_share": task_s / infer_s})
        print(f"tier 3 {name:>9}: {1000 * task_s:.3f} ms per sample = "
              f"{100 * task_s / infer_s:.1f}% of one reference inference ({1000 * infer_s:.2f} ms)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    t1 = tier1(args.repeat)
    t3 = tier3(args.repeat)
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine(), "numpy": np.__version__, "tier1": t1, "tier3": t3}
    (RESULTS / "check_cost.json").write_text(json.dumps(record, indent=2))
    lines = ["# Check cost", "", f"Machine: {record['machine']}; numpy {np.__version__}.", "",
             "Tier 1 on a passing float32 output, best of the repeats: the one-pass verdict "
             f"({'C kernel' if t1[0]['kernel'] else 'numpy: the C kernel is not built here'}), "
             "the same with the full statistics (every failure gets them, and one pass in "
             f"{PASS_STATS_EVERY}), the mean at that sampling, and the verdict on the numpy path "
             "(an install without a C compiler) in the same run.", "",
             "Targets: verdict <= 3x a copy at 1 MB and above; <= 20 us at 4 KB and below.", "",
             "| float32 output | verdict us | verdict GB/s | numpy copy GB/s | verdict / copy | "
             "with statistics / copy | sampled mean / copy | numpy path us | numpy path / copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['size']} | {r['tier1_us']:.1f} | {r['tier1_gb_s']:.3f} | "
              f"{r['copy_gb_s']:.2f} | {r['tier1_over_copy']:.1f}x | {r['stats_over_copy']:.1f}x | "
              f"{r['sampled_mean_over_copy']:.1f}x | {r['numpy_us']:.1f} | "
              f"{r['numpy_over_copy']:.1f}x |" for r in t1]
    lines += ["", "| model | task | reference inference ms | tier 3 ms | share |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['task']} | {r['inference_ms']:.2f} | {r['tier3_ms']:.3f} | "
              f"{100 * r['tier3_share']:.1f}% |" for r in t3]
    (RESULTS / "check_cost.md").write_text("\n".join(lines) + "\n")
    print(f"written: {RESULTS / 'check_cost.md'}")


if __name__ == "__main__":
    main()
