"""Answers a server's parser splits (reasoning, tool calls) against the generation tier: never
compared before, scored whole now.

A server with a reasoning parser (vLLM's ``--reasoning-parser``) answers a chat with the
reasoning apart from the answer, and one with a tool parser (``--tool-call-parser``) with the
call taken out of the text; guard counted every such answer not comparable (``reasoning``,
``tools``), so the traffic of reasoning models and agents went unchecked. Now the whole output
(the reasoning, the parser's tags, the call, the answer) is scored from the tokens the server
reports. This measures, on SmolLM2 asked (a system prompt and two answers of that form, then
one of 12 questions) to think first in the ``<think>`` form (``--form reasoning``) or to call
``get_weather`` in Hermes' ``<tool_call>`` form (``--form tools``):

- how many answers come out in that form (a parser would split them);
- on those, how many each rung fails now, with the primary's top-5 logprobs (the per-token
  comparison, as ``sample_logprobs`` gives) and with its token ids alone (the greedy or the
  sampled check, as ``sample_token_ids`` gives), greedy and sampled at temperature 0.8;
- for Q2_K's greedy answers: how many end as F16's do (the same final answer, the same call):
  drift an eval of the final answers would not see.

The primaries are llama-cpp-python in-process on SmolLM2's F16, Q8_0 and Q2_K (llama.cpp's
default sampler at 0.8), the reference guard's ``transformers`` scorer (fp32, the issue's
reference). Each answer is split as vLLM's parsers split it (olmo3's: the text between the
tags, the text after; hermes': the text before the call, the call's JSON) and checked as the
edge builds it (``reasoning_text``; ``tools``, ``tool_calls`` and the server's prompt ids).

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_parsed.py [--form reasoning|tools]
       [--tokens 48] [--out DIR]
Writes benchmarks/results/llm_reasoning.{json,md} or llm_tool_calls.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("F16", "Q8_0", "Q2_K")
QUESTIONS = ("What is the capital of France?", "What is 3+4?", "What colour is the sky?",
             "How many legs does a spider have?", "What is the largest planet?",
             "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
             "What is the capital of Japan?", "How many days are in a week?",
             "What gas do plants breathe in?", "What is 10 times 10?",
             "Which ocean is the largest?")
CITIES = ("Paris", "Tokyo", "Madrid", "Cairo", "Lima", "Berlin", "Sydney", "Toronto", "Nairobi",
          "Dublin", "Seoul", "Vienna")
THINK = re.compile(r"^(?:<think>)?(?P<reasoning>.*?)</think>(?P<answer>.*)$", re.DOTALL)
TOOL_CALL = re.compile(r"<tool_call>\s*(?P<call>\{.*?\})\s*</tool_call>", re.DOTALL)


def _tool_call(city: str) -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>' % city


FORMS = {
    "reasoning": {
        "few_shot": (("system", "Think first inside <think></think>, then answer."),
                     ("user", "What is 1+1?"),
                     ("assistant", "<think>One plus one makes two.</think>2"),
                     ("user", "What is the capital of Italy?"),
                     ("assistant", "<think>Italy's capital city is Rome.</think>Rome")),
        "questions": QUESTIONS, "results": "llm_reasoning",
        "title": "Reasoning answers against the generation tier",
        "before": "reasoning"},
    "tools": {
        "few_shot": (("system", "You call the tool get_weather(city) in <tool_call> tags."),
                     ("user", "Weather in Rome?"), ("assistant", _tool_call("Rome")),
                     ("user", "Weather in Oslo?"), ("assistant", _tool_call("Oslo"))),
        "questions": tuple(f"Weather in {city}?" for city in CITIES),
        "results": "llm_tool_calls", "title": "Tool calls against the generation tier",
        "before": "tools"},
}


def chat_prompt(form: dict, question: str) -> str:
    """The few-shot chat in SmolLM2's ChatML, with the generation prompt."""
    turns = (*form["few_shot"], ("user", question))
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) \
        + "<|im_start|>assistant\n"


def parsed(form: str, sample, prompt_ids: tuple[int, ...]):
    """``sample`` as the server's parser answers it, and its final answer; None where the
    output is not in the form (the parser would leave it as text)."""
    if form == "reasoning":
        found = THINK.match(sample.completion_text)
        if found is None:
            return None
        return (replace(sample, completion_text=found["answer"],
                        reasoning_text=found["reasoning"]), found["answer"].strip())
    found = TOOL_CALL.search(sample.completion_text)
    try:
        call = json.loads(found["call"]) if found else None
    except ValueError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return (replace(sample, endpoint="chat", prompt=None, messages=(
        {"role": "user", "content": "(the chat)"},), prompt_token_ids=prompt_ids,
        completion_text=sample.completion_text[:found.start()], tools=True,
        tool_calls=(call["name"],)), json.dumps(call, sort_keys=True))


def run(form_name: str, tokens: int) -> dict:
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation
    from guard.zoo import llm as smol

    form = FORMS[form_name]
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
                    for seed, question in enumerate(form["questions"]):
                        prompt = chat_prompt(form, question)
                        sample = smol.complete(primary, prompt, tokens,
                                               SamplingParams(temperature=temperature),
                                               logprobs=5, seed=seed, token_ids=True)
                        split = parsed(form_name, sample,
                                       tuple(reference.encode_prompt(prompt)))
                        row = {"question": question, "output": sample.completion_text,
                               "parsed": split is not None}
                        if split is not None:
                            whole, row["answer"] = split
                            ids_only = replace(whole, tokens=tuple(
                                replace(t, text="", logprob=None, top=()) for t in whole.tokens))
                            for name, shown in (("logprobs", whole), ("ids", ids_only)):
                                check = check_generation(shown, reference.score(shown), engine)
                                row[f"{name}_mode"] = check.mode
                                row[f"{name}_passed"] = check.passed
                                row[f"{name}_statistic"] = check.statistic
                        rows.append(row)
                    found[f"{rung}, {decoding}"] = rows
                    split_rows = [r for r in rows if r["parsed"]]
                    bench.log(f"{rung} {decoding}: {len(split_rows)} of {len(rows)} in the form; "
                              f"failed {sum(not r['logprobs_passed'] for r in split_rows)} "
                              f"(logprobs), {sum(not r['ids_passed'] for r in split_rows)} "
                              "(ids alone)")
            finally:
                primary.close()
    finally:
        reference.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--form", choices=sorted(FORMS), default="reasoning")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    form = FORMS[args.form]
    found = run(args.form, args.tokens)
    report = {"settings": vars(args) | {"out": str(args.out)}, "machine": bench.machine_info(),
              "cells": found}
    head = ["primary, decoding", "answers in the form", "before: compared",
            "now: failed, top-5 logprobs", "now: failed, token ids alone (mode)"]
    rows = []
    for cell, calls in found.items():
        split = [c for c in calls if c["parsed"]]
        modes = sorted({c["ids_mode"] for c in split})
        rows.append([cell, f"{len(split)} of {len(calls)}",
                     f"0 (not comparable `{form['before']}`)",
                     f"{sum(not c['logprobs_passed'] for c in split)} of {len(split)}",
                     f"{sum(not c['ids_passed'] for c in split)} of {len(split)} "
                     f"({', '.join(modes)})"])
    f16 = {c["question"]: c.get("answer") for c in found["F16, greedy"]}
    same = [c for c in found["Q2_K, greedy"]
            if c["parsed"] and c.get("answer") == f16.get(c["question"])]
    hidden = sum(not c["logprobs_passed"] for c in same)
    shape = ("to think first in the `<think>` form" if args.form == "reasoning" else
             "to call `get_weather` in Hermes' `<tool_call>` form")
    context = [
        f"SmolLM2-135M-Instruct asked {shape} (a system prompt and two answers of that form, "
        f"then one of {len(form['questions'])} questions), {args.tokens} tokens at most: "
        "primaries in llama.cpp (in-process, one thread; llama.cpp's default sampler at 0.8), "
        "the reference guard's `transformers` scorer on the GGUF in fp32. Answers split as "
        "vLLM's parser splits them and checked whole, as the edge builds the sample. Before "
        f"this change each was not comparable `{form['before']}`.",
        bench.machine_line(report["machine"], ("numpy", "torch")),
    ]
    bench.write_one_table(
        args.out, form["results"], report, form["title"], context, head, rows,
        [f"Q2_K greedy: {len(same)} answers in the form end as F16's do; {hidden} of them "
         "fail: the drift is in what the parser took apart (an eval of the final answers "
         "would see none).",
         "F16 and Q8_0 must pass (the issue's agreeing rungs), Q2_K must fail.",
         "Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_parsed.py "
         f"--form {args.form} --tokens {args.tokens}`"])


if __name__ == "__main__":
    main()
