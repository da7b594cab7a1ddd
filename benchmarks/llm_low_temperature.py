"""Low temperatures against the generation tier: the sampled z, and the near-greedy check.

At temperature T the server samples from softmax(logits / T): kernel noise of a few hundredths
of a nat between the primary's logits and the reference's (a Q8_0 primary, an F16 reference)
is amplified by 1 / T, and the sampled check (z of the reference's surprise at each token)
reads it as drift on a healthy pair. Below `near_greedy_temperature` (0.1) guard checks such a
call as greedy decoding instead (argmax agreement where the reference's margin exceeds
`margin_floor`): at T <= 0.1 the server leaves a confident argmax with a chance of at most
e^(-margin_floor / T) = 5e-5.

The primaries are llama-cpp-python in-process on SmolLM2's F16, Q8_0 and Q2_K (token by token,
llama.cpp's sampler: top_k 40, top_p 0.95, min_p 0.05, temperature last), the reference guard's
`llama_cpp` scorer on the F16; each completion is checked twice: in the sampled mode (as guard
checked every T > 0 before, `near_greedy_temperature: 0`) and as guard checks it now.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_low_temperature.py [--completions 16]
       [--temperatures 0.05,0.1,0.2,0.8] [--tokens 24] [--out DIR]
Writes benchmarks/results/llm_low_temperature.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("F16", "Q8_0", "Q2_K")


def run(completions: int, temperatures: list[float], tokens: int) -> dict:
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, GenerationThresholds, check_generation
    from guard.zoo import llm as smol

    ladder = smol.quant_ladder(RUNGS)
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(ladder["F16"]),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    now = GenerationThresholds()
    before = replace(now, near_greedy_temperature=0.0)
    engine = SERVER_DEFAULTS["llama.cpp"]
    found: dict = {}
    try:
        for rung in RUNGS:
            primary = open_llama(ladder[rung], context_length=512)
            try:
                for temperature in temperatures:
                    rows = []
                    for seed in range(completions):
                        sample = smol.complete(primary, smol.PROMPTS[seed % len(smol.PROMPTS)],
                                               tokens, SamplingParams(temperature=temperature),
                                               seed=seed, token_ids=True)
                        scores = reference.score(sample)
                        old, new = (check_generation(sample, scores, engine, limits)
                                    for limits in (before, now))
                        rows.append({"seed": seed, "before_mode": old.mode,
                                     "before_statistic": old.statistic,
                                     "before_passed": old.passed, "now_mode": new.mode,
                                     "now_statistic": new.statistic, "now_passed": new.passed})
                    found[f"{rung} T={temperature:g}"] = rows
                    bench.log(f"{rung} T={temperature:g}: "
                              f"{sum(not r['before_passed'] for r in rows)} failed before, "
                              f"{sum(not r['now_passed'] for r in rows)} now")
            finally:
                primary.close()
    finally:
        reference.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--temperatures", default="0.05,0.1,0.2,0.8")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    found = run(args.completions, temperatures, args.tokens)
    report = {"settings": vars(args) | {"out": str(args.out)}, "machine": bench.machine_info(),
              "cells": found}
    head = ["primary, temperature", "before: mode", "before: failed", "before: max |z|",
            "now: mode", "now: failed"]
    rows = []
    for cell, calls in found.items():
        zs = [abs(c["before_statistic"]) for c in calls if c["before_statistic"] is not None]
        rows.append([cell, calls[0]["before_mode"],
                     f"{sum(not c['before_passed'] for c in calls)} of {len(calls)}",
                     f"{max(zs):.2f}" if zs else "-", calls[0]["now_mode"],
                     f"{sum(not c['now_passed'] for c in calls)} of {len(calls)}"])
    context = [
        f"SmolLM2-135M-Instruct: primaries in llama.cpp (in-process, one thread, llama.cpp's "
        f"default sampler at the temperature shown), the reference guard's `llama_cpp` scorer "
        f"on the F16; {args.completions} completions of {args.tokens} tokens per cell, "
        "scored on the sampled token ids. Before: every T > 0 in the sampled mode "
        "(|z| <= max_abs_z 4); now: T <= near_greedy_temperature (0.1) in the greedy mode "
        "(share of confident argmax flips <= 0.05).",
        bench.machine_line(report["machine"], ("numpy",)),
    ]
    bench.write_one_table(
        args.out, "llm_low_temperature", report, "Low temperatures against the generation tier",
        context, head, rows,
        ["F16 and Q8_0 must pass (the issue's agreeing rungs), Q2_K must fail.",
         f"Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_low_temperature.py "
         f"--completions {args.completions} --temperatures {args.temperatures}`"])


if __name__ == "__main__":
    main()
