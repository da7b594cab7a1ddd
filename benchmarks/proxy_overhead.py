"""What does the guard cost on the request path? Closed-loop load over loopback, three servers.

Same model, same backend in every cell: the zoo classifier (``guard.zoo.classifier``) on ONNX
Runtime fp32, batch 1, with the same session options (those guard builds for a primary; intra-op
threads 1 unless ``--ort-threads``: ORT's default spins one thread per core, which on a small box
shared with the load generator mostly measures the spinning).

  (a) baseline  a bare Open Inference Protocol gRPC server: grpc.aio + tritonclient's
                ``service_pb2_grpc`` servicer, ``raw_input_contents`` -> numpy -> ``session.run``
                -> ``raw_output_contents``. Nothing else.
  (b) guard     ``python -m guard serve`` with the same ONNX model as primary, no reference
                (mirroring off).
  (c) guard+mirror  as (b), plus a torch reference (``module:factory`` written into the work
                folder) that runs the same TorchScript model, repeating its forward pass so
                that it costs ~5x the primary (calibrated at start-up); ``mirror.sample_rate``
                0.1, ``mirror.threads`` 1. Its outputs equal the model's, so the checks pass.
                The mirror's threads run at guard's default ``mirror.nice`` (10 below the
                request path).
  (n) as (c) with ``mirror.nice: 0``: what the mirror costs when its threads compete with
                the request path at equal priority (guard before the niceness existed).

Each server is its own subprocess (the load generator shares no GIL with it); they run one at a
time: start, wait for readiness, check the answers, then for each concurrency warm up and
measure. Load: C threads, one gRPC channel (own TCP connection) each, tritonclient's
``GRPCInferenceServiceStub``; closed loop (each thread sends its next request as soon as the
answer arrives) for ``--duration`` seconds. For (c) the guard's ``/metrics`` are scraped before
and after each cell (mirror queue drained) for the mirror outcomes. The servers' CPU per request
and the CPU other processes used meanwhile are read from /proc: on a shared machine a disturbed
cell is measured again, and what stays disturbed is marked so in the report.

Usage: ``.venv/bin/python benchmarks/proxy_overhead.py [--duration S] [--concurrency 1,8]
[--rounds N] [--out DIR] [--quick]`` (``--help`` for the rest); ``make bench`` runs it. Results:
``proxy_overhead.json`` and ``proxy_overhead.md`` under ``--out`` (default
``benchmarks/results``). The servers, the load and the CPU accounting are oip_load.py's and
bench.py's, shared with the other benchmarks here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402  (this folder, on sys.path above)
    HERE,
    HOST,
    REPO,
    Child,
    add_run_arguments,
    clean_up,
    free_port,
    log,
    machine_info,
    machine_line,
    mark_disturbed,
    noisy_warning,
    ok_word,
    parse_and_run,
    render_markdown,
    render_text,
    run_line,
    run_plan,
    wait_quiet,
    write_results,
)
from oip_load import (  # noqa: E402
    LOAD_GENERATOR,
    REFERENCE_MODULE,
    TARGET_COMPARED_EXTRA_CPU_MS,
    TARGET_LOCAL_CPU_ADD_MS,
    TARGET_LOCAL_THROUGHPUT,
    build_requests,
    check_answers,
    guard_config,
    measure_cell,
    merge_rounds,
    wait_ready,
)

# Targets printed beside the figures.
# Targets printed beside the figures.
TARGET_ADD_P50_MS = 0.2
TARGET_ADD_P99_MS = 1.0
TARGET_MIRROR_P99_RATIO = 1.10

CELLS = {
    "a": "baseline (bare OIP server + ORT)",
    "t": "baseline on grpc's threaded server (sync servicer)",
    "b": "guard, mirroring off",
    "w": "as (b), server.inline_below_ms 0 (ORT always on the worker threads: the thread hop)",
    "c": "guard, mirror 10% -> ~5x reference",
    "n": "as (c), mirror.nice 0 (mirror threads at the request path's priority)",
    "x": "guard, mirror 100% -> ~100x reference",
}
# Cells of guard with a reference: (sample rate or None for --sample-rate, reference slowdown
# factor over the calibrated ~5x).
MIRROR_CELLS = {"c": (None, 1), "n": (None, 1), "x": (1.0, 20)}

# The verifier process's other targets (those local_cost.py and sample_cost.py share are
# oip_load.py's).
TARGET_MIRROR_THROUGHPUT = 0.90  # (c) over (b)
TARGET_SLOW_REFERENCE_P99 = 1.5  # (x) over (b)


# -- the run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import yaml

    concurrencies, duration, warmup, out_dir, workdir, env = run_plan(args, "guard-bench-")
    children: list[Child] = []
    try:
        (workdir / "bench_reference.py").write_text(REFERENCE_MODULE)
        log("exporting the zoo classifier and calibrating the reference ...")
        wait_quiet([], args.wait_quiet)
        subprocess.run(
            [sys.executable, str(HERE / "oip_load.py"), "_prepare", "--workdir", str(workdir),
             "--slowdown", str(args.reference_slowdown), "--iters", "300" if args.quick else "2000",
             "--ort-threads", str(args.ort_threads)],
            check=True, env=env, cwd=str(REPO),
        )
        prep = json.loads((workdir / "prepare.json").read_text())
        log(f"primary ORT p50 {prep['primary_ort_p50_ms'] * 1e3:.0f} us; torch forward (1 thread) "
            f"{prep['torch_forward_1thread_p50_ms'] * 1e3:.0f} us -> reference = {prep['repeats']} "
            f"forward pass(es), {prep['reference_p50_ms'] * 1e3:.0f} us = "
            f"{prep['reference_slowdown']:.1f}x the primary")
        inputs = np.load(workdir / "inputs.npy")
        expected = np.load(workdir / "expected.npy")
        requests = build_requests(inputs)

        runs: dict[str, dict[int, list[dict]]] = {c: {n: [] for n in concurrencies} for c in CELLS}
        pooled: dict[str, dict[int, list[np.ndarray]]] = {
            c: {n: [] for n in concurrencies} for c in CELLS}
        for round_index in range(args.rounds):
            for cell in CELLS:
                port = free_port()
                target = f"{HOST}:{port}"
                metrics_port = None
                if cell in ("a", "t"):
                    argv = [sys.executable, str(HERE / "oip_load.py"), "_baseline",
                            "--onnx", prep["onnx"], "--port", str(port),
                            "--executor", str(args.baseline_executor),
                            "--ort-threads", str(args.ort_threads)]
                    if cell == "t":
                        argv.append("--threaded")
                else:
                    metrics_port = free_port()
                    ports = {"grpc_port": port, "metrics_port": metrics_port,
                             "admin_port": free_port()}
                    rate, slowdown = MIRROR_CELLS.get(cell, (None, 1))
                    config = guard_config(prep, ports, mirror=cell in MIRROR_CELLS,
                                          sample_rate=rate or args.sample_rate,
                                          ort_threads=args.ort_threads,
                                          workers=args.guard_workers,
                                          nice=0 if cell == "n" else None, slowdown=slowdown,
                                          inline_below_ms=0.0 if cell == "w" else None)
                    path = workdir / f"guard_{cell}.yaml"
                    path.write_text(yaml.safe_dump(config, sort_keys=False))
                    argv = [sys.executable, "-m", "guard", "serve", "--config", str(path)]
                child = Child(cell, argv, workdir / f"server_{cell}_r{round_index}.log", env)
                children.append(child)
                wait_ready(target, child)
                worst = check_answers(target, requests, expected)
                log(f"round {round_index + 1}: ({cell}) {CELLS[cell]} ready on {target}; "
                    f"answers match ORT (max |diff| {worst:.1e})")
                for concurrency in concurrencies:
                    figures, latencies = measure_cell(args, cell, child, target, metrics_port,
                                                      requests, concurrency, duration, warmup)
                    runs[cell][concurrency].append(figures)
                    pooled[cell][concurrency].append(latencies)
                code = child.stop()
                if code not in (0, None):
                    log(f"warning: server ({cell}) exited with code {code}:\n{child.log_tail()}")

        report = build_report(args, prep, concurrencies, duration, warmup, runs, pooled)
        write_results(out_dir, "proxy_overhead", report, markdown(report), text_table(report))
        return 0
    finally:
        clean_up(children, workdir, args.keep_workdir)


# -- report ----------------------------------------------------------------------------------------
def lean_path_targets(cells: dict, c: str, prep: dict) -> dict:
    """The verifier-process issue's targets at concurrency ``c``, as ratios of this run."""
    a, t, b, w, cc, x = (cells[k][c] for k in "atbwcx")
    cpu = lambda f, who="server": f.get("cpu", {}).get(f"{who}_cpu_ms_per_request",  # noqa: E731
                                                       float("nan"))
    out = {
        "threaded_over_aio_baseline": {"throughput": t["throughput_rps"] / a["throughput_rps"],
                                       "cpu_ms_per_request": cpu(t) - cpu(a)},
        "local_cpu_add_ms": {"value": cpu(b) - cpu(a), "target": TARGET_LOCAL_CPU_ADD_MS},
        "local_cpu_add_ms_thread_hop": {"value": cpu(w) - cpu(a),
                                        "target": TARGET_LOCAL_CPU_ADD_MS},
        "local_throughput": {"value": b["throughput_rps"] / a["throughput_rps"],
                             "target": TARGET_LOCAL_THROUGHPUT},
        "local_throughput_thread_hop": {"value": w["throughput_rps"] / a["throughput_rps"],
                                        "target": TARGET_LOCAL_THROUGHPUT},
        "mirror_p99": {"value": cc["p99_ms"] / b["p99_ms"], "target": TARGET_MIRROR_P99_RATIO},
        "mirror_throughput": {"value": cc["throughput_rps"] / b["throughput_rps"],
                              "target": TARGET_MIRROR_THROUGHPUT},
        "slow_reference_p99": {"value": x["p99_ms"] / b["p99_ms"],
                               "target": TARGET_SLOW_REFERENCE_P99},
    }
    for key in ("local_cpu_add_ms", "local_cpu_add_ms_thread_hop"):
        out[key]["ok"] = out[key]["value"] <= out[key]["target"]
    for key in ("local_throughput", "local_throughput_thread_hop", "mirror_throughput"):
        out[key]["ok"] = out[key]["value"] >= out[key]["target"]
    for key in ("mirror_p99", "slow_reference_p99"):
        out[key]["ok"] = out[key]["value"] <= out[key]["target"]
    mirror_x = x.get("guard", {}).get("mirror", {})
    requests_x = x.get("guard", {}).get("requests_primary", 0)
    out["slow_reference_accounted"] = {
        "requests": requests_x, "compared": mirror_x.get("compared", 0),
        "dropped": mirror_x.get("dropped", 0), "timeout": mirror_x.get("timeout", 0),
        "error": mirror_x.get("error", 0), "client_errors": x["errors"],
        "ok": x["errors"] == 0 and mirror_x.get("sampled", -1) == requests_x}
    compared = cc.get("guard", {}).get("mirror", {}).get("compared", 0)
    verifier_s = cc.get("cpu", {}).get("verifier_s")
    if compared and verifier_s is not None:
        per_sample = verifier_s * 1e3 / compared
        # The reference's forward pass as the verifier timed it in this cell (under the same
        # load), else its in-process p50 from the calibration.
        reference = cc.get("guard", {}).get("reference_mean_ms", prep["reference_p50_ms"])
        out["compared_sample_cpu_ms"] = {
            "value": per_sample, "reference_forward_ms": reference,
            "target": reference + TARGET_COMPARED_EXTRA_CPU_MS,
            "ok": per_sample <= reference + TARGET_COMPARED_EXTRA_CPU_MS,
            "note": "verifier process CPU over the cell / samples compared (includes its idle "
                    "ring polling); the reference forward as timed by the verifier in the cell"}
    return out


def build_report(args, prep, concurrencies, duration, warmup, runs, pooled) -> dict:
    cells = merge_rounds(CELLS, concurrencies, runs, pooled)

    comparisons = {}
    for c in concurrencies:
        a, b, cc, n = (cells[x][str(c)] for x in "abcn")
        comp = {
            "b_over_a": {"p50": b["p50_ms"] / a["p50_ms"], "p99": b["p99_ms"] / a["p99_ms"],
                         "throughput": b["throughput_rps"] / a["throughput_rps"]},
            "c_over_b": {"p50": cc["p50_ms"] / b["p50_ms"], "p99": cc["p99_ms"] / b["p99_ms"],
                         "throughput": cc["throughput_rps"] / b["throughput_rps"]},
            "n_over_b": {"p50": n["p50_ms"] / b["p50_ms"], "p99": n["p99_ms"] / b["p99_ms"],
                         "throughput": n["throughput_rps"] / b["throughput_rps"]},
            "b_minus_a_ms": {"p50": b["p50_ms"] - a["p50_ms"], "p99": b["p99_ms"] - a["p99_ms"]},
        }
        cpu = [x.get("cpu", {}).get("server_cpu_ms_per_request") for x in (a, b, cc)]
        if None not in cpu:
            comp["server_cpu_ms_per_request"] = {"a": cpu[0], "b": cpu[1], "c": cpu[2],
                                                 "b_minus_a": cpu[1] - cpu[0],
                                                 "c_minus_b": cpu[2] - cpu[1]}
        mirror = cc.get("guard", {}).get("mirror", {})
        requests = cc.get("guard", {}).get("requests_primary", 0)
        sampled = mirror.get("sampled", 0)
        # Every sampled request must end as an outcome (compared/dropped/timeout/error) and the
        # share must be the configured rate: a sample the request path waited for, or lost
        # uncounted, would not add up. 5 sigma of a binomial draw.
        sigma = (requests * args.sample_rate * (1 - args.sample_rate)) ** 0.5
        accounted = requests > 0 and abs(sampled - requests * args.sample_rate) <= 5 * sigma + 1
        comp["targets"] = {
            "guard_add_p50_ms": {"value": comp["b_minus_a_ms"]["p50"], "target": TARGET_ADD_P50_MS,
                                 "ok": comp["b_minus_a_ms"]["p50"] <= TARGET_ADD_P50_MS},
            "guard_add_p99_ms": {"value": comp["b_minus_a_ms"]["p99"], "target": TARGET_ADD_P99_MS,
                                 "ok": comp["b_minus_a_ms"]["p99"] <= TARGET_ADD_P99_MS},
            "mirror_p99_ratio": {"value": comp["c_over_b"]["p99"],
                                 "target": TARGET_MIRROR_P99_RATIO,
                                 "ok": comp["c_over_b"]["p99"] <= TARGET_MIRROR_P99_RATIO},
            "mirror_non_blocking": {
                "client_errors": cc["errors"], "requests": requests, "sampled": sampled,
                "sampled_share": sampled / requests if requests else None,
                "dropped": mirror.get("dropped", 0), "timeout": mirror.get("timeout", 0),
                "ok": cc["errors"] == 0 and accounted,
            },
        }
        comp["lean_path"] = lean_path_targets(cells, str(c), prep)
        comparisons[str(c)] = comp

    report = {
        "benchmark": "proxy_overhead",
        "machine": machine_info(),
        "settings": {
            "duration_s": duration, "warmup_s": warmup, "rounds": args.rounds,
            "wait_quiet_s": args.wait_quiet, "retries": args.retries,
            "ort_intra_op_threads": args.ort_threads,
            "concurrency": concurrencies, "quick": bool(args.quick),
            "model": "guard.zoo.classifier (seed 0), ONNX Runtime fp32 CPU, batch 1, "
                     "input image FP32 [1,3,32,32], output logits FP32 [1,10]",
            "ort_session": f"graph optimisation all, intra_op {args.ort_threads} ("
                           + ("ORT default" if not args.ort_threads else "options.intra_op_threads")
                           + "), inter_op 0, sequential; the same session options in (a) and guard",
            "baseline_executor_threads": args.baseline_executor,
            "guard_workers": "guard's default (4)" if args.guard_workers is None
                             else args.guard_workers,
            "mirror": {"sample_rate": args.sample_rate, "threads": 1, "queue_size": 64,
                       "timeout_s": 5.0},
            "load_generator": LOAD_GENERATOR,
        },
        "calibration": prep,
        "cells": {k: {"name": CELLS[k], "by_concurrency": v} for k, v in cells.items()},
        "comparisons": comparisons,
    }
    flag_disturbed(report)
    return report


def flag_disturbed(report: dict) -> None:
    for c, comp in report["comparisons"].items():
        t = comp["targets"]
        for key, cells in (("guard_add_p50_ms", "ab"), ("guard_add_p99_ms", "ab"),
                           ("mirror_p99_ratio", "bc"), ("mirror_non_blocking", "c")):
            mark_disturbed(report, t[key], c, cells)


def _rows(report: dict) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    figures, ratios, targets = [], [], []
    for c, comp in report["comparisons"].items():
        for cell in CELLS:
            f = report["cells"][cell]["by_concurrency"][c]
            g = f.get("guard", {})
            m = g.get("mirror")
            note = ""
            if m:
                note = (f"mirror: compared {m['compared']}, dropped {m['dropped']}, timeout "
                        f"{m['timeout']}, error {m['error']}; checks pass {g['checks']['pass']} "
                        f"fail {g['checks']['fail']}")
            cpu = f.get("cpu") or {}
            figures.append([c, f"({cell}) {CELLS[cell]}", f"{f['p50_ms']:.3f}",
                            f"{f['p99_ms']:.3f}",
                            f"{f['throughput_rps']:.0f}", str(f["requests"]), str(f["errors"]),
                            f"{cpu.get('server_cpu_ms_per_request', float('nan')):.3f}",
                            f"{cpu.get('verifier_cpu_ms_per_request', float('nan')):.3f}",
                            f"{cpu.get('other_cores', float('nan')):.2f}", note])
        r = comp
        cpu_add = r.get("server_cpu_ms_per_request", {}).get("b_minus_a", float("nan"))
        ratios.append([c, f"{r['b_over_a']['p50']:.2f}", f"{r['b_over_a']['p99']:.2f}",
                       f"{r['b_over_a']['throughput']:.2f}", f"{r['b_minus_a_ms']['p50']:+.3f}",
                       f"{r['b_minus_a_ms']['p99']:+.3f}", f"{r['c_over_b']['p50']:.2f}",
                       f"{r['c_over_b']['p99']:.2f}", f"{r['c_over_b']['throughput']:.2f}",
                       f"{r['n_over_b']['p99']:.2f}", f"{cpu_add:+.3f}"])
        t = comp["targets"]
        nb = t["mirror_non_blocking"]
        share = f"{nb['sampled_share']:.1%}" if nb["sampled_share"] is not None else "n/a"
        targets += [
            [c, "guard adds at p50 (b-a)", f"<= {TARGET_ADD_P50_MS} ms",
             f"{t['guard_add_p50_ms']['value']:+.3f} ms", ok_word(t["guard_add_p50_ms"])],
            [c, "guard adds at p99 (b-a)", f"<= {TARGET_ADD_P99_MS} ms",
             f"{t['guard_add_p99_ms']['value']:+.3f} ms", ok_word(t["guard_add_p99_ms"])],
            [c, "mirroring 10% raises p99 (c/b)", f"<= {TARGET_MIRROR_P99_RATIO:.2f}x",
             f"{t['mirror_p99_ratio']['value']:.2f}x", ok_word(t["mirror_p99_ratio"])],
            [c, "mirror never blocks (all samples end counted)", "0 errors, ~10% sampled",
             f"{nb['client_errors']} errors, {nb['sampled']} sampled ({share}) of "
             f"{nb['requests']}, dropped {nb['dropped']}, timeout {nb['timeout']}",
             ok_word(nb)],
        ]
    return figures, ratios, targets


FIG_HEAD = ["C", "server", "p50 ms", "p99 ms", "req/s", "requests", "errors",
            "server CPU ms/req", "verifier CPU ms/req", "other load (cores)", "notes"]


RATIO_HEAD = ["C", "b/a p50", "b/a p99", "b/a req/s", "b-a p50 ms", "b-a p99 ms", "c/b p50",
              "c/b p99", "c/b req/s", "n/b p99 (nice 0)", "b-a server CPU ms/req"]


TARGET_HEAD = ["C", "target", "bound", "measured", "result"]


def _context_lines(report: dict) -> list[str]:
    s = report["settings"]
    cal = report["calibration"]
    lines = [
        machine_line(report["machine"], ("onnxruntime", "torch")),
        run_line(s),
        f"Model: {s['model']}",
        f"Servers: ORT intra-op threads {s.get('ort_intra_op_threads', '?')}; baseline runs ORT "
        + (f"on {s['baseline_executor_threads']} threads" if s.get("baseline_executor_threads")
           else "inline on its event loop")
        + f"; guard server.workers: {s.get('guard_workers', '?')}",
        f"Reference (c): torch TorchScript on 1 thread, forward pass x{cal['repeats']} (one "
        f"forward {cal['torch_forward_1thread_p50_ms'] * 1e3:.0f} us vs primary ORT "
        f"{cal['primary_ort_p50_ms'] * 1e3:.0f} us p50 in-process, target "
        f"{cal['target_slowdown']:g}x); the reference as built: "
        f"{cal['reference_p50_ms'] * 1e3:.0f} us p50 = {cal['reference_slowdown']:.1f}x",
    ]
    lines += noisy_warning(report, "server CPU ms/req")
    for c in report["comparisons"]:
        g = report["cells"]["c"]["by_concurrency"][c].get("guard", {})
        gb = report["cells"]["b"]["by_concurrency"][c].get("guard", {})
        if "reference_mean_ms" in g:
            lines.append(f"  C={c}: inside guard, mean request "
                         f"{gb.get('in_guard_mean_ms', 0):.3f} ms"
                         f" (b) / {g.get('in_guard_mean_ms', 0):.3f} ms (c); mean reference "
                         f"call {g['reference_mean_ms']:.3f} ms under load")
    return lines


LEAN_HEAD = ["C", "target", "bound", "measured", "result"]


def _lean_rows(report: dict) -> list[list[str]]:
    rows = []
    for c, comp in report["comparisons"].items():
        t = comp["lean_path"]
        ok = lambda d: "PASS" if d.get("ok") else "MISS"  # noqa: E731
        threaded = t["threaded_over_aio_baseline"]
        rows += [
            [c, "grpc threaded vs grpc.aio, bare server (t vs a)", "keep the cheaper",
             f"{threaded['throughput']:.2f}x req/s, {threaded['cpu_ms_per_request']:+.3f} ms "
             "CPU/req", "info"],
            [c, "guard adds serving CPU/req (b-a)", f"<= {TARGET_LOCAL_CPU_ADD_MS} ms",
             f"{t['local_cpu_add_ms']['value']:+.3f} ms", ok(t["local_cpu_add_ms"])],
            [c, "same, with the thread hop (w-a)", f"<= {TARGET_LOCAL_CPU_ADD_MS} ms",
             f"{t['local_cpu_add_ms_thread_hop']['value']:+.3f} ms",
             ok(t["local_cpu_add_ms_thread_hop"])],
            [c, "guard throughput (b/a)", f">= {TARGET_LOCAL_THROUGHPUT}x",
             f"{t['local_throughput']['value']:.2f}x", ok(t["local_throughput"])],
            [c, "same, with the thread hop (w/a)", f">= {TARGET_LOCAL_THROUGHPUT}x",
             f"{t['local_throughput_thread_hop']['value']:.2f}x",
             ok(t["local_throughput_thread_hop"])],
            [c, "mirror 10% onto 5x: p99 (c/b)", f"<= {TARGET_MIRROR_P99_RATIO}x",
             f"{t['mirror_p99']['value']:.2f}x", ok(t["mirror_p99"])],
            [c, "mirror 10% onto 5x: throughput (c/b)", f">= {TARGET_MIRROR_THROUGHPUT}x",
             f"{t['mirror_throughput']['value']:.2f}x", ok(t["mirror_throughput"])],
            [c, "mirror 100% onto 100x: p99 (x/b)", f"<= {TARGET_SLOW_REFERENCE_P99}x",
             f"{t['slow_reference_p99']['value']:.2f}x", ok(t["slow_reference_p99"])],
        ]
        acc = t["slow_reference_accounted"]
        rows.append([c, "mirror 100% onto 100x: every sample counted", "compared + dropped "
                     "+ timeout + error = requests, 0 client errors",
                     f"{acc['compared']} + {acc['dropped']} + {acc['timeout']} + {acc['error']}"
                     f" of {acc['requests']}, {acc['client_errors']} errors", ok(acc)])
        sample = t.get("compared_sample_cpu_ms")
        if sample:
            rows.append([c, "verifier CPU per compared sample (c)", f"<= reference forward "
                         f"{sample['reference_forward_ms']:.3f} + {TARGET_COMPARED_EXTRA_CPU_MS}"
                         " ms", f"{sample['value']:.3f} ms", ok(sample)])
    return rows


def text_table(report: dict) -> str:
    figures, ratios, targets = _rows(report)
    return render_text(_context_lines(report), [
        ("", FIG_HEAD, figures),
        ("Ratios (a: baseline, b: guard, c: guard + mirror)", RATIO_HEAD, ratios),
        ("Targets", TARGET_HEAD, targets),
        ("Lean path targets (verifier process)", LEAN_HEAD, _lean_rows(report))])


def markdown(report: dict) -> str:
    figures, ratios, targets = _rows(report)
    return render_markdown(
        "Proxy overhead: guard vs a bare OIP server", "proxy_overhead.py", _context_lines(report),
        CELLS, [("Figures", FIG_HEAD, figures), ("Ratios", RATIO_HEAD, ratios),
                ("Targets", TARGET_HEAD, targets),
                ("Lean path targets (verifier process)", LEAN_HEAD, _lean_rows(report))])


# -- entry -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description="Guard's request-path overhead: (a) a bare OIP gRPC server, (b) guard with "
        "mirroring off, (c) guard mirroring 10% onto a ~5x slower reference; same ONNX Runtime "
        "model, closed-loop load over loopback.")
    add_run_arguments(parser, "proxy_overhead",
                      "repeat the a,b,c sequence (servers restarted each round)")
    parser.add_argument("--sample-rate", type=float, default=0.1,
                        help="mirror.sample_rate of cell (c) (default 0.1)")
    parser.add_argument("--reference-slowdown", type=float, default=5.0,
                        help="how many times the primary's latency the reference costs (5)")
    parser.add_argument("--baseline-executor", type=int, default=0, metavar="N",
                        help="run the baseline's ORT calls on N threads instead of inline on the "
                        "event loop (guard uses 4); default 0 = inline")
    parser.add_argument("--guard-workers", type=int, default=None, metavar="N",
                        help="server.workers of guard in (b) and (c) (default: guard's default; "
                        "0 = inference inline on the event loop, where guard supports it)")
    parser.add_argument("--ort-threads", type=int, default=1, metavar="N",
                        help="ORT intra-op threads of the primary, in (a) and in guard "
                        "(options.intra_op_threads); 0 = ORT's default (one spinning thread per "
                        "core). Default 1")
    return parse_and_run(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
