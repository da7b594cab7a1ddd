"""Reliability: a property-based fuzzer and a memory flood against a real `guard serve` process.

1. Fuzz (tests/fuzz_messages.py, hypothesis): N cases (default 10,000) over ModelInferRequest
   (and ModelMetadata/ModelReady), Tap (Observe, WatchRoute), Admin (GetStatus, SetRoute) and
   raw bytes on those methods, over loopback with grpc stubs. Counted: answers by status code,
   UNKNOWN/INTERNAL (must be 0), tracebacks in the server's stderr (must be 0), whether the
   server is alive and answers correctly afterwards.
2. Memory: clients send requests of the largest size the server accepts
   (server.max_message_bytes) for a while; the resident size (VmRSS from /proc) of the serving
   process and of its verifier is sampled every 50 ms. Also requests just over the limit.
3. Faults under load (``faults``): a `guard serve` subprocess under closed-loop tritonclient
   load, mirroring on, a real torch reference: the verifier killed (SIGKILL) and hung (SIGSTOP),
   a reference that hangs inside forward(), capture to a full disk (a 2 MiB tmpfs: needs root
   for ``mount``), 50 SIGHUP reloads in a row, an invalid config mid-load. Counted: client
   failures, every sampled request's outcome (compared/dropped/timeout/error: none may go
   missing), time to recover, RSS/threads/fds around the reloads.

    .venv/bin/python benchmarks/reliability.py [--parts fuzz,memory,faults] [--cases 10000]
        [--flood-s 30] [--load-s 4] [--reloads 50]

Writes benchmarks/results/reliability.json (the parts not run keep their figures) and the
faults section of reliability.md (between its markers; the other sections are written by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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

import bench  # noqa: E402  (this folder: the machinery the benchmarks share)
from bench import free_port  # noqa: E402
from fixture_models import SLEEP_TRIGGER, Affine  # noqa: E402
from fuzz_messages import Target, cases, reset_routes, target_models  # noqa: E402

MAX_MESSAGE = 16 * 1024 * 1024


def rss_mib(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def verifier_pid(pid: int) -> int:
    """The serving process's child running ``guard.verifier_process``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids = open(f"/proc/{pid}/task/{task}/children").read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                if b"guard.verifier_process" in open(f"/proc/{kid}/cmdline", "rb").read():
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


def launch(folder: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    """``python -m guard serve`` on ``config`` (written to folder/guard.yaml), once ready."""
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = folder / "guard.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                               cwd=folder)
    channel = grpc.insecure_channel(f"127.0.0.1:{config['server']['grpc_port']}")
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
    return process, log


def start_guard(folder: Path) -> tuple[subprocess.Popen, dict, Path]:
    ports = {"grpc_port": free_port(), "metrics_port": free_port(), "admin_port": free_port()}
    tap_port = free_port()
    config = {"version": 1,
              "server": {"host": "127.0.0.1", **ports, "max_message_bytes": MAX_MESSAGE,
                         "tap": {"host": "127.0.0.1", "port": tap_port},
                         "reload_interval_s": 0},
              "models": target_models({"backend": "torch", "path": "fixture_models:affine"})}
    process, log = launch(folder, config)
    ports["tap_port"] = tap_port
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


# -- faults under load ---------------------------------------------------------------------------
# One `guard serve` with three models, all served by tests/fixture_models.py's affine model
# (the file copied into the work folder as faultmodels.py, loaded as a `module:factory`):
#   m: mirror 100% (every request sampled, so every one must end in an outcome): the verifier is
#      killed and hung under m's load, and m's mirror settings are what the reloads change;
#   s: mirror 100%, a reference that sleeps SLOW_S inside forward() on a trigger row, timeout 1 s;
#   c: mirror 10%, capture mode all (every request recorded) to a 2 MiB tmpfs, nearly full.
SLOW_S = 3.0  # the slow reference's sleep; its mirror timeout_s is 1 s, hang_timeout_s 2 s
HANG_TIMEOUT_S = 2.0
CAPTURE_FS_BYTES = 2 * 1024 * 1024
CAPTURE_FREE_BYTES = 96 * 1024  # left free on the tmpfs when the load starts
OUTCOMES = ("compared", "dropped", "timeout", "error")
RECORDS = ("written", "dropped", "disabled", "error")


def _affine(**kwargs) -> dict:
    return {"backend": "torch", "path": "faultmodels:affine", "options": {"kwargs": kwargs}}


def faults_config(ports: dict, m_timeout_s: float = 5.0, m_rate: float = 1.0,
                  **verifier) -> dict:
    """``m_timeout_s``: what the reloads alternate (one of m's mirror settings)."""
    checks = {"tensor": {"atol": 1e-5, "rtol": 1e-4}}
    policy = {"action": "alert", "detector": "window", "window": 20, "min_samples": 10}
    same = {"primary": _affine(), "checks": checks, "policy": policy}
    return {"version": 1,
            "server": {"host": "127.0.0.1", **ports, "reload_interval_s": 0,
                       "verifier": {"hang_timeout_s": HANG_TIMEOUT_S, "restart_backoff_s": 0.5,
                                    **verifier}},
            "models": [
                {"name": "m", "reference": _affine(), **same,
                 "mirror": {"sample_rate": m_rate, "queue_size": 256, "timeout_s": m_timeout_s}},
                {"name": "s", "reference": _affine(sleep_on_trigger=SLOW_S), **same,
                 "mirror": {"sample_rate": 1.0, "queue_size": 64, "timeout_s": 1.0}},
                {"name": "c", "reference": _affine(), **same,
                 "mirror": {"sample_rate": 0.1, "queue_size": 64},
                 "capture": {"dir": "capture", "mode": "all", "sample_rate": 1.0}}]}


def scrape_all(port: int, timeout: float = 10.0) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                  timeout=timeout).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(values: dict | None, name: str, **labels) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    if not values:
        return 0.0
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


def outcomes(values: dict, model: str) -> dict[str, float]:
    return {o: value(values, "guard_mirror_total", model=model, outcome=o) for o in OUTCOMES}


def primary_requests(values: dict, model: str) -> float:
    return value(values, "guard_requests_total", model=model, route="primary")


def read_events(log: Path) -> list[dict]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        at = line.find(" guard.events ")
        if at >= 0:
            try:
                out.append(json.loads(line[at + len(" guard.events "):]))
            except ValueError:
                pass
    return out


def proc_status(pid: int) -> dict:
    """VmRSS (MiB), threads and open descriptors of ``pid``."""
    out = {"rss_mib": round(rss_mib(pid), 1)}
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def _ms(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1e3, 2) if seconds else None


class Load:
    """Closed-loop tritonclient load on one model: ``clients`` threads, each its own
    InferenceServerClient, each sending the next row as soon as the answer came back, every
    answer checked against the model's own output. ``trigger()``: client 0's next row is the
    slow reference's trigger row."""

    def __init__(self, port: int, model: str, clients: int = 2):
        rows = np.random.default_rng(7).standard_normal((64, 4)).astype(np.float32)
        trigger = np.array([[SLEEP_TRIGGER, 0.5, -0.5, 1.0]], dtype=np.float32)
        self.rows = np.concatenate([rows, trigger])
        with __import__("torch").no_grad():
            self.expected = Affine()(__import__("torch").from_numpy(self.rows)).numpy()
        self.port, self.model, self.clients = port, model, clients
        self.records: list[tuple[float, float, bool]] = []  # (start, end, ok)
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._trigger = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(clients)]

    def start(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def trigger(self) -> None:
        self._trigger.set()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self, index: int) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.port}")
        i, normal = index * 7, len(self.rows) - 1
        while not self._stop.is_set():
            k = i % normal
            i += 1
            if index == 0 and self._trigger.is_set():
                self._trigger.clear()
                k = normal
            tensor = grpcclient.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(self.rows[k:k + 1])
            started = time.monotonic()
            error = ""
            try:
                got = client.infer(self.model, [tensor], client_timeout=30).as_numpy("y")
                if got is None or not np.allclose(got[0], self.expected[k], atol=1e-4):
                    error = "wrong answer"
            except Exception as exc:  # counted: the figure is how many
                error = f"{type(exc).__name__}: {str(exc)[:160]}"
            with self._lock:
                self.records.append((started, time.monotonic(), not error))
                if error:
                    self.errors[error] = self.errors.get(error, 0) + 1
        client.close()

    def window(self, start: float = 0.0, end: float = float("inf")) -> dict:
        """Requests that ended in [start, end): count, failures, latency p50/p99/max (ms)."""
        with self._lock:
            records = [r for r in self.records if start <= r[1] < end]
        seconds = [r[1] - r[0] for r in records if r[2]]
        return {"requests": len(records), "failed": sum(1 for r in records if not r[2]),
                "p50_ms": _ms(seconds, 50), "p99_ms": _ms(seconds, 99),
                "max_ms": round(max(seconds) * 1e3, 1) if seconds else None}

    def summary(self) -> dict:
        out = self.window()
        out["clients"] = self.clients
        out["errors"] = dict(self.errors)
        if self.records:
            out["seconds"] = round(max(r[1] for r in self.records)
                                   - min(r[0] for r in self.records), 2)
        return out


class Sampler(threading.Thread):
    """Scrapes /metrics every ``period`` seconds: [(time when the scrape returned, values)]."""

    def __init__(self, port: int, period: float = 0.1):
        super().__init__(daemon=True)
        self.port, self.period = port, period
        self.points: list[tuple[float, dict | None]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                values = scrape_all(self.port)
            except Exception:
                values = None
            self.points.append((time.monotonic(), values))
            self._halt.wait(self.period)

    def first(self, after: float, test) -> float | None:
        """Seconds from ``after`` to the first scrape after it whose values pass ``test``."""
        for t, values in list(self.points):
            if t > after and values is not None and test(values):
                return t - after
        return None

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


class FaultServer:
    """The `guard serve` subprocess the faults are done to, and what they need of it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ports = {"grpc_port": free_port(), "metrics_port": free_port(),
                      "admin_port": free_port()}
        # The models as a `module:factory` in the work folder (the fixture file, copied).
        shutil.copyfile(ROOT / "tests" / "fixture_models.py", folder / "faultmodels.py")
        self.capture = folder / "capture"
        self.capture.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CAPTURE_FS_BYTES}", "tmpfs",
                        str(self.capture)], check=True, capture_output=True)
        self.process, self.log = launch(folder, faults_config(self.ports))
        self.path = folder / "guard.yaml"
        # Per model, the serving process's drops so far (samples a dead verifier held).
        self.serving_dropped: dict[str, float] = {}
        self.clock = time.time() - time.monotonic()  # event ts (wall) -> monotonic

    @property
    def pid(self) -> int:
        return self.process.pid

    def scrape(self) -> dict:
        return scrape_all(self.ports["metrics_port"])

    def events(self, since: int = 0) -> list[dict]:
        return read_events(self.log)[since:]

    def write_config(self, text: str) -> None:
        """Replace the config file whole (rename), as a deploy tool would."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def drained(self, model: str, timeout: float = 60.0) -> dict:
        """Scrape once the model's mirror and capture queues are empty, its verifier is up and
        its counts stopped moving (two scrapes 0.3 s apart agree)."""
        deadline, previous = time.monotonic() + timeout, None
        while True:
            values = self.scrape()
            key = (primary_requests(values, model), tuple(outcomes(values, model).values()),
                   tuple(value(values, "guard_capture_records_total", model=model, outcome=o)
                         for o in RECORDS))
            if (value(values, "guard_verifier_up") == 1 and key == previous
                    and value(values, "guard_mirror_queue_depth", model=model) == 0
                    and value(values, "guard_capture_queue_depth", model=model) == 0):
                return values
            if time.monotonic() > deadline:
                return values
            previous = key
            time.sleep(0.3)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(30)
        subprocess.run(["umount", "-l", str(self.capture)], capture_output=True)
        return code


def accounting(sampled: float, counted: dict[str, float]) -> dict:
    counted = {k: int(round(v)) for k, v in counted.items()}
    total = sum(counted.values())
    return {"sampled": int(sampled), **counted, "counted": total,
            "unaccounted": int(sampled) - total}


def verifier_fault(srv: FaultServer, how: str, lead_s: float, tail_s: float,
                   model: str = "m") -> dict:
    """SIGKILL (``how`` = kill) or SIGSTOP (stop) the verifier under load on ``model``; with
    model s, the signal comes while s's reference sleeps on the trigger row and its mirror
    queue is full (samples held in the verifier).

    Accounting (the model samples every request): sampled = its requests. The verifier's
    counters die with it, so what the dead one counted is read from a scrape taken just before
    the signal; what the new one counted from a drained scrape at the end; the samples the dead
    one held (taken from the ring, not finished) are counted ``dropped`` by the serving process
    (``verifier_lost``'s ``samples_lost``)."""
    pre = srv.drained(model)
    n_events = len(srv.events())
    victim = verifier_pid(srv.pid)
    restarts = value(pre, "guard_verifier_restarts_total")
    load = Load(srv.ports["grpc_port"], model).start()
    sampler = Sampler(srv.ports["metrics_port"])
    sampler.start()
    time.sleep(lead_s)
    if model == "s":  # wait until the sleeping reference has filled s's queue
        load.trigger()
        full = time.monotonic()
        while (time.monotonic() - full < 10 and sampler.first(
                full, lambda v: value(v, "guard_mirror_queue_depth", model="s") >= 60) is None):
            time.sleep(0.05)
    requests_1s = load.window(time.monotonic() - 1.0)["requests"]
    scraped = time.monotonic()
    last = srv.scrape()
    at = time.monotonic()
    os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    def comparing(values):  # a new verifier, up, has compared a sample of the model
        return (value(values, "guard_verifier_restarts_total") > restarts
                and value(values, "guard_verifier_up") == 1
                and outcomes(values, model)["compared"] > 0)

    deadline = at + 60
    while time.monotonic() < deadline and sampler.first(at, comparing) is None:
        time.sleep(0.1)
    recovered = sampler.first(at, comparing)
    if recovered is None and how == "stop":
        os.kill(victim, signal.SIGCONT)  # the supervisor never killed it: let it go on
    time.sleep(tail_s)
    load.stop()
    sampler.stop()
    end = srv.drained(model)
    events = srv.events(n_events)
    lost = [e for e in events if e.get("event") == "verifier_lost"]
    held = sum(e.get("samples_lost", {}).get(model, 0) for e in lost)
    # The serving process's own drops (held samples, a full ring), seen while no verifier was up.
    down = [v for _, v in sampler.points if v is not None and value(v, "guard_verifier_up") == 0]
    known = srv.serving_dropped.get(model, 0.0)
    serving_dropped = outcomes(down[-1], model)["dropped"] if down else known + held
    before, at_fault, after = outcomes(pre, model), outcomes(last, model), outcomes(end, model)
    counted = {o: at_fault[o] - before[o] + after[o] - (known if o == "dropped" else 0.0)
               for o in OUTCOMES}
    srv.serving_dropped[model] = serving_dropped
    for other in ("m", "s", "c"):
        if other != model and down:
            srv.serving_dropped[other] = outcomes(down[-1], other)["dropped"]
    restarted = [e for e in events if e.get("event") == "verifier_restarted"]
    new_pid = verifier_pid(srv.pid)
    return {
        "fault": ("SIGKILL" if how == "kill" else "SIGSTOP") + f" of the verifier, load on {model}",
        "clients": load.summary(),
        "clients_before_fault": load.window(0, at),
        "clients_fault_to_recovered": load.window(at, at + (recovered or 60)),
        "samples": {**accounting(primary_requests(end, model) - primary_requests(pre, model),
                                 counted),
                    "dropped_before_fault": int(at_fault["dropped"] - before["dropped"]),
                    "queue_depth_at_fault": int(value(last, "guard_mirror_queue_depth",
                                                      model=model)),
                    "dropped_held_by_dead_verifier": int(held),
                    "dropped_ring_full": int(serving_dropped - known - held),
                    "last_scrape_ms": round((at - scraped) * 1e3, 1),
                    # Samples that can have left the dead verifier's hands between its
                    # registry read and the signal: its queue then, less what it still held,
                    # plus what arrived meanwhile (at most the requests of that scrape).
                    "left_after_last_scrape_estimate": int(
                        value(last, "guard_mirror_queue_depth", model=model) - held
                        + load.window(scraped, at)["requests"]),
                    "requests_per_s_at_fault": requests_1s},
        "verifier_restarts": int(value(end, "guard_verifier_restarts_total") - restarts),
        "verifier_lost_events": [{k: e.get(k) for k in ("how", "samples_lost", "restart_in_s")}
                                 for e in lost],
        "seconds_to_lost_event": (round(lost[0]["ts"] - srv.clock - at, 2) if lost else None),
        "seconds_to_restarted_event": (round(restarted[0]["ts"] - srv.clock - at, 2)
                                       if restarted else None),
        "seconds_to_comparing_again": round(recovered, 2) if recovered is not None else None,
        "new_verifier_pid": new_pid != victim and new_pid > 0,
    }


def slow_reference(srv: FaultServer, lead_s: float, tail_s: float) -> dict:
    """Model s's reference sleeps SLOW_S in forward() on the trigger row (one request):
    timeouts are counted, clients see nothing, the verifier is not taken for hung."""
    pre = srv.drained("s")
    restarts = value(pre, "guard_verifier_restarts_total")
    load = Load(srv.ports["grpc_port"], "s").start()
    sampler = Sampler(srv.ports["metrics_port"])
    sampler.start()
    time.sleep(lead_s)
    at_values = srv.scrape()
    at = time.monotonic()
    load.trigger()
    base = outcomes(at_values, "s")
    deadline = at + 30
    timed_out = recovered = None
    while time.monotonic() < deadline and recovered is None:
        time.sleep(0.1)
        timed_out = sampler.first(at, lambda v: outcomes(v, "s")["timeout"] > base["timeout"])
        if timed_out is None:
            continue
        # Recovered: the first scrape, after the first timeout, at which compared grew again.
        points = [(t, v) for t, v in sampler.points if t >= at + timed_out and v is not None]
        stalled = outcomes(points[0][1], "s")["compared"]
        recovered = next((t - at for t, v in points if outcomes(v, "s")["compared"] > stalled),
                         None)
    time.sleep(tail_s)
    load.stop()
    sampler.stop()
    end = srv.drained("s")
    counted = {o: outcomes(end, "s")[o] - outcomes(pre, "s")[o] for o in OUTCOMES}
    return {
        "fault": f"reference sleeps {SLOW_S:g} s in forward() on one request (mirror.timeout_s "
                 f"1, hang_timeout_s {HANG_TIMEOUT_S:g})",
        "clients": load.summary(),
        "clients_before_fault": load.window(0, at),
        "clients_fault_to_recovered": load.window(at, at + (recovered or 30)),
        "samples": accounting(primary_requests(end, "s") - primary_requests(pre, "s"), counted),
        "verifier_restarts": int(value(end, "guard_verifier_restarts_total") - restarts),
        "seconds_to_first_timeout": round(timed_out, 2) if timed_out is not None else None,
        "seconds_to_comparing_again": round(recovered, 2) if recovered is not None else None,
    }


def disk_full(srv: FaultServer, seconds: float) -> dict:
    """Model c captures every request to a 2 MiB tmpfs left with CAPTURE_FREE_BYTES free."""
    stat = os.statvfs(srv.capture)
    free = stat.f_bavail * stat.f_frsize
    filler = srv.capture / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, free - CAPTURE_FREE_BYTES))
    stat = os.statvfs(srv.capture)
    free = stat.f_bavail * stat.f_frsize
    pre = srv.drained("c")
    n_events = len(srv.events())
    load = Load(srv.ports["grpc_port"], "c").start()
    at = time.monotonic()
    sampler = Sampler(srv.ports["metrics_port"])
    sampler.start()
    off = lambda v: value(v, "guard_capture_enabled", model="c") == 0  # noqa: E731
    deadline = at + 30
    while time.monotonic() < deadline and sampler.first(at, off) is None:
        time.sleep(0.1)
    disabled = sampler.first(at, off)
    remaining = at + seconds - time.monotonic()
    if disabled is not None:
        remaining = max(remaining, 2.0)  # some serving after capture went off
    time.sleep(max(0.0, remaining))
    load.stop()
    sampler.stop()
    end = srv.drained("c")
    events = [e for e in srv.events(n_events) if e.get("event") == "capture_disabled"]
    records = {o: value(end, "guard_capture_records_total", model="c", outcome=o)
               - value(pre, "guard_capture_records_total", model="c", outcome=o)
               for o in RECORDS}
    requests = primary_requests(end, "c") - primary_requests(pre, "c")
    segments = sorted(p for p in srv.capture.rglob("*.gcap"))
    return {
        "fault": f"capture.dir on a {CAPTURE_FS_BYTES // 1024} KiB tmpfs, "
                 f"{free // 1024} KiB free at the start",
        "clients": load.summary(),
        "clients_before_disabled": load.window(0, at + (disabled or seconds)),
        "clients_after_disabled": load.window(at + (disabled or seconds)),
        "records": {"requests": int(requests), **{k: int(v) for k, v in records.items()},
                    "unaccounted": int(requests - sum(records.values()))},
        "capture_enabled_after": value(end, "guard_capture_enabled", model="c"),
        "seconds_to_capture_disabled": round(disabled, 2) if disabled is not None else None,
        "capture_disabled_events": [{k: e.get(k) for k in ("error", "errno")} for e in events],
        "segment_bytes_on_disk": sum(p.stat().st_size for p in segments),
        "mirror_outcomes": {o: int(outcomes(end, "c")[o] - outcomes(pre, "c")[o])
                            for o in OUTCOMES},
    }


def _wait_events(srv: FaultServer, since: int, names: tuple[str, ...], count: int,
                 timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in srv.events(since) if e.get("event") in names]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def reloads(srv: FaultServer, count: int) -> dict:
    """``count`` SIGHUPs in a row under load on m, each after the previous reload finished,
    the config alternating m's mirror.timeout_s between 6 and 5 s (m is rebuilt each time)."""
    texts = [yaml.safe_dump(faults_config(srv.ports, m_timeout_s=t), sort_keys=False)
             for t in (6.0, 5.0)]
    pre = srv.drained("m")
    n_events = len(srv.events())
    verifier = verifier_pid(srv.pid)
    load = Load(srv.ports["grpc_port"], "m").start()
    time.sleep(1.0)
    status_before = {"serving": proc_status(srv.pid), "verifier": proc_status(verifier)}
    first = time.monotonic()
    times, results, every10 = [], [], []
    for i in range(count):
        srv.write_config(texts[i % 2])
        since = len(srv.events())
        sent = time.time()
        srv.process.send_signal(signal.SIGHUP)
        done = _wait_events(srv, since, ("config_reloaded", "config_rejected"), 1, 120)
        if not done:
            results.append("no event within 120 s")
            break
        times.append(done[0]["ts"] - sent)
        results.append("applied" if done[0]["event"] == "config_reloaded"
                       and not done[0].get("failed") else json.dumps(done[0])[:300])
        if (i + 1) % 10 == 0:
            every10.append(round(rss_mib(srv.pid), 1))
    last = time.monotonic()
    burst = reload_burst(srv, texts, count)
    time.sleep(1.0)
    load.stop()
    end = srv.drained("m")
    time.sleep(2.0)
    status_after = {"serving": proc_status(srv.pid), "verifier": proc_status(verifier_pid(srv.pid))}
    counted = {o: outcomes(end, "m")[o] - outcomes(pre, "m")[o] for o in OUTCOMES}
    applied = (value(end, "guard_config_reloads_total", result="applied")
               - value(pre, "guard_config_reloads_total", result="applied"))
    events = [e for e in srv.events(n_events)
              if e.get("event") in ("config_reloaded", "config_rejected")]
    return {
        "sighups": count,
        "clients": load.summary(),
        "clients_before_reloads": load.window(0, first),
        "clients_during_reloads": load.window(first, last),
        "reloads_applied_counter": int(applied),
        "results": {r: results.count(r) for r in sorted(set(results))},
        "seconds_per_reload": {"mean": round(float(np.mean(times)), 3),
                               "p50": round(float(np.percentile(times, 50)), 3),
                               "max": round(float(np.max(times)), 3)} if times else None,
        "models_changed_per_reload": sorted({",".join(e.get("changed", []))
                                             for e in events[:count]
                                             if e.get("event") == "config_reloaded"}),
        "samples": accounting(primary_requests(end, "m") - primary_requests(pre, "m"), counted),
        "before": status_before, "after": status_after,
        "serving_rss_mib_every_10_reloads": every10,
        "verifier_restarts": int(value(end, "guard_verifier_restarts_total")
                                 - value(pre, "guard_verifier_restarts_total")),
        "burst": burst,
    }


def reload_burst(srv: FaultServer, texts: list[str], count: int) -> dict:
    """Then ``count`` SIGHUPs 5 ms apart, the file rewritten before each: signals coalesce
    and reloads queue behind each other, but the config in force at the end must be the file's
    last content (``config_hash`` of the last ``config_reloaded``)."""
    import hashlib

    since = len(srv.events())
    for i in range(count):
        srv.write_config(texts[i % 2])
        srv.process.send_signal(signal.SIGHUP)
        time.sleep(0.005)
    last_text = texts[(count - 1) % 2]
    seen, quiet_since = -1, time.monotonic()
    while time.monotonic() - quiet_since < 2.0:  # until no reload for 2 s
        n = len([e for e in srv.events(since) if e.get("event") == "config_reloaded"])
        if n != seen:
            seen, quiet_since = n, time.monotonic()
        time.sleep(0.1)
    done = [e for e in srv.events(since) if e.get("event") in ("config_reloaded",
                                                                "config_rejected")]
    want = hashlib.sha256(last_text.encode()).hexdigest()[:16]
    return {"sighups": count, "reload_events": len(done),
            "failed_or_rejected": sum(1 for e in done if e.get("event") != "config_reloaded"
                                      or e.get("failed")),
            "last_file_in_force": bool(done) and done[-1].get("config_hash") == want}


def invalid_config(srv: FaultServer, settle_s: float) -> dict:
    """Under load on m: a config with a schema error (and m's mirror switched off, so that its
    being applied would show), then one that is not YAML, then a valid one again."""
    bad = faults_config(srv.ports, m_rate=0.0)
    bad["server"]["verifier"]["hang_timeout_s"] = -1
    steps = [("schema error (server.verifier.hang_timeout_s: -1; m's mirror off)",
              yaml.safe_dump(bad, sort_keys=False)),
             ("not YAML", "version: 1\nmodels: [\n  {name: m,\n"),
             ("valid again (m's mirror.timeout_s 7)",
              yaml.safe_dump(faults_config(srv.ports, m_timeout_s=7.0), sort_keys=False))]
    pre = srv.drained("m")
    load = Load(srv.ports["grpc_port"], "m").start()
    time.sleep(settle_s)
    rows = []
    for label, text in steps:
        before = srv.scrape()
        srv.write_config(text)
        since = len(srv.events())
        sent = time.time()
        srv.process.send_signal(signal.SIGHUP)
        done = _wait_events(srv, since, ("config_reloaded", "config_rejected"), 1, 60)
        time.sleep(settle_s)  # serving on whatever config is now in force
        after = srv.scrape()
        requests = primary_requests(after, "m") - primary_requests(before, "m")
        mirrored = sum(outcomes(after, "m").values()) - sum(outcomes(before, "m").values())
        rows.append({
            "config": label,
            "event": done[0]["event"] if done else None,
            "problems": (done[0].get("problems") if done else None),
            "seconds": round(done[0]["ts"] - sent, 3) if done else None,
            "rejected_counter": int(value(after, "guard_config_reloads_total", result="rejected")
                                    - value(before, "guard_config_reloads_total",
                                            result="rejected")),
            "applied_counter": int(value(after, "guard_config_reloads_total", result="applied")
                                   - value(before, "guard_config_reloads_total",
                                           result="applied")),
            "m_requests": int(requests), "m_samples_settled": int(mirrored)})
    load.stop()
    end = srv.drained("m")
    counted = {o: outcomes(end, "m")[o] - outcomes(pre, "m")[o] for o in OUTCOMES}
    return {"clients": load.summary(), "steps": rows,
            "samples": accounting(primary_requests(end, "m") - primary_requests(pre, "m"),
                                  counted)}


def faults(folder: Path, load_s: float, reload_count: int, keep_log: str = "") -> dict:
    out: dict = {"loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    srv = FaultServer(folder)
    lead = tail = load_s / 2
    try:
        started = {"serving": proc_status(srv.pid), "verifier": proc_status(verifier_pid(srv.pid))}
        for name, run in (("reference_slow", lambda: slow_reference(srv, lead, tail)),
                          ("reference_killed", lambda: verifier_fault(srv, "kill", lead, tail)),
                          ("reference_hung", lambda: verifier_fault(srv, "stop", lead, tail)),
                          ("reference_killed_busy",
                           lambda: verifier_fault(srv, "kill", lead, tail, model="s")),
                          ("disk_full", lambda: disk_full(srv, load_s)),
                          ("reloads", lambda: reloads(srv, reload_count)),
                          ("invalid_config", lambda: invalid_config(srv, lead))):
            print(f"faults: {name} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            out[name] = run()
            out[name]["scenario_seconds"] = round(time.monotonic() - t0, 1)
            out[name]["server_alive"] = srv.process.poll() is None
            print(json.dumps(out[name]), file=sys.stderr, flush=True)
        out["started"] = started
    finally:
        out["exit_code_after_sigterm"] = srv.stop()
        text = srv.log.read_text(errors="replace")
        if keep_log:
            Path(keep_log).write_text(text)
        out["tracebacks_in_server_log"] = text.count("Traceback")
        out["traceback_excerpts"] = _excerpts(text)
    return out


def _excerpts(text: str) -> list[str]:
    out, at = [], text.find("Traceback")
    while at >= 0 and len(out) < 5:
        start = text.rfind("\n", 0, max(0, at - 300)) + 1
        out.append(text[start:at + 2500])
        at = text.find("Traceback", at + 1)
    return out


FAULTS_BEGIN, FAULTS_END = "<!-- faults:begin -->", "<!-- faults:end -->"


def _cell(d: dict | None, key: str, unit: str = "") -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:g}{unit}"


def _samples_cell(s: dict) -> str:
    return (f"{s['sampled']} sampled: {s['compared']} compared, {s['dropped']} dropped, "
            f"{s['timeout']} timeout, {s['error']} error")


def faults_markdown(r: dict) -> str:
    """The faults section of reliability.md, from the report."""

    k, h, sl, d = (r["reference_killed"], r["reference_hung"], r["reference_slow"],
                   r["disk_full"])
    kb = r["reference_killed_busy"]
    rl, inv = r["reloads"], r["invalid_config"]

    def fault_row(name, x, recover):
        c, w = x["clients"], x["clients_fault_to_recovered"]
        return (f"| {name} | {c['requests']} / **{c['failed']}** | "
                f"{_cell(x['clients_before_fault'], 'p99_ms')} / {_cell(w, 'p99_ms')} / "
                f"{_cell(w, 'max_ms')} | {_samples_cell(x['samples'])} | "
                f"**{x['samples']['unaccounted']}** | {recover} |")

    rec = d["records"]
    burst = rl["burst"]
    spr = rl["seconds_per_reload"] or {}
    lines = [
        "## Faults under load", "",
        f"`{r['command']}`: one `python -m guard serve` subprocess on loopback, "
        f"{r['settings']['load']} (every answer checked against the model's own output), "
        "/metrics scraped every 100 ms. Three models, all the seeded affine model of "
        "tests/fixture_models.py (copied into the work folder as a `module:factory`): "
        "`m` mirrors 100% of its requests (so every request must end as compared, dropped, "
        "timeout or error); `s` mirrors 100% to a reference that sleeps "
        f"{SLOW_S:g} s inside forward() on a trigger row (mirror.timeout_s 1); `c` mirrors 10% "
        "and captures every request (mode all). `server.verifier`: hang_timeout_s "
        f"{HANG_TIMEOUT_S:g}, restart_backoff_s 0.5. Raw figures: `reliability.json` "
        "(`faults`).", "",
        bench.machine_line(r["machine"], ("torch", "tritonclient")) + "; load average at the "
        f"start {r['loadavg_at_start']} (the machine's 2 cores are shared with other work).",
        "",
        "| fault | client requests / failed | client p99 before / p99, max during (ms) "
        "| samples (or capture records) | unaccounted | time to recover |",
        "| --- | --- | --- | --- | --- | --- |",
        fault_row("reference killed (SIGKILL of the verifier)", k,
                  f"{_cell(k, 'seconds_to_comparing_again', ' s')} until a new verifier "
                  "compares"),
        fault_row(f"reference hung (SIGSTOP of the verifier, hang_timeout_s "
                  f"{HANG_TIMEOUT_S:g})", h,
                  f"{_cell(h, 'seconds_to_comparing_again', ' s')} until a new verifier "
                  "compares"),
        fault_row("reference killed while busy (SIGKILL while s's reference sleeps on the "
                  "trigger and s's queue is full)", kb,
                  f"{_cell(kb, 'seconds_to_comparing_again', ' s')} until a new verifier "
                  "compares"),
        fault_row(f"reference hangs {SLOW_S:g} s in forward() (one request)", sl,
                  f"{_cell(sl, 'seconds_to_comparing_again', ' s')} until compared grows"),
        (f"| disk full under capture ({d['fault']}) | {d['clients']['requests']} / "
         f"**{d['clients']['failed']}** | {_cell(d['clients_before_disabled'], 'p99_ms')} / "
         f"{_cell(d['clients_after_disabled'], 'p99_ms')}, "
         f"{_cell(d['clients_after_disabled'], 'max_ms')} (after capture went off) | "
         f"{rec['requests']} records: {rec['written']} written, {rec['disabled']} disabled, "
         f"{rec['dropped']} dropped, {rec['error']} error | **{rec['unaccounted']}** | "
         f"capture off after {_cell(d, 'seconds_to_capture_disabled', ' s')}; stays off "
         "until restart (by design) |"),
        (f"| {rl['sighups']} reloads in a row (SIGHUP, m's mirror.timeout_s 6 <-> 5) | "
         f"{rl['clients']['requests']} / **{rl['clients']['failed']}** | "
         f"{_cell(rl['clients_before_reloads'], 'p99_ms')} / "
         f"{_cell(rl['clients_during_reloads'], 'p99_ms')}, "
         f"{_cell(rl['clients_during_reloads'], 'max_ms')} (the {rl['sighups']} in a row) | "
         f"{_samples_cell(rl['samples'])} | **{rl['samples']['unaccounted']}** | "
         f"{_cell(spr, 'mean', ' s')} per reload (p50 {_cell(spr, 'p50', ' s')}, max "
         f"{_cell(spr, 'max', ' s')}) |"),
        (f"| invalid config mid-load (schema error, then not YAML, then valid) | "
         f"{inv['clients']['requests']} / **{inv['clients']['failed']}** | - / "
         f"{_cell(inv['clients'], 'p99_ms')}, {_cell(inv['clients'], 'max_ms')} | "
         f"{_samples_cell(inv['samples'])} | **{inv['samples']['unaccounted']}** | "
         "nothing to recover: the old config stays |"),
        "",
        "Figures beside the table:", "",
    ]
    for name, x in (("Killed", k), ("Hung", h), ("Killed while busy", kb)):
        lost = x["verifier_lost_events"]
        lines.append(
            f"- {name}: `verifier_lost` after {_cell(x, 'seconds_to_lost_event', ' s')} "
            f"(how: {lost[0]['how'] if lost else 'none'!s}; restart_in_s "
            f"{lost[0]['restart_in_s'] if lost else '-'}), `verifier_restarted` after "
            f"{_cell(x, 'seconds_to_restarted_event', ' s')}, "
            f"guard_verifier_restarts_total +{x['verifier_restarts']}; samples counted "
            f"dropped as held by the dead verifier: "
            f"**{x['samples']['dropped_held_by_dead_verifier']}**; refused by a full ring: "
            f"{x['samples']['dropped_ring_full']}; mirror queue depth at the signal "
            f"{x['samples']['queue_depth_at_fault']}; dropped before the fault (a full mirror "
            f"queue): {x['samples']['dropped_before_fault']}; the last scrape before the "
            f"signal took {x['samples']['last_scrape_ms']:g} ms at "
            f"{x['samples']['requests_per_s_at_fault']} requests/s; samples that can have "
            f"left its hands after that scrape (queue depth then - held + requests during "
            f"the scrape): about {x['samples']['left_after_last_scrape_estimate']}.")
    lines += [
        "- Unaccounted, for the verifier faults: sampled - counted. A dead verifier's counters "
        "die with it, so what it counted is read from the last scrape before the signal; "
        "samples it counted (compared, or dropped by its full queue) after its registry was "
        "read for that scrape and before the signal are in nobody's /metrics (a counter "
        "reset, as the README says): about as many as the estimate above (approximate: "
        "samples still in the ring at the scrape are not in it). The samples it held are all "
        "counted (`samples_lost`), and the ring refused none.",
        f"- Slow reference: first `timeout` {_cell(sl, 'seconds_to_first_timeout', ' s')} "
        f"after the trigger; guard_verifier_restarts_total +{sl['verifier_restarts']} (a "
        "forward pass that hangs is not a hung verifier: its heartbeat goes on).",
        f"- Disk full: guard_capture_enabled{{model=\"c\"}} {d['capture_enabled_after']:g} "
        f"afterwards; `capture_disabled` events: {len(d['capture_disabled_events'])} "
        f"({'; '.join(str(e['error']) for e in d['capture_disabled_events']) or 'none'}); "
        f"{d['segment_bytes_on_disk']} bytes of segments on the tmpfs; mirror of c meanwhile: "
        f"{d['mirror_outcomes']['compared']} compared, {d['mirror_outcomes']['error']} "
        "errors.",
        f"- Reloads: guard_config_reloads_total{{result=\"applied\"}} "
        f"+{rl['reloads_applied_counter']} for {rl['sighups']} + {burst['sighups']} SIGHUPs "
        f"(results of the {rl['sighups']} in a row: {rl['results']}; models rebuilt per "
        f"reload: {rl['models_changed_per_reload']}). Serving process RSS / threads / fds "
        f"before {rl['before']['serving']['rss_mib']:g} MiB / "
        f"{rl['before']['serving'].get('threads')} / {rl['before']['serving'].get('fds')}, "
        f"after {rl['after']['serving']['rss_mib']:g} MiB / "
        f"{rl['after']['serving'].get('threads')} / {rl['after']['serving'].get('fds')} "
        f"(every 10 reloads: {rl['serving_rss_mib_every_10_reloads']} MiB); verifier "
        f"{rl['before']['verifier']['rss_mib']:g} -> {rl['after']['verifier']['rss_mib']:g} "
        f"MiB, threads {rl['before']['verifier'].get('threads')} -> "
        f"{rl['after']['verifier'].get('threads')}. Then {burst['sighups']} SIGHUPs 5 ms "
        f"apart, the file rewritten before each: {burst['reload_events']} reloads ran, "
        f"{burst['failed_or_rejected']} failed or rejected, the file's "
        f"last content in force at the end: {'yes' if burst['last_file_in_force'] else 'NO'}.",
        "- Invalid config: " + "; ".join(
            f"{s['config']}: `{s['event']}` in {_cell(s, 'seconds', ' s')}, rejected "
            f"+{s['rejected_counter']}, applied +{s['applied_counter']}, then m "
            f"{s['m_requests']} requests / {s['m_samples_settled']} samples settled"
            + (f" (problems: {s['problems']})" if s["problems"] else "")
            for s in inv["steps"]) + ". More samples settled while each invalid file was "
        "there than m's mirror queue holds (256): m's mirror stayed on, the old config in "
        "force.",
        f"- Server: tracebacks in its log {r['tracebacks_in_server_log']}, exit code after "
        f"SIGTERM {r['exit_code_after_sigterm']}.",
    ]
    return "\n".join(lines)


def write_faults_markdown(path: Path, report: dict) -> None:
    """Replace the faults section (between the markers) of ``path``, or append it."""
    section = f"{FAULTS_BEGIN}\n{faults_markdown(report)}\n{FAULTS_END}"
    text = path.read_text() if path.exists() else ""
    if FAULTS_BEGIN in text and FAULTS_END in text:
        head, rest = text.split(FAULTS_BEGIN, 1)
        text = head + section + rest.split(FAULTS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="fuzz,memory,faults",
                        help="comma-separated: fuzz, memory, faults (the parts not run keep "
                        "their figures from the existing results)")
    parser.add_argument("--cases", type=int, default=10000)
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--load-s", type=float, default=4.0,
                        help="faults: seconds of load around each fault")
    parser.add_argument("--reloads", type=int, default=50, help="faults: SIGHUPs in a row")
    parser.add_argument("--keep-log", default="", help="faults: copy the server's log here")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reliability"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    out = Path(args.out + ".json")
    result = json.loads(out.read_text()) if out.exists() else {}
    ok = True
    if parts & {"fuzz", "memory"}:
        with tempfile.TemporaryDirectory(prefix="guard-reliability-") as tmp:
            process, ports, log = start_guard(Path(tmp))
            try:
                if "fuzz" in parts:
                    fuzzed = fuzz(ports, args.cases, args.seed)
                    fuzzed["server_alive"] = process.poll() is None
                    result["fuzz"] = fuzzed
                    ok = fuzzed["unknown_or_internal"] == 0 and fuzzed["correct_afterwards"]
                if "memory" in parts:
                    flooded = flood(ports, process.pid, args.flood_s, args.clients)
                    flooded["server_alive"] = process.poll() is None
                    result["memory"] = flooded
            finally:
                process.send_signal(signal.SIGTERM)
                exit_code = process.wait(120)
            text = log.read_text(errors="replace")
        result.update({"machine": {"cpu": platform.processor() or platform.machine(),
                                   "cores": os.cpu_count(),
                                   "python": platform.python_version()},
                       "tracebacks_in_server_log": text.count("Traceback"),
                       "traceback_excerpts": _excerpts(text),
                       "exit_code_after_sigterm": exit_code})
        ok = ok and result["tracebacks_in_server_log"] == 0
    if "faults" in parts:

        with tempfile.TemporaryDirectory(prefix="guard-faults-") as tmp:
            faulted = faults(Path(tmp), args.load_s, args.reloads, args.keep_log)
        faulted["machine"] = bench.machine_info()
        faulted["command"] = " ".join(["python", "benchmarks/reliability.py", *sys.argv[1:]])
        faulted["settings"] = {"load_s": args.load_s, "reloads": args.reloads,
                               "load": "2 closed-loop tritonclient.grpc clients, FP32 [1, 4]"}
        result["faults"] = faulted
        write_faults_markdown(Path(args.out + ".md"), faulted)
        ok = ok and faulted["tracebacks_in_server_log"] == 0
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
