"""What a sampled completion's check costs where the server truncates by top_p alone (vLLM's
and OpenAI's style: no top_k), with top_p's nucleus found from a partial sort (guard's
``_nucleus``) beside a stable sort of the whole vocabulary at every position (what it did
before), in one run on the same completions.

The primary is llama-cpp-python in-process on SmolLM2's Q8_0 sampling at temperature 0.8 and
top_p 0.9 (top_k and min_p off), the reference guard's ``llama_cpp`` scorer on the F16; each
completion is scored once and checked by both ways (the sampled mode: the transform's support
at every position). CPU seconds of this process (one thread), mean per completion.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_nucleus.py [--completions 10]
       [--tokens 128] [--out DIR]
Writes benchmarks/results/llm_nucleus.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def whole_sort_nucleus(values, top_p: float):
    """The obvious way: a stable argsort of every candidate, then the prefix."""
    import numpy as np

    from guard.verify.generation.transform import _softmax

    order = np.argsort(-values, kind="stable")
    cumulative = np.cumsum(_softmax(values[order]))
    return order[:int(np.searchsorted(cumulative, top_p, side="left")) + 1]


def cpu(function, *args, **kwargs):
    """``function(*args, **kwargs)`` and the CPU seconds it took this process."""
    started = time.process_time()
    result = function(*args, **kwargs)
    return result, time.process_time() - started


def run(completions: int, tokens: int) -> list[dict]:
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation, transform
    from guard.zoo import llm as smol

    ladder = smol.quant_ladder(("F16", "Q8_0"))
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(ladder["F16"]),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    primary = open_llama(ladder["Q8_0"], context_length=512)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=0, min_p=0.0)
    engine = SERVER_DEFAULTS["llama.cpp"]
    partial = transform._nucleus
    rows = []
    try:
        for seed in range(completions):
            sample, generating = cpu(smol.complete, primary,
                                     smol.PROMPTS[seed % len(smol.PROMPTS)], tokens, sampling,
                                     seed=seed, token_ids=True)
            scores, scoring = cpu(reference.score, sample)
            now, now_s = cpu(check_generation, sample, scores, engine)
            transform._nucleus = whole_sort_nucleus
            try:
                before, before_s = cpu(check_generation, sample, scores, engine)
            finally:
                transform._nucleus = partial
            assert now.mode == before.mode == "sampled"
            assert now.statistic == before.statistic, (now.statistic, before.statistic)
            rows.append({"seed": seed, "tokens": now.tokens, "generate_s": generating,
                         "score_s": scoring,
                         "check_partial_s": now_s, "check_whole_sort_s": before_s,
                         "z": now.statistic})
            bench.log(f"completion {seed + 1}/{completions}: {now.tokens} tokens, score "
                      f"{scoring:.3f} s, check {now_s:.3f} s (whole sort {before_s:.3f} s)")
    finally:
        primary.close()
        reference.close()
    return rows


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = run(args.completions, args.tokens)
    report = {"settings": vars(args) | {"out": str(args.out)}, "machine": bench.machine_info(),
              "completions": rows}

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    generate = mean("generate_s")
    score, partial, whole = mean("score_s"), mean("check_partial_s"), mean("check_whole_sort_s")
    head = ["per completion (mean)", "CPU s", "x the reference's pass", "x generating"]
    table = [["the primary generating (Q8_0, llama.cpp)", f"{generate:.3f}", "",  "1"],
             ["the reference's teacher-forced pass (llama_cpp F16)", f"{score:.3f}", "1",
              f"{score / generate:.2f}"],
             ["check, nucleus from a partial sort (guard now)", f"{partial:.3f}",
              f"{partial / score:.2f}", f"{partial / generate:.3f}"],
             ["check, a stable sort of the whole vocabulary (before)", f"{whole:.3f}",
              f"{whole / score:.2f}", f"{whole / generate:.3f}"]]
    context = [
        f"SmolLM2-135M-Instruct: a Q8_0 primary in llama.cpp (in-process) sampling "
        f"{args.completions} completions of up to {args.tokens} tokens at temperature 0.8, "
        "top_p 0.9, top_k and min_p off (the truncation vLLM's and OpenAI's clients use); the "
        "reference guard's `llama_cpp` scorer on the F16. Each completion scored once and "
        "checked both ways in the sampled mode (the same z to the last bit, asserted). "
        f"Median check: {statistics.median(r['check_partial_s'] for r in rows):.3f} s now, "
        f"{statistics.median(r['check_whole_sort_s'] for r in rows):.3f} s before "
        f"({whole / partial:.1f}x the CPU, means).",
        bench.machine_line(report["machine"], ("numpy",)),
    ]
    bench.write_one_table(
        args.out, "llm_nucleus", report, "A sampled check's cost where only top_p truncates",
        context, head, table,
        [f"Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_nucleus.py "
         f"--completions {args.completions} --tokens {args.tokens}`"])


if __name__ == "__main__":
    main()
