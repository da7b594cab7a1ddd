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
                Upstream forwarding is async (``UpstreamBackend.forward_raw``) and never touches
                the executor, so this cell says whether the setting matters on this path at all.
  (p) raw proxy  the obvious alternative, for scale: a minimal raw-bytes Python gRPC pass-through
                proxy (grpc's threaded server, a generic handler that forwards every unary call's
                bytes on one channel, no protobuf parse), started here with ``_proxy``. guard's
                target: its CPU per forwarded request <= 1.1x the proxy's.

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
    "p": "raw-bytes Python proxy -> MLServer",
}
TARGET_PROXY_CPU_RATIO = 1.1  # guard's CPU per forwarded request over the raw proxy's
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
    """Runs in a child process, so the load generator never imports torch or onnxruntime.
    Not ``po.cmd_prepare``: no reference to calibrate, and ORT's default session (as the
    MLServer runtime builds it) instead of guard's primary session options."""
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
class Child(po.Child):
    """A server subprocess in its own session (process group): stopped, and killed, as a group
    (MLServer forks; ``po.Child`` signals only its one process, enough for guard and the
    baseline there)."""

    def __init__(self, cell: str, argv: list[str], logfile: Path, env: dict, cwd: Path):
        super().__init__(cell, argv, logfile, env, cwd=cwd)
        self.pgid = self.process.pid

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
    """``po.cpu_snapshot``'s machine-wide and load-generator ticks, plus one key per process
    group (its name: "mlserver", "guard") instead of its single server pid; read by
    ``po.cpu_usage(..., servers=tuple(groups))``."""
    base = po.cpu_snapshot(os.getpid())
    if base is None:
        return None
    base.pop("server", None)
    base.pop("verifier", None)  # in the guard process group already
    base.update({name: group_ticks(pgid) for name, pgid in groups.items()})
    return base


# -- one cell --------------------------------------------------------------------------------------
def cell_note(figures: dict) -> str:
    """What the log shows after a cell's latencies: CPU per request of MLServer (and guard)."""
    cpu = figures["cpu"]
    if not cpu:
        return ""
    return (f"; CPU ms/req MLServer {cpu['mlserver_cpu_ms_per_request']:.3f}"
            + (f", guard {cpu['guard_cpu_ms_per_request']:.3f}"
               if "guard_cpu_ms_per_request" in cpu else "")
            + f"; cores client {cpu['client_cores']:.2f}, other {cpu['other_cores']:.2f}")


def measure_cell(args, cell: str, child: Child, groups: dict[str, int], target: str,
                 metrics_port: int | None, requests: list, concurrency: int, duration: float,
                 warmup: float):
    """``po.measure_cell`` with CPU read per process group (``groups``: name -> pgid), and
    guard's /metrics scraped once (no mirror here, so nothing to drain)."""
    return po.measure_cell(args, cell, child, target, metrics_port, requests, concurrency,
                           duration, warmup, pids=list(groups.values()),
                           snapshot=lambda: cpu_snapshot(groups), servers=tuple(groups),
                           scrape_fn=po.scrape, note=cell_note)


# -- the run -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import yaml

    if not MLSERVER.exists():
        raise SystemExit(f"{MLSERVER} not found: pip install -e '.[dev]' (mlserver)")
    concurrencies, duration, warmup, out_dir, workdir, env = po.run_plan(args, "guard-hop-")
    children: list[Child] = []
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
        worst = po.check_answers(upstream, requests, expected)
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
                elif cell == "p":
                    port = po.free_port()
                    guard = Child(cell, [sys.executable, str(Path(__file__).resolve()), "_proxy",
                                         "--port", str(port), "--upstream", upstream],
                                  workdir / f"proxy_r{round_index}.log", env, cwd=REPO)
                    children.append(guard)
                    target = f"{HOST}:{port}"
                    po.wait_ready(target, guard)
                    worst = po.check_answers(target, requests, expected)
                    groups["guard"] = guard.pgid  # the proxy's CPU, in guard's column
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
                    worst = po.check_answers(target, requests, expected)
                    groups["guard"] = guard.pgid
                po.log(f"round {round_index + 1}: ({cell}) {CELLS[cell]} on {target}"
                       + (f"; answers match (max |diff| {worst:.1e})" if guard else ""))
                for concurrency in concurrencies:
                    figures, latencies = measure_cell(args, cell, guard or mlserver, groups,
                                                      target, metrics_port, requests,
                                                      concurrency, duration, warmup)
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
        po.write_results(out_dir, "upstream_hop", report, markdown(report), text_table(report))
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
def build_report(args, prep, concurrencies, duration, warmup, runs, pooled) -> dict:
    # po's merge also sums mirror outcomes and checks: none here (no reference, so guard reports
    # no mirror figures), which leaves guard's requests, errors and mean time in guard.
    cells = po.merge_rounds(CELLS, concurrencies, runs, pooled)

    comparisons = {}
    for c in concurrencies:
        a = cells["a"][str(c)]
        comp = {}
        for x in ("b", "c", "p"):
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
        b, cc, proxy = cells["b"][str(c)], cells["c"][str(c)], cells["p"][str(c)]
        guard_cpu = b.get("cpu", {}).get("guard_cpu_ms_per_request")
        proxy_cpu = proxy.get("cpu", {}).get("guard_cpu_ms_per_request")
        if guard_cpu and proxy_cpu:
            ratio = guard_cpu / proxy_cpu
            comp["guard_over_proxy_cpu"] = {"value": ratio, "target": TARGET_PROXY_CPU_RATIO,
                                            "ok": ratio <= TARGET_PROXY_CPU_RATIO,
                                            "guard_ms": guard_cpu, "proxy_ms": proxy_cpu}
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
            "load_generator": po.LOAD_GENERATOR,
        },
        "calibration": prep,
        "cells": {k: {"name": CELLS[k], "by_concurrency": v} for k, v in cells.items()},
        "comparisons": comparisons,
    }
    flag_disturbed(report)
    return report


def flag_disturbed(report: dict) -> None:
    for c, comp in report["comparisons"].items():
        for x in ("b", "c"):
            po.mark_disturbed(report, comp[x]["target_hop_p50"], c, ("a", x))


FIG_HEAD = ["C", "path", "p50 ms", "p99 ms", "req/s", "requests", "errors",
            "MLServer CPU ms/req", "guard CPU ms/req", "in guard mean ms", "other load (cores)"]
HOP_HEAD = ["C", "path", "+p50 ms", "+p99 ms", "p50 x", "p99 x", "req/s x",
            f"target +p50 <= {TARGET_HOP_P50_MS} ms"]


# The rows and context lines stay this script's own: other cells, comparisons and columns than
# proxy_overhead's; what they share (machine/run lines, the warning, rendering) is po's.
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
                         po._ok(h["target_hop_p50"])])
        cb = comp["c_vs_b"]
        hops.append([c, "(c) - (b): workers 0 vs 4", f"{cb['c_minus_b_ms']['p50']:+.3f}",
                     f"{cb['c_minus_b_ms']['p99']:+.3f}", "", "",
                     f"{cb['c_over_b_throughput']:.2f}", ""])
        h = comp["p"]
        hops.append([c, "(p) - (a): raw proxy", f"{h['minus_a_ms']['p50']:+.3f}",
                     f"{h['minus_a_ms']['p99']:+.3f}", f"{h['over_a']['p50']:.2f}",
                     f"{h['over_a']['p99']:.2f}", f"{h['over_a']['throughput']:.2f}", ""])
        ratio = comp.get("guard_over_proxy_cpu")
        if ratio:
            hops.append([c, f"guard CPU/req over the raw proxy's (target <= "
                         f"{TARGET_PROXY_CPU_RATIO}x)", "", "", "", "", "",
                         f"{ratio['value']:.2f}x ({ratio['guard_ms']:.3f} vs "
                         f"{ratio['proxy_ms']:.3f} ms) {'PASS' if ratio['ok'] else 'MISS'}"])
    return figures, hops


def _context_lines(report: dict) -> list[str]:
    s = report["settings"]
    return [
        po.machine_line(report["machine"], ("mlserver", "onnxruntime")),
        po.run_line(s),
        f"Model: {s['model']}; ORT in-process p50 "
        f"{report['calibration']['ort_in_process_p50_ms'] * 1e3:.0f} us (default session)",
        f"Upstream: {s['upstream']}",
        f"guard: {s['guard']}",
    ] + po.noisy_warning(report, "CPU ms/req")


def text_table(report: dict) -> str:
    figures, hops = _rows(report)
    return po.render_text(_context_lines(report), [
        ("", FIG_HEAD, figures),
        ("The extra hop (guard cells minus direct)", HOP_HEAD, hops)])


def markdown(report: dict) -> str:
    figures, hops = _rows(report)
    return po.render_markdown(
        "Upstream hop: client -> MLServer vs client -> guard -> MLServer", "upstream_hop.py",
        _context_lines(report), CELLS,
        [("Figures", FIG_HEAD, figures), ("The extra hop", HOP_HEAD, hops)])


# -- entry ---------------------------------------------------------------------------------------
def cmd_proxy(port: int, upstream: str) -> None:
    """The minimal raw-bytes pass-through proxy of cell (p): every unary call's bytes go on,
    unparsed, on one channel, with the caller's deadline; the answer's bytes come back."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    options = [("grpc.max_receive_message_length", po.MAX_MESSAGE),
               ("grpc.max_send_message_length", po.MAX_MESSAGE)]
    channel = grpc.insecure_channel(upstream, options)
    calls: dict = {}

    class Forward(grpc.GenericRpcHandler):
        def service(self, details):
            method = details.method
            call = calls.get(method) or calls.setdefault(method, channel.unary_unary(method))

            def forward(request: bytes, context):
                try:
                    return call(request, timeout=context.time_remaining())
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details())
            return grpc.unary_unary_rpc_method_handler(forward)

    server = grpc.server(ThreadPoolExecutor(max_workers=16), handlers=(Forward(),),
                         options=options)
    server.add_insecure_port(f"{HOST}:{port}")
    po.serve_until_signalled(server)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_proxy":
        p = argparse.ArgumentParser()
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--upstream", required=True)
        a = p.parse_args(argv[1:])
        cmd_proxy(a.port, a.upstream)
        return 0
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
    return po.parse_and_run(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
