"""``guard demo``: the sidecar on embedded seeded models, driven by a real OIP client.

1. Builds the seeded CNN of ``guard.zoo.classifier`` (TorchScript + ONNX, no downloads).
2. Writes a config: reference torch eager fp32; primary ONNX Runtime ``precision: int8`` (the
   guard derives it, and it drifts); fallback ONNX Runtime fp32; ``policy.action:
   fallback_model``.
3. Starts ``guard serve`` on it as a child process and waits for readiness.
4. Sends requests with ``tritonclient.grpc``, printing progress and the guard's route events.
5. Prints what happened (from /metrics and the admin API) and where to look next.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from argparse import Namespace
from pathlib import Path

import yaml

from guard.errors import GuardError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SAMPLE_RATE = 0.5  # the share of the demo's requests mirrored, unless --sample-rate says


def default_workdir() -> Path:
    from guard.backends.derive import cache_root

    return cache_root() / "demo"


def demo_config(models: dict[str, Path], ports: dict[str, int], sample_rate: float) -> dict:
    onnx = models["onnx"].name
    return {
        "version": 1,
        "server": {"host": "127.0.0.1", **ports},
        "models": [{
            "name": "classifier",
            "task": "classification",
            "primary": {"backend": "onnxruntime", "path": onnx, "precision": "int8"},
            "reference": {"backend": "torch", "path": models["torchscript"].name},
            "fallback": {"backend": "onnxruntime", "path": onnx},
            "mirror": {"sample_rate": sample_rate, "queue_size": 64, "timeout_s": 5.0},
            "checks": {"tensor": {"atol": 1.0e-4, "rtol": 1.0e-3}},
            # CUSUM with p0 pinned: a demo has no time for the burn-in that measures it.
            "policy": {"action": "fallback_model", "detector": "cusum", "p0": 0.01,
                       "arl0": 1.0e5, "dwell_s": 2.0},
        }],
    }


class _ServerLog(threading.Thread):
    """Copies the child's log to a file and echoes the events a demo viewer cares about."""

    SHOWN = {"model_loaded", "route_transition", "drift_alert", "mirror_error", "server_started",
             "server_stopped"}

    def __init__(self, stream, path: Path):
        super().__init__(daemon=True)
        self.stream = stream
        self.path = path
        self.transitions: list[dict] = []

    def run(self) -> None:
        with self.path.open("w") as log:
            for line in self.stream:
                log.write(line)
                log.flush()
                self._show(line)

    def _show(self, line: str) -> None:
        start = line.find("{")
        if "guard.events" not in line or start < 0:
            if not line.startswith(tuple("0123456789")):  # not a log record: stderr output
                print(f"  [guard] {line.rstrip()}", flush=True)
            return
        try:
            event = json.loads(line[start:])
        except json.JSONDecodeError:
            return
        name = event.get("event")
        if name not in self.SHOWN:
            return
        if name == "route_transition":
            self.transitions.append(event)
            print(f"  [guard] ROUTE {event['from_route']} -> {event['to_route']} "
                  f"({event['trigger']}): {event['reason']}", flush=True)
            failure = event.get("evidence", {}).get("last_failure")
            if failure:
                print(f"          last failing check: {_failure_line(failure)}", flush=True)
        elif name == "model_loaded":
            for role, summary in event["backends"].items():
                print(f"  [guard] {event['model']} {role:<9} {summary}", flush=True)
        elif name == "server_started":
            print(f"  [guard] serving OIP on 127.0.0.1:{event['grpc_port']}, "
                  f"metrics {event['metrics']}, admin {event['admin']}", flush=True)
        else:
            fields = {k: v for k, v in event.items() if k not in ("ts", "event")}
            print(f"  [guard] {name}: {fields}", flush=True)


def _failure_line(failure: str | dict) -> str:
    """A route transition's last failing check, on one line: a tensor model's is a line already
    ("tensor: fail: ..."); a generative model's is the completion's verdict (a dict: its figures
    and first divergent token, which the demo printed in full when the completion failed)."""
    if not isinstance(failure, dict):
        return str(failure)
    request = failure.get("request_id")
    first = failure.get("first_divergence")
    return "".join((f"completion {request[:8]}: " if request else "",
                    str(failure.get("reason", "failed")),
                    f", first divergent token at {first['position']}" if first else ""))


def _wait_ready(client, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise GuardError(f"guard serve exited with code {process.returncode} before it was "
                             "ready (its log is printed above)")
        try:
            if client.is_server_ready():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise GuardError(f"guard serve was not ready after {timeout:.0f}s")


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def _metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def _drive(client, n: int, log: _ServerLog) -> dict[str, int]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    from guard.zoo.classifier import sample_inputs

    images = sample_inputs(n, seed=2026)
    routes = {"primary": 0, "fallback": 0}
    errors = 0
    started = time.monotonic()
    for i in range(n):
        tensor = grpcclient.InferInput("image", [1, 3, 32, 32], "FP32")
        tensor.set_data_from_numpy(images[i:i + 1])
        try:
            result = client.infer("classifier", [tensor], request_id=f"demo-{i}")
        except Exception as exc:  # counted and shown; the demo goes on
            errors += 1
            print(f"  request {i} failed: {exc}", flush=True)
            continue
        route = result.get_response().parameters["guard_route"].string_param
        routes[route] = routes.get(route, 0) + 1
        np.asarray(result.as_numpy("logits"))
        if (i + 1) % 50 == 0 or i + 1 == n:
            rate = (i + 1) / (time.monotonic() - started)
            print(f"  sent {i + 1}/{n} ({rate:.0f} req/s): answered by primary "
                  f"{routes['primary']}, by fallback {routes['fallback']}", flush=True)
        time.sleep(0.01)  # a steady trickle, so the mirror keeps up and the story unfolds
    routes["errors"] = errors
    return routes


def _summary(values: dict, routes: dict[str, int], ports: dict[str, int], status,
             serving_on: bool) -> None:
    """What guard saw and did; where to look at it (``serving_on``: the server stays up)."""
    m = "classifier"
    print("\nWhat the guard saw and did")
    answered = {r: int(_metric(values, "guard_requests_total", model=m, route=r))
                for r in ("primary", "fallback")}
    print(f"  requests answered   primary {answered['primary']}"
          f", fallback {answered['fallback']}"
          f" (client saw: primary {routes['primary']}, fallback {routes['fallback']}, "
          f"errors {routes['errors']})")
    outcomes = {o: int(_metric(values, "guard_mirror_total", model=m, outcome=o))
                for o in ("compared", "dropped", "error", "timeout")}
    print("  mirrored samples    " + ", ".join(f"{k} {v}" for k, v in outcomes.items())
          + " (none while the fallback serves its dwell)")
    passed = int(_metric(values, "guard_checks_total", model=m, tier="tensor", result="pass"))
    failed = int(_metric(values, "guard_checks_total", model=m, tier="tensor", result="fail"))
    print(f"  tier-1 checks       pass {passed}, fail {failed}")
    to_fallback = int(_metric(values, "guard_fallback_transitions_total", model=m,
                              to="fallback_model"))
    to_primary = int(_metric(values, "guard_fallback_transitions_total", model=m, to="primary"))
    active = int(_metric(values, "guard_fallback_active", model=m, scope="model"))
    print(f"  fallback            engaged {to_fallback}x, released {to_primary}x, "
          f"active now: {'yes' if active else 'no'}")
    if status is not None and status.has_last_transition:
        t = status.last_transition
        print(f"  last transition     {t.from_route} -> {t.to_route}: {t.reason}")
    if not serving_on:
        return
    if status is not None and status.probing:
        print("  the guard keeps probing the int8 primary in the background and routes back "
              "when its recovery detector finds the probes clean")
    print(f"\n  metrics:  http://127.0.0.1:{ports['metrics_port']}/metrics")
    print(f"  admin:    guard admin --admin 127.0.0.1:{ports['admin_port']} status")
    print(f"  OIP gRPC: 127.0.0.1:{ports['grpc_port']} (tritonclient.grpc, model 'classifier')")


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def run_demo(args: Namespace) -> int:
    # SIGTERM (a `kill`, a supervisor) stops the demo as Ctrl-C does: what it started (guard
    # serve, the llama.cpp servers) is stopped too, never left running.
    signal.signal(signal.SIGTERM, _interrupted)
    if getattr(args, "llm", False):
        from guard.demo_llm import run_llm_demo

        return run_llm_demo(args)
    import tritonclient.grpc as grpcclient

    from guard.admin_client import get_status
    from guard.zoo import classifier

    workdir = Path(args.workdir) if args.workdir else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    sample_rate = SAMPLE_RATE if args.sample_rate is None else args.sample_rate
    print(f"guard demo: building the seeded demo models in {workdir} ...", flush=True)
    models = classifier.export(workdir)
    ports = {
        "grpc_port": args.grpc_port or _free_port(),
        "metrics_port": args.metrics_port or _free_port(),
        "admin_port": args.admin_port or _free_port(),
    }
    config_path = workdir / "demo.yaml"
    config_path.write_text(yaml.safe_dump(demo_config(models, ports, sample_rate),
                                          sort_keys=False))
    print(f"guard demo: starting `guard serve --config {config_path}`", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "guard", "serve", "--config", str(config_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )
    log = _ServerLog(process.stderr, workdir / "guard.log")
    log.start()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['grpc_port']}")
    try:
        _wait_ready(client, process)
        print(f"guard demo: sending {args.requests or 300} requests with tritonclient.grpc "
              f"(mirroring {sample_rate:.0%} onto the torch reference)", flush=True)
        routes = _drive(client, args.requests or 300, log)
        time.sleep(1.0)  # let the mirror finish the samples in its queue
        values = _scrape(ports["metrics_port"])
        status = get_status(f"127.0.0.1:{ports['admin_port']}", "classifier").models[0]
        _summary(values, routes, ports, status, serving_on=not args.exit)
        print(f"  log:      {workdir / 'guard.log'}")
        if args.exit:
            return _stop(process, log)
        print("\nguard demo: the guard serves on; Ctrl-C stops it.", flush=True)
        try:
            process.wait()
        except KeyboardInterrupt:
            return _stop(process, log)
        return 0
    finally:
        client.close()
        if process.poll() is None:
            process.kill()


def _stop(process: subprocess.Popen, log: _ServerLog) -> int:
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    log.join(5)
    print(f"guard demo: sent SIGTERM; guard serve stopped gracefully with exit code {code}")
    return 0 if code == 0 else 1
