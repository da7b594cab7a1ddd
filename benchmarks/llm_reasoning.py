"""Reasoning answers against the generation tier: never compared before, scored whole now.

A server with a reasoning parser (vLLM's ``--reasoning-parser``) answers a chat with the
reasoning apart from the answer; guard counted every such answer not comparable
(``reasoning``), so a reasoning model's traffic went unchecked. Now the whole output (the
reasoning, the parser's tags, the answer) is scored from the tokens the server reports
(logprobs, or token ids alone). This measures, on SmolLM2 asked to think first in the
``<think>`` form (a system prompt and two answers of that form, then a question):

- how many answers come out in that form (a parser would split them);
- on those, how many each rung fails now, with the primary's top-5 logprobs (the per-token
  comparison, as ``sample_logprobs`` gives) and with its token ids alone (the greedy or the
  sampled check, as ``sample_token_ids`` gives), greedy and sampled at temperature 0.8;
- for Q2_K's greedy answers: how many give the same final answer as F16 (drift a check of
  the answer alone would not see: the reasoning differs).

The primaries are llama-cpp-python in-process on SmolLM2's F16, Q8_0 and Q2_K (llama.cpp's
default sampler at 0.8), the reference guard's ``transformers`` scorer (fp32, the issue's
reference). Each answer is split as vLLM's olmo3 parser splits it (the text between the tags,
the text after) and checked as the edge builds it (``reasoning_text`` set, every token).

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_reasoning.py [--tokens 48] [--out DIR]
Writes benchmarks/results/llm_reasoning.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("F16", "Q8_0", "Q2_K")
FEW_SHOT = (("system", "Think first inside <think></think>, then answer."),
            ("user", "What is 1+1?"), ("assistant", "<think>One plus one makes two.</think>2"),
            ("user", "What is the capital of Italy?"),
            ("assistant", "<think>Italy's capital city is Rome.</think>Rome"))
QUESTIONS = ("What is the capital of France?", "What is 3+4?", "What colour is the sky?",
             "How many legs does a spider have?", "What is the largest planet?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
             "What is the capital of Japan?", "How many days are in a week?",
             "What gas do plants breathe in?", "What is 10 times 10?",
             "Which ocean is the largest?")
SPLIT = re.compile(r"^(?:<think>)?(?P<reasoning>.*?)</think>(?P<answer>.*)$", re.DOTALL)


def chat_prompt(question: str) -> str:
    """The few-shot chat in SmolLM2's ChatML, with the generation prompt."""
    turns = (*FEW_SHOT, ("user", question))
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) \
        + "<|im_start|>assistant\n"


def run(tokens: int) -> dict:
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation
    from guard.zoo import llm as smol

    ladder = smol.quant_ladder(RUNGS)
    reference = create_backend(BackendConfig(backend="transformers",
                                             path=str(smol.smollm2_gguf())), "reference", 1)
    reference.load()
    engine = SERVER_DEFAULTS["llama.cpp"]
    found: dict = {}
    try:
        for rung in RUNGS:
            primary = open_llama(ladder[rung], context_length=512)
            try:
                for decoding, temperature in (("greedy", 0.0), ("T 0.8", 0.8)):
                    rows = []
                    for seed, question in enumerate(QUESTIONS):
                        sample = smol.complete(primary, chat_prompt(question), tokens,
                                               SamplingParams(temperature=temperature),
                                               logprobs=5, seed=seed, token_ids=True)
                        split = SPLIT.match(sample.completion_text)
                        row = {"question": question, "output": sample.completion_text,
                               "reasoned": split is not None}
                        if split is not None:
                            reasoned = replace(sample, completion_text=split["answer"],
                                               reasoning_text=split["reasoning"])
                            ids_only = replace(reasoned, tokens=tuple(
                                replace(t, text="", logprob=None, top=())
                                for t in reasoned.tokens))
                            for name, shown in (("logprobs", reasoned), ("ids", ids_only)):
                                check = check_generation(shown, reference.score(shown), engine)
                                row[f"{name}_mode"] = check.mode
                                row[f"{name}_passed"] = check.passed
                                row[f"{name}_statistic"] = check.statistic
                            row["answer"] = split["answer"].strip()
                        rows.append(row)
                    found[f"{rung}, {decoding}"] = rows
                    reasoned_rows = [r for r in rows if r["reasoned"]]
                    bench.log(f"{rung} {decoding}: {len(reasoned_rows)} of {len(rows)} reasoned; "
                              f"failed {sum(not r['logprobs_passed'] for r in reasoned_rows)} "
                              f"(logprobs), {sum(not r['ids_passed'] for r in reasoned_rows)} "
                              "(ids alone)")
            finally:
                primary.close()
    finally:
        reference.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    found = run(args.tokens)
    report = {"settings": vars(args) | {"out": str(args.out)}, "machine": bench.machine_info(),
              "cells": found}
    head = ["primary, decoding", "answers in the reasoning form", "before: compared",
            "now: failed, top-5 logprobs", "now: failed, token ids alone (mode)"]
    rows = []
    for cell, calls in found.items():
        reasoned = [c for c in calls if c["reasoned"]]
        modes = sorted({c["ids_mode"] for c in reasoned})
        rows.append([cell, f"{len(reasoned)} of {len(calls)}", "0 (not comparable)",
                     f"{sum(not c['logprobs_passed'] for c in reasoned)} of {len(reasoned)}",
                     f"{sum(not c['ids_passed'] for c in reasoned)} of {len(reasoned)} "
                     f"({', '.join(modes)})"])
    f16 = {c["question"]: c.get("answer") for c in found["F16, greedy"]}
    same = [c for c in found["Q2_K, greedy"]
            if c["reasoned"] and c.get("answer") == f16.get(c["question"])]
    hidden = sum(not c["logprobs_passed"] for c in same)
    context = [
        "SmolLM2-135M-Instruct asked to think first in the `<think>` form (a system prompt and "
        f"two answers of that form, then one of {len(QUESTIONS)} questions), {args.tokens} "
        "tokens at most: primaries in llama.cpp (in-process, one thread; llama.cpp's default "
        "sampler at 0.8), the reference guard's `transformers` scorer on the GGUF in fp32. "
        "Answers split as vLLM's olmo3 parser splits them and checked whole (the sample's "
        "`reasoning_text` set, every token). Before this change each was not comparable "
        "`reasoning`.",
        bench.machine_line(report["machine"], ("numpy", "torch")),
    ]
    bench.write_one_table(
        args.out, "llm_reasoning", report, "Reasoning answers against the generation tier",
        context, head, rows,
        [f"Q2_K greedy: {len(same)} reasoned answers end in the same final answer as F16's; "
         f"{hidden} of them fail: the drift is in the reasoning (an eval of the final "
         "answers would see none).",
         "F16 and Q8_0 must pass (the issue's agreeing rungs), Q2_K must fail.",
         "Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_reasoning.py "
         f"--tokens {args.tokens}`"])


if __name__ == "__main__":
    main()
