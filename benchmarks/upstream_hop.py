"""What does the extra hop cost? client -> MLServer direct vs client -> guard -> MLServer.

guard in front of a real model server (``backend: upstream``, the sidecar deployment): the
client's ``ModelInferRequest`` is forwarded as it came, on one ``grpc.aio`` channel, and the
upstream's answer comes back unchanged. This measures what that extra gRPC hop adds, side by side
in one run, with the same model server behind every cell:

  (a) direct    the client talks to MLServer (from pip, ``mlserver start``) directly. MLServer
                runs as a subprocess with ``parallel_workers: 0`` (its worker pool crashes under
                uvloop 0.22+, as in tests/e2e/test_upstream.py), ``debug: false`` (no access log
                line per request), and serves the zoo classifier (``guard.zoo.classifier.export``,
                ONNX fp32) with the custom runtime of the e2e tests,
                ``tests/upstream_runtime/ort_runtime.py`` (ONNX Runtime, its default session).
  (b) guard     the client talks to ``python -m guard serve`` whose model is
                ``{backend: upstream, target: <MLServer>, model: classifier}``; no reference,
                ``mirror.sample_rate: 0`` (mirroring off); guard's default ``server.workers``
                (4 inference threads).
  (c) guard, workers 0   as (b) with ``server.workers: 0`` (inference inline on the event loop).
                Upstream forwarding is async (``UpstreamBackend.forward``) and never touches the
                executor, so this cell says whether the setting matters on this path at all.

One MLServer serves every cell for the whole run; guard is started fresh for each guard cell and
stopped after it. The load generator, readiness wait, CPU snapshots, quiet-waiting and table
helpers are ``benchmarks/proxy_overhead.py``'s (imported): closed loop, C threads, one gRPC
channel (own TCP connection) each, pre-built raw requests (64 distinct images), loopback. CPU per
request is read from /proc for MLServer and guard separately (each process group), and the CPU
that *other* processes used meanwhile: on a shared machine a disturbed cell is measured again,
and what stays disturbed is marked so.

Usage: ``.venv/bin/python benchmarks/upstream_hop.py [--duration S] [--concurrency 1,8]
[--rounds N] [--quick]`` (``--help`` for the rest). Results: ``upstream_hop.json`` and
``upstream_hop.md`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import proxy_overhead as po  # noqa: E402  (the shared machinery)

REPO = HERE.parent
RUNTIME_DIR = REPO / "tests" / "upstream_runtime"
MLSERVER = Path(sys.executable).with_name("mlserver")
MODEL = po.MODEL  # "classifier": the name on MLServer and on guard alike
HOST = po.HOST

TARGET_HOP_P50_MS = 0.5  # the extra hop may add at most this at p50

CELLS = {
    "a": "MLServer direct",
    "b": "guard -> MLServer (workers 4)",
    "c": "guard -> MLServer (workers 0)",
}
GUARD_WORKERS = {"b": None, "c": 0}  # None: guard's default (4)

SIGNATURE = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 32, 32]}],
             "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}

# --ort-threads N: the e2e runtime, only its ORT session built with N intra-op threads.
RUNTIME_WRAPPER = '''"""ort_runtime.OnnxModel with a fixed intra-op thread count (upstream_hop --ort-threads)."""
import onnxruntime as ort

from ort_runtime import OnnxModel as _Base

THREADS = {threads}


class OnnxModel(_Base):
    async def load(self) -> bool:
        so = ort.SessionOptions()
        so.intra_op_num_threads = THREADS
        self.session = ort.InferenceSession(self.settings.parameters.uri, so)
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True
'''


# -- (internal) preparation: export the model, the inputs and the answers to expect --------------
def cmd_prepare(workdir: Path, iters: int) -> None:
    """Runs in a child process, so the load generator never imports torch or onnxruntime."""
    import onnxruntime as ort

    from guard.zoo import classifier

    paths = classifier.export(workdir / "models")
    inputs = classifier.sample_inputs(po.REQUEST_POOL, seed=2026)
    session = ort.InferenceSession(str(paths["onnx"]))  # as ort_runtime builds it
    expected = np.concatenate([session.run(["logits"], {"image": inputs[i:i + 1]})[0]
                               for i in range(po.REQUEST_POOL)])
    for i in range(50):
        session.run(["logits"], {"image": inputs[i % 64:i % 64 + 1]})
    times = []
    for i in range(iters):
        x = inputs[i % po.REQUEST_POOL:i % po.REQUEST_POOL + 1]
        t0 = time.perf_counter_ns()
        session.run(["logits"], {"image": x})
        times.append(time.perf_counter_ns() - t0)
    np.save(workdir / "inputs.npy", inputs)
    np.save(workdir / "expected.npy", expected)
    (workdir / "prepare.json").write_text(json.dumps({
        "onnx": str(paths["onnx"]),
        "ort_in_process_p50_ms": float(np.median(times)) / 1e6,
    }, indent=2))


# -- child processes -----------------------------------------------------------------------------
class Child:
    """A server subprocess in its own session (process group): stopped, and killed, as a group.
    Duck-types ``proxy_overhead.Child`` for ``po.wait_ready``."""

    def __init__(self, cell: str, argv: list[str], logfile: Path, env: dict, cwd: Path):
        self.cell = cell
        self.logfile = logfile
        self._log = logfile.open("w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=str(cwd), start_new_session=True)
        self.pgid = self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=10)
        self._signal_group(signal.SIGKILL)  # anything the server left behind in its group
        if not self._log.closed:
            self._log.close()
        return self.process.returncode

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if not self._log.closed:
            self._log.close()


def mlserver_folder(workdir: Path, prep: dict, ports: dict, ort_threads: int) -> Path:
    folder = workdir / "mlserver"
    (folder / MODEL).mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps({
        "parallel_workers": 0, "load_models_at_startup": True, "debug": False, "host": HOST,
        "metrics_dir": str(workdir / "mlserver-metrics"),
        "environments_dir": str(workdir / "mlserver-envs"), **ports}, indent=2))
    shutil.copy(prep["onnx"], folder / MODEL / "model.onnx")
    implementation = "ort_runtime.OnnxModel"
    if ort_threads:
        (workdir / "bench_ort_runtime.py").write_text(RUNTIME_WRAPPER.format(threads=ort_threads))
        implementation = "bench_ort_runtime.OnnxModel"
    (folder / MODEL / "model-settings.json").write_text(json.dumps({
        "name": MODEL, "implementation": implementation,
        "parameters": {"uri": str(folder / MODEL / "model.onnx")}, **SIGNATURE}, indent=2))
    return folder


def guard_config(upstream: str, ports: dict, workers: int | None) -> dict:
    model = {"name": MODEL,
             "primary": {"backend": "upstream", "target": upstream, "model": MODEL},
             "mirror": {"sample_rate": 0.0}}
    server = {"host": HOST, "shutdown_grace_s": 5.0, **ports}
    if workers is not None:
        server["workers"] = workers
    return {"version": 1, "server": server, "models": [model]}


def check_answers(target: str, requests: list, expected: np.ndarray) -> float:
    """Every pooled request once; the answers (raw or typed contents: MLServer answers typed)
    must match ORT in-process. Returns the largest |diff|."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    worst = 0.0
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for i, request in enumerate(requests):
            response = stub.ModelInfer(request, timeout=30)
            names = [o.name for o in response.outputs]
            k = names.index("logits")
            if response.raw_output_contents:
                got = np.frombuffer(response.raw_output_contents[k], dtype=np.float32)
            else:
                got = np.asarray(response.outputs[k].contents.fp32_contents, dtype=np.float32)
            worst = max(worst, float(np.abs(got.reshape(1, 10) - expected[i:i + 1]).max()))
    if worst > 1e-4:
        raise RuntimeError(f"answers from {target} differ from ORT in-process by {worst:g}")
    return worst


# -- CPU accounting per process group ------------------------------------------------------------
def group_ticks(pgid: int) -> int:
    """utime + stime of every live process in process group ``pgid`` (all threads)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total


def cpu_snapshot(groups: dict[str, int]) -> dict | None:
    base = po.cpu_snapshot(os.getpid())  # machine-wide ticks and this process (load generator)
    if base is None:
        return None
    base.pop("server", None)
    base["groups"] = {name: group_ticks(pgid) for name, pgid in groups.items()}
    return base


def cpu_usage(before: dict | None, after: dict | None, requests: int) -> dict:
    if not before or not after:
        return {}
    tck = po.CLK_TCK
    wall = after["wall"] - before["wall"]
    groups = {k: (after["groups"][k] - before["groups"][k]) / tck for k in before["groups"]}
    client = (after["self"] - before["self"]) / tck
    busy = (after["busy"] - before["busy"]) / tck
    return cpu_summary({"wall_s": wall, "client_s": client,
                        "other_s": max(0.0, busy - client - sum(groups.values())),
                        "steal_s": (after["steal"] - before["steal"]) / tck,
                        "requests": requests, **{f"{k}_s": v for k, v in groups.items()}})


def cpu_summary(raw: dict) -> dict:
    wall = raw["wall_s"] or float("nan")
    out = dict(raw)
    for key in ("mlserver", "guard", "client", "other", "steal"):
        if f"{key}_s" in raw:
            out[f"{key}_cores"] = raw[f"{key}_s"] / wall
    for key in ("mlserver", "guard"):
        if f"{key}_s" in raw:
            out[f"{key}_cpu_ms_per_request"] = (raw[f"{key}_s"] * 1e3 / raw["requests"]
                                                if raw["requests"] else float("nan"))
    return out


def merge_cpu(parts: list[dict]) -> dict:
    parts = [p["cpu"] for p in parts if p.get("cpu")]
    if not parts:
        return {}
    keys = [k for k in parts[0] if k.endswith("_s") and not k.endswith("_cores")] + ["requests"]
    return cpu_summary({k: sum(p.get(k, 0.0) for p in parts) for k in keys})


# -- one cell --------------------------------------------------------------------------------------
def measure_cell(args, cell: str, groups: dict[str, int], target: str, metrics_port: int | None,
                 requests: list, concurrency: int, duration: float, warmup: float):
    """Warm up and measure; measure again (up to --retries) when other processes used the CPU
    meanwhile, keeping the least disturbed attempt."""
    best = None
    pids = list(groups.values())
    for attempt in range(args.retries + 1):
        po.wait_quiet(pids, args.wait_quiet)
        po.closed_loop(target, requests, concurrency, warmup)
        before = po.scrape(metrics_port) if metrics_port else None
        cpu_before = cpu_snapshot(groups)
        result = po.closed_loop(target, requests, concurrency, duration)
        cpu_after = cpu_snapshot(groups)
        after = po.scrape(metrics_port) if metrics_port else None
        if result["errors"]:
            po.log(f"  ({cell}) c={concurrency}: {result['errors']} errors, first: "
                   f"{result['first_error']}")
        figures = po.summarize(result["latencies_ns"], result["elapsed_s"], result["errors"])
        figures["cpu"] = cpu_usage(cpu_before, cpu_after, figures["requests"])
        figures["attempt"] = attempt + 1
        if metrics_port:
            figures["guard"] = po.guard_delta(before, after)
        cpu = figures["cpu"]
        extra = ""
        if cpu:
            extra = (f"; CPU ms/req MLServer {cpu['mlserver_cpu_ms_per_request']:.3f}"
                     + (f", guard {cpu['guard_cpu_ms_per_request']:.3f}"
                        if "guard_cpu_ms_per_request" in cpu else "")
                     + f"; cores client {cpu['client_cores']:.2f}, other "
                     f"{cpu['other_cores']:.2f}")
        po.log(f"  ({cell}) c={concurrency}: p50 {figures['p50_ms']:.3f} ms, p99 "
               f"{figures['p99_ms']:.3f} ms, {figures['throughput_rps']:.0f} req/s{extra}")
        other = cpu.get("other_cores", 0.0)
        if best is None or other < best[0]["cpu"].get("other_cores", 0.0):
            best = (figures, result["latencies_ns"])
        if other <= po.NOISY_NEIGHBOUR_CORES:
            break
        if attempt < args.retries:
            po.log(f"  other processes used {other:.2f} cores during the cell: measuring again")
    return best


# -- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import yaml

    if not MLSERVER.exists():
        raise SystemExit(f"{MLSERVER} not found: pip install -e '.[dev]' (mlserver)")
    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("--concurrency: a comma-separated list of integers >= 1")
    duration = args.duration if args.duration is not None else (2.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 2.0)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    out_dir = Path(args.out).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="guard-hop-"))
    env = dict(os.environ, GUARD_CACHE_DIR=str(workdir), PYTHONUNBUFFERED="1")
    os.environ["GUARD_CACHE_DIR"] = str(workdir)
    children: list[Child] = []
    po.log(f"work folder {workdir}; {duration:g}s per cell after {warmup:g}s warm-up; "
           f"concurrency {concurrencies}; {args.rounds} round(s)")
    try:
        po.log("exporting the zoo classifier ...")
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_prepare",
                        "--workdir", str(workdir), "--iters", "300" if args.quick else "2000"],
                       check=True, env=env, cwd=str(REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        inputs = np.load(workdir / "inputs.npy")
        expected = np.load(workdir / "expected.npy")
        requests = po.build_requests(inputs)

        # The upstream: one MLServer for the whole run.
        ml_ports = {"grpc_port": po.free_port(), "http_port": po.free_port(),
                    "metrics_port": po.free_port()}
        folder = mlserver_folder(workdir, prep, ml_ports, args.ort_threads)
        ml_env = dict(env, PYTHONPATH=os.pathsep.join(
            [str(RUNTIME_DIR), str(workdir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                else [])))
        mlserver = Child("mlserver", [str(MLSERVER), "start", str(folder)],
                         workdir / "mlserver.log", ml_env, cwd=workdir)
        children.append(mlserver)
        upstream = f"{HOST}:{ml_ports['grpc_port']}"
        po.wait_ready(upstream, mlserver)
        worst = check_answers(upstream, requests, expected)
        po.log(f"MLServer ready on {upstream} (pid {mlserver.process.pid}); answers match ORT "
               f"in-process (max |diff| {worst:.1e})")

        runs = {c: {n: [] for n in concurrencies} for c in CELLS}
        pooled = {c: {n: [] for n in concurrencies} for c in CELLS}
        for round_index in range(args.rounds):
            for cell in CELLS:
                guard = None
                metrics_port = None
                groups = {"mlserver": mlserver.pgid}
                if cell == "a":
                    target = upstream
                else:
                    port, metrics_port = po.free_port(), po.free_port()
                    ports = {"grpc_port": port, "metrics_port": metrics_port,
                             "admin_port": po.free_port()}
                    path = workdir / f"guard_{cell}.yaml"
                    path.write_text(yaml.safe_dump(
                        guard_config(upstream, ports, GUARD_WORKERS[cell]), sort_keys=False))
                    guard = Child(cell, [sys.executable, "-m", "guard", "serve", "--config",
                                         str(path)],
                                  workdir / f"guard_{cell}_r{round_index}.log", env, cwd=REPO)
                    children.append(guard)
                    target = f"{HOST}:{port}"
                    po.wait_ready(target, guard)
                    worst = check_answers(target, requests, expected)
                    groups["guard"] = guard.pgid
                po.log(f"round {round_index + 1}: ({cell}) {CELLS[cell]} on {target}"
                       + (f"; answers match (max |diff| {worst:.1e})" if guard else ""))
                for concurrency in concurrencies:
                    figures, latencies = measure_cell(args, cell, groups, target, metrics_port,
                                                      requests, concurrency, duration, warmup)
                    runs[cell][concurrency].append(figures)
                    pooled[cell][concurrency].append(latencies)
                if guard is not None:
                    code = guard.stop()
                    if code not in (0, None):
                        po.log(f"warning: guard ({cell}) exited with code {code}:\n"
                               f"{guard.log_tail()}")
                if mlserver.process.poll() is not None:
                    raise RuntimeError(f"MLServer exited with code {mlserver.process.returncode}"
                                       f":\n{mlserver.log_tail()}")

        report = build_report(args, prep, concurrencies, duration, warmup, runs, pooled)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "upstream_hop.json").write_text(json.dumps(report, indent=2) + "\n")
        (out_dir / "upstream_hop.md").write_text(markdown(report))
        print()
        print(text_table(report))
        po.log(f"wrote {out_dir / 'upstream_hop.json'} and {out_dir / 'upstream_hop.md'}")
        return 0
    finally:
        for child in reversed(children):  # guard first, then MLServer; each whole group
            try:
                child.stop(timeout=5.0)
            except Exception:
                pass
            child.kill()
        if args.keep_workdir:
            po.log(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- report ----------------------------------------------------------------------------------------
def _merge_guard(parts: list[dict]) -> dict:
    if not any("guard" in p for p in parts):
        return {}
    requests = sum(p["guard"]["requests_primary"] for p in parts)
    merged = {"requests_primary": requests,
              "request_errors": sum(p["guard"]["request_errors"] for p in parts)}
    weighted = [(p["guard"]["in_guard_mean_ms"], p["guard"]["requests_primary"]) for p in parts
                if "in_guard_mean_ms" in p["guard"]]
    if weighted and requests:
        merged["in_guard_mean_ms"] = sum(m * n for m, n in weighted) / sum(n for _, n in weighted)
    return merged


def build_report(args, prep, concurrencies, duration, warmup, runs, pooled) -> dict:
    cells = {}
    for cell in CELLS:
        cells[cell] = {}
        for c in concurrencies:
            parts = runs[cell][c]
            lat = np.concatenate(pooled[cell][c])
            figures = po.summarize(lat, sum(p["elapsed_s"] for p in parts),
                                   sum(p["errors"] for p in parts))
            figures["cpu"] = merge_cpu(parts)
            guard = _merge_guard(parts)
            if guard:
                figures["guard"] = guard
            if len(parts) > 1:
                figures["per_round"] = [{k: p[k] for k in ("p50_ms", "p99_ms", "throughput_rps")}
                                        for p in parts]
            cells[cell][str(c)] = figures

    comparisons = {}
    for c in concurrencies:
        a = cells["a"][str(c)]
        comp = {}
        for x in ("b", "c"):
            f = cells[x][str(c)]
            add_p50 = f["p50_ms"] - a["p50_ms"]
            comp[x] = {
                "minus_a_ms": {"p50": add_p50, "p99": f["p99_ms"] - a["p99_ms"],
                               "mean": f["mean_ms"] - a["mean_ms"]},
                "over_a": {"p50": f["p50_ms"] / a["p50_ms"], "p99": f["p99_ms"] / a["p99_ms"],
                           "throughput": f["throughput_rps"] / a["throughput_rps"]},
                "guard_cpu_ms_per_request": f.get("cpu", {}).get("guard_cpu_ms_per_request"),
                "target_hop_p50": {"value": add_p50, "target": TARGET_HOP_P50_MS,
                                   "ok": add_p50 <= TARGET_HOP_P50_MS},
            }
        b, cc = cells["b"][str(c)], cells["c"][str(c)]
        comp["c_vs_b"] = {"c_minus_b_ms": {"p50": cc["p50_ms"] - b["p50_ms"],
                                           "p99": cc["p99_ms"] - b["p99_ms"]},
                          "c_over_b_throughput": cc["throughput_rps"] / b["throughput_rps"]}
        comparisons[str(c)] = comp

    from importlib.metadata import version

    machine = po.machine_info()
    try:
        machine["versions"]["mlserver"] = version("mlserver")
    except Exception:
        machine["versions"]["mlserver"] = "n/a"
    report = {
        "benchmark": "upstream_hop",
        "machine": machine,
        "settings": {
            "duration_s": duration, "warmup_s": warmup, "rounds": args.rounds,
            "wait_quiet_s": args.wait_quiet, "retries": args.retries,
            "concurrency": concurrencies, "quick": bool(args.quick),
            "model": "guard.zoo.classifier (seed 0) exported to ONNX fp32, batch 1, input image "
                     "FP32 [1,3,32,32], output logits FP32 [1,10]",
            "upstream": "MLServer (mlserver start), parallel_workers 0, debug false, custom "
                        "runtime tests/upstream_runtime/ort_runtime.py (ONNX Runtime CPU, "
                        + (f"intra-op threads {args.ort_threads} via a wrapper)"
                           if args.ort_threads else "its default session)"),
            "guard": "python -m guard serve; primary backend upstream -> MLServer's model, no "
                     "reference, mirror.sample_rate 0; server.workers default (4) in (b), 0 in "
                     "(c)",
            "load_generator": "closed loop, one thread + one gRPC channel (own connection) per "
                              "concurrent client, tritonclient GRPCInferenceServiceStub, "
                              "pre-built raw requests (64 distinct inputs), loopback",
        },
        "calibration": prep,
        "cells": {k: {"name": CELLS[k], "by_concurrency": v} for k, v in cells.items()},
        "comparisons": comparisons,
    }
    flag_disturbed(report)
    return report


def _other(report: dict, cell: str, c: str) -> float:
    return report["cells"][cell]["by_concurrency"][c].get("cpu", {}).get("other_cores", 0.0)


def flag_disturbed(report: dict) -> None:
    for c, comp in report["comparisons"].items():
        for x in ("b", "c"):
            comp[x]["target_hop_p50"]["disturbed"] = any(
                _other(report, cell, c) > po.NOISY_NEIGHBOUR_CORES for cell in ("a", x))


def _ok(target: dict) -> str:
    word = "PASS" if target["ok"] else "MISS"
    return f"{word} (disturbed)" if target.get("disturbed") else word


FIG_HEAD = ["C", "path", "p50 ms", "p99 ms", "req/s", "requests", "errors",
            "MLServer CPU ms/req", "guard CPU ms/req", "in guard mean ms", "other load (cores)"]
HOP_HEAD = ["C", "path", "+p50 ms", "+p99 ms", "p50 x", "p99 x", "req/s x",
            f"target +p50 <= {TARGET_HOP_P50_MS} ms"]


def _rows(report: dict) -> tuple[list[list[str]], list[list[str]]]:
    figures, hops = [], []
    nan = float("nan")
    for c, comp in report["comparisons"].items():
        for cell in CELLS:
            f = report["cells"][cell]["by_concurrency"][c]
            cpu = f.get("cpu") or {}
            guard_cpu = cpu.get("guard_cpu_ms_per_request")
            in_guard = f.get("guard", {}).get("in_guard_mean_ms")
            figures.append([c, f"({cell}) {CELLS[cell]}", f"{f['p50_ms']:.3f}",
                            f"{f['p99_ms']:.3f}", f"{f['throughput_rps']:.0f}",
                            str(f["requests"]), str(f["errors"]),
                            f"{cpu.get('mlserver_cpu_ms_per_request', nan):.3f}",
                            f"{guard_cpu:.3f}" if guard_cpu is not None else "-",
                            f"{in_guard:.3f}" if in_guard is not None else "-",
                            f"{cpu.get('other_cores', nan):.2f}"])
        for x in ("b", "c"):
            h = comp[x]
            hops.append([c, f"({x}) - (a)", f"{h['minus_a_ms']['p50']:+.3f}",
                         f"{h['minus_a_ms']['p99']:+.3f}", f"{h['over_a']['p50']:.2f}",
                         f"{h['over_a']['p99']:.2f}", f"{h['over_a']['throughput']:.2f}",
                         _ok(h["target_hop_p50"])])
        cb = comp["c_vs_b"]
        hops.append([c, "(c) - (b): workers 0 vs 4", f"{cb['c_minus_b_ms']['p50']:+.3f}",
                     f"{cb['c_minus_b_ms']['p99']:+.3f}", "", "",
                     f"{cb['c_over_b_throughput']:.2f}", ""])
    return figures, hops


def _context_lines(report: dict) -> list[str]:
    m = report["machine"]
    v = m["versions"]
    s = report["settings"]
    source = m.get("guard_source", {})
    lines = [
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores ({m['cpus_usable']} usable); "
        f"Python {v['python']}, mlserver {v.get('mlserver', '?')}, onnxruntime "
        f"{v['onnxruntime']}, grpcio {v['grpcio']}, guard {v['guard']} (commit "
        f"{source.get('commit', '?')}"
        f"{', with uncommitted changes in guard/' if source.get('uncommitted_guard_files') else ''}"
        f"); {m['platform']}; {m['date']}",
        f"Run: {s['duration_s']:g} s per cell after {s['warmup_s']:g} s warm-up, "
        f"{s['rounds']} round(s), concurrency {s['concurrency']}"
        + (" (--quick: smoke check, not figures to quote)" if s["quick"] else ""),
        f"Model: {s['model']}; ORT in-process p50 "
        f"{report['calibration']['ort_in_process_p50_ms'] * 1e3:.0f} us (default session)",
        f"Upstream: {s['upstream']}",
        f"guard: {s['guard']}",
    ]
    other = max((f.get("cpu", {}).get("other_cores", 0.0) for cell in report["cells"].values()
                 for f in cell["by_concurrency"].values()), default=0.0)
    if other > po.NOISY_NEIGHBOUR_CORES:
        lines.append(f"WARNING: other processes used up to {other:.2f} cores during a cell (see "
                     "'other load'): the machine was shared; latency figures and targets marked "
                     "'disturbed' are unreliable (CPU ms/req is the steadier figure)")
    return lines


def text_table(report: dict) -> str:
    figures, hops = _rows(report)
    return "\n".join(["\n".join(_context_lines(report)), "", po._plain(FIG_HEAD, figures), "",
                      "The extra hop (guard cells minus direct)", po._plain(HOP_HEAD, hops)])


def markdown(report: dict) -> str:
    figures, hops = _rows(report)
    cells = "\n".join(f"- ({k}) {v}" for k, v in CELLS.items())
    context = "\n".join(f"- {line}" for line in _context_lines(report))
    return (
        "# Upstream hop: client -> MLServer vs client -> guard -> MLServer\n\n"
        "Generated by `benchmarks/upstream_hop.py`; closed-loop load over loopback, latency "
        "measured at the client.\n\n"
        f"{context}\n\nCells:\n\n{cells}\n\n"
        f"## Figures\n\n{po._md(FIG_HEAD, figures)}\n\n"
        f"## The extra hop\n\n{po._md(HOP_HEAD, hops)}\n"
    )


# -- entry ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_prepare":
        p = argparse.ArgumentParser()
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--iters", type=int, default=2000)
        a = p.parse_args(argv[1:])
        cmd_prepare(a.workdir, a.iters)
        return 0

    parser = argparse.ArgumentParser(
        description="The cost of guard's extra hop in upstream mode: (a) client -> MLServer, "
        "(b) client -> guard -> MLServer, (c) as (b) with server.workers 0; same ONNX model on "
        "the same MLServer, closed-loop load over loopback.")
    po.add_run_arguments(parser, "upstream_hop",
                         "repeat the a,b,c sequence (guard restarted each time, MLServer kept)")
    parser.add_argument("--ort-threads", type=int, default=0, metavar="N",
                        help="MLServer's ORT intra-op threads; 0 (default) = the e2e runtime "
                        "as it is (ORT's default: one thread per core)")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")

    def terminated(signum, frame):  # SIGTERM too runs run()'s finally: no server left behind
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
