"""How fast is replay, and what does capture cost the request path? Two measurements, one run.

(1) Replay throughput. A capture of ``--records`` requests (batch 1 each, the zoo CNN's 3x32x32
    images, default 10 000) is written by guard's own ``CaptureWriter``. Then:
    - limit: the reference alone (torch TorchScript fp32, built as replay builds it: role
      "reference", ``mirror.threads`` = 1) runs the same images in batches of ``--batch``
      rows, as fast as it can. Replay cannot beat this: it must run the reference too.
    - replay (measured right after the limit, in ``--repeats`` pairs; the median ratio is the
      figure, since other work on a shared machine loads both halves of a pair alike):
      ``guard replay`` on the capture (local engine, same batch rows), with the
      reference above and an ONNX Runtime fp32 primary. Steady state (backends loaded, capture
      read, batches run, tiers checked, outcomes aggregated) and end to end (everything
      ``guard replay`` does, including loading backends and writing the report).
    The ratio replay / limit is the figure: target >= 80%. Tiers on: tier 1 (tensor) and tier 3
    (task: classification); tier 2 (activation) is off, as by default: it is opt-in per
    model (``checks.activation``) and benchmarks/activation_cost.py measures its cost.

(2) Capture overhead on the request path. ``python -m guard serve`` (a subprocess) with the
    zoo CNN on ONNX Runtime fp32, no mirror, with capture off and with capture at 100%
    (mode all, every request recorded), alternating over ``--rounds``; closed-loop load from
    ``--concurrency`` tritonclient-stub threads for ``--duration`` s per cell (the load
    generator of benchmarks/oip_load.py). The figure is p99 with capture / p99 without:
    target <= 1.05.

Usage: ``.venv/bin/python benchmarks/replay_throughput.py [--records N] [--duration S]
[--rounds N] [--concurrency C] [--out DIR] [--quick]``. Results: ``replay_throughput.json`` and
``.md`` under ``--out`` (default benchmarks/results), with the machine noted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the machinery the benchmarks share)
from bench import log  # noqa: E402
import oip_load as oip  # noqa: E402  (the classifier over OIP, its load)

MODEL = oip.MODEL  # "classifier": the load generator's requests name it
TARGET_RATIO = 0.80
# Batches run before timing, on both sides of a pair: TorchScript's profiling executor
# re-optimises over its first calls (the first pass over 5 000 images ran at 55-70% of the
# speed of later ones on the AMD EPYC), so one warm-up batch left the limit cold.
WARM_BATCHES = 4
TARGET_P99_RATIO = 1.05


# -- (1) replay throughput -------------------------------------------------------------------------
def write_capture(folder: Path, images: np.ndarray) -> float:
    """One record per image, through the real writer. Returns the seconds it took."""
    from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
    from guard.config import CaptureConfig
    from guard.observe.metrics import GuardMetrics

    metrics = GuardMetrics("bench")
    writer = CaptureWriter(MODEL, CaptureConfig(dir=str(folder), queue_size=len(images) + 1,
                                                max_total_bytes=8 * 2**30), metrics, {})
    started = time.perf_counter()
    writer.start()
    logits = np.zeros((1, 10), np.float32)
    t0 = time.time_ns()
    for i in range(len(images)):
        tag = CaptureTag(f"r{i}", t0 + i * 1000, 0.001, True)
        writer.submit(PendingRecord(tag, "primary", 0, {"image": images[i:i + 1]},
                                    {"logits": logits}))
    writer.close(timeout=600)
    written = metrics.registry.get_sample_value(
        "guard_capture_records_total", {"model": MODEL, "outcome": "written"})
    if written != len(images):
        raise RuntimeError(f"the writer wrote {written} of {len(images)} records")
    return time.perf_counter() - started


def reference_limit(config, images: np.ndarray, batch: int, repeats: int) -> dict:
    """The reference's own batched throughput on the same images (best of ``repeats``)."""
    from guard.backends import create_backend

    spec = config.model(MODEL)
    backend = create_backend(spec.reference, "reference", spec.mirror.threads)
    backend.load()
    for lo in range(0, WARM_BATCHES * batch, batch):  # warm-up, as replay_steady's
        backend.infer({"image": images[lo:lo + batch]})
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        for lo in range(0, len(images), batch):
            backend.infer({"image": images[lo:lo + batch]})
        best = max(best, len(images) / (time.perf_counter() - started))
    backend.close()
    return {"rows_per_s": best, "batch": batch, "threads": spec.mirror.threads}


def warm_process(config, images: np.ndarray, batch: int) -> None:
    """Load and run one reference that is then thrown away, so that neither half of the first
    pair pays for the process's first load. Before guard/malloc.py, the first TorchScript
    module in a process ran 1.5x slower per row than later ones on the AMD EPYC (400 vs 260-270
    us): glibc trimmed and re-faulted its heap on every forward, depending on where earlier
    allocations had left the heap's top. With the malloc settings the throwaway runs as fast
    as the rest; the warm-up stays, cheap insurance for the first pair."""
    limit = reference_limit(config, images[: 8 * batch], batch, 1)
    log(f"process warm-up: a throwaway reference at {limit['rows_per_s']:.0f} rows/s")


def replay_steady(config, capture: Path, batch: int, max_records: int | None = None) -> dict:
    """The replay pipeline with the backends already loaded: read, batch, run, check,
    aggregate (the pieces ``guard replay`` chains, timed without the one-off load)."""
    from guard.replay.aggregate import ModelAggregate
    from guard.replay.engines import LocalEngine
    from guard.replay.plan import plan_batches
    from guard.replay.source import Filters, Source

    engine = LocalEngine(config)
    try:
        tiers = engine.describe(MODEL)["tiers"]  # loads reference and primary
        warm = Source([str(capture)], {MODEL}, Filters(max_records=WARM_BATCHES * batch),
                      engine.input_specs, MODEL)
        for _ in engine.run(plan_batches(warm.items(), batch)):
            pass
        started = time.perf_counter()
        source = Source([str(capture)], {MODEL}, Filters(max_records=max_records),
                        engine.input_specs, MODEL)
        outcomes = []
        for batch_outcomes in engine.run(plan_batches(source.items(), batch)):
            outcomes += batch_outcomes
        aggregate = ModelAggregate(config.model(MODEL))
        for outcome in sorted(outcomes, key=lambda o: o.index):
            aggregate.add(outcome)
        result = aggregate.result()
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    tensor = result["tiers"]["tensor"]
    return {"records": len(outcomes), "seconds": seconds, "tiers": tiers,
            "records_per_s": len(outcomes) / seconds, "checks": tensor["checks"],
            "passed": tensor["passed"], "max_abs_error": tensor["max_abs_error"]}


def stage_costs(config, capture: Path, batch: int) -> dict:
    """Microseconds per record of each stage, measured alone (one after the other, no overlap):
    where replay's time goes, so the ratio to the limit can be read."""
    from guard.replay.engines import LocalEngine
    from guard.replay.plan import plan_batches
    from guard.replay.source import Filters, Source

    engine = LocalEngine(config)
    try:
        runner = engine.runners.get(MODEL)
        started = time.perf_counter()
        items = list(Source([str(capture)], {MODEL}, Filters(), engine.input_specs,
                            MODEL).items())
        read = time.perf_counter() - started
        batches = list(plan_batches(items, batch))
        stacked = [{"image": np.concatenate([it.inputs["image"] for it in b.items])}
                   for b in batches]
        costs = {}
        for role in ("reference", "primary"):
            backend = getattr(runner, role)
            started = time.perf_counter()
            for inputs in stacked:
                backend.infer(inputs)
            costs[role] = time.perf_counter() - started
        started = time.perf_counter()
        inferred = [runner.infer(b) for b in batches]
        costs["infer_both"] = time.perf_counter() - started
        started = time.perf_counter()
        for one in inferred:
            runner.check(one)
        costs["check"] = time.perf_counter() - started
    finally:
        engine.close()
    n = len(items)
    return {"read_parse_us": read / n * 1e6, "reference_us": costs["reference"] / n * 1e6,
            "primary_us": costs["primary"] / n * 1e6,
            "reference_and_primary_together_us": costs["infer_both"] / n * 1e6,
            "checks_us": costs["check"] / n * 1e6}


def replay_end_to_end(config_path: Path, capture: Path, batch: int, report_dir: Path) -> dict:
    from guard.replay.run import ReplayOptions, replay
    from guard.replay.report import write_report

    started = time.perf_counter()
    code, report = replay(ReplayOptions(config=str(config_path), captures=[str(capture)],
                                        report_dir=str(report_dir), batch_rows=batch,
                                        progress=False))
    write_report(report, report_dir)
    seconds = time.perf_counter() - started
    records = report["timing"]["records"]
    return {"exit_code": code, "records": records, "seconds": seconds,
            "records_per_s": records / seconds}


def measure_heavy(work: Path, paths: dict, config_path: Path, capture: Path, images, batch: int,
                  repeats: int, heavy_repeats: int, records: int) -> dict:
    """The same replay with a reference ``heavy_repeats`` times as costly (the TorchScript
    forward repeated, benchmarks/oip_load.py's module): when the reference dominates, as
    it does for real models, does replay keep up with it?"""
    from guard.plan.complete import load_config

    (work / "bench_reference.py").write_text(oip.REFERENCE_MODULE)
    data = yaml.safe_load(config_path.read_text())
    data["models"][0]["reference"] = {
        "backend": "torch", "path": "bench_reference:make",
        "options": {"kwargs": {"path": str(paths["torchscript"]), "repeats": heavy_repeats}}}
    heavy_path = work / "replay-heavy.yaml"
    heavy_path.write_text(yaml.safe_dump(data))
    config = load_config(heavy_path)
    log(f"heavier reference (forward x{heavy_repeats}), {records} records")
    limit, steady, ratios = paired(config, capture, images[:records], batch, repeats, records)
    log(f"  limit {limit['rows_per_s']:.0f} rows/s, replay {steady['records_per_s']:.0f} "
        "records/s")
    return {"repeats": heavy_repeats, "records": records, "limit": limit, "steady": steady,
            "ratios": ratios, "ratio_steady": steady["records_per_s"] / limit["rows_per_s"]}


def paired(config, capture: Path, images, batch: int, pairs: int,
           max_records: int | None = None) -> tuple[dict, dict, list[float]]:
    """The limit and the replay measured back to back, ``pairs`` times: on a machine shared
    with other work, the two halves of one pair see about the same load, so their ratio is
    the figure (the pair with the median ratio is kept; all ratios are recorded)."""
    runs = []
    for _ in range(pairs):
        limit = reference_limit(config, images, batch, 1)
        steady = replay_steady(config, capture, batch, max_records)
        runs.append((steady["records_per_s"] / limit["rows_per_s"], limit, steady))
    runs.sort(key=lambda r: r[0])
    _, limit, steady = runs[len(runs) // 2]
    return limit, steady, [r[0] for r in runs]


def measure_replay(work: Path, paths: dict, records: int, batch: int, repeats: int,
                   heavy_repeats: int = 4, heavy_records: int = 2000) -> dict:
    from guard.plan.complete import load_config
    from guard.zoo.classifier import sample_inputs

    config_path = work / "replay.yaml"
    config_path.write_text(yaml.safe_dump({"version": 1, "models": [{
        "name": MODEL, "task": "classification",
        # One intra-op thread: on a 2-core machine the primary runs beside the reference on
        # the other core (ORT's default pool would spin on both cores).
        "primary": {"backend": "onnxruntime", "path": str(paths["onnx"]),
                    "options": {"intra_op_threads": 1}},
        "reference": {"backend": "torch", "path": str(paths["torchscript"])},
        "checks": {"tensor": {"atol": 1e-4, "rtol": 1e-3}},
    }]}))
    config = load_config(config_path)
    images = sample_inputs(records, seed=11)
    capture = work / "capture"
    log(f"writing a capture of {records} records")
    write_seconds = write_capture(capture, images)
    size = sum(p.stat().st_size for p in capture.rglob("*.gcap"))
    log(f"  {size / 2**20:.1f} MiB in {write_seconds:.1f} s")
    warm_process(config, images, batch)
    log(f"limit (the reference alone, batches of {batch}) and replay, in pairs")
    limit, steady, ratios = paired(config, capture, images, batch, repeats)
    log(f"  limit {limit['rows_per_s']:.0f} rows/s, replay {steady['records_per_s']:.0f} "
        f"records/s ({steady['passed']}/{steady['checks']} pass); ratios "
        + ", ".join(f"{r:.0%}" for r in ratios))
    log("stage costs, each alone")
    stages = stage_costs(config, capture, batch)
    log("  " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()))
    log("replay, end to end (guard replay)")
    e2e = replay_end_to_end(config_path, capture, batch, work / "report")
    log(f"  {e2e['records_per_s']:.0f} records/s over {e2e['seconds']:.1f} s")
    heavy = None
    if heavy_repeats > 1:
        heavy = measure_heavy(work, paths, config_path, capture, images, batch, repeats,
                              heavy_repeats, min(heavy_records, records))
    return {
        "heavy_reference": heavy,
        "records": records, "capture_bytes": size, "capture_write_s": write_seconds,
        "batch_rows": batch, "limit": limit, "steady": steady, "end_to_end": e2e,
        "stages_us_per_record": stages,
        "ratio_steady": steady["records_per_s"] / limit["rows_per_s"], "ratios": ratios,
        "ratio_end_to_end": e2e["records_per_s"] / limit["rows_per_s"],
        "primary": "onnxruntime fp32 (1 intra-op thread)",
        "reference": "torch TorchScript fp32 (1 thread)",
        "tiers": steady["tiers"],
    }


# -- (2) capture overhead on the request path ------------------------------------------------------
def serve_config(work: Path, onnx: Path, capture: bool) -> Path:
    model = {"name": MODEL, "primary": {"backend": "onnxruntime", "path": str(onnx)},
             "mirror": {"sample_rate": 0.0}}
    if capture:
        model["capture"] = {"dir": str(work / "serve-capture"), "sample_rate": 1.0,
                            "queue_size": 1024, "max_total_bytes": 2 * 2**30}
    cell = "on" if capture else "off"
    grpc_port, metrics_port, admin_port = bench.free_port(), bench.free_port(), bench.free_port()
    path = work / f"serve-{cell}.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "server": {
        "host": bench.HOST, "grpc_port": grpc_port, "metrics_port": metrics_port,
        "admin_port": admin_port}, "models": [model]}))
    return path


def measure_capture(work: Path, onnx: Path, rounds: int, concurrency: int,
                    duration: float) -> dict:
    from guard.zoo.classifier import sample_inputs

    requests = oip.build_requests(sample_inputs(oip.REQUEST_POOL, seed=5))
    env = dict(os.environ)
    cells: dict[str, list] = {"off": [], "on": []}
    written = 0.0
    for r in range(rounds):
        for cell in ("off", "on"):
            path = serve_config(work, onnx, cell == "on")
            data = yaml.safe_load(path.read_text())
            target = f"{bench.HOST}:{data['server']['grpc_port']}"
            child = bench.Child(cell, [sys.executable, "-m", "guard", "serve", "--config",
                                    str(path)], work / f"serve-{cell}-{r}.log", env)
            try:
                oip.wait_ready(target, child)
                oip.closed_loop(target, requests, concurrency, min(2.0, duration))  # warm-up
                result = oip.closed_loop(target, requests, concurrency, duration)
                if cell == "on":
                    values = oip.scrape(data["server"]["metrics_port"])
                    written = values.get("guard_capture_records_total,outcome=written", 0.0)
                    dropped = values.get("guard_capture_records_total,outcome=dropped", 0.0)
            finally:
                child.stop()
            summary = bench.summarize(result["latencies_ns"], result["elapsed_s"], result["errors"])
            if cell == "on":
                summary["capture_written"] = written
                summary["capture_dropped"] = dropped
            cells[cell].append(summary)
            log(f"round {r + 1} capture {cell}: {summary['throughput_rps']:.0f} req/s, "
                f"p50 {summary['p50_ms']:.3f} ms, p99 {summary['p99_ms']:.3f} ms"
                + (f", {written:.0f} written, {dropped:.0f} dropped" if cell == "on" else ""))
            shutil.rmtree(work / "serve-capture", ignore_errors=True)

    def median(cell: str, key: str) -> float:
        return float(np.median([c[key] for c in cells[cell]]))

    return {
        "rounds": rounds, "concurrency": concurrency, "duration_s": duration, "cells": cells,
        "p50_ms": {c: median(c, "p50_ms") for c in cells},
        "p99_ms": {c: median(c, "p99_ms") for c in cells},
        "throughput_rps": {c: median(c, "throughput_rps") for c in cells},
        "p99_ratio": median("on", "p99_ms") / median("off", "p99_ms"),
    }


# -- report ----------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Replay throughput and capture overhead", "",
        f"Machine: {m['cpu_model']}, {m['cpus_usable']} usable CPU(s) of {m['cpu_count']} "
        f"(shared with other work), {m['platform']}; {m['date']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        f"malloc: {result.get('malloc', '?')}; replay's gc freeze (guard/collector.py): "
        f"{'on' if result.get('gc_freeze', True) else 'off (GUARD_GC_FREEZE=off)'}.",
        f"Command: `{result['command']}`" + (" (--quick: a smoke check, not figures to quote)"
                                              if result["quick"] else ""),
        "Load average (1, 5, 15 min) at start: "
        + ", ".join(f"{x:.1f}" for x in result["load_average_at_start"]) + "; at end: "
        + ", ".join(f"{x:.1f}" for x in result["load_average_at_end"])
        + " (other work on the machine; above 2 the CPUs were oversubscribed).", "",
    ]
    if "replay" in result:
        lines += replay_markdown(result["replay"])
    if "capture" in result:
        lines += capture_markdown(result["capture"])
    return "\n".join(lines)


def replay_markdown(rp: dict) -> list[str]:
    return [
        "## Replay throughput", "",
        f"{rp['records']} records (zoo CNN, 1 image each, {rp['capture_bytes'] / 2**20:.1f} MiB "
        f"of capture written in {rp['capture_write_s']:.1f} s); reference "
        f"{rp['reference']}, primary {rp['primary']}, tiers on: {', '.join(rp['tiers'])} "
        "(tier 2, activation, is off: opt-in per model, its cost in activation_cost.md); "
        f"batches of {rp['batch_rows']} rows.", "",
        "| what | records/s | vs the limit |", "| --- | ---: | ---: |",
        f"| limit: reference alone, batched | {rp['limit']['rows_per_s']:.0f} | 100% |",
        f"| replay, steady state | {rp['steady']['records_per_s']:.0f} | "
        f"{rp['ratio_steady']:.0%} |",
        f"| replay, end to end (`guard replay`, incl. loading and report) | "
        f"{rp['end_to_end']['records_per_s']:.0f} | {rp['ratio_end_to_end']:.0%} |", "",
        f"Limit and replay are measured back to back in {len(rp.get('ratios', [0]))} pair(s) "
        "(both halves of a pair see about the same load from other work); the pair with the "
        "median ratio is shown. Ratios of all pairs: "
        + ", ".join(f"{r:.0%}" for r in rp.get("ratios", [])) + ".", "",
        f"Target: steady state >= {TARGET_RATIO:.0%} of the limit: "
        f"{'met' if rp['ratio_steady'] >= TARGET_RATIO else 'NOT met'}.", "",
        *heavy_markdown(rp.get("heavy_reference")),
        "Where the time goes (microseconds per record, each stage measured alone): " + ", ".join(
            f"{k.removesuffix('_us').replace('_', ' ')} {v:.0f}"
            for k, v in rp["stages_us_per_record"].items()) + ". Replay must run the reference "
        "*and* the primary and check every record. The local engine gives each side its own "
        "thread, running its queue of batches back to back (two batches queued beyond the one "
        "being checked), while the main thread reads records and checks inferred batches "
        "(tiers 1 and 3 of a stacked batch computed at once for the records that pass, "
        "guard/replay/batchcheck.py). So the reference never waits for the primary or for "
        "the reading. What it can still wait for is the interpreter lock: a TorchScript "
        "forward takes it back at least twice per call (on return, and inside, when it drops "
        "the input tensor Python made), so every stretch the main thread holds the lock "
        "stalls the reference. Two such stretches were found with perf (sched_switch call "
        "graphs of the reference thread) and removed: the torch backend's per-call tensor "
        "calls (.to, .detach, .cpu: one lock round trip each; 8 per forward became 2) and "
        "the cyclic collector's full collections over torch's ~430 000 objects (300+ ms "
        "each, holding the lock; guard/collector.py freezes what loading left alive). "
        "Steady state on the AMD EPYC: 70% before both, 75% with the first, 87% with both "
        "(medians of 5 pairs). What is left: the main thread's own Python per record, "
        "and two busy cores slowing each other (the reference's CPU per row inside replay "
        "is 0-10% above the limit's).", "",
    ]


def heavy_markdown(h: dict | None) -> list[str]:
    if not h:
        return []
    return [
        f"With a reference {h['repeats']}x as costly (its forward repeated; the first "
        f"{h['records']} records): limit {h['limit']['rows_per_s']:.0f} rows/s, replay steady "
        f"state {h['steady']['records_per_s']:.0f} records/s = {h['ratio_steady']:.0%} of the "
        "limit.", "",
    ]


def capture_markdown(cp: dict) -> list[str]:
    lines = [
        "## Capture overhead on the request path", "",
        f"`guard serve`, zoo CNN on ONNX Runtime fp32, no mirror; closed loop, "
        f"{cp['concurrency']} connection(s), {cp['duration_s']:.0f} s per cell, "
        f"{cp['rounds']} round(s) alternating; medians over rounds.", "",
        "| capture | req/s | p50 ms | p99 ms |", "| --- | ---: | ---: | ---: |",
    ]
    for cell, label in (("off", "off"), ("on", "100% (mode all)")):
        lines.append(f"| {label} | {cp['throughput_rps'][cell]:.0f} | {cp['p50_ms'][cell]:.3f} | "
                     f"{cp['p99_ms'][cell]:.3f} |")
    lines += ["", f"p99 ratio (on / off): {cp['p99_ratio']:.3f}; target <= {TARGET_P99_RATIO}: "
              f"{'met' if cp['p99_ratio'] <= TARGET_P99_RATIO else 'NOT met'}.", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64, help="replay batch rows (default 64)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="limit/replay pairs, the median ratio kept (default 5)")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="seconds of load per capture cell (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="off/on rounds (default 3)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--heavy-repeats", type=int, default=4,
                        help="also replay with the reference's forward repeated N times "
                        "(default 4; 1 skips it)")
    parser.add_argument("--heavy-records", type=int, default=2000,
                        help="records for the heavier-reference run (default 2000)")
    parser.add_argument("--part", choices=["all", "replay", "capture"], default="all",
                        help="measure both (default) or one part")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--quick", action="store_true",
                        help="smoke check: 500 records, 2 s cells, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.duration, args.rounds, args.repeats = 500, 2.0, 1, 1

    from guard import collector
    from guard.malloc import tune_for_inference
    from guard.zoo import classifier

    # As `guard replay` (guard/cli.py) does: the limit and the replay both run tuned.
    malloc = tune_for_inference()
    log(f"malloc: {malloc}")
    cache = Path(tempfile.mkdtemp(prefix="guard-replay-bench-"))
    os.environ.setdefault("GUARD_CACHE_DIR", str(cache / "cache"))
    try:
        paths = classifier.export(cache / "zoo")
        result = {"machine": bench.machine_info(), "quick": args.quick, "malloc": malloc,
                  "gc_freeze": collector.enabled(),
                  "load_average_at_start": os.getloadavg(),
                  "command": "benchmarks/replay_throughput.py " + " ".join(argv or sys.argv[1:])}
        if args.part in ("all", "replay"):
            result["replay"] = measure_replay(cache, paths, args.records, args.batch,
                                              args.repeats, args.heavy_repeats,
                                              args.heavy_records)
        if args.part in ("all", "capture"):
            result["capture"] = measure_capture(cache, paths["onnx"], args.rounds,
                                                args.concurrency, args.duration)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result["load_average_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "replay_throughput" + ("" if args.part == "all" else f"_{args.part}") + (
        "_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
