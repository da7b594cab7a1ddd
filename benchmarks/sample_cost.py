"""What does one compared sample cost? guard's CPU at 10% mirroring minus at 0%, per sample.

The verifier's per-sample path: the serving process samples a request and copies it into the
shared ring (guard/runtime/sampling.py, guard/ipc/ring.py); the verifier's ring reader decodes
it (guard/ipc/wire.py) and queues it for its model's mirror worker
(guard/verifier_process/mirror.py), which runs the reference and the checks (guard/verify/:
tiers 1 and 3) and feeds the route policy, detectors and metrics
(guard/verifier_process/model.py). Everything besides the reference's own forward pass is
overhead, and the target is that it stays under 0.3 ms of CPU per compared sample.

Cells, side by side in one run, each a fresh ``python -m guard serve`` (the same config but the
sample rate), alternating over ``--rounds``:

  (0)  mirroring configured, ``mirror.sample_rate: 0``: the reference is loaded, nothing sampled;
  (s)  ``mirror.sample_rate: 0.1`` (``--sample-rate``).

The model is proxy_overhead.py's: the zoo classifier, ONNX Runtime fp32 primary (intra-op 1),
``task: classification`` (tiers 1 and 3), 10 logits; the reference is its TorchScript, one
forward pass (``--reference-slowdown`` 1: as cheap as it gets, so the overhead shows), on
``mirror.threads: 1``. Load: oip_load.py's closed loop (C threads, raw requests).

Per compared sample: (guard's CPU in (s) - guard's CPU per request in (0) x requests in (s)) /
samples compared in (s), for the whole process tree (serving + verifier) and for each process
(the verifier's baseline is per second, not per request: it polls its ring when idle). The
reference's forward is quoted twice: its in-process p50 (calibration, 1 thread) and the mean the
verifier timed (``guard_reference_duration_seconds``, under load).

``--in-process`` adds a steadier figure: the verifier's own path (its ring reader, the mirror
worker, the checks, policy and metrics) in one child process, fed through a real ring at the
(s) cell's sample rate (``--in-process-rate``, 100/s), with the CPU of each thread read from
/proc, and the reference's forward timed alone in the same process twice: back to back (hot)
and spaced like the samples (cold: caches and predictors lose it between samples, which on a
shared VM triples its cost). Overhead = CPU per sample - the spaced forward.

``--profile`` also records the verifier of the last (s) cell with py-spy (``pip install
py-spy``; the ``bench`` extra) and writes the collapsed stacks (``sample_cost.pyspy.txt``) and a
summary of where the verifier's samples went (``sample_cost.profile.md``) under ``--out``.

Usage: ``.venv/bin/python benchmarks/sample_cost.py [--duration S] [--rounds N]
[--concurrency 1] [--profile]``. Results: ``sample_cost.json`` and ``sample_cost.md`` under
``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the machinery the benchmarks share)
import oip_load as oip  # noqa: E402  (the classifier over OIP, its load)

TARGET_EXTRA_MS = oip.TARGET_COMPARED_EXTRA_CPU_MS  # 0.3 ms over the reference's forward
CELLS = {"0": "mirror configured, sample_rate 0", "s": "mirror sample_rate {rate:g}"}


def measure(args, cell: str, rate: float, prep: dict, workdir: Path, env: dict,
            requests: list, expected: np.ndarray, concurrency: int, duration: float,
            warmup: float, round_index: int, profile_to: Path | None) -> dict:
    import yaml

    port, metrics_port = bench.free_port(), bench.free_port()
    ports = {"grpc_port": port, "metrics_port": metrics_port, "admin_port": bench.free_port()}
    config = oip.guard_config(prep, ports, mirror=True, sample_rate=rate,
                             ort_threads=args.ort_threads)
    path = workdir / f"guard_{cell}_r{round_index}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    child = bench.Child(cell, [sys.executable, "-m", "guard", "serve", "--config", str(path)],
                     workdir / f"server_{cell}_r{round_index}.log", env)
    try:
        target = f"{bench.HOST}:{port}"
        oip.wait_ready(target, child)
        oip.check_answers(target, requests, expected)
        bench.wait_quiet([child.process.pid], args.wait_quiet)
        oip.closed_loop(target, requests, concurrency, warmup)
        before = oip.drained(metrics_port)
        spy = None
        if profile_to is not None:
            (verifier,) = bench.child_pids(child.process.pid)
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--pid",
                 str(verifier), "--rate", "250", "--format", "raw", "--duration",
                 str(int(duration)), "--output", str(profile_to), "--nonblocking"],
                stdout=(workdir / "py-spy.log").open("w"), stderr=subprocess.STDOUT)
        cpu_before = bench.cpu_snapshot(child.process.pid)
        result = oip.closed_loop(target, requests, concurrency, duration)
        cpu_after = bench.cpu_snapshot(child.process.pid)
        after = oip.drained(metrics_port)
        if spy is not None:
            spy.wait(timeout=duration + 60)
        figures = bench.summarize(result["latencies_ns"], result["elapsed_s"], result["errors"])
        figures["cpu"] = bench.cpu_usage(cpu_before, cpu_after, figures["requests"])
        # The mirror's outcomes by the drained scrape: samples of the cell finish after it.
        figures["guard"] = oip.guard_delta(before, after)
        mirror = figures["guard"].get("mirror", {})
        cpu = figures["cpu"]
        bench.log(f"  round {round_index + 1} ({cell}) c={concurrency}: "
               f"{figures['throughput_rps']:.0f} req/s, p50 {figures['p50_ms']:.3f} ms; CPU "
               f"serving {cpu['server_cpu_ms_per_request']:.3f} ms/req, verifier "
               f"{cpu['verifier_cores']:.3f} cores; compared {mirror.get('compared', 0)}, "
               f"dropped {mirror.get('dropped', 0)}; other load {cpu['other_cores']:.2f} cores")
        return figures
    finally:
        code = child.stop()
        if code not in (0, None):
            bench.log(f"warning: guard ({cell}) exited with code {code}:\n{child.log_tail()}")


def thread_ticks() -> dict[int, int]:
    """utime + stime of each thread of this process, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = int(fields[11]) + int(fields[12])
    return out


def cmd_in_process(workdir: Path, rate: float, samples: int, ort_threads: int) -> None:
    """The verifier's path in this process (a child of the benchmark): its ring reader,
    mirror and checks as ``python -m guard.verifier_process`` runs them (``VerifierProcess``
    with a real ring and route table, the model built by its ``_build``), fed at ``rate``;
    prints JSON."""
    import threading

    import yaml

    from guard.plan.complete import load_config
    from guard.ipc import routes, wire
    from guard.ipc.ring import SampleRing
    from guard.verifier_process.process import VerifierProcess

    prep = json.loads((workdir / "prepare.json").read_text())
    config_path = workdir / "guard_in_process.yaml"
    config_path.write_text(yaml.safe_dump(oip.guard_config(
        prep, {"grpc_port": 0, "metrics_port": 0, "admin_port": 0}, mirror=True,
        sample_rate=0.1, ort_threads=ort_threads)))
    model_config = load_config(config_path).models[0]

    class NoServing:  # the verifier's link to a serving process: nothing on this path uses it
        def use_primary(self, *args):
            return ""

        def transition(self, *args):
            pass

        def span(self, *args):
            pass

    table = routes.RouteTable(16)
    slot = table.assign([model_config.name])[model_config.name]
    ring = SampleRing(64 << 20)
    verifier = VerifierProcess(None, table, [ring])
    verifier.link = NoServing()
    model = verifier._build(model_config, slot, "", None, [])
    verifier.models[model.name], verifier.by_slot[slot] = model, model
    inputs, expected = np.load(workdir / "inputs.npy"), np.load(workdir / "expected.npy")
    reference = model.backends["reference"]
    gap = 1.0 / rate

    def forward_ms(spacing: float, n: int) -> float:
        total = 0.0
        for i in range(n):
            t0 = time.thread_time()
            reference.infer({"image": inputs[i % 64:i % 64 + 1]})
            total += time.thread_time() - t0
            if spacing:
                time.sleep(spacing)
        return total / n * 1e3

    forward_ms(0, 200)
    hot = forward_ms(0, 2000)
    spaced: list[float] = []
    timer = threading.Thread(target=lambda: spaced.append(forward_ms(gap, min(samples, 500))))
    timer.start()
    timer.join()
    compared = lambda: model.metrics.mirror.labels(model.name, "compared")._value.get()  # noqa

    def feed(k: int) -> float:
        t0 = time.thread_time()
        i = k % 64
        parts = wire.encode(wire.Sample(
            model.name, slot, "primary", 0, wire.MIRROR, f"r{k}", "", 0.001,
            wire.Tensors({"image": inputs[i:i + 1]}, {"logits": expected[i:i + 1]}),
            time.time_ns()))
        if not ring.put(parts):
            raise RuntimeError("ring full")
        return time.thread_time() - t0

    verifier._reader.start()
    verifier._beat.start()
    for k in range(100):  # warm-up, and every ring page touched once
        feed(k)
        time.sleep(gap)
    while compared() < 100:
        time.sleep(0.01)
    idle_before, idle_wall = time.process_time(), time.perf_counter()
    time.sleep(3.0)
    idle_cores = (time.process_time() - idle_before) / (time.perf_counter() - idle_wall)
    start_compared = compared()
    ticks_before, cpu_before = thread_ticks(), time.process_time()
    wall_before = time.perf_counter()
    fed = 0.0
    for k in range(samples):
        fed += feed(k)
        time.sleep(gap)
    while compared() < start_compared + samples:
        time.sleep(0.001)
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    ticks_after = thread_ticks()
    names = {t.native_id: t.name for t in threading.enumerate()}
    by_thread = {}
    for tid, after in ticks_after.items():
        used = (after - ticks_before.get(tid, 0)) / bench.CLK_TCK * 1e3 / samples
        if used:
            name = names.get(tid, str(tid))
            by_thread[name] = by_thread.get(name, 0.0) + used
    per_sample = (cpu - fed - idle_cores * wall) / samples * 1e3
    print(json.dumps({
        "rate": rate, "samples": samples, "per_sample_cpu_ms": per_sample,
        "forward_hot_ms": hot, "forward_spaced_ms": spaced[0],
        "overhead_ms": per_sample - spaced[0], "feed_ms": fed / samples * 1e3,
        "idle_cores": idle_cores, "by_thread_ms": by_thread,
        "dropped": model.metrics.mirror.labels(model.name, "dropped")._value.get()}))
    os._exit(0)  # the verifier's threads are daemons; nothing to flush


def in_process(args, workdir: Path, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "_in_process", "--workdir", str(workdir),
         "--rate", str(args.in_process_rate), "--samples", str(args.in_process_samples),
         "--ort-threads", str(args.ort_threads)],
        check=True, env=env, cwd=str(bench.REPO), capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    bench.log(f"  in process: {result['per_sample_cpu_ms']:.3f} ms CPU per sample; forward "
           f"{result['forward_spaced_ms']:.3f} ms spaced, {result['forward_hot_ms']:.3f} ms hot; "
           f"overhead {result['overhead_ms']:.3f} ms; by thread {result['by_thread_ms']}")
    return result


def per_sample(zero: dict, sampled: dict) -> dict:
    """The CPU a compared sample adds, from a (0) and an (s) cell's summed figures."""
    z, s = zero["cpu"], sampled["cpu"]
    compared = sampled["guard"].get("mirror", {}).get("compared", 0)
    if not compared:
        return {}
    requests = s["requests"]
    serving = s["server_s"] - z["server_s"] / z["requests"] * requests
    verifier = s["verifier_s"] - z["verifier_s"] / z["wall_s"] * s["wall_s"]
    return {"compared": compared, "requests": requests,
            "serving_ms": serving * 1e3 / compared, "verifier_ms": verifier * 1e3 / compared,
            "tree_ms": (serving + verifier) * 1e3 / compared}


def merged(parts: list[dict]) -> dict:
    out = {"cpu": bench.merge_cpu(parts), "guard": oip.merge_guard(parts)}
    out.update({k: sum(p[k] for p in parts) for k in ("requests", "errors")})
    out["throughput_rps"] = out["requests"] / sum(p["elapsed_s"] for p in parts)
    out["rounds"] = [per_round(p) for p in parts]
    return out


def per_round(p: dict) -> dict:
    return {"throughput_rps": p["throughput_rps"], "p50_ms": p["p50_ms"],
            "server_cpu_ms_per_request": p["cpu"]["server_cpu_ms_per_request"],
            "verifier_cores": p["cpu"]["verifier_cores"], "other_cores": p["cpu"]["other_cores"],
            "compared": p["guard"].get("mirror", {}).get("compared", 0)}


def profile_summary(stacks: Path, top: int = 40) -> str:
    """Where the verifier's py-spy samples went, from py-spy's collapsed ``--format raw``
    output (one ``frame;frame;... count`` line per stack, a frame ``function (file:line)``):
    the share of samples each function was on the stack for (inclusive, lines merged), and
    the share it was on top (self)."""
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame.rsplit(":", 1)[0] + ")" if ":" in frame else frame
                  for frame in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    if not total:
        return "no samples\n"
    lines = [f"{total} samples of the verifier's active threads", "",
             "| function (file) | inclusive | self |", "|---|---|---|"]
    lines += [f"| `{f}` | {n / total:.1%} | {own[f] / total:.1%} |"
              for f, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    concurrencies, duration, warmup, out_dir, workdir, env = bench.run_plan(args, "guard-sample-")
    if len(concurrencies) != 1:
        raise SystemExit("--concurrency: one value (the per-sample cost needs one load)")
    concurrency = concurrencies[0]
    if args.profile and not Path(sys.executable).with_name("py-spy").exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy (the bench extra)")
    try:
        (workdir / "bench_reference.py").write_text(oip.REFERENCE_MODULE)
        bench.log("exporting the zoo classifier and calibrating the reference ...")
        subprocess.run([sys.executable, str(HERE / "oip_load.py"), "_prepare",
                        "--workdir", str(workdir), "--slowdown", str(args.reference_slowdown),
                        "--iters", "2000", "--ort-threads", str(args.ort_threads)],
                       check=True, env=env, cwd=str(bench.REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        bench.log(f"primary ORT p50 {prep['primary_ort_p50_ms'] * 1e3:.0f} us; reference "
               f"{prep['repeats']} forward(s), p50 {prep['reference_p50_ms'] * 1e3:.0f} us")
        requests = oip.build_requests(np.load(workdir / "inputs.npy"))
        expected = np.load(workdir / "expected.npy")
        runs: dict[str, list[dict]] = {"0": [], "s": []}
        stacks = out_dir / "sample_cost.pyspy.txt"
        out_dir.mkdir(parents=True, exist_ok=True)
        inprocess = []
        for round_index in range(args.rounds):
            if args.in_process:
                inprocess.append(in_process(args, workdir, env))
            for cell, rate in (("0", 0.0), ("s", args.sample_rate)):
                last = round_index == args.rounds - 1 and cell == "s"
                runs[cell].append(measure(
                    args, cell, rate, prep, workdir, env, requests, expected, concurrency,
                    duration, warmup, round_index,
                    stacks if args.profile and last else None))
        report = build_report(args, prep, concurrency, duration, warmup, runs)
        if inprocess:
            report["in_process"] = inprocess
        md = markdown(report)
        if args.profile and stacks.exists():
            summary = profile_summary(stacks)
            (out_dir / "sample_cost.profile.md").write_text(
                "# Verifier profile (py-spy), the last sampled cell\n\n" + summary)
            print(summary)
        bench.write_results(out_dir, "sample_cost", report, md, md)
        return 0
    finally:
        if not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def build_report(args, prep, concurrency, duration, warmup, runs) -> dict:
    zero, sampled = merged(runs["0"]), merged(runs["s"])
    cost = per_sample(zero, sampled)
    forward = prep["reference_p50_ms"]
    timed = sampled["guard"].get("reference_mean_ms")
    if cost:
        cost["target_ms"] = forward + TARGET_EXTRA_MS
        cost["ok"] = cost["tree_ms"] <= cost["target_ms"]
    rounds = [per_sample({"cpu": a["cpu"], "guard": a["guard"]},
                         {"cpu": b["cpu"], "guard": b["guard"]})
              for a, b in zip(runs["0"], runs["s"])]
    return {
        "machine": bench.machine_info(),
        "settings": {"duration_s": duration, "warmup_s": warmup, "rounds": args.rounds,
                     "concurrency": concurrency, "sample_rate": args.sample_rate,
                     "reference_slowdown": args.reference_slowdown,
                     "ort_threads": args.ort_threads},
        "prepare": prep,
        "cells": {"0": zero, "s": sampled},
        "per_compared_sample": cost,
        "per_round": rounds,
        "reference_forward_ms": {"in_process_p50": forward, "timed_by_verifier_mean": timed},
        "other_cores_max": max(p["cpu"]["other_cores"] for ps in runs.values() for p in ps),
    }


def markdown(report: dict) -> str:
    m, st, cost = report["machine"], report["settings"], report["per_compared_sample"]
    ref = report["reference_forward_ms"]
    lines = [
        "# Sample cost: the CPU one compared sample adds",
        "",
        "Generated by `benchmarks/sample_cost.py`: guard's CPU at mirror sample rate "
        f"{st['sample_rate']:g} minus at 0, per compared sample; closed loop, "
        f"C={st['concurrency']}.",
        "",
        "- " + bench.machine_line(m, ("onnxruntime", "torch", "numpy")),
        f"- Run: {st['duration_s']:g} s per cell after {st['warmup_s']:g} s warm-up, "
        f"{st['rounds']} round(s), cells alternating",
        f"- Reference: the zoo classifier's TorchScript, {report['prepare']['repeats']} forward "
        f"pass(es), 1 thread: in-process p50 {ref['in_process_p50']:.3f} ms; as timed by the "
        f"verifier under load (wall time, on its niced thread) "
        f"{(ref['timed_by_verifier_mean'] or float('nan')):.3f} ms",
        f"- Other processes used up to {report['other_cores_max']:.2f} cores during a cell",
        "",
        "| cell | req/s | requests | compared | serving CPU ms/req | verifier cores |",
        "|---|---|---|---|---|---|",
    ]
    for cell, name in CELLS.items():
        f = report["cells"][cell]
        compared = f["guard"].get("mirror", {}).get("compared", 0)
        lines.append(f"| ({cell}) {name.format(rate=st['sample_rate'])} | "
                     f"{f['throughput_rps']:.0f} | {f['requests']} | {compared} | "
                     f"{f['cpu']['server_cpu_ms_per_request']:.3f} | "
                     f"{f['cpu']['verifier_cores']:.3f} |")
    if cost:
        lines += [
            "",
            "| per compared sample | CPU ms |",
            "|---|---|",
            f"| serving process (sampling, ring copy) | {cost['serving_ms']:.3f} |",
            f"| verifier process (decode, reference, checks, policy, metrics) | "
            f"{cost['verifier_ms']:.3f} |",
            f"| **whole tree** | **{cost['tree_ms']:.3f}** |",
            f"| target: the reference's forward + {TARGET_EXTRA_MS} | {cost['target_ms']:.3f} "
            f"({'PASS' if cost['ok'] else 'MISS'}) |",
            "",
            "Per round (whole tree ms per compared sample): "
            + ", ".join(f"{r['tree_ms']:.3f}" for r in report["per_round"] if r),
        ]
    for r in report.get("in_process", []):
        if r is report["in_process"][0]:
            lines += ["", f"In process (the verifier's path fed at {r['rate']:g} samples/s "
                      "through a real ring; CPU by thread; the forward timed alone in the same "
                      "process):", "",
                      "| samples | CPU ms per sample | forward spaced ms | forward hot ms | "
                      "overhead ms (CPU - spaced forward) | by thread (ms per sample) |",
                      "|---|---|---|---|---|---|"]
        threads = ", ".join(f"{k} {v:.3f}" for k, v in sorted(
            r["by_thread_ms"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['samples']} | {r['per_sample_cpu_ms']:.3f} | "
                     f"{r['forward_spaced_ms']:.3f} | {r['forward_hot_ms']:.3f} | "
                     f"**{r['overhead_ms']:.3f}** | {threads} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_in_process":
        p = argparse.ArgumentParser()
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--rate", type=float, required=True)
        p.add_argument("--samples", type=int, required=True)
        p.add_argument("--ort-threads", type=int, default=1)
        a = p.parse_args(argv[1:])
        cmd_in_process(a.workdir, a.rate, a.samples, a.ort_threads)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_run_arguments(parser, "sample_cost", "repeat the (0), (s) pair (fresh servers)")
    parser.set_defaults(concurrency="1")
    parser.add_argument("--sample-rate", type=float, default=0.1)
    parser.add_argument("--reference-slowdown", type=float, default=1.0,
                        help="the reference's cost over the primary's (1: one forward pass)")
    parser.add_argument("--ort-threads", type=int, default=1)
    parser.add_argument("--in-process", action="store_true",
                        help="also measure the verifier's path in one process (each round)")
    parser.add_argument("--in-process-rate", type=float, default=100.0)
    parser.add_argument("--in-process-samples", type=int, default=500)
    parser.add_argument("--profile", action="store_true",
                        help="py-spy the verifier during the last sampled cell")
    return bench.parse_and_run(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
