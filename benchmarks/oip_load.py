"""The seeded zoo classifier served over the Open Inference Protocol, and closed-loop load on it:
the setting proxy_overhead.py, local_cost.py, sample_cost.py, serving_processes.py,
upstream_hop.py, mirror_batching.py and replay_throughput.py measure guard in.

- ``python benchmarks/oip_load.py _prepare``: export the classifier (ONNX, TorchScript), save the
  request pool's inputs and ORT's answers to them, and calibrate the torch reference
  (``REFERENCE_MODULE``, written into the work folder first) to a given slowdown over the
  primary: in a child process, so that the load generator never imports torch or onnxruntime;
- ``python benchmarks/oip_load.py _baseline``: the bare OIP server around one ORT session
  (grpc.aio, or grpc's threaded server): serving without guard;
- in the load generator: readiness, the pre-built requests, the answers' check, the closed loop
  (C threads, one gRPC channel each), guard's /metrics (the mirror's outcomes, once drained),
  guard's config for a cell, one cell measured (again when other processes disturbed it) and
  the rounds merged.

The generic machinery (child processes, CPU accounting, run flags, reports) is bench.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import (
    HOST,
    NOISY_NEIGHBOUR_CORES,
    Child,
    cpu_snapshot,
    cpu_usage,
    log,
    merge_cpu,
    summarize,
    wait_quiet,
)

MODEL = "classifier"
REQUEST_POOL = 64  # distinct pre-built requests, cycled by the load generator
MAX_MESSAGE = 64 * 1024 * 1024

# The verifier process's targets, which proxy_overhead.py, local_cost.py and sample_cost.py
# measure.
# The verifier-process issue's targets (ratios from one run).
TARGET_LOCAL_CPU_ADD_MS = 0.10  # guard's serving CPU per request over the bare server
TARGET_LOCAL_THROUGHPUT = 0.85  # of the bare server's req/s, at 4-8 clients
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


# -- (child process) preparation: export, calibrate, expected outputs ----------------------------
def export_mlp(path: Path) -> Path:
    """The small MLP of the scale benchmarks (mirror_batching.py, upstream_hop.py --model mlp):
    ``x`` FP32 [-1, 32] -> 64 -> 64 -> ``logits`` FP32 [-1, 10], ReLU, torch seed 31, written
    as ONNX (opset 17, batch dimension dynamic) to ``path``. Imports torch: call it in a child."""
    import warnings

    import torch
    from torch import nn

    torch.manual_seed(31)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 10)).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(mlp, (torch.zeros(1, 32),), str(path), input_names=["x"],
                          output_names=["logits"], dynamic_axes={"x": {0: "batch"},
                                                                 "logits": {0: "batch"}},
                          opset_version=17, dynamo=False)
    return path


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
    session = None  # (freed before torch loads)
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


# -- (child process) the bare server ---------------------------------------------------------------
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


# -- the load generator's side ---------------------------------------------------------------------
def wait_ready(target: str, child: Child, timeout: float = 180.0, model: str = MODEL) -> None:
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
                        and stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=2).ready):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"server {child.cell} not ready after {timeout:.0f}s:\n{child.log_tail()}")


def build_requests(inputs: np.ndarray, model: str = MODEL, input_name: str = "image") -> list:
    """One raw OIP request per row of ``inputs`` (batch 1, the row's shape), asking for
    ``logits``."""
    from tritonclient.grpc import service_pb2 as pb

    requests = []
    for i in range(inputs.shape[0]):
        request = pb.ModelInferRequest(model_name=model)
        tensor = request.inputs.add(name=input_name, datatype="FP32")
        tensor.shape.extend(inputs[i:i + 1].shape)
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
            worst = max(worst, float(np.abs(got.reshape(expected[i:i + 1].shape)
                                            - expected[i:i + 1]).max()))
    if worst > 1e-4:
        raise RuntimeError(f"answers from {target} differ from ORT in-process by {worst:g}")
    return worst


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


LOAD_GENERATOR = ("closed loop, one thread + one gRPC channel (own connection) per concurrent "
                  "client, tritonclient GRPCInferenceServiceStub, pre-built raw requests (64 "
                  "distinct inputs), loopback")


# -- guard: its metrics and its config -------------------------------------------------------------
def scrape(port: int, model: str = MODEL) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") not in (None, model):
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


def drained(port: int, timeout: float = 60.0, model: str = MODEL) -> dict:
    """Scrape once the mirror queue is empty and the outcome counts have stopped moving."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        values = scrape(port, model)
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


# -- one cell, and the rounds ----------------------------------------------------------------------
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


def merge_guard(parts: list[dict]) -> dict:
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
            guard = merge_guard(parts)
            if guard:
                figures["guard"] = guard
            if len(parts) > 1:
                figures["per_round"] = [{k: p[k] for k in ("p50_ms", "p99_ms", "throughput_rps")}
                                        for p in parts]
            cells[cell][str(c)] = figures
    return cells


# -- entry (the child processes) -------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``_prepare`` or ``_baseline``, with their flags (the scripts above start them)."""
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    p = argparse.ArgumentParser(prog=f"oip_load.py {command}")
    if command == "_prepare":
        p.add_argument("--workdir", type=Path, required=True)
        p.add_argument("--slowdown", type=float, required=True)
        p.add_argument("--iters", type=int, default=2000)
        p.add_argument("--ort-threads", type=int, default=1)
        a = p.parse_args(rest)
        cmd_prepare(a.workdir, a.slowdown, a.iters, a.ort_threads)
        return 0
    if command == "_baseline":
        p.add_argument("--onnx", required=True)
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--executor", type=int, default=0)
        p.add_argument("--ort-threads", type=int, default=1)
        p.add_argument("--threaded", action="store_true")
        a = p.parse_args(rest)
        cmd_baseline(a.onnx, a.port, a.executor, a.ort_threads, a.threaded)
        return 0
    print("usage: oip_load.py _prepare|_baseline ...: the benchmarks' child processes "
          "(see the module docstring)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
