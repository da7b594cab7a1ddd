"""What does tier 2 cost per sample, relative to one reference inference?

For every seeded zoo model, two pairs the sidecar meets:

  onnx/onnx    fp32 ONNX reference vs the int8 variant the guard derives (value-name alignment,
               isolated error from one-segment models);
  torch/onnx   eager torch reference (the zoo's factory) vs the fp32 ONNX export (exporter
               scope alignment, forward hooks).

Per pair: the first check (capture sessions and segment models built), then the median of
``--samples`` steady-state checks at batch 1; the reference's own inference time at batch 1
(ONNX Runtime, one thread, optimisations on, as a reference backend runs); layers aligned and
unaligned. Tier 2 runs on a sub-sample in the mirror worker, so the figure to read is its cost
in reference inferences: at ``checks.activation.sample_rate`` s, the mirror spends about
s x (this ratio) reference inferences more per compared sample.

With ``--large``: the same on a BERT-base-sized encoder (seq 128) and a ResNet-50-sized CNN
(224x224) from transformers configs (guard.zoo.families, seeded, nothing downloaded), the
eager module as reference vs its ONNX export (TorchScript exporter, opset 17) and the fp32
export vs its int8 variant, with the time split into capture (both sides, aligned) and
isolation (at most ``checks.activation.max_isolated`` layers re-run), and how many layers were
isolated against that budget.

Usage: ``.venv/bin/python benchmarks/activation_cost.py [--samples 20] [--large] [--out DIR]``.
Writes activation_cost.json and activation_cost.md (``--large``: activation_cost_large.*).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(name: str, work: Path, samples: int) -> dict:
    from guard.backends import create_backend
    from guard.plan.complete import parse_config
    from guard.verify.activation import ActivationChecker
    from guard.zoo import zoo_entry

    entry = zoo_entry(name)
    paths = entry.export(work / name, 0)
    onnx = str(paths["onnx"])
    feeds = [entry.sample_inputs(1, seed) for seed in range(samples + 1)]
    pairs = {
        "onnx/onnx": ({"backend": "onnxruntime", "path": onnx, "precision": "int8"},
                      {"backend": "onnxruntime", "path": onnx}),
        "torch/onnx": ({"backend": "onnxruntime", "path": onnx},
                       {"backend": "torch", "path": entry.factory,
                        "options": {"kwargs": entry.factory_kwargs}}),
    }
    out = {"task": entry.task, "pairs": {}}
    reference = create_backend(parse_config({"version": 1, "models": [{
        "name": "m", "primary": {"backend": "onnxruntime", "path": onnx}}]}, work)
        .models[0].primary, "reference")
    reference.load()
    times = []
    for f in feeds * 3:
        started = time.perf_counter()
        reference.infer(f)
        times.append(time.perf_counter() - started)
    out["reference_ms"] = float(np.median(times) * 1e3)
    for label, (primary, ref) in pairs.items():
        config = parse_config({"version": 1, "models": [{
            "name": "m", "primary": primary, "reference": ref,
            "checks": {"activation": {"sample_rate": 1.0}}}]}, work).models[0]
        checker = ActivationChecker.for_model(config)
        started = time.perf_counter()
        first = checker.check(feeds[0])
        first_ms = (time.perf_counter() - started) * 1e3
        steady = []
        for f in feeds[1:]:
            started = time.perf_counter()
            report = checker.check(f)
            steady.append((time.perf_counter() - started) * 1e3)
        median = float(np.median(steady))
        out["pairs"][label] = {
            "first_ms": first_ms, "steady_ms": median,
            "x_reference": median / out["reference_ms"],
            "aligned": len(report.layers), "unaligned": len(report.unaligned),
            "isolated": sum(1 for layer in report.layers if layer.isolated is not None),
            "first_divergence": (report.first_divergence_dict() or {}).get("layer"),
            "error": first.error or report.error,
        }
        checker.close()
        print(f"{name} {label}: first {first_ms:.0f} ms, then {median:.1f} ms "
              f"({median / out['reference_ms']:.0f}x a reference inference of "
              f"{out['reference_ms']:.2f} ms); {len(report.layers)} aligned, "
              f"{len(report.unaligned)} unaligned", flush=True)
    return out


def measure_large(name: str, work: Path, samples: int) -> dict:
    """Tier 2 on a full-size architecture: torch eager vs its export, and fp32 vs int8 ONNX."""
    from guard.backends import create_backend
    from guard.plan.complete import parse_config
    from guard.zoo import families, layouts
    from guard.zoo.faults import INT8, FaultCase, checker_for

    build, feeds_for = families.LARGE[name]
    feeds = [feeds_for(seed) for seed in range(samples + 1)]
    started = time.perf_counter()
    onnx = layouts.export(build(), work / f"{name}.onnx", feeds[0])
    export_s = time.perf_counter() - started
    reference = create_backend(parse_config({"version": 1, "models": [{
        "name": "m", "primary": {"backend": "onnxruntime", "path": str(onnx)}}]}, work)
        .models[0].primary, "reference")
    reference.load()
    times = []
    for f in feeds:
        started = time.perf_counter()
        reference.infer(f)
        times.append(time.perf_counter() - started)
    out = {"reference_ms": float(np.median(times) * 1e3), "export_s": export_s, "pairs": {}}
    cases = {"torch/onnx": FaultCase(name, "clean", name, build, onnx, feeds[0], None,
                                     input_names=["x"]),
             "onnx/onnx int8": FaultCase(name, "clean", name, onnx, onnx, feeds[0], None,
                                         precision="int8", tensor=INT8)}
    for label, case in cases.items():
        checker = checker_for(case)
        budget = checker.config.max_isolated
        started = time.perf_counter()
        first = checker.check(feeds[0])
        first_ms = (time.perf_counter() - started) * 1e3
        runs = [checker.check(f) for f in feeds[1:]]
        total = [r.seconds * 1e3 for r in runs]
        report = runs[-1]
        isolated = max(sum(1 for layer in r.layers if layer.isolated is not None) for r in runs)
        out["pairs"][label] = {
            "first_ms": first_ms, "steady_ms": float(np.median(total)),
            "capture_ms": float(np.median([r.capture_seconds * 1e3 for r in runs])),
            "isolate_ms": float(np.median([r.isolate_seconds * 1e3 for r in runs])),
            "x_reference": float(np.median(total)) / out["reference_ms"],
            "aligned": len(report.layers), "unaligned": len(report.unaligned),
            "isolated": isolated, "max_isolated": budget,
            # layers left without an isolated figure for the budget's sake (none: all fit)
            "outside_budget": max(sum(1 for layer in r.layers
                                      if layer.isolation_note.startswith("outside the isolation"))
                                  for r in runs),
            "first_divergence": (report.first_divergence_dict() or {}).get("layer"),
            "error": first.error or report.error,
        }
        checker.close()
        p = out["pairs"][label]
        print(f"{name} {label}: first {first_ms:.0f} ms, then {p['steady_ms']:.0f} ms "
              f"(capture {p['capture_ms']:.0f}, isolation {p['isolate_ms']:.0f}; "
              f"{p['x_reference']:.0f}x a reference inference of {out['reference_ms']:.1f} ms); "
              f"{p['aligned']} aligned, {p['unaligned']} unaligned, {isolated} isolated, "
              f"{p['outside_budget']} left for the budget ({budget})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="classifier,resnet,vit,detector,segmenter")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--large", action="store_true",
                        help="a BERT-base-sized encoder and a ResNet-50-sized CNN instead")
    args = parser.parse_args()
    os.environ.setdefault("GUARD_CACHE_DIR", str(Path(tempfile.gettempdir()) / "guard-bench"))
    work = Path(tempfile.mkdtemp(prefix="guard-tier2-"))
    results = {"models": {}, "machine": {
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_before": os.getloadavg()[0],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}}
    if args.large:
        return _large(args, work, results)
    for name in args.models.split(","):
        results["models"][name] = measure(name, work, args.samples)
    lines = ["# Tier 2 cost per sample", "",
             "Batch 1; steady state is the median over "
             f"{args.samples} samples after the first check (which builds the capture sessions "
             "and segment models). Reference inference: ONNX Runtime fp32, batch 1.", "",
             "| model | pair | first check ms | steady ms | x reference inference | aligned / "
             "unaligned | isolated | first divergence |", "| --- |" + " --- |" * 7]
    for name, r in results["models"].items():
        for label, p in r["pairs"].items():
            lines.append(f"| {name} | {label} | {p['first_ms']:.0f} | {p['steady_ms']:.1f} | "
                         f"{p['x_reference']:.0f}x ({r['reference_ms']:.2f} ms) | "
                         f"{p['aligned']} / {p['unaligned']} | {p['isolated']} | "
                         f"{p['first_divergence'] or '-'} |")
    m = results["machine"]
    lines += ["", f"Machine: {m['cpu_count']} cores shared with other work (1-minute load "
              f"average {m['load_average_before']:.1f} when it started), {m['platform']}, "
              f"Python {m['python']}; {m['date']}. Figures from a loaded machine: read the "
              "ratios as orders of magnitude.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "activation_cost.json").write_text(json.dumps(results, indent=2))
    (args.out / "activation_cost.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _large(args, work: Path, results: dict) -> None:
    for name in ("bert-base", "resnet50"):
        results["models"][name] = measure_large(name, work, args.samples)
    lines = ["# Tier 2 cost per sample on full-size architectures", "",
             "Batch 1 (BERT-base-sized: seq 128; ResNet-50-sized: 224x224), seeded, from "
             "transformers configs. Steady state: the median over "
             f"{args.samples} samples after the first check (which builds the capture sessions, "
             "the segment models and measures the reference's per-layer noise). Reference "
             "inference: ONNX Runtime fp32, batch 1. Isolated: layers with an isolated "
             "figure, those that compute exactly as the reference does (most of an int8 "
             "variant) included, which cost nothing and are outside the budget; left for the "
             "budget: layers ranked past max_isolated, without one.", "",
             "| model | pair | first check ms | steady ms | capture ms | isolation ms | "
             "x reference inference | aligned / unaligned | isolated / left for the budget "
             "(max_isolated) |",
             "| --- |" + " --- |" * 8]
    for name, r in results["models"].items():
        for label, p in r["pairs"].items():
            lines.append(f"| {name} | {label} | {p['first_ms']:.0f} | {p['steady_ms']:.0f} | "
                         f"{p['capture_ms']:.0f} | {p['isolate_ms']:.0f} | "
                         f"{p['x_reference']:.0f}x ({r['reference_ms']:.1f} ms) | "
                         f"{p['aligned']} / {p['unaligned']} | {p['isolated']} / "
                         f"{p['outside_budget']} ({p['max_isolated']}) |")
    m = results["machine"]
    lines += ["", f"Machine: {m['cpu_count']} cores shared with other work (1-minute load "
              f"average {m['load_average_before']:.1f} when it started), {m['platform']}, "
              f"Python {m['python']}; {m['date']}.", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "activation_cost_large.json").write_text(json.dumps(results, indent=2))
    (args.out / "activation_cost_large.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
