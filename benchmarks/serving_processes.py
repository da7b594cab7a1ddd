"""Does a second serving process help? ``server.processes`` 1 vs 2, closed-loop load over loopback.

Same model and backend in both cells, as in proxy_overhead.py's (b): the zoo classifier on ONNX
Runtime fp32 (intra-op threads 1), batch 1, no reference (mirroring off), guard's default
``server.workers``:

  (1) ``python -m guard serve`` with ``server.processes: 1`` (one serving process; the
      verifier process idles: nothing is mirrored);
  (2) the same with ``server.processes: 2``: a second serving process on the same port
      (SO_REUSEPORT), so the kernel spreads the client connections over two interpreters.

Which process gets a connection is the kernel's hash of the connection, so at C=1 only one
process works, and at C=4 or 8 the split need not be even. CPU per request counts every guard
process (the primary, its verifier and, in (2), the second serving process; read from /proc): on
this machine's cores the load generator competes with them. The load generator, readiness wait,
answer check, CPU snapshots and quiet-waiting are ``benchmarks/oip_load.py``'s and
``benchmarks/bench.py``'s, as in upstream_hop.py: C threads, one gRPC channel (own TCP connection)
each, pre-built raw requests (64 distinct images); a cell disturbed by other processes is measured
again, and what stays disturbed is marked so.

Usage: ``.venv/bin/python benchmarks/serving_processes.py [--duration S] [--concurrency 1,4,8]
[--rounds N] [--quick]`` (``--help`` for the rest). Results: ``serving_processes.json`` and
``serving_processes.md`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the machinery the benchmarks share)
import oip_load as oip  # noqa: E402  (the classifier over OIP, its load)

CELLS = {"1": "guard, server.processes 1", "2": "guard, server.processes 2"}


def guard_config(prep: dict, ports: dict, processes: int) -> dict:
    config = oip.guard_config(prep, ports, mirror=False, sample_rate=0.0, ort_threads=1)
    config["server"]["processes"] = processes
    return config


def cell_note(figures: dict) -> str:
    cpu = figures["cpu"]
    if not cpu:
        return ""
    return (f"; CPU ms/req all guard processes {guard_cpu_ms(cpu):.3f} (primary "
            f"{cpu['server_cores']:.2f} cores, its children {cpu['verifier_cores']:.2f}); "
            f"client {cpu['client_cores']:.2f}, other {cpu['other_cores']:.2f}")


def guard_cpu_ms(cpu: dict) -> float:
    """CPU ms per request of the primary and its children (verifier, other serving process)."""
    return cpu["server_cpu_ms_per_request"] + cpu["verifier_cpu_ms_per_request"]


def run(args: argparse.Namespace) -> int:
    import yaml

    concurrencies, duration, warmup, out_dir, workdir, env = bench.run_plan(args, "guard-procs-")
    children: list[bench.Child] = []
    try:
        (workdir / "bench_reference.py").write_text(oip.REFERENCE_MODULE)  # _prepare times it
        bench.log("exporting the zoo classifier ...")
        subprocess.run([sys.executable, str(HERE / "oip_load.py"), "_prepare",
                        "--workdir", str(workdir), "--slowdown", "1", "--iters",
                        "300" if args.quick else "1000", "--ort-threads", "1"],
                       check=True, env=env, cwd=str(bench.REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        requests = oip.build_requests(np.load(workdir / "inputs.npy"))
        expected = np.load(workdir / "expected.npy")

        runs = {c: {n: [] for n in concurrencies} for c in CELLS}
        pooled = {c: {n: [] for n in concurrencies} for c in CELLS}
        for round_index in range(args.rounds):
            for cell in CELLS:
                port, metrics_port = bench.free_port(), bench.free_port()
                ports = {"grpc_port": port, "metrics_port": metrics_port,
                         "admin_port": bench.free_port()}
                path = workdir / f"guard_{cell}.yaml"
                path.write_text(yaml.safe_dump(guard_config(prep, ports, int(cell)),
                                               sort_keys=False))
                child = bench.Child(cell, [sys.executable, "-m", "guard", "serve", "--config",
                                        str(path)],
                                 workdir / f"guard_{cell}_r{round_index}.log", env)
                children.append(child)
                target = f"{bench.HOST}:{port}"
                oip.wait_ready(target, child)
                worst = oip.check_answers(target, requests, expected)
                bench.log(f"round {round_index + 1}: ({cell}) {CELLS[cell]} on {target}; answers "
                       f"match ORT (max |diff| {worst:.1e})")
                for concurrency in concurrencies:
                    figures, latencies = oip.measure_cell(
                        args, cell, child, target, metrics_port, requests, concurrency,
                        duration, warmup, scrape_fn=oip.scrape, note=cell_note)
                    runs[cell][concurrency].append(figures)
                    pooled[cell][concurrency].append(latencies)
                code = child.stop()
                if code not in (0, None):
                    bench.log(f"warning: guard ({cell}) exited with code {code}:\n"
                           f"{child.log_tail()}")

        report = build_report(args, prep, concurrencies, duration, warmup, runs, pooled)
        bench.write_results(out_dir, "serving_processes", report, markdown(report),
                         text_table(report))
        return 0
    finally:
        bench.clean_up(children, workdir, args.keep_workdir)


# -- report ----------------------------------------------------------------------------------------
def build_report(args, prep, concurrencies, duration, warmup, runs, pooled) -> dict:
    cells = oip.merge_rounds(CELLS, concurrencies, runs, pooled)
    comparisons = {}
    for c in concurrencies:
        one, two = cells["1"][str(c)], cells["2"][str(c)]
        comparisons[str(c)] = {
            "two_over_one": {"throughput": two["throughput_rps"] / one["throughput_rps"],
                             "p50": two["p50_ms"] / one["p50_ms"],
                             "p99": two["p99_ms"] / one["p99_ms"],
                             "guard_cpu_ms_per_request": (guard_cpu_ms(two["cpu"])
                                                          / guard_cpu_ms(one["cpu"])
                                                          if one["cpu"] and two["cpu"]
                                                          else None)},
            "disturbed": any(bench.other_cores({"cells": {k: {"by_concurrency": v}
                                                       for k, v in cells.items()}}, x, str(c))
                             > bench.NOISY_NEIGHBOUR_CORES for x in CELLS),
        }
    return {
        "benchmark": "serving_processes",
        "machine": bench.machine_info(),
        "settings": {
            "duration_s": duration, "warmup_s": warmup, "rounds": args.rounds,
            "wait_quiet_s": args.wait_quiet, "retries": args.retries,
            "concurrency": concurrencies, "quick": bool(args.quick),
            "model": "guard.zoo.classifier (seed 0) exported to ONNX fp32, batch 1, input image "
                     "FP32 [1,3,32,32], output logits FP32 [1,10]",
            "guard": "python -m guard serve; primary onnxruntime (intra-op threads 1), no "
                     "reference, server.workers default; server.processes 1 vs 2",
            "load_generator": oip.LOAD_GENERATOR,
        },
        "calibration": {"primary_ort_p50_ms": prep["primary_ort_p50_ms"]},
        "cells": {k: {"name": CELLS[k], "by_concurrency": v} for k, v in cells.items()},
        "comparisons": comparisons,
    }


FIG_HEAD = ["C", "processes", "req/s", "p50 ms", "p99 ms", "requests", "errors",
            "guard CPU ms/req (all processes)", "primary cores", "children cores",
            "client cores", "other load (cores)"]
CMP_HEAD = ["C", "req/s (2)/(1)", "p50 (2)/(1)", "p99 (2)/(1)", "guard CPU/req (2)/(1)", "note"]


def _rows(report: dict) -> tuple[list[list[str]], list[list[str]]]:
    figures, comparisons = [], []
    for c, comp in report["comparisons"].items():
        for cell in CELLS:
            f = report["cells"][cell]["by_concurrency"][c]
            cpu = f.get("cpu") or {}
            figures.append([c, cell, f"{f['throughput_rps']:.0f}", f"{f['p50_ms']:.3f}",
                            f"{f['p99_ms']:.3f}", str(f["requests"]), str(f["errors"]),
                            f"{guard_cpu_ms(cpu):.3f}" if cpu else "-",
                            f"{cpu.get('server_cores', float('nan')):.2f}",
                            f"{cpu.get('verifier_cores', float('nan')):.2f}",
                            f"{cpu.get('client_cores', float('nan')):.2f}",
                            f"{cpu.get('other_cores', float('nan')):.2f}"])
        r = comp["two_over_one"]
        cpu_ratio = r["guard_cpu_ms_per_request"]
        comparisons.append([c, f"{r['throughput']:.2f}", f"{r['p50']:.2f}", f"{r['p99']:.2f}",
                            f"{cpu_ratio:.2f}" if cpu_ratio is not None else "-",
                            "disturbed" if comp["disturbed"] else ""])
    return figures, comparisons


def _context_lines(report: dict) -> list[str]:
    s = report["settings"]
    return [
        bench.machine_line(report["machine"], ("onnxruntime",)),
        bench.run_line(s),
        f"Model: {s['model']}; ORT in-process p50 "
        f"{report['calibration']['primary_ort_p50_ms'] * 1e3:.0f} us",
        f"guard: {s['guard']}",
        "children cores: the primary's child processes (its verifier, idle here, and in (2) "
        "the second serving process)",
    ] + bench.noisy_warning(report, "guard CPU ms/req")


def text_table(report: dict) -> str:
    figures, comparisons = _rows(report)
    return bench.render_text(_context_lines(report), [
        ("", FIG_HEAD, figures), ("Two processes over one", CMP_HEAD, comparisons)])


def markdown(report: dict) -> str:
    figures, comparisons = _rows(report)
    return bench.render_markdown(
        "Serving processes: server.processes 1 vs 2", "serving_processes.py",
        _context_lines(report), CELLS,
        [("Figures", FIG_HEAD, figures), ("Two processes over one", CMP_HEAD, comparisons)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="server.processes 1 vs 2: one or two guard serving processes on one port "
        "(SO_REUSEPORT), same ONNX Runtime model, closed-loop load over loopback.")
    bench.add_run_arguments(parser, "serving_processes",
                         "repeat the 1,2 sequence (guard restarted each time)")
    parser.set_defaults(concurrency="1,4,8")
    return bench.parse_and_run(parser, sys.argv[1:] if argv is None else argv, run)


if __name__ == "__main__":
    sys.exit(main())
