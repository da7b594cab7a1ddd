"""Reliability: a property-based fuzzer and a memory flood against a real `guard serve` process.

1. Fuzz (tests/fuzz_messages.py, hypothesis): N cases (default 10,000) over ModelInferRequest
   (and ModelMetadata/ModelReady), Tap (Observe, WatchRoute), Admin (GetStatus, SetRoute) and
   raw bytes on those methods, over loopback with grpc stubs. Counted: answers by status code,
   UNKNOWN/INTERNAL (must be 0), tracebacks in the server's stderr (must be 0), whether the
   server is alive and answers correctly afterwards.
2. Memory: clients send requests of the largest size the server accepts
   (server.max_message_bytes) for a while; the resident size (VmRSS from /proc) of the serving
   process and of its verifier is sampled every 50 ms. Also requests just over the limit.

    .venv/bin/python benchmarks/reliability.py [--cases 10000] [--flood-s 30]

Writes benchmarks/results/reliability.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from tritonclient.grpc import service_pb2 as oip  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as oip_grpc  # noqa: E402

from fixture_models import Affine  # noqa: E402
from fuzz_messages import Target, cases, reset_routes, target_models  # noqa: E402

MAX_MESSAGE = 16 * 1024 * 1024


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def verifier_pid(pid: int) -> int:
    """The serving process's child running ``guard.verifier``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                if b"guard.verifier" in open(f"/proc/{kid}/cmdline", "rb").read():
                    return int(kid)
            except OSError:
                pass
    return 0


def mirror_outcomes(metrics_port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "guard_mirror_total" and s.labels.get("model") == "m"}


def start_guard(folder: Path) -> tuple[subprocess.Popen, dict, Path]:
    ports = {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()}
    tap_port = free_port()
    config = {"version": 1,
              "server": {"host": "127.0.0.1", **ports, "max_message_bytes": MAX_MESSAGE,
                         "tap": {"host": "127.0.0.1", "port": tap_port},
                         "reload_interval_s": 0},
              "models": target_models({"backend": "torch", "path": "fixture_models:affine"})}
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = folder / "guard.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                               cwd=folder)
    ports["tap_port"] = tap_port
    channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}")
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if stub.ServerReady(oip.ServerReadyRequest(), timeout=1).ready:
                break
        except grpc.RpcError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"guard serve exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    channel.close()
    return process, ports, log


def fuzz(ports: dict, n: int, seed_value: int) -> dict:
    target = Target(ports["grpc_port"], ports["tap_port"], ports["admin_port"])
    failures: list[str] = []

    @seed(seed_value)
    @settings(max_examples=n, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case):
        try:
            target.send(case)
        except AssertionError as exc:  # counted; the run goes on
            failures.append(str(exc)[:500])

    started = time.monotonic()
    one()
    seconds = time.monotonic() - started
    reset_routes(target)
    correct = target.answers_correctly(Affine())
    target.close()
    return {"cases": sum(target.codes.values()), "seconds": round(seconds, 1),
            "codes": dict(sorted(target.codes.items())), "unknown_or_internal": len(failures),
            "failures": failures[:10], "correct_afterwards": correct}


def flood(ports: dict, pid: int, seconds: float, clients: int) -> dict:
    rows = (MAX_MESSAGE - 4096) // 16  # FP32 [rows, 4]: just under the limit with framing
    payload = np.random.default_rng(0).standard_normal((rows, 4)).astype(np.float32)
    request = oip.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(payload.tobytes())
    over = oip.ModelInferRequest()
    over.CopyFrom(request)
    over.raw_input_contents[0] = payload.tobytes() + b"\0" * 8192
    over.inputs[0].shape[0] = rows + 512
    size, over_size = request.ByteSize(), over.ByteSize()
    options = [("grpc.max_send_message_length", 2 * MAX_MESSAGE),
               ("grpc.max_receive_message_length", 2 * MAX_MESSAGE)]
    verifier = verifier_pid(pid)
    mirrored_before = mirror_outcomes(ports["metrics_port"])
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    counts = {"ok": 0, "errors": {}, "over_limit": {}}
    lock = threading.Lock()

    def sample():
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append((time.monotonic() - t0, rss_mib(pid), rss_mib(verifier)))
            time.sleep(0.05)

    def client(index: int):
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}", options=options)
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        i = 0
        while not stop.is_set():
            i += 1
            message = over if index == 0 and i % 10 == 0 else request
            message.id = f"flood-{index}-{i}"
            try:
                stub.ModelInfer(message, timeout=60)
                with lock:
                    counts["ok"] += 1
            except grpc.RpcError as exc:
                key = "over_limit" if message is over else "errors"
                with lock:
                    counts[key][exc.code().name] = counts[key].get(exc.code().name, 0) + 1
        channel.close()

    baseline = (rss_mib(pid), rss_mib(verifier))
    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    sampler.join()
    time.sleep(2)
    after = (rss_mib(pid), rss_mib(verifier))
    serving = [s[1] for s in samples]
    verifying = [s[2] for s in samples]
    half = len(serving) // 2
    return {"max_message_bytes": MAX_MESSAGE, "request_bytes": size,
            "over_limit_request_bytes": over_size, "clients": clients, "seconds": seconds,
            "answered": counts["ok"], "errors": counts["errors"],
            "over_limit_answers": counts["over_limit"],
            "serving_rss_mib": {"before": round(baseline[0], 1), "peak": round(max(serving), 1),
                                "peak_second_half": round(max(serving[half:]), 1),
                                "after": round(after[0], 1)},
            "verifier_rss_mib": {"before": round(baseline[1], 1),
                                 "peak": round(max(verifying), 1),
                                 "peak_second_half": round(max(verifying[half:]), 1),
                                 "after": round(after[1], 1)},
            "samples": len(samples), "verifier_pid_found": verifier > 0,
            "mirror_outcomes_during_flood": {
                k: v - mirrored_before.get(k, 0.0)
                for k, v in mirror_outcomes(ports["metrics_port"]).items()},
            "serving_rss_mib_every_5s": [round(max(s[1] for s in samples
                                                   if i * 5 <= s[0] < (i + 1) * 5), 1)
                                         for i in range(int(seconds // 5))]}


def _excerpts(text: str) -> list[str]:
    out, at = [], text.find("Traceback")
    while at >= 0 and len(out) < 5:
        start = text.rfind("\n", 0, max(0, at - 300)) + 1
        out.append(text[start:at + 2500])
        at = text.find("Traceback", at + 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reliability"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="guard-reliability-") as tmp:
        process, ports, log = start_guard(Path(tmp))
        try:
            fuzzed = fuzz(ports, args.cases, args.seed)
            fuzzed["server_alive"] = process.poll() is None
            flooded = flood(ports, process.pid, args.flood_s, args.clients)
            flooded["server_alive"] = process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            exit_code = process.wait(120)
        text = log.read_text(errors="replace")
    result = {"machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "python": platform.python_version()},
              "fuzz": fuzzed, "memory": flooded, "tracebacks_in_server_log":
              text.count("Traceback"), "traceback_excerpts": _excerpts(text),
              "exit_code_after_sigterm": exit_code}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if (fuzzed["unknown_or_internal"] == 0 and result["tracebacks_in_server_log"] == 0
                 and fuzzed["correct_afterwards"]) else 1


if __name__ == "__main__":
    sys.exit(main())
