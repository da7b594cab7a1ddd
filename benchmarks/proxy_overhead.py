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
[--rounds N] [--out DIR] [--quick]`` (``--help`` for the rest); ``make bench`` runs it. Results: ``proxy_overhead.json``
and ``proxy_overhead.md`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from guard.machine import cpu_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = "classifier"
HOST = "127.0.0.1"
REQUEST_POOL = 64  # distinct pre-built requests, cycled by the load generator
MAX_MESSAGE = 64 * 1024 * 1024

# Targets printed beside the figures.
TARGET_ADD_P50_MS = 0.2
TARGET_ADD_P99_MS = 1.0
TARGET_MIRROR_P99_RATIO = 1.10
NOISY_NEIGHBOUR_CORES = 0.15  # other processes' CPU during a cell above which we warn

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

# The verifier-process issue's targets (ratios from one run).
TARGET_LOCAL_CPU_ADD_MS = 0.10  # guard's serving CPU per request over the bare server
TARGET_LOCAL_THROUGHPUT = 0.85  # of the bare server's req/s, at 4-8 clients
TARGET_MIRROR_THROUGHPUT = 0.90  # (c) over (b)
TARGET_SLOW_REFERENCE_P99 = 1.5  # (x) over (b)
TARGET_COMPARED_EXTRA_CPU_MS = 0.3  # verifier CPU per compared sample over the reference's

# The reference written into the work folder: the same TorchScript model, its forward pass
# repeated `repeats` times (real CPU work), the last result returned (equal to the model's).
REFERENCE_MODULE = '''"""Benchmark reference: the zoo classifier, its forward pass repeated."""
import torch
from torch import nn

SIGNATURE = {
    "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 32, 32]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
}


class Repeated(nn.Module):
    def __init__(self, path, repeats):
        super().__init__()
        self.inner = torch.jit.load(path, map_location="cpu")
        self.repeats = max(1, int(repeats))

    def forward(self, image):
        out = self.inner(image)
        for _ in range(self.repeats - 1):
            out = self.inner(image)
        return out


def make(path, repeats=1):
    module = Repeated(path, repeats).eval()
    module.guard_signature = SIGNATURE
    return module
'''


# -- small helpers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def ort_session(path: str, threads: int):
    """The session guard builds for an onnxruntime primary (``options.intra_op_threads``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 0
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def percentile_ms(latencies_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(latencies_ns, q)) / 1e6 if latencies_ns.size else float("nan")


def machine_info() -> dict:
    cpu = cpu_model()
    versions = {"python": platform.python_version()}
    for name in ("onnxruntime", "torch", "grpcio", "numpy", "tritonclient", "protobuf"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = "n/a"
    try:
        from guard import __version__ as guard_version
    except Exception:
        guard_version = "n/a"
    versions["guard"] = guard_version
    return {
        "guard_source": guard_source(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "versions": versions,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def guard_source() -> dict:
    """Which guard was measured: the commit, and guard/ files changed since (if any)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.rstrip("\n")

    try:
        return {"commit": git("rev-parse", "--short", "HEAD"),
                "uncommitted_guard_files": git("status", "--porcelain", "--", "guard").splitlines()}
    except (OSError, subprocess.SubprocessError):
        return {}


# -- (internal) preparation: export, calibrate, expected outputs --------------------------------
def cmd_prepare(workdir: Path, slowdown: float, iters: int, ort_threads: int) -> None:
    """Runs in a child process, so the load generator never imports torch or onnxruntime."""
    import torch

    from guard.zoo import classifier

    paths = classifier.export(workdir / "models")
    inputs = classifier.sample_inputs(REQUEST_POOL, seed=2026)
    session = ort_session(str(paths["onnx"]), ort_threads)
    expected = np.concatenate([session.run(["logits"], {"image": inputs[i:i + 1]})[0]
                               for i in range(REQUEST_POOL)])

    def p50_ms(fn) -> float:
        for i in range(max(50, iters // 10)):
            fn(inputs[i % REQUEST_POOL:i % REQUEST_POOL + 1])
        times = []
        for i in range(iters):
            x = inputs[i % REQUEST_POOL:i % REQUEST_POOL + 1]
            t0 = time.perf_counter_ns()
            fn(x)
            times.append(time.perf_counter_ns() - t0)
        return float(np.median(times)) / 1e6

    primary_ms = p50_ms(lambda x: session.run(["logits"], {"image": x}))
    del session
    # The reference runs with mirror.threads = 1 (guard pins torch to it).
    torch.set_num_threads(1)
    sys.path.insert(0, str(workdir))
    import bench_reference

    with torch.inference_mode():
        single = bench_reference.make(str(paths["torchscript"]), 1)
        forward_ms = p50_ms(lambda x: single(torch.from_numpy(x)))
        repeats = max(1, round(slowdown * primary_ms / forward_ms))
        reference = bench_reference.make(str(paths["torchscript"]), repeats)
        reference_ms = p50_ms(lambda x: reference(torch.from_numpy(x)))
        ref_out = np.concatenate([reference(torch.from_numpy(inputs[i:i + 1])).numpy()
                                  for i in range(REQUEST_POOL)])
    np.save(workdir / "inputs.npy", inputs)
    np.save(workdir / "expected.npy", expected)
    result = {
        "onnx": str(paths["onnx"]),
        "torchscript": str(paths["torchscript"]),
        "primary_ort_p50_ms": primary_ms,
        "torch_forward_1thread_p50_ms": forward_ms,
        "target_slowdown": slowdown,
        "repeats": repeats,
        "reference_p50_ms": reference_ms,
        "reference_slowdown": reference_ms / primary_ms,
        "reference_vs_primary_max_abs_diff": float(np.abs(ref_out - expected).max()),
    }
    (workdir / "prepare.json").write_text(json.dumps(result, indent=2))


# -- (internal) the baseline server ---------------------------------------------------------------
def cmd_baseline(onnx_path: str, port: int, executor_workers: int, ort_threads: int,
                 threaded: bool = False) -> None:
    """A bare OIP server on grpc.aio (``threaded``: on grpc's thread-pool server, the
    servicer's methods plain functions) around one ORT session."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    session = ort_session(onnx_path, ort_threads)
    output_names = [o.name for o in session.get_outputs()]
    numpy_of = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64,
                "INT32": np.int32, "UINT8": np.uint8, "INT8": np.int8, "BOOL": np.bool_}
    oip_of = {np.dtype(v): k for k, v in numpy_of.items()}
    pool = ThreadPoolExecutor(executor_workers) if executor_workers else None

    class Servicer(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=request.name == MODEL)

        async def ModelInfer(self, request, context):
            inputs = {
                t.name: np.frombuffer(raw, dtype=numpy_of[t.datatype]).reshape(tuple(t.shape))
                for t, raw in zip(request.inputs, request.raw_input_contents)
            }
            if pool is None:
                outputs = session.run(output_names, inputs)
            else:
                outputs = await asyncio.get_running_loop().run_in_executor(
                    pool, session.run, output_names, inputs)
            response = pb.ModelInferResponse(model_name=request.model_name,
                                             model_version=request.model_version, id=request.id)
            for name, array in zip(output_names, outputs):
                tensor = response.outputs.add(name=name, datatype=oip_of[array.dtype])
                tensor.shape.extend(array.shape)
                response.raw_output_contents.append(array.tobytes())
            return response

    if threaded:
        class ThreadedServicer(pb_grpc.GRPCInferenceServiceServicer):
            def ServerLive(self, request, context):
                return pb.ServerLiveResponse(live=True)

            def ServerReady(self, request, context):
                return pb.ServerReadyResponse(ready=True)

            def ModelReady(self, request, context):
                return pb.ModelReadyResponse(ready=request.name == MODEL)

            def ModelInfer(self, request, context):
                inputs = {t.name: np.frombuffer(raw, dtype=numpy_of[t.datatype]).reshape(
                    tuple(t.shape)) for t, raw in zip(request.inputs, request.raw_input_contents)}
                outputs = session.run(output_names, inputs)
                response = pb.ModelInferResponse(model_name=request.model_name,
                                                 model_version=request.model_version,
                                                 id=request.id)
                for name, array in zip(output_names, outputs):
                    tensor = response.outputs.add(name=name, datatype=oip_of[array.dtype])
                    tensor.shape.extend(array.shape)
                    response.raw_output_contents.append(array.tobytes())
                return response

        server = grpc.server(ThreadPoolExecutor(max_workers=max(8, executor_workers)),
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE),
                                      ("grpc.so_reuseport", 0)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(ThreadedServicer(), server)
        if not server.add_insecure_port(f"{HOST}:{port}"):
            raise SystemExit(f"baseline: cannot listen on {HOST}:{port}")
        serve_until_signalled(server)
        return

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                          ("grpc.max_send_message_length", MAX_MESSAGE),
                                          ("grpc.so_reuseport", 0)])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
        if not server.add_insecure_port(f"{HOST}:{port}"):
            raise SystemExit(f"baseline: cannot listen on {HOST}:{port}")
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(2)

    asyncio.run(main())


def serve_until_signalled(server) -> None:
    """Run a started-here grpc threaded server until SIGTERM/SIGINT (also upstream_hop.py's
    raw proxy)."""
    server.start()
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    server.stop(2)


# -- servers as child processes ------------------------------------------------------------------
class Child:
    def __init__(self, cell: str, argv: list[str], logfile: Path, env: dict, cwd: Path = REPO):
        self.cell = cell
        self.logfile = logfile
        self._log = logfile.open("w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env, cwd=str(cwd), start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


def wait_ready(target: str, child: Child, timeout: float = 180.0) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise RuntimeError(f"server {child.cell} exited with code "
                                   f"{child.process.returncode} before it was ready:\n"
                                   f"{child.log_tail()}")
            try:
                if (stub.ServerReady(pb.ServerReadyRequest(), timeout=2).ready
                        and stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=2).ready):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"server {child.cell} not ready after {timeout:.0f}s:\n{child.log_tail()}")


def build_requests(inputs: np.ndarray) -> list:
    from tritonclient.grpc import service_pb2 as pb

    requests = []
    for i in range(inputs.shape[0]):
        request = pb.ModelInferRequest(model_name=MODEL)
        tensor = request.inputs.add(name="image", datatype="FP32")
        tensor.shape.extend([1, 3, 32, 32])
        request.outputs.add(name="logits")
        request.raw_input_contents.append(np.ascontiguousarray(inputs[i:i + 1]).tobytes())
        requests.append(request)
    return requests


def check_answers(target: str, requests: list, expected: np.ndarray) -> float:
    """Every pooled request once; the answers (raw or typed contents: guard and the baseline
    answer raw, MLServer typed) must match ORT in-process. Returns the largest |diff|."""
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


# -- load generator ------------------------------------------------------------------------------
def closed_loop(target: str, requests: list, concurrency: int, duration: float) -> dict:
    """C threads, each its own channel/connection, each sending the next request as soon as the
    previous answer arrives, until ``duration`` has passed. Returns latencies and counts."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    barrier = threading.Barrier(concurrency + 1, timeout=60)
    start_ns = [0]
    latencies: list[list[int]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    first_error: list[str] = []
    ends = [0] * concurrency

    def worker(index: int) -> None:
        options = [("grpc.use_local_subchannel_pool", 1),
                   ("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.max_send_message_length", MAX_MESSAGE)]
        channel = grpc.insecure_channel(target, options=options)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        infer = stub.ModelInfer
        try:
            stub.ServerLive(pb.ServerLiveRequest(), timeout=10)  # connect before the clock
            barrier.wait()
            deadline = start_ns[0] + int(duration * 1e9)
            mine = latencies[index]
            k = index * 7
            n = len(requests)
            while True:
                request = requests[k % n]
                k += 1
                t0 = time.perf_counter_ns()
                try:
                    infer(request, timeout=30)
                except grpc.RpcError as exc:
                    errors[index] += 1
                    if not first_error:
                        first_error.append(f"{exc.code()}: {exc.details()}")
                    t1 = time.perf_counter_ns()
                else:
                    t1 = time.perf_counter_ns()
                    mine.append(t1 - t0)
                if t1 >= deadline:
                    ends[index] = t1
                    break
        finally:
            channel.close()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(concurrency)]
    for t in threads:
        t.start()
    gc.collect()
    gc.disable()  # no collector pauses in the load generator while it measures
    try:
        start_ns[0] = time.perf_counter_ns()
        barrier.wait()
        for t in threads:
            t.join(duration + 120)
    finally:
        gc.enable()
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"load generator against {target} did not finish")
    elapsed = (max(ends) - start_ns[0]) / 1e9
    all_ns = np.concatenate([np.asarray(x, dtype=np.int64) for x in latencies])
    return {"latencies_ns": all_ns, "elapsed_s": elapsed, "errors": sum(errors),
            "first_error": first_error[0] if first_error else None}


def summarize(latencies_ns: np.ndarray, elapsed_s: float, errors: int) -> dict:
    return {
        "requests": int(latencies_ns.size),
        "errors": int(errors),
        "elapsed_s": round(elapsed_s, 3),
        "throughput_rps": latencies_ns.size / elapsed_s if elapsed_s > 0 else float("nan"),
        "mean_ms": float(latencies_ns.mean()) / 1e6 if latencies_ns.size else float("nan"),
        "p50_ms": percentile_ms(latencies_ns, 50),
        "p90_ms": percentile_ms(latencies_ns, 90),
        "p99_ms": percentile_ms(latencies_ns, 99),
        "p999_ms": percentile_ms(latencies_ns, 99.9),
        "max_ms": float(latencies_ns.max()) / 1e6 if latencies_ns.size else float("nan"),
    }


# -- CPU accounting ------------------------------------------------------------------------------
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (guard serve's verifier process)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def proc_ticks(pid) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def cpu_snapshot(server_pid: int) -> dict | None:
    """Machine-wide busy/total/steal ticks, and the CPU ticks of the server (the serving
    process), of its children (guard's verifier process; none for the baseline) and of this
    process."""

    try:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        idle = values[3] + values[4]
        verifier = 0
        for pid in child_pids(server_pid):
            try:
                verifier += proc_ticks(pid)
            except OSError:
                pass
        return {"busy": sum(values) - idle - values[7], "total": sum(values),
                "steal": values[7], "server": proc_ticks(server_pid), "verifier": verifier,
                "self": proc_ticks("self"), "wall": time.monotonic()}
    except (OSError, ValueError, IndexError):
        return None


def cpu_usage(before: dict | None, after: dict | None, requests: int,
              servers: tuple[str, ...] = ("server", "verifier")) -> dict:
    """Cores used on average over the cell: by each server, the load generator, and anything
    else on the machine (other processes: a noisy neighbour makes the figures unreliable).
    ``servers`` names the snapshot keys holding server ticks: ``cpu_snapshot``'s one "server"
    here; upstream_hop.py snapshots one key per process group (MLServer, guard)."""
    if not before or not after:
        return {}
    seconds = lambda key: (after[key] - before[key]) / CLK_TCK  # noqa: E731
    used = {name: seconds(name) for name in servers}
    client = seconds("self")
    return cpu_summary({"wall_s": after["wall"] - before["wall"],
                        **{f"{name}_s": s for name, s in used.items()}, "client_s": client,
                        "other_s": max(0.0, seconds("busy") - sum(used.values()) - client),
                        "steal_s": seconds("steal"), "requests": requests})


NOT_SERVERS = ("wall", "client", "other", "steal")  # the ``*_s`` keys of cpu_usage that are not


def cpu_summary(raw: dict) -> dict:
    """``raw`` (CPU seconds per ``<name>_s``, "requests") plus cores per name and CPU ms per
    request for each server (every ``<name>_s`` but wall, client, other, steal)."""
    wall = raw["wall_s"] or float("nan")
    servers = [k[:-2] for k in raw if k.endswith("_s") and k[:-2] not in NOT_SERVERS]
    out = dict(raw)
    for name in (*servers, "client", "other", "steal"):
        out[f"{name}_cores"] = raw[f"{name}_s"] / wall
    for name in servers:
        out[f"{name}_cpu_ms_per_request"] = (raw[f"{name}_s"] * 1e3 / raw["requests"]
                                             if raw["requests"] else float("nan"))
    return out


def merge_cpu(parts: list[dict]) -> dict:
    """The CPU figures of several rounds of one cell: seconds and requests summed."""
    parts = [p["cpu"] for p in parts if p.get("cpu")]
    if not parts:
        return {}
    keys = [k for k in parts[0] if k.endswith("_s")] + ["requests"]
    return cpu_summary({k: sum(p.get(k, 0.0) for p in parts) for k in keys})


def other_load(pids: list[int], seconds: float = 1.0) -> float:
    """Cores used over ``seconds`` by processes other than this one and ``pids``."""
    before = [cpu_snapshot(pid) for pid in pids] or [cpu_snapshot(os.getpid())]
    time.sleep(seconds)
    after = [cpu_snapshot(pid) for pid in pids] or [cpu_snapshot(os.getpid())]
    if None in before or None in after:
        return 0.0
    ours = sum(a["server"] - b["server"] for a, b in zip(after, before)) + (
        after[0]["self"] - before[0]["self"])
    wall = after[0]["wall"] - before[0]["wall"]
    return max(0.0, (after[0]["busy"] - before[0]["busy"] - ours) / CLK_TCK / wall)


def wait_quiet(pids: list[int], max_wait: float) -> None:
    """On a shared machine, wait (at most ``max_wait`` s) until other processes are quiet."""
    if max_wait <= 0:
        return
    deadline = time.monotonic() + max_wait
    load = other_load(pids)
    if load <= NOISY_NEIGHBOUR_CORES:
        return
    log(f"  other processes use {load:.2f} cores; waiting up to {max_wait:.0f}s for quiet ...")
    while time.monotonic() < deadline:
        load = other_load(pids, 2.0)
        if load <= NOISY_NEIGHBOUR_CORES:
            log(f"  quiet now ({load:.2f} cores)")
            return
    log(f"  still {load:.2f} cores of other load: measuring anyway (flagged in the report)")


# -- guard metrics ---------------------------------------------------------------------------------
def scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") not in (None, MODEL):
                continue
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model", "le"))
            if "le" in sample.labels:
                continue
            values[key] = sample.value
    return values


MIRROR_OUTCOMES = ("compared", "dropped", "timeout", "error")


def mirror_total(values: dict) -> float:
    return sum(values.get(f"guard_mirror_total,outcome={o}", 0.0) for o in MIRROR_OUTCOMES)


def drained(port: int, timeout: float = 60.0) -> dict:
    """Scrape once the mirror queue is empty and the outcome counts have stopped moving."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        values = scrape(port)
        total = mirror_total(values)
        if values.get("guard_mirror_queue_depth", 0.0) == 0 and previous == total:
            return values
        if time.monotonic() > deadline:
            log(f"warning: mirror queue not drained after {timeout:.0f}s")
            return values
        previous = total
        time.sleep(0.25)


def guard_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {
        "requests_primary": int(d.get("guard_requests_total,route=primary", 0)),
        "request_errors": int(sum(v for k, v in d.items()
                                  if k.startswith("guard_request_errors_total"))),
    }
    count = d.get("guard_request_duration_seconds_count,route=primary", 0)
    if count:
        seconds = d["guard_request_duration_seconds_sum,route=primary"]
        out["in_guard_mean_ms"] = seconds / count * 1e3
    observed = {k.rsplit("=", 1)[1]: int(v) for k, v in d.items()
                if k.startswith("guard_observer_calls_total,outcome=")}
    if any(observed.values()):  # Envoy mode: the calls Envoy copied to guard's observer
        out["observer"] = observed
    mirror = {o: int(d.get(f"guard_mirror_total,outcome={o}", 0)) for o in MIRROR_OUTCOMES}
    if any(mirror.values()) or "guard_reference_duration_seconds_count" in d:
        out["mirror"] = mirror
        out["mirror"]["sampled"] = sum(mirror.values())
        out["checks"] = {r: int(d.get(f"guard_checks_total,result={r},tier=tensor", 0))
                         for r in ("pass", "fail")}
        ref_count = d.get("guard_reference_duration_seconds_count", 0)
        if ref_count:
            out["reference_mean_ms"] = (d["guard_reference_duration_seconds_sum"]
                                        / ref_count * 1e3)
            out["reference_s"] = d["guard_reference_duration_seconds_sum"]  # all its calls
    return out


# -- configs -------------------------------------------------------------------------------------
def guard_config(prep: dict, ports: dict, mirror: bool, sample_rate: float,
                 ort_threads: int, workers: int | None = None, nice: int | None = None,
                 slowdown: int = 1, inline_below_ms: float | None = None) -> dict:
    primary = {"backend": "onnxruntime", "path": prep["onnx"]}
    if ort_threads:
        primary["options"] = {"intra_op_threads": ort_threads}
    model = {"name": MODEL, "task": "classification", "primary": primary}
    if mirror:
        model["reference"] = {
            "backend": "torch",
            "path": "bench_reference:make",
            "options": {"kwargs": {"path": prep["torchscript"],
                                   "repeats": prep["repeats"] * slowdown}},
        }
        model["mirror"] = {"sample_rate": sample_rate, "threads": 1, "queue_size": 64,
                           "timeout_s": 5.0}
        if nice is not None:
            model["mirror"]["nice"] = nice
    server = {"host": HOST, "shutdown_grace_s": 5.0, **ports}
    if workers is not None:
        server["workers"] = workers
    if inline_below_ms is not None:
        server["inline_below_ms"] = inline_below_ms
    return {"version": 1, "server": server, "models": [model]}


# -- the run -------------------------------------------------------------------------------------
def run_plan(args: argparse.Namespace, prefix: str):
    """The run's settings from ``add_run_arguments``' flags (defaults filled in, ``args.rounds``
    too) and a fresh work folder that is also guard's cache (``GUARD_CACHE_DIR``, here and in
    the children's ``env``). Returns (concurrencies, duration, warmup, out_dir, workdir, env)."""
    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1:
        raise SystemExit("--concurrency: a comma-separated list of integers >= 1")
    duration = args.duration if args.duration is not None else (2.0 if args.quick else 10.0)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 2.0)
    out_dir = Path(args.out).resolve()
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    env = dict(os.environ, GUARD_CACHE_DIR=str(workdir), PYTHONUNBUFFERED="1")
    os.environ["GUARD_CACHE_DIR"] = str(workdir)
    log(f"work folder {workdir}; {duration:g}s per cell after {warmup:g}s warm-up; "
        f"concurrency {concurrencies}; {args.rounds} round(s)")
    return concurrencies, duration, warmup, out_dir, workdir, env


def write_results(out_dir: Path, name: str, report: dict, md: str, text: str) -> None:
    """``<name>.json`` and ``<name>.md`` under ``out_dir``; the text tables to stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(md)
    print()
    print(text)
    log(f"wrote {out_dir / f'{name}.json'} and {out_dir / f'{name}.md'}")


def run(args: argparse.Namespace) -> int:
    import yaml

    concurrencies, duration, warmup, out_dir, workdir, env = run_plan(args, "guard-bench-")
    children: list[Child] = []
    try:
        (workdir / "bench_reference.py").write_text(REFERENCE_MODULE)
        log("exporting the zoo classifier and calibrating the reference ...")
        wait_quiet([], args.wait_quiet)
        subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "_prepare", "--workdir", str(workdir),
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
                    argv = [sys.executable, str(Path(__file__).resolve()), "_baseline",
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


def clean_up(children: list, workdir: Path, keep_workdir: bool) -> None:
    """Kill what still runs of ``children`` and remove the work folder (unless kept)."""
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait(timeout=10)
    if keep_workdir:
        log(f"work folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def cell_note(figures: dict) -> str:
    """What measure_cell logs after the latencies: mirror outcomes, the server's CPU."""
    extra = ""
    mirror = figures.get("guard", {}).get("mirror")
    if mirror:
        extra = (f"; mirror compared {mirror['compared']}, dropped {mirror['dropped']}, "
                 f"timeout {mirror['timeout']}")
    cpu = figures["cpu"]
    if cpu:
        extra += (f"; CPU server {cpu['server_cores']:.2f} cores "
                  f"({cpu['server_cpu_ms_per_request']:.3f} ms/req), verifier "
                  f"{cpu.get('verifier_cores', 0.0):.2f} cores, client "
                  f"{cpu['client_cores']:.2f}, other {cpu['other_cores']:.2f}")
    return extra


def measure_cell(args, cell: str, child: Child, target: str, metrics_port: int | None,
                 requests: list, concurrency: int, duration: float, warmup: float, *,
                 pids: list[int] | None = None, snapshot=None,
                 servers: tuple[str, ...] = ("server", "verifier"), scrape_fn=drained,
                 note=cell_note):
    """Warm up, measure one cell; on a shared machine, measure again (up to --retries times) when
    other processes used the CPU meanwhile, and keep the attempt they disturbed least.
    Defaults: one server, ``child``; upstream_hop.py passes its process groups' ``pids``, a
    ``snapshot`` of their ticks named ``servers``, a plain ``scrape`` (no mirror to drain) and
    its own log ``note``."""
    pids = [child.process.pid] if pids is None else pids
    snapshot = snapshot or (lambda: cpu_snapshot(child.process.pid))
    best = None
    for attempt in range(args.retries + 1):
        wait_quiet(pids, args.wait_quiet)
        closed_loop(target, requests, concurrency, warmup)
        before = scrape_fn(metrics_port) if metrics_port else None
        cpu_before = snapshot()
        result = closed_loop(target, requests, concurrency, duration)
        cpu_after = snapshot()
        after = scrape_fn(metrics_port) if metrics_port else None
        if result["errors"]:
            log(f"  ({cell}) c={concurrency}: {result['errors']} errors, first: "
                f"{result['first_error']}")
        figures = summarize(result["latencies_ns"], result["elapsed_s"], result["errors"])
        figures["cpu"] = cpu_usage(cpu_before, cpu_after, figures["requests"], servers)
        figures["attempt"] = attempt + 1
        if metrics_port:
            figures["guard"] = guard_delta(before, after)
        cpu = figures["cpu"]
        extra = note(figures)
        log(f"  ({cell}) c={concurrency}: p50 {figures['p50_ms']:.3f} ms, p99 "
            f"{figures['p99_ms']:.3f} ms, {figures['throughput_rps']:.0f} req/s{extra}")
        other = cpu.get("other_cores", 0.0)
        if best is None or other < best[0]["cpu"].get("other_cores", 0.0):
            best = (figures, result["latencies_ns"])
        if other <= NOISY_NEIGHBOUR_CORES:
            break
        if attempt < args.retries:
            log(f"  other processes used {other:.2f} cores during the cell: measuring again")
    return best


# -- report ----------------------------------------------------------------------------------------
def _merge_guard(parts: list[dict]) -> dict:
    """Sum counters over rounds; average the means weighted by requests."""
    if not parts or not any("guard" in p for p in parts):
        return {}
    merged: dict = {"requests_primary": 0, "request_errors": 0}
    weight = 0
    mean = 0.0
    ref_w = 0
    ref_mean = 0.0
    for p in parts:
        g = p["guard"]
        merged["requests_primary"] += g["requests_primary"]
        merged["request_errors"] += g["request_errors"]
        if "in_guard_mean_ms" in g:
            mean += g["in_guard_mean_ms"] * g["requests_primary"]
            weight += g["requests_primary"]
        for k, v in g.get("observer", {}).items():
            merged.setdefault("observer", {})[k] = merged.get("observer", {}).get(k, 0) + v
        if "mirror" in g:
            m = merged.setdefault("mirror", {k: 0 for k in g["mirror"]})
            for k, v in g["mirror"].items():
                m[k] += v
            c = merged.setdefault("checks", {"pass": 0, "fail": 0})
            for k, v in g["checks"].items():
                c[k] += v
            if "reference_s" in g:
                merged["reference_s"] = merged.get("reference_s", 0.0) + g["reference_s"]
            if "reference_mean_ms" in g:
                n = g["mirror"]["compared"]
                ref_mean += g["reference_mean_ms"] * n
                ref_w += n
    if weight:
        merged["in_guard_mean_ms"] = mean / weight
    if ref_w:
        merged["reference_mean_ms"] = ref_mean / ref_w
    return merged


def merge_rounds(cell_names, concurrencies: list[int], runs: dict, pooled: dict) -> dict:
    """Per cell and concurrency (as a string), the figures of all rounds: latencies pooled,
    counters and CPU summed, and each round's p50/p99/throughput when there were several."""
    cells = {}
    for cell in cell_names:
        cells[cell] = {}
        for c in concurrencies:
            parts = runs[cell][c]
            lat = np.concatenate(pooled[cell][c])
            elapsed = sum(p["elapsed_s"] for p in parts)
            figures = summarize(lat, elapsed, sum(p["errors"] for p in parts))
            figures["cpu"] = merge_cpu(parts)
            guard = _merge_guard(parts)
            if guard:
                figures["guard"] = guard
            if len(parts) > 1:
                figures["per_round"] = [{k: p[k] for k in ("p50_ms", "p99_ms", "throughput_rps")}
                                        for p in parts]
            cells[cell][str(c)] = figures
    return cells


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


LOAD_GENERATOR = ("closed loop, one thread + one gRPC channel (own connection) per concurrent "
                  "client, tritonclient GRPCInferenceServiceStub, pre-built raw requests (64 "
                  "distinct inputs), loopback")


def other_cores(report: dict, cell: str, c: str) -> float:
    """Cores other processes used during ``cell`` at concurrency ``c`` (0 when unknown)."""
    return report["cells"][cell]["by_concurrency"][c].get("cpu", {}).get("other_cores", 0.0)


def mark_disturbed(report: dict, target: dict, c: str, cells) -> None:
    """Mark ``target`` 'disturbed' when other processes used the CPU during a cell it compares:
    then its PASS or MISS says more about the neighbours than about guard."""
    target["disturbed"] = any(other_cores(report, x, c) > NOISY_NEIGHBOUR_CORES for x in cells)


def flag_disturbed(report: dict) -> None:
    for c, comp in report["comparisons"].items():
        t = comp["targets"]
        for key, cells in (("guard_add_p50_ms", "ab"), ("guard_add_p99_ms", "ab"),
                           ("mirror_p99_ratio", "bc"), ("mirror_non_blocking", "c")):
            mark_disturbed(report, t[key], c, cells)


def _ok(target: dict) -> str:
    word = "PASS" if target["ok"] else "MISS"
    return f"{word} (disturbed)" if target.get("disturbed") else word


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
             f"{t['guard_add_p50_ms']['value']:+.3f} ms", _ok(t["guard_add_p50_ms"])],
            [c, "guard adds at p99 (b-a)", f"<= {TARGET_ADD_P99_MS} ms",
             f"{t['guard_add_p99_ms']['value']:+.3f} ms", _ok(t["guard_add_p99_ms"])],
            [c, "mirroring 10% raises p99 (c/b)", f"<= {TARGET_MIRROR_P99_RATIO:.2f}x",
             f"{t['mirror_p99_ratio']['value']:.2f}x", _ok(t["mirror_p99_ratio"])],
            [c, "mirror never blocks (all samples end counted)", "0 errors, ~10% sampled",
             f"{nb['client_errors']} errors, {nb['sampled']} sampled ({share}) of "
             f"{nb['requests']}, dropped {nb['dropped']}, timeout {nb['timeout']}",
             _ok(nb)],
        ]
    return figures, ratios, targets


FIG_HEAD = ["C", "server", "p50 ms", "p99 ms", "req/s", "requests", "errors",
            "server CPU ms/req", "verifier CPU ms/req", "other load (cores)", "notes"]
RATIO_HEAD = ["C", "b/a p50", "b/a p99", "b/a req/s", "b-a p50 ms", "b-a p99 ms", "c/b p50",
              "c/b p99", "c/b req/s", "n/b p99 (nice 0)", "b-a server CPU ms/req"]
TARGET_HEAD = ["C", "target", "bound", "measured", "result"]


def _plain(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _md(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def machine_line(machine: dict, packages: tuple[str, ...]) -> str:
    """The report's 'Machine:' line, naming the versions of ``packages`` (then grpcio, guard)."""
    m, v = machine, machine["versions"]
    source = m.get("guard_source", {})
    names = "".join(f", {name} {v.get(name, '?')}" for name in (*packages, "grpcio"))
    return (
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores ({m['cpus_usable']} usable); "
        f"Python {v['python']}{names}, guard {v['guard']} (commit {source.get('commit', '?')}"
        f"{', with uncommitted changes in guard/' if source.get('uncommitted_guard_files') else ''}"
        f"); {m['platform']}; {m['date']}")


def run_line(settings: dict) -> str:
    s = settings
    return (f"Run: {s['duration_s']:g} s per cell after {s['warmup_s']:g} s warm-up, "
            f"{s['rounds']} round(s), concurrency {s['concurrency']}"
            + (" (--quick: smoke check, not figures to quote)" if s["quick"] else ""))


def noisy_warning(report: dict, steadier: str) -> list[str]:
    """The WARNING line (or none) when other processes used the CPU during some cell."""
    other = max((f.get("cpu", {}).get("other_cores", 0.0) for cell in report["cells"].values()
                 for f in cell["by_concurrency"].values()), default=0.0)
    if other <= NOISY_NEIGHBOUR_CORES:
        return []
    return [f"WARNING: other processes used up to {other:.2f} cores during a cell (see "
            "'other load'): the machine was shared; latency figures and targets marked "
            f"'disturbed' are unreliable ({steadier} is the steadier figure)"]


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


def render_text(context: list[str], tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    """Context lines, then each (title, head, rows) table; the first table goes untitled."""
    parts = ["\n".join(context), "", _plain(*tables[0][1:])]
    for title, head, rows in tables[1:]:
        parts += ["", title, _plain(head, rows)]
    return "\n".join(parts)


def render_markdown(title: str, script: str, context: list[str], cells: dict[str, str],
                    tables: list[tuple[str, list[str], list[list[str]]]]) -> str:
    """The .md report: title, context bullets, the cells, then a section per (heading, head,
    rows) table."""
    cell_lines = "\n".join(f"- ({k}) {v}" for k, v in cells.items())
    context_lines = "\n".join(f"- {line.strip()}" for line in context)
    sections = "\n\n".join(f"## {heading}\n\n{_md(head, rows)}" for heading, head, rows in tables)
    return (
        f"# {title}\n\n"
        f"Generated by `benchmarks/{script}`; closed-loop load over loopback, latency "
        "measured at the client.\n\n"
        f"{context_lines}\n\nCells:\n\n{cell_lines}\n\n"
        f"{sections}\n"
    )


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


# -- entry ---------------------------------------------------------------------------------------
def add_run_arguments(parser: argparse.ArgumentParser, name: str, rounds_what: str) -> None:
    """The flags every closed-loop benchmark here shares (also used by upstream_hop.py)."""
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds measured per cell (default 10; 2 with --quick)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of warm-up load before each cell (default 2; 0.5 --quick)")
    parser.add_argument("--concurrency", default="1,8",
                        help="comma-separated concurrent clients (default 1,8)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"{rounds_what}; latencies are pooled over rounds "
                        "(default 2; 1 with --quick)")
    parser.add_argument("--out", default=str(HERE / "results"),
                        help=f"folder for {name}.json/.md (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--wait-quiet", type=float, default=20.0, metavar="S",
                        help="before each cell, wait up to S seconds while other processes use "
                        f"more than {NOISY_NEIGHBOUR_CORES} cores (shared machines); 0 = off "
                        "(default 20)")
    parser.add_argument("--retries", type=int, default=1,
                        help="measure a cell again when other processes used the CPU during it; "
                        "the least disturbed attempt is kept (default 1)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the temp folder (models, configs, server logs)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_prepare":
        p = argparse.ArgumentParser()
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--slowdown", type=float, required=True)
        p.add_argument("--iters", type=int, default=2000)
        p.add_argument("--ort-threads", type=int, default=1)
        a = p.parse_args(argv[1:])
        cmd_prepare(a.workdir, a.slowdown, a.iters, a.ort_threads)
        return 0
    if argv and argv[0] == "_baseline":
        p = argparse.ArgumentParser()
        p.add_argument("--onnx", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--executor", type=int, default=0)
        p.add_argument("--ort-threads", type=int, default=1)
        p.add_argument("--threaded", action="store_true")
        a = p.parse_args(argv[1:])
        cmd_baseline(a.onnx, a.port, a.executor, a.ort_threads, a.threaded)
        return 0

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


def parse_and_run(parser: argparse.ArgumentParser, argv: list[str], run_fn) -> int:
    """Parse (``--rounds`` >= 1), make SIGTERM run ``run_fn``'s cleanup, run (also upstream_hop)."""
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be >= 1")

    def terminated(signum, frame):  # SIGTERM too runs run()'s finally: no server left behind
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    return run_fn(args)


if __name__ == "__main__":
    sys.exit(main())
