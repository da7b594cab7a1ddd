"""What asking llama-server for a sampled call's prompt costs, beside the call it is asked for
(guard/backends/llama_server_prompts.py, ``options.tokenize_prompts``).

For each of a few chats (a short one, one with a 300-token system prompt) and a completions
prompt, one after another on one llama-server (SmolLM2-135M-Instruct F16, one thread, ``-c 1024``):
the call itself (32 sampled tokens, not streamed), then guard's asks for its prompt
(``/apply-template`` for a chat, then ``/tokenize``) as the verifier makes them. Measured: the
asks' wall time (median, p90) and llama-server's CPU for them, from /proc, beside its CPU for
the call. That CPU is what 100% sampling would add to the model server's own work: the asks run
in the verifier, off the request path, so the client's latency does not carry them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_server_prompts.py [--calls 40]

Writes benchmarks/results/llm_server_prompts.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402

OUT = HERE / "results"
SYSTEM = " ".join(["You are a careful assistant who answers in plain English."] * 30)
CALLS = {
    "chat, one short message": {"messages": [{"role": "user",
                                              "content": "What is the capital of France?"}]},
    "chat, 300-token system prompt": {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name three rivers in Europe."}]},
    "completion": {"prompt": "The three most common trees in northern Europe are"},
}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def server_cpu(pid: int) -> float:
    return bench.proc_ticks(pid) / os.sysconf("SC_CLK_TCK")


def measure(url: str, pid: int, calls: int) -> dict:
    from guard.backends.llama_server_prompts import LlamaServerPrompts
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import GenerationSample

    ask = LlamaServerPrompts(BackendConfig(backend="openai", target=url, model="smol",
                                           options={"engine": "llama.cpp"}), timeout_s=30)
    out = {}
    for name, fields in CALLS.items():
        chat = "messages" in fields
        path = "/v1/chat/completions" if chat else "/v1/completions"
        call_cpu, ask_cpu, ask_wall, prompt_tokens = [], [], [], 0
        for i in range(calls):
            before = server_cpu(pid)
            answer = post(url + path, {**fields, "max_tokens": 32, "seed": i,
                                       "cache_prompt": False})
            middle = server_cpu(pid)
            prompt_tokens = answer["usage"]["prompt_tokens"]
            sample = GenerationSample(
                model="smol", endpoint="chat" if chat else "completions", completion_text="",
                tokens=(), **({"messages": tuple(fields["messages"])} if chat
                              else {"prompt": fields["prompt"]}))
            started = time.perf_counter()
            asked = ask(sample)
            ask_wall.append(time.perf_counter() - started)
            ask_cpu.append(server_cpu(pid) - middle)
            call_cpu.append(middle - before)
            assert asked.prompt_token_ids is not None and \
                len(asked.prompt_token_ids) == prompt_tokens, "the asks were not answered"
        out[name] = {
            "prompt_tokens": prompt_tokens,
            "call_server_cpu_ms": round(1e3 * statistics.mean(call_cpu), 2),
            "asks_server_cpu_ms": round(1e3 * statistics.mean(ask_cpu), 3),
            "asks_wall_ms_p50": round(1e3 * statistics.median(ask_wall), 2),
            "asks_wall_ms_p90": round(1e3 * sorted(ask_wall)[int(0.9 * len(ask_wall))], 2),
            "share_of_call_cpu": round(statistics.mean(ask_cpu) / statistics.mean(call_cpu), 4)}
        bench.log(f"{name}: {out[name]}")
    return out


def markdown(report: dict) -> str:
    lines = ["# Asking llama-server for a sampled call's prompt", "",
             f"`{report['command']}`", "",
             bench.machine_line(report["machine"], ()) + ".", "",
             f"llama-server (`make test`'s build) on SmolLM2-135M-Instruct F16, `-t 1 -c 1024`; "
             f"{report['calls']} calls of each kind one after another, each a 32-token sampled "
             "answer (`cache_prompt: false`: the whole prompt evaluated, as a new prompt is), "
             "then guard's asks for its prompt (`/apply-template` for a chat, then "
             "`/tokenize`: guard/backends/llama_server_prompts.py). llama-server's CPU from "
             "/proc (10 ms ticks: a mean over the calls); the asks' wall time is the verifier's "
             "wait, off the request path.", "",
             "| call | prompt tokens | server CPU for the call, ms | server CPU for the asks, "
             "ms | asks / call | asks' wall time p50 / p90, ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {r['prompt_tokens']} | {r['call_server_cpu_ms']} | "
                     f"{r['asks_server_cpu_ms']} | {100 * r['share_of_call_cpu']:.2f}% | "
                     f"{r['asks_wall_ms_p50']} / {r['asks_wall_ms_p90']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--llama-server", default=str(bench.LLAMA_SERVER))
    args = parser.parse_args(argv)
    from guard.zoo.llm import quant_ladder

    gguf = quant_ladder(("F16",))["F16"]
    port = bench.free_port()
    with tempfile.TemporaryDirectory(prefix="guard-prompts-") as tmp:
        server = subprocess.Popen(
            [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "-c", "1024", "-t", "1", "--seed", "1"],
            stdout=open(Path(tmp) / "llama-server.log", "wb"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"{url}/health", timeout=2).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("llama-server not up") from None
                    time.sleep(0.25)
            results = measure(url, server.pid, args.calls)
        finally:
            server.terminate()
            server.wait(30)
    report = {"command": "benchmarks/llm_server_prompts.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": bench.machine_info(),
        "calls": args.calls, "results": results}
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "llm_server_prompts.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (OUT / "llm_server_prompts.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
