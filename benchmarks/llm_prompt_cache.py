"""What a shared prompt costs the llama_cpp reference, with and without its prompt cache.

Deployed LLMs mostly answer behind a shared preamble (a system prompt, a chat template, a
few-shot block), and their servers cache its keys and values: llama.cpp's server
(``cache_prompt``, on by default), vLLM (automatic prefix caching) and llama-cpp-python in
process (``Llama.generate`` keeps the longest common prefix). A reference that evaluates every
sampled call's whole prompt again pays for the preamble on every call that the primary paid for
once. This benchmark measures it side by side in one run:

- the primary: the shipped Q4_1 SmolLM2 in llama.cpp (llama-cpp-python, in-process, one
  thread, as its server generates: prompt cached, no logprobs), generating ``--tokens`` tokens
  (EOS banned) after a ``--preamble-repeat``-fold preamble and one of ten questions;
- the references, each scoring every completion once with ``cache_prompt: false`` (every
  score evaluates its whole sequence) and once with ``cache_prompt: true`` (guard's default),
  each its own instance, the calls interleaved: the F16 GGUF of the same model
  (``backend: llama_cpp``) and the fp32 reference (``backend: transformers`` on the shipped
  GGUF, dequantized); then the tier's check (logprobs mode: top-5 logprobs, as guard asks on
  sampled calls, taken from the primary teacher-forced on its completion, untimed).

Figures: CPU seconds of this process from /proc/self/stat (user + system) per call, means over
the calls after the first (the first call fills every cache), and the ratio of scoring to
generating: issue 29's target is <= 0.25x. Each reference's two instances must agree (asserted:
same best token everywhere, log-probabilities within 1e-3).

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_prompt_cache.py [--calls 10]
Writes benchmarks/results/llm_prompt_cache.json and .md (machine and load average noted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_ladder import LLAMA, cpu_seconds, machine, scorer  # noqa: E402

from guard.backends.llama_cpp import open_llama  # noqa: E402
from guard.matrix.columns import sample_from_distributions  # noqa: E402
from guard.protocol.generation import SamplingParams  # noqa: E402
from guard.verify.generation import check_generation  # noqa: E402
from guard.zoo.llm import PROMPTS, SHIPPED, quant_ladder, sample_from_response, \
    smollm2_gguf  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = {"llama_cpp": "llama_cpp F16 reference",
         "transformers": "transformers fp32 reference (Q4_1 dequantized)"}
PREAMBLE = ("You are a helpful assistant for a travel company. Answer in plain English, in "
            "short sentences, and never invent facts. ")
QUESTIONS = [
    "Question: what is the capital of France?", "Question: name a river in Germany.",
    "Question: how many days are in a leap year?", "Question: what language is spoken in Brazil?",
    "Question: which ocean lies west of Portugal?", "Question: what is the tallest mountain?",
    "Question: where is the Colosseum?", "Question: what currency does Japan use?",
    "Question: which city is called the Big Apple?", "Question: what is the largest desert?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--preamble-repeat", type=int, default=4,
                        help="the preamble: the zoo's prompts joined, this many times")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_start = [round(v, 2) for v in os.getloadavg()]
    ladder = quant_ladder(("F16", SHIPPED))
    preamble = PREAMBLE + " ".join(PROMPTS) * args.preamble_repeat + " "
    primary = open_llama(ladder[SHIPPED], context_length=1024, threads=1, logits_all=False)
    teacher = scorer("llama_cpp", ladder[SHIPPED], 1, context_length=1024)
    kinds = {"llama_cpp": ("llama_cpp", ladder["F16"], {"context_length": 1024}),
             "transformers": ("transformers", smollm2_gguf(), {})}
    references = {(kind, cache): scorer(backend, path, 1, cache_prompt=cache, **options)
                  for kind, (backend, path, options) in kinds.items() for cache in (False, True)}
    cpu: dict[str, list[float]] = {"generate": [], "check": []}
    for kind in kinds:
        cpu[f"{kind}_whole"], cpu[f"{kind}_cached"] = [], []
    lengths = []
    for call in range(args.calls):
        prompt = preamble + QUESTIONS[call % len(QUESTIONS)] + " Answer:"
        start = cpu_seconds()
        response = primary.create_completion(prompt, max_tokens=args.tokens, seed=call,
                                             temperature=0.8,
                                             logit_bias={primary.token_eos(): -1e9})
        cpu["generate"].append(cpu_seconds() - start)
        sampled = sample_from_response(prompt, response, SamplingParams())
        prompt_ids = teacher.encode_prompt(prompt)
        ids = teacher.vocab.encode(sampled.completion_text)
        lengths.append((len(prompt_ids), len(ids)))
        sample = replace(sample_from_distributions(
            prompt, ids, teacher.forward(prompt_ids + ids, len(prompt_ids)), teacher.vocab, 5,
            teacher.decode), sampling=SamplingParams(logprobs=5))
        for kind in kinds:
            scores = {}
            for cache in (False, True):
                start = cpu_seconds()
                scores[cache] = references[kind, cache].score(sample)
                cpu[f"{kind}_{'cached' if cache else 'whole'}"].append(cpu_seconds() - start)
            whole, cached = scores[False].logprobs, scores[True].logprobs
            assert whole is not None and cached is not None
            assert (whole.argmax(axis=1) == cached.argmax(axis=1)).all(), kind
            assert float(np.abs(whole - cached).max()) <= 1e-3, kind
        start = cpu_seconds()
        assert check_generation(sample, scores[True], LLAMA).mode == "logprobs"
        cpu["check"].append(cpu_seconds() - start)
        print(f"call {call}: prompt {len(prompt_ids)} + completion {len(ids)} tokens; "
              + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items()), file=sys.stderr)
    steady = {k: float(np.mean(v[1:] if len(v) > 1 else v)) for k, v in cpu.items()}
    record = {
        "machine": {**machine(), "loadavg_start": load_start,
                    "loadavg_end": [round(v, 2) for v in os.getloadavg()],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "calls": args.calls, "tokens": args.tokens, "lengths": lengths,
        "cpu_per_call": cpu, "steady_mean": steady,
        "ratios": {key: (steady[key] + steady["check"]) / steady["generate"]
                   for key in steady if key not in ("generate", "check")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_prompt_cache.json").write_text(json.dumps(record, indent=2) + "\n")
    text = "\n".join(markdown(record)) + "\n"
    (args.out / "llm_prompt_cache.md").write_text(text)
    print(text)


def markdown(record: dict) -> list[str]:
    m, s = record["machine"], record["steady_mean"]
    prompt = int(np.mean([p for p, _ in record["lengths"]]))
    completion = int(np.mean([c for _, c in record["lengths"]]))
    return [
        "# A shared prompt and the llama_cpp reference's prompt cache",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']}; "
        f"load average {m['loadavg_start']} at the start, {m['loadavg_end']} at the end; "
        f"{m['date']}.",
        "",
        f"{record['calls']} calls, each a shared preamble and one question (prompt {prompt} "
        f"tokens on average) and a {completion}-token sampled completion of the Q4_1 primary "
        "(llama.cpp, one thread, its prompt cached as its server caches it), scored by each "
        "reference (one thread) without and with `cache_prompt`, interleaved. "
        "CPU seconds per call from /proc/self/stat, mean of the calls after the first.",
        "",
        "| | CPU s per call | x generating |",
        "| --- | --- | --- |",
        f"| generate (Q4_1 primary) | {s['generate']:.3f} | 1 |",
        *[f"| score with the {NAMES[key.rsplit('_', 1)[0]]}, `cache_prompt: "
          f"{'true` (guard' + chr(39) + 's default)' if key.endswith('cached') else 'false`'} "
          f"| {s[key]:.3f} | {record['ratios'][key]:.3f} |" for key in record["ratios"]],
        f"| the tier's check (logprobs mode), included in the ratios | {s['check']:.3f} | |",
        "",
        "Each reference's two instances agree on every call (same best token at every "
        "position, "
        "log-probabilities within 1e-3: asserted). Target (issue 29): scoring <= 0.25x "
        "generating.",
        "",
        "Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_prompt_cache.py "
        f"--calls {record['calls']} --tokens {record['tokens']}`.",
    ]


if __name__ == "__main__":
    main()
