"""Does the verifier keep up? Batched checking against one-by-one, on a small fast model.

The model is a small MLP (``x`` FP32 [-1, 32] -> 64 -> 64 -> ``logits`` FP32 [-1, 10], seeded,
exported here to ONNX with a dynamic batch), primary and reference both ONNX Runtime fp32 on one
intra-op thread: a reference forward of a few hundredths of a millisecond, so what the verifier
spends around it is what shows. ``task: classification`` (tiers 1 and 3).

Two parts, side by side in one run:

1. **In process** (``_in_process``, a child per measurement): the verifier's own path as
   ``python -m guard.verifier_process`` runs it (``VerifierProcess`` with a real ring and route
   table, the model built by its ``_build``: ring reader, decode, model, mirror, checks,
   detectors, metrics), fed through the ring at a steady rate (``--rates``, samples/s) by the
   same process (the feed's CPU, the serving side's ``wire.encode`` + ``ring.put``, is timed and
   reported apart). CPU from /proc for the whole process, less the feed and the idle CPU the
   verifier spends with nothing to do (measured first); the reference's forward passes are timed
   in their thread (``time.thread_time`` around each call: what the reference costs itself).
   Overhead per compared sample = (CPU - forward CPU) / samples. Cells: ``mirror.max_batch: 1``
   (one by one) and the default (batched).
2. **End to end** (unless ``--no-e2e``): ``python -m guard serve`` with this model, driven by
   ``--concurrency`` (4) closed-loop clients (tritonclient's gRPC stubs, oip_load.py's
   load generator) on the same machine. Cells: (off) mirroring configured, ``sample_rate: 0``;
   (one) 100% mirrored, ``max_batch: 1``; (batch) 100% mirrored, batched; and with ``--before
   DIR`` (a source tree of guard from before batching, e.g. ``git archive <commit> guard | tar
   -x -C DIR``) (today) 100% mirrored by that tree. Per cell: p50/p99, req/s, the share of
   sampled requests dropped (``guard_mirror_total``, scraped once the queue has drained), CPU
   per request of the serving and the verifier process. Targets (issue 31): dropped <= 1%,
   p99 <= 1.5x the (off) cell's.

Usage: ``.venv/bin/python benchmarks/mirror_batching.py [--rates 200,1000] [--samples 2000]
[--duration 8] [--rounds 2] [--concurrency 4] [--before DIR] [--no-e2e]``. Results:
``mirror_batching.json`` and ``mirror_batching.md`` under ``--out`` (default
``benchmarks/results``), with the machine and the load average noted: figures from a shared
machine are not to be quoted as its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench
import oip_load as oip
from sample_cost import thread_ticks

MODEL = oip.MODEL  # the name oip_load's scrape and readiness wait look for
POOL = 256  # distinct inputs
TARGET_OVERHEAD_MS = 0.1  # CPU per compared sample beyond the reference's forward
TARGET_DROPPED = 0.01
TARGET_P99_RATIO = 1.5


# -- the model -----------------------------------------------------------------------------------
def cmd_prepare(workdir: Path) -> None:
    """Export the MLP, the input pool and ORT's answers (a child: the parent never loads torch)."""
    import onnxruntime as ort

    path = oip.export_mlp(workdir / "mlp.onnx")
    inputs = np.random.default_rng(31).standard_normal((POOL, 32)).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    expected = np.concatenate([session.run(None, {"x": inputs[i:i + 1]})[0]
                               for i in range(POOL)])
    times = []
    for i in range(3000):
        t0 = time.thread_time_ns()
        session.run(None, {"x": inputs[i % POOL:i % POOL + 1]})
        times.append(time.thread_time_ns() - t0)
    np.save(workdir / "inputs.npy", inputs)
    np.save(workdir / "expected.npy", expected)
    (workdir / "prepare.json").write_text(json.dumps({
        "onnx": str(path), "forward_cpu_ms_hot": float(np.median(times[500:])) / 1e6}))


def guard_config(onnx: str, ports: dict, sample_rate: float, max_batch: int | None) -> dict:
    mirror = {"sample_rate": sample_rate, "threads": 1, "queue_size": 64, "timeout_s": 5.0}
    if max_batch is not None:  # (None: a tree from before batching, which lacks the key)
        mirror["max_batch"] = max_batch
    model = {"name": MODEL, "task": "classification",
             "primary": {"backend": "onnxruntime", "path": onnx,
                         "options": {"intra_op_threads": 1}},
             "reference": {"backend": "onnxruntime", "path": onnx},
             "mirror": mirror}
    return {"version": 1, "server": {"host": bench.HOST, "shutdown_grace_s": 5.0, **ports},
            "models": [model]}


# -- part 1: the verifier's path in one process ---------------------------------------------------
class _NoServing:  # the verifier's link to a serving process: nothing on this path uses it
    def use_primary(self, *args):
        return ""

    def transition(self, *args):
        pass

    def span(self, *args):
        pass


def cmd_in_process(workdir: Path, max_batch: int, rate: float, samples: int) -> None:
    """Prints one JSON line: the verifier's CPU per sample fed at ``rate``, and its parts."""
    from guard.config import ModelConfig
    from guard.ipc import routes, wire
    from guard.ipc.ring import SampleRing
    from guard.verifier_process.process import VerifierProcess

    prep = json.loads((workdir / "prepare.json").read_text())
    block = guard_config(prep["onnx"], {}, 1.0, max_batch)["models"][0]
    block["mirror"]["queue_size"] = 1024  # what is measured is CPU, not the queue's bound
    config = ModelConfig.model_validate(block)
    table = routes.RouteTable(16)
    slot = table.assign([MODEL])[MODEL]
    ring = SampleRing(64 << 20)
    verifier = VerifierProcess(None, table, [ring])
    verifier.link = _NoServing()
    model = verifier._build(config, slot, "", None, [])
    verifier.models[MODEL], verifier.by_slot[slot] = model, model
    inputs, expected = np.load(workdir / "inputs.npy"), np.load(workdir / "expected.npy")
    reference = model.backends["reference"]
    infer, forward = reference.infer, {"cpu": 0.0, "calls": 0, "rows": 0}

    def timed(feeds):  # the reference's own CPU: its forward runs on the calling thread
        t0 = time.thread_time()
        try:
            return infer(feeds)
        finally:
            forward["cpu"] += time.thread_time() - t0
            forward["calls"] += 1
            forward["rows"] += next(iter(feeds.values())).shape[0]

    reference.infer = timed
    counter = model.metrics.mirror

    def outcome(name: str) -> float:
        return counter.labels(MODEL, name)._value.get()

    def feed(k: int) -> None:
        i = k % POOL
        if not ring.put(wire.encode(wire.Sample(
                MODEL, slot, "primary", 0, wire.MIRROR, f"r{k}", "", 0.001,
                wire.Tensors({"x": inputs[i:i + 1]}, {"logits": expected[i:i + 1]}),
                time.time_ns()))):
            raise RuntimeError("ring full")

    def paced(first: int, n: int) -> float:
        """Feed n samples at ``rate`` in 2 ms ticks; the feeding thread's CPU (s): the encode
        and ring copy, and its own sleeps and wake-ups."""
        fed, start, cpu = 0, time.perf_counter(), time.thread_time()
        while fed < n:
            due = min(n, int((time.perf_counter() - start) * rate) + 1)
            while fed < due:
                feed(first + fed)
                fed += 1
            time.sleep(0.002)
        return time.thread_time() - cpu

    verifier._reader.start()
    verifier._beat.start()
    paced(0, min(samples, int(rate)))  # warm-up: a second's worth
    while sum(outcome(o) for o in ("compared", "dropped", "error", "timeout")) < min(
            samples, int(rate)):
        time.sleep(0.01)
    idle_cpu, idle_wall = time.process_time(), time.perf_counter()
    time.sleep(2.0)
    idle_cores = (time.process_time() - idle_cpu) / (time.perf_counter() - idle_wall)
    base = {o: outcome(o) for o in ("compared", "dropped", "error", "timeout")}
    forward.update(cpu=0.0, calls=0, rows=0)
    ticks, cpu, wall = thread_ticks(), time.process_time(), time.perf_counter()
    main_cpu = time.thread_time()
    fed_cpu = paced(10_000_000, samples)
    while sum(outcome(o) - base[o] for o in base) < samples:
        time.sleep(0.001)
    main_cpu = time.thread_time() - main_cpu  # the feeder's, waiting included
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    after = thread_ticks()
    names = {t.native_id: t.name for t in threading.enumerate()}
    by_thread: dict[str, float] = {}
    for tid, used in after.items():
        ms = (used - ticks.get(tid, 0)) / bench.CLK_TCK * 1e3 / samples
        if ms:
            name = names.get(tid, str(tid))
            by_thread[name] = by_thread.get(name, 0.0) + ms
    compared = outcome("compared") - base["compared"]
    verifier_cpu = cpu - main_cpu - idle_cores * wall
    print(json.dumps({
        "max_batch": max_batch, "rate": rate, "samples": samples, "compared": compared,
        "dropped": outcome("dropped") - base["dropped"], "wall_s": wall,
        "achieved_rate": samples / wall,
        "verifier_cpu_ms": verifier_cpu / samples * 1e3,
        "forward_cpu_ms": forward["cpu"] / samples * 1e3,
        "overhead_ms": (verifier_cpu - forward["cpu"]) / samples * 1e3,
        "forward_calls": forward["calls"], "mean_batch": forward["rows"] / max(1, forward["calls"]),
        "feed_ms": fed_cpu / samples * 1e3, "idle_cores": idle_cores, "by_thread_ms": by_thread}))
    os._exit(0)  # the verifier's threads are daemons; nothing to flush


def in_process(workdir: Path, env: dict, max_batch: int, rate: float, samples: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "_in_process", "--workdir", str(workdir),
         "--max-batch", str(max_batch), "--rate", str(rate), "--samples", str(samples)],
        check=True, env=env, cwd=str(bench.REPO), capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    bench.log(f"  in process, max_batch {max_batch}, {rate:g}/s: verifier "
           f"{result['verifier_cpu_ms']:.3f} ms CPU/sample, forward {result['forward_cpu_ms']:.3f}"
           f", overhead {result['overhead_ms']:.3f} ms; mean batch {result['mean_batch']:.1f}; "
           f"feed {result['feed_ms']:.3f} ms; dropped {result['dropped']:.0f}")
    return result


# -- part 2: end to end --------------------------------------------------------------------------
CELLS = {"off": "mirroring configured, sample_rate 0",
         "today": "100% mirrored, the --before tree",
         "one": "100% mirrored, max_batch 1 (one by one)",
         "batch": "100% mirrored, batched (max_batch 64)"}


def build_requests(inputs: np.ndarray) -> list:
    from tritonclient.grpc import service_pb2 as pb

    requests = []
    for i in range(min(64, inputs.shape[0])):
        request = pb.ModelInferRequest(model_name=MODEL)
        tensor = request.inputs.add(name="x", datatype="FP32")
        tensor.shape.extend([1, 32])
        request.outputs.add(name="logits")
        request.raw_input_contents.append(np.ascontiguousarray(inputs[i:i + 1]).tobytes())
        requests.append(request)
    return requests


def measure(cell: str, args, prep: dict, workdir: Path, env: dict, requests: list,
            round_index: int) -> dict:
    import yaml

    port, metrics_port = bench.free_port(), bench.free_port()
    ports = {"grpc_port": port, "metrics_port": metrics_port, "admin_port": bench.free_port()}
    rate = 0.0 if cell == "off" else 1.0
    max_batch = {"one": 1, "batch": 64}.get(cell)
    path = workdir / f"guard_{cell}_r{round_index}.yaml"
    path.write_text(yaml.safe_dump(guard_config(prep["onnx"], ports, rate, max_batch)))
    cwd = Path(args.before).resolve() if cell == "today" else bench.REPO
    child = bench.Child(cell, [sys.executable, "-m", "guard", "serve", "--config", str(path)],
                     workdir / f"server_{cell}_r{round_index}.log", env, cwd=cwd)
    try:
        target = f"{bench.HOST}:{port}"
        oip.wait_ready(target, child)
        bench.wait_quiet([child.process.pid], args.wait_quiet)
        oip.closed_loop(target, requests, args.concurrency, args.warmup)
        before = oip.drained(metrics_port)
        cpu_before = bench.cpu_snapshot(child.process.pid)
        load_before = os.getloadavg()[0]
        result = oip.closed_loop(target, requests, args.concurrency, args.duration)
        cpu_after = bench.cpu_snapshot(child.process.pid)
        after = oip.drained(metrics_port)
        figures = bench.summarize(result["latencies_ns"], result["elapsed_s"], result["errors"])
        figures["cpu"] = bench.cpu_usage(cpu_before, cpu_after, figures["requests"])
        figures["guard"] = oip.guard_delta(before, after)
        figures["loadavg"] = [load_before, os.getloadavg()[0]]
        mirror = figures["guard"].get("mirror", {})
        bench.log(f"  round {round_index + 1} ({cell}): {figures['throughput_rps']:.0f} req/s, p50 "
               f"{figures['p50_ms']:.3f} ms, p99 {figures['p99_ms']:.3f} ms; compared "
               f"{mirror.get('compared', 0)}, dropped {mirror.get('dropped', 0)}; other load "
               f"{figures['cpu'].get('other_cores', float('nan')):.2f} cores")
        return figures
    finally:
        code = child.stop()
        if code not in (0, None):
            bench.log(f"warning: guard ({cell}) exited with code {code}:\n{child.log_tail()}")


def pooled(parts: list[dict]) -> dict:
    """One cell's rounds: latencies pooled by their percentiles' mean (each round's own), the
    counts and CPU summed."""
    mirror: dict[str, int] = {}
    for p in parts:
        for k, v in p["guard"].get("mirror", {}).items():
            mirror[k] = mirror.get(k, 0) + v
    requests = sum(p["requests"] for p in parts)
    out = {"requests": requests, "errors": sum(p["errors"] for p in parts),
           "throughput_rps": requests / sum(p["elapsed_s"] for p in parts),
           "p50_ms": float(np.mean([p["p50_ms"] for p in parts])),
           "p99_ms": float(np.mean([p["p99_ms"] for p in parts])),
           "mirror": mirror, "cpu": bench.merge_cpu(parts),
           "loadavg_max": max(max(p["loadavg"]) for p in parts),
           "other_cores_max": max(p["cpu"].get("other_cores", 0.0) for p in parts),
           "rounds": [{k: p[k] for k in ("throughput_rps", "p50_ms", "p99_ms")}
                      | {"mirror": p["guard"].get("mirror", {})} for p in parts]}
    sampled = mirror.get("sampled", 0)
    out["dropped_share"] = mirror.get("dropped", 0) / sampled if sampled else 0.0
    return out


# -- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"guard-batching-{os.getpid()}"
    workdir.mkdir(parents=True)
    env = dict(os.environ, GUARD_CACHE_DIR=str(workdir), PYTHONUNBUFFERED="1")
    os.environ["GUARD_CACHE_DIR"] = str(workdir)
    report: dict = {"machine": bench.machine_info(), "loadavg_start": os.getloadavg(),
                    "settings": {k: v for k, v in vars(args).items()}}
    try:
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_prepare", "--workdir",
                        str(workdir)], check=True, env=env, cwd=str(bench.REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        report["forward_cpu_ms_hot"] = prep["forward_cpu_ms_hot"]
        bench.log(f"MLP exported; ORT forward, batch 1, hot: {prep['forward_cpu_ms_hot']:.4f} "
                  "ms CPU")
        report["in_process"] = []
        for _round in range(args.in_process_rounds):
            for rate in [float(r) for r in args.rates.split(",")]:
                for max_batch in (1, 64):
                    report["in_process"].append(
                        in_process(workdir, env, max_batch, rate, args.samples))
        if not args.no_e2e:
            cells = ["off", "one", "batch"] + (["today"] if args.before else [])
            requests = build_requests(np.load(workdir / "inputs.npy"))
            runs: dict[str, list] = {c: [] for c in cells}
            for round_index in range(args.rounds):
                order = cells[round_index % len(cells):] + cells[:round_index % len(cells)]
                for cell in order:
                    runs[cell].append(measure(cell, args, prep, workdir, env, requests,
                                              round_index))
            report["e2e"] = {cell: pooled(parts) for cell, parts in runs.items()}
        report["loadavg_end"] = os.getloadavg()
        md = markdown(report)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mirror_batching.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "mirror_batching.md").write_text(md)
        print(md)
        return 0
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Mirror batching: does the verifier keep up with a fast model?", "",
        "Generated by `benchmarks/mirror_batching.py` (" + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in report["settings"].items()
            if v not in (None, False) and k not in ("out",)) + ").", "",
        "- " + bench.machine_line(m, ("onnxruntime", "numpy", "grpcio")),
        f"- Load average (1 min) at start {report['loadavg_start'][0]:.2f}, at end "
        f"{report['loadavg_end'][0]:.2f}"
        # (the load at the end is mostly the benchmark's own: other processes' CPU during each
        # e2e cell is measured, in the table's last column)
        + (": **a shared, busy machine; rerun on a quiet one before quoting**"
           if report["loadavg_start"][0] > 0.5
           or any(f["other_cores_max"] > 0.2 for f in report.get("e2e", {}).values())
           else ""),
        f"- Model: MLP 32 -> 64 -> 64 -> 10, ONNX Runtime fp32, 1 thread; its forward at batch 1, "
        f"hot: {report['forward_cpu_ms_hot']:.4f} ms CPU", "",
        "## The verifier's path in one process", "",
        "CPU per compared sample of the whole verifier path (ring reader, decode, model, mirror, "
        "reference, checks, detectors, metrics), the reference's forward passes (CPU of their "
        f"thread) and the rest: the overhead, target <= {TARGET_OVERHEAD_MS} ms at >= 200 "
        "samples/s. The feed (the serving side's encode + ring copy, same process) is apart.", "",
        "| max_batch | rate /s | samples | mean batch | verifier CPU ms | forward CPU ms | "
        "**overhead ms** | feed ms | dropped | target |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["in_process"]:
        ok = r["overhead_ms"] <= TARGET_OVERHEAD_MS
        lines.append(f"| {r['max_batch']} | {r['rate']:g} | {r['samples']} | "
                     f"{r['mean_batch']:.1f} | {r['verifier_cpu_ms']:.3f} | "
                     f"{r['forward_cpu_ms']:.3f} | **{r['overhead_ms']:.3f}** | "
                     f"{r['feed_ms']:.3f} | {r['dropped']:.0f} | "
                     f"{'PASS' if ok else 'MISS'} |")
    by = report["in_process"][-1]["by_thread_ms"]
    lines += ["", "By thread, the last row (ms per sample): " + ", ".join(
        f"{k} {v:.3f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))]
    e2e = report.get("e2e")
    if e2e:
        off = e2e["off"]
        lines += ["", "## End to end: guard serve, closed-loop clients", "",
                  f"{report['settings']['concurrency']} closed-loop tritonclient gRPC clients, "
                  f"{report['settings']['duration']:g} s per cell, {report['settings']['rounds']}"
                  " round(s), cells in rotating order; percentiles: mean over rounds.", "",
                  "| cell | req/s | p50 ms | p99 ms | sampled | dropped | dropped share | "
                  "serving CPU ms/req | verifier CPU ms/req | p99 / off | req/s / off | "
                  "other load (cores) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cell, f in e2e.items():
            cpu = f["cpu"]
            lines.append(
                f"| ({cell}) {CELLS[cell]} | {f['throughput_rps']:.0f} | {f['p50_ms']:.3f} | "
                f"{f['p99_ms']:.3f} | {f['mirror'].get('sampled', 0)} | "
                f"{f['mirror'].get('dropped', 0)} | {f['dropped_share']:.2%} | "
                f"{cpu.get('server_cpu_ms_per_request', float('nan')):.3f} | "
                f"{cpu.get('verifier_cpu_ms_per_request', float('nan')):.3f} | "
                f"{f['p99_ms'] / off['p99_ms']:.2f}x | "
                f"{f['throughput_rps'] / off['throughput_rps']:.2f}x | "
                f"{f['other_cores_max']:.2f} |")
        lines += ["", "| target | cell | measured | result |", "|---|---|---|---|"]
        for cell in [c for c in ("batch", "one", "today") if c in e2e]:
            f = e2e[cell]
            ratio = f["p99_ms"] / off["p99_ms"]
            lines += [
                f"| dropped <= {TARGET_DROPPED:.0%} | ({cell}) | {f['dropped_share']:.2%} | "
                f"{'PASS' if f['dropped_share'] <= TARGET_DROPPED else 'MISS'} |",
                f"| p99 <= {TARGET_P99_RATIO}x (off) | ({cell}) | {ratio:.2f}x | "
                f"{'PASS' if ratio <= TARGET_P99_RATIO else 'MISS'} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_prepare", "_in_process"):
        p = argparse.ArgumentParser()
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--max-batch", type=int, default=64)
        p.add_argument("--rate", type=float, default=200.0)
        p.add_argument("--samples", type=int, default=2000)
        a = p.parse_args(argv[1:])
        if argv[0] == "_prepare":
            cmd_prepare(a.workdir)
        else:
            cmd_in_process(a.workdir, a.max_batch, a.rate, a.samples)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="200,1000",
                        help="in-process feed rates, samples/s (default 200,1000)")
    parser.add_argument("--samples", type=int, default=2000,
                        help="samples per in-process measurement (default 2000)")
    parser.add_argument("--in-process-rounds", type=int, default=1)
    parser.add_argument("--duration", type=float, default=8.0, help="s per e2e cell (8)")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="e2e rounds (2)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="a guard source tree from before batching: the (today) cell")
    parser.add_argument("--no-e2e", action="store_true", help="only the in-process part")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="wait up to S s for other processes to calm down before a cell")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--keep-workdir", action="store_true")
    return bench.parse_and_run(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
