"""The sampled mode's null: z when the primary samples from the reference's own weights.

The generation tier scores a sampled completion (no logprobs from the server) by z: the
reference's surprise at each sampled token minus its expectation under the sampling transform
the server applied, normalised. When the primary samples from the reference's own distribution,
z has mean 0 and unit spread by construction, and `max_abs_z` (4) is set against that. This
benchmark measures it per rung of SmolLM2's ladder, the same GGUF on both sides in llama.cpp:
the primary generates (llama-cpp-python in-process, token by token, llama.cpp's default
sampler: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8), the `llama_cpp` reference scores
the prompt and completion in one teacher-forced pass, twice: on the completion's text alone (the
reference's own tokenization of it), and on the sampled token ids (as a server that returns
them, llama.cpp's `tokens` or vLLM's `return_token_ids`, lets guard). Where the two passes
compute the same distribution over the same tokens, z's mean is ~0 and its sd ~1.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_z_null.py [--completions 60]
       [--rungs F16,Q8_0,Q4_1] [--tokens 24]
Writes benchmarks/results/llm_z_null.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def z_scores(rung: str, path: Path, completions: int, tokens: int) -> dict[str, list]:
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation
    from guard.zoo import llm as smol

    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(path),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    primary = open_llama(path, context_length=512)
    zs: dict[str, list] = {"text": [], "ids": []}
    try:
        for seed in range(completions):
            with_ids = smol.complete(primary, smol.PROMPTS[seed % len(smol.PROMPTS)], tokens,
                                     SamplingParams(), seed=seed, token_ids=True)
            for way, sample in (("text", replace(with_ids, tokens=())), ("ids", with_ids)):
                check = check_generation(sample, reference.score(sample),
                                         SERVER_DEFAULTS["llama.cpp"])
                # (seed, z): None where the completion was not scored (a mismatch, say)
                zs[way].append((seed, check.statistic if check.mode == "sampled" else None))
            bench.log(f"{rung}: {seed + 1}/{completions}")
    finally:
        primary.close()
        reference.close()
    return zs


def main() -> None:
    from guard.verify.generation import GenerationThresholds
    from guard.zoo import llm as smol

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rungs", default="F16,Q8_0,Q4_1")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rungs = args.rungs.split(",")
    ladder = smol.quant_ladder(tuple(r for r in rungs if r != "Q4_1"))
    ladder["Q4_1"] = smol.smollm2_gguf()  # the shipped file itself
    limit = GenerationThresholds().max_abs_z
    rows, report = [], {"settings": vars(args) | {"out": str(args.out)},
                        "machine": bench.machine_info(), "rungs": {}}
    for rung in rungs:
        report["rungs"][rung] = {}
        for way, pairs in z_scores(rung, ladder[rung], args.completions, args.tokens).items():
            z = np.array([value for _, value in pairs if value is not None])
            figures = {"scored": int(z.size), "not_scored": len(pairs) - int(z.size),
                       "mean": float(z.mean()), "sd": float(z.std(ddof=1)),
                       "se_mean": float(z.std(ddof=1) / np.sqrt(z.size)),
                       "beyond_max_abs_z": [s for s, v in pairs
                                            if v is not None and abs(v) > limit],
                       "z": pairs}
            report["rungs"][rung][way] = figures
            rows.append([rung, way, f"{figures['scored']} ({figures['not_scored']})",
                         f"{figures['mean']:+.3f}", f"{figures['se_mean']:.3f}",
                         f"{figures['sd']:.3f}",
                         f"{len(figures['beyond_max_abs_z'])} (seeds "
                         f"{', '.join(map(str, figures['beyond_max_abs_z'])) or '-'})"])
    head = ["rung (both sides)", "scored on", "completions (not scored)", "mean z",
            "se of the mean", "sd of z", f"z beyond ±max_abs_z ({limit:g})"]
    machine = bench.machine_line(report["machine"], ("torch",))
    md = "\n".join([
        "# z's null: the primary samples from the reference's own weights", "",
        f"`benchmarks/llm_z_null.py`, {args.completions} completions of {args.tokens} tokens "
        "per rung, llama.cpp's default sampler, the llama_cpp reference on the same GGUF.", "",
        bench.md_table(head, rows), "", machine, ""])
    bench.write_results(args.out, "llm_z_null", report, md, bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
