"""Local mode's request-path cost: guard answering from its own ONNX Runtime backend against a
bare grpc.aio OIP server running the same model, and (optionally) guard from another source tree
(``--before DIR``, e.g. an export of the previous commit), all in one run.

The servers are proxy_overhead.py's (oip_load.py's): (a) the bare OIP server, (b) ``python -m guard
serve`` with mirroring off (guard's defaults: the ~0.1 ms primary runs inline on the event loop).
All of them run at once, idle between cells; the cells are measured in turn, the order rotated each
round (a, b, b0; b, b0, a; ...), for ``--rounds`` rounds, so that the drift of a shared machine
falls on every cell alike. Figures: the serving process's CPU per request (/proc utime+stime, the
verifier process excluded: it is not on the request path) and req/s, per concurrency, summed over
the rounds; ratios to (a), and the median over the rounds of each round's ratio.

Usage: ``.venv/bin/python benchmarks/local_cost.py [--concurrency 4,8] [--duration 6]
[--rounds 3] [--before DIR]``. Results: ``local_cost.json`` and ``local_cost.md`` under ``--out``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the machinery the benchmarks share)
import oip_load as oip  # noqa: E402  (the classifier over OIP, its load)

TARGET_CPU_ADD_MS = oip.TARGET_LOCAL_CPU_ADD_MS
TARGET_THROUGHPUT = oip.TARGET_LOCAL_THROUGHPUT


def start(cell: str, argv: list[str], workdir: Path, env: dict, port: int,
          cwd: str = str(bench.REPO)) -> bench.Child:
    """A server, ready. ``cwd`` is the source tree: ``python -m`` puts it first on sys.path."""
    child = bench.Child(cell, argv, workdir / f"server_{cell}.log", env, cwd=Path(cwd))
    oip.wait_ready(f"{bench.HOST}:{port}", child)
    return child


def run(args: argparse.Namespace) -> int:
    import yaml

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"guard-localcost-{os.getpid()}"
    workdir.mkdir(parents=True)
    env = dict(os.environ, GUARD_CACHE_DIR=str(workdir), PYTHONUNBUFFERED="1")
    os.environ["GUARD_CACHE_DIR"] = str(workdir)
    children: dict[str, bench.Child] = {}
    try:
        (workdir / "bench_reference.py").write_text(oip.REFERENCE_MODULE)  # _prepare times it
        subprocess.run([sys.executable, str(Path(oip.__file__)), "_prepare", "--workdir",
                        str(workdir), "--slowdown", "1", "--iters", "300",
                        "--ort-threads", str(args.ort_threads)],
                       check=True, env=env, cwd=str(bench.REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        requests = oip.build_requests(np.load(workdir / "inputs.npy"))
        expected = np.load(workdir / "expected.npy")
        trees = {"b": str(bench.REPO)}
        if args.before:
            trees["b0"] = str(Path(args.before).resolve())
        targets = {}
        port = bench.free_port()
        children["a"] = start("a", [sys.executable, str(Path(oip.__file__)), "_baseline",
                                    "--onnx", prep["onnx"], "--port", str(port),
                                    "--ort-threads", str(args.ort_threads)], workdir, env, port)
        targets["a"] = f"{bench.HOST}:{port}"
        for cell, tree in trees.items():
            port = bench.free_port()
            ports = {"grpc_port": port, "metrics_port": bench.free_port(),
                     "admin_port": bench.free_port()}
            config = oip.guard_config(prep, ports, mirror=False, sample_rate=0.0,
                                     ort_threads=args.ort_threads)
            path = workdir / f"guard_{cell}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            cenv = dict(env, PYTHONPATH=tree)
            children[cell] = start(cell, [sys.executable, "-m", "guard", "serve", "--config",
                                          str(path)], workdir, cenv, port, cwd=tree)
            targets[cell] = f"{bench.HOST}:{port}"
        for target in targets.values():
            oip.check_answers(target, requests, expected)
        sums = {cell: {c: {"server_s": 0.0, "requests": 0, "wall_s": 0.0, "other_s": 0.0}
                       for c in concurrencies} for cell in targets}
        for round_index in range(args.rounds):
            for c in concurrencies:
                cells = list(targets)  # rotated each round: no cell always follows another
                shift = round_index % len(cells)
                for cell in cells[shift:] + cells[:shift]:
                    target = targets[cell]
                    pid = children[cell].process.pid
                    oip.closed_loop(target, requests, c, args.warmup)
                    before = bench.cpu_snapshot(pid)
                    result = oip.closed_loop(target, requests, c, args.duration)
                    after = bench.cpu_snapshot(pid)
                    n = int(result["latencies_ns"].size)
                    cpu = bench.cpu_usage(before, after, n)
                    s = sums[cell][c]
                    s["server_s"] += cpu["server_s"]
                    s["requests"] += n
                    s["wall_s"] += result["elapsed_s"]
                    s["other_s"] += cpu["other_s"]
                    s.setdefault("rounds", []).append(
                        {"rps": n / result["elapsed_s"],
                         "cpu_ms": cpu["server_cpu_ms_per_request"]})
                    bench.log(f"round {round_index + 1} ({cell}) c={c}: "
                           f"{n / result['elapsed_s']:.0f} req/s, serving CPU "
                           f"{cpu['server_cpu_ms_per_request']:.3f} ms/req, other "
                           f"{cpu['other_cores']:.2f} cores, errors {result['errors']}")
        report = {"machine": bench.machine_info(), "source": bench.guard_source(),
                  "settings": {"concurrency": concurrencies, "duration_s": args.duration,
                               "warmup_s": args.warmup, "rounds": args.rounds,
                               "ort_threads": args.ort_threads, "before": args.before},
                  "primary_ort_p50_ms": prep["primary_ort_p50_ms"], "cells": {}}
        for cell in targets:
            report["cells"][cell] = {}
            for c in concurrencies:
                s = sums[cell][c]
                report["cells"][cell][str(c)] = {
                    "requests": s["requests"], "throughput_rps": s["requests"] / s["wall_s"],
                    "cpu_ms_per_request": s["server_s"] * 1e3 / s["requests"],
                    "other_cores": s["other_s"] / s["wall_s"], "rounds": s["rounds"]}
                if cell != "a":  # per-round ratios to (a) measured just before: less drift
                    base = sums["a"][c]["rounds"]
                    f = report["cells"][cell][str(c)]
                    f["median_round_throughput_ratio"] = float(np.median(
                        [r["rps"] / b["rps"] for r, b in zip(s["rounds"], base)]))
                    f["median_round_cpu_add_ms"] = float(np.median(
                        [r["cpu_ms"] - b["cpu_ms"] for r, b in zip(s["rounds"], base)]))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "local_cost.json").write_text(json.dumps(report, indent=2) + "\n")
        md = markdown(report, targets)
        (out / "local_cost.md").write_text(md)
        print(md)
        return 0
    finally:
        for child in children.values():
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def markdown(report: dict, cells) -> str:
    names = {"a": "(a) bare grpc.aio + ORT", "b": "(b) guard, this tree",
             "b0": f"(b0) guard, {report['settings']['before']}"}
    lines = ["# Local mode: guard vs a bare OIP server", "",
             bench.machine_line(report["machine"], ("onnxruntime",)), "",
             f"Run: {report['settings']}; guard commit {report['source']}", "",
             "| C | cell | req/s | x bare | serving CPU ms/req | + over bare | median of rounds: "
             "x bare | median of rounds: + over bare | other cores |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in map(str, report["settings"]["concurrency"]):
        a = report["cells"]["a"][c]
        for cell in cells:
            f = report["cells"][cell][c]
            lines.append(
                f"| {c} | {names[cell]} | {f['throughput_rps']:.0f} | "
                f"{f['throughput_rps'] / a['throughput_rps']:.2f}x | "
                f"{f['cpu_ms_per_request']:.3f} | "
                f"{f['cpu_ms_per_request'] - a['cpu_ms_per_request']:+.3f} | "
                f"{f.get('median_round_throughput_ratio', 1.0):.2f}x | "
                f"{f.get('median_round_cpu_add_ms', 0.0):+.3f} | "
                f"{f['other_cores']:.2f} |")
    lines += ["", f"Targets: + over bare <= {TARGET_CPU_ADD_MS} ms; x bare >= "
              f"{TARGET_THROUGHPUT}x at C=4-8.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="4,8")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ort-threads", type=int, default=1)
    p.add_argument("--before", default=None, metavar="DIR",
                   help="another guard source tree, served beside this one as (b0)")
    p.add_argument("--out", default=str(bench.HERE / "results"))
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
