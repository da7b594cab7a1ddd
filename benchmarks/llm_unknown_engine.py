"""What an undeclared engine costs a healthy server's sampled calls: z of completions that a
llama.cpp primary samples under its own defaults (top_k 40, top_p 0.95, min_p 0.05), the
request saying only the temperature, scored three ways: as the ``unknown`` engine once did
(no truncation assumed), as it does now (the truncations not known: not comparable), and with
the engine declared (``llama-cpp-python``: its defaults and sampler order).

The primary is SmolLM2's F16 GGUF in llama-cpp-python (in-process, its own sampler), the
reference the ``llama_cpp`` scorer on the same file, on the sampled token ids. Each request
says ``repeat_penalty`` 1.0, as llama-cpp-python's Llama API applies unless told (its server's
default is 1.1), so that the declared preset and the primary agree on it.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_unknown_engine.py [--completions 12]
       [--tokens 64] [--temperature 0.8]
Writes benchmarks/results/llm_unknown_engine.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, GenerationThresholds, check_generation
    from guard.verify.generation.defaults import ServerDefaults
    from guard.zoo import llm as smol

    f16 = smol.quant_ladder(("F16",))["F16"]
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(f16),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    primary = open_llama(f16, context_length=512)
    ways = {"unknown engine, no truncation assumed (before)": ServerDefaults(),
            "unknown engine, truncations not known (now)": SERVER_DEFAULTS["unknown"],
            "engine: llama-cpp-python": SERVER_DEFAULTS["llama-cpp-python"]}
    sampling = SamplingParams(temperature=args.temperature, repeat_penalty=1.0)
    found: dict[str, list] = {name: [] for name in ways}
    try:
        for seed in range(args.completions):
            sample = smol.complete(primary, smol.PROMPTS[seed % len(smol.PROMPTS)], args.tokens,
                                   sampling, seed=200 + seed, token_ids=True)
            scores = reference.score(sample)
            for name, defaults in ways.items():
                check = check_generation(sample, scores, defaults)
                found[name].append(None if check.statistic is None else
                                   float(check.statistic))
            bench.log(f"completion {seed + 1}/{args.completions}")
    finally:
        reference.close()
    limit = GenerationThresholds().max_abs_z
    rows = []
    for name, values in found.items():
        scored = np.array([v for v in values if v is not None])
        if scored.size:
            rows.append([name, f"{scored.size} of {len(values)}", f"{scored.mean():+.2f}",
                         f"{scored.min():+.2f} to {scored.max():+.2f}",
                         f"{scored.sum() / math.sqrt(scored.size):+.2f}",
                         str(int(np.sum(np.abs(scored) > limit)))])
        else:
            rows.append([name, f"0 of {len(values)} (not comparable)", "-", "-", "-", "-"])
    head = ["scored as", "compared", "mean z", "range", "pooled z (sum / sqrt n)",
            f"beyond ±max_abs_z ({limit:g})"]
    report = {"completions": args.completions, "tokens": args.tokens,
              "temperature": args.temperature, "z": found, "machine": bench.machine_info()}
    md = "\n".join([
        "# A healthy llama.cpp primary's sampled calls under an undeclared engine", "",
        f"`benchmarks/llm_unknown_engine.py`: {args.completions} completions of {args.tokens} "
        f"tokens, the request saying temperature {args.temperature:g} (and repeat_penalty 1.0); "
        "llama-cpp-python samples with its own top_k 40, top_p 0.95, min_p 0.05. Under "
        "agreement z is about N(0, 1); the detector accumulates it over completions.", "",
        bench.md_table(head, rows), "",
        bench.machine_line(report["machine"], ("llama-cpp-python",)), ""])
    bench.write_results(args.out, "llm_unknown_engine", report, md,
                        bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
