"""z of healthy completions longer than half the repetition penalty's window, with the window
taken right and as guard took it before (a slice that kept too little).

llama-cpp-python's server applies ``repeat_penalty`` 1.1 unless told, over the last 64
sampled tokens. guard rebuilt that window with ``history[len(history) - 64:]``: for a history
of 33 to 63 tokens the start is negative, and the slice kept only the last ``64 - len``
tokens, so from the 33rd token of a completion on, the reference was penalized less than the
server was, and a healthy server's z drifted up. Here the primary is SmolLM2's F16 GGUF in
llama-cpp-python (in-process, its own sampler and penalties), the reference the ``llama_cpp``
scorer on the same file, scored on the sampled token ids with the llama-cpp-python preset,
twice per completion: with guard's window (``guard.verify.generation.transform._window``) and
with the old slice put back in its place.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_penalty_window.py [--completions 12]
       [--tokens 64] [--penalties 1.1,1.3]
Writes benchmarks/results/llm_penalty_window.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _old_window(tokens: list[int], last_n: int) -> list[int]:
    """The slice guard used before (kept here to measure what it did)."""
    return tokens[len(tokens) - last_n:] if last_n else []


def z_scores(penalty: float, completions: int, tokens: int) -> dict[str, list[float]]:
    import guard.verify.generation.transform as transform
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, check_generation
    from guard.zoo import llm as smol

    f16 = smol.quant_ladder(("F16",))["F16"]
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(f16),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    primary = open_llama(f16, context_length=512)
    defaults = SERVER_DEFAULTS["llama-cpp-python"]
    window = transform._window
    zs: dict[str, list[float]] = {"guard's window": [], "the old slice": []}
    try:
        for seed in range(completions):
            sample = smol.complete(primary, smol.PROMPTS[seed % len(smol.PROMPTS)], tokens,
                                   SamplingParams(repeat_penalty=penalty), seed=100 + seed,
                                   token_ids=True)
            scores = reference.score(sample)
            for name, slicing in (("guard's window", window), ("the old slice", _old_window)):
                transform._window = slicing
                zs[name].append(float(check_generation(sample, scores, defaults).statistic))
            transform._window = window
            bench.log(f"repeat_penalty {penalty}: completion {seed + 1}/{completions}")
    finally:
        transform._window = window
        reference.close()
    return zs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--penalties", default="1.1,1.3")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from guard.verify.generation import GenerationThresholds

    limit = GenerationThresholds().max_abs_z
    report: dict = {"completions": args.completions, "tokens": args.tokens,
                    "machine": bench.machine_info(), "penalties": {}}
    rows = []
    for penalty in (float(p) for p in args.penalties.split(",")):
        zs = z_scores(penalty, args.completions, args.tokens)
        report["penalties"][str(penalty)] = zs
        for name, values in zs.items():
            z = np.array(values)
            rows.append([f"{penalty:g}", name, f"{z.mean():+.2f}", f"{z.std(ddof=1):.2f}",
                         f"{np.abs(z).max():.2f}", f"{int(np.sum(np.abs(z) > limit))} of {z.size}"])
    head = ["repeat_penalty", "window", "mean z", "sd of z", "largest |z|",
            f"beyond ±max_abs_z ({limit:g})"]
    machine = bench.machine_line(report["machine"], ("llama-cpp-python",))
    md = "\n".join([
        "# The repetition penalty's window on completions longer than half of it", "",
        f"`benchmarks/llm_penalty_window.py`: {args.completions} healthy completions of "
        f"{args.tokens} tokens per penalty (SmolLM2 F16 in llama-cpp-python, scored by the "
        "llama_cpp reference on the same file, on the sampled ids, with the llama-cpp-python "
        "preset: the last 64 sampled tokens). Under agreement z is about N(0, 1).", "",
        bench.md_table(head, rows), "", machine, ""])
    bench.write_results(args.out, "llm_penalty_window", report, md,
                        bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
