"""How llama-server applies penalties, measured on the server itself: z of its healthy
completions scored with guard's llama.cpp model (the prompt's tokens in the one penalty window
that the repeat, presence and frequency penalties share) beside the alternatives (the prompt
left out of the window, as llama-cpp-python's sampler does; presence and frequency over the
completion only, as vLLM does; either name of the repetition penalty read, as guard did
before), and a request's ``repetition_penalty`` (vLLM's name, which llama-server does not
read).

llama-server (built from the llama.cpp that llama-cpp-python vendors; pass its path) on
SmolLM2's F16 GGUF with its built-in defaults (read from /props); each prompt is one of
guard.zoo.llm's said twice (so that its words are in the window), asked for ``--tokens``
tokens with a seed; the reference is the ``llama_cpp`` scorer on the same file. Three
request kinds: sampled with ``repeat_penalty`` 1.3, ``presence_penalty`` 1.0,
``frequency_penalty`` 0.5; the same greedy (temperature 0); sampled with
``repetition_penalty`` 1.5 alone.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_llama_server_penalties.py [LLAMA_SERVER]
       [--completions 12] [--tokens 48]
Writes benchmarks/results/llm_llama_server_penalties.{json,md} (machine noted).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
from llm_llama_server_props import completion_sample, start_llama_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REQUESTS = {
    "sampled, repeat 1.3, presence 1.0, frequency 0.5": dict(
        repeat_penalty=1.3, presence_penalty=1.0, frequency_penalty=0.5),
    "greedy, the same penalties": dict(temperature=0, repeat_penalty=1.3,
                                       presence_penalty=1.0, frequency_penalty=0.5),
    "sampled, repetition_penalty 1.5 (vLLM's name)": dict(repetition_penalty=1.5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("llama_server", nargs="?", default=str(bench.LLAMA_SERVER),
                        help="llama.cpp's llama-server binary (default: the one `make test` "
                        "builds, %(default)s)")
    parser.add_argument("--completions", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from guard.backends import create_backend
    from guard.config.backend import BackendConfig
    from guard.verify.generation import check_generation, declared_defaults
    from guard.zoo import llm as smol

    f16 = smol.quant_ladder(("F16",))["F16"]
    server, base, params = start_llama_server(args.llama_server, f16)
    reference = create_backend(BackendConfig(backend="llama_cpp", path=str(f16),
                                             options={"context_length": 512}), "reference", 1)
    reference.load()
    ours = declared_defaults({"engine": "llama.cpp"}, reported=params)
    ways = {"guard's llama.cpp model": ours,
            "the prompt left out": replace(ours, penalize_prompt=False),
            "presence/frequency over the completion": replace(ours,
                                                              penalties_share_window=False),
            "either name read (before)": replace(ours, penalty_fields=("repetition_penalty",
                                                                       "repeat_penalty"))}
    found: dict[str, dict[str, list]] = {kind: {way: [] for way in ways} for kind in REQUESTS}
    try:
        for kind, fields in REQUESTS.items():
            for seed in range(args.completions):
                prompt = smol.PROMPTS[seed % len(smol.PROMPTS)]
                sample = completion_sample(base, {
                    "model": "smol", "prompt": f"{prompt} {prompt}", "max_tokens": args.tokens,
                    "seed": 400 + seed, "return_tokens": True, **fields})
                scores = reference.score(sample)
                for way, defaults in ways.items():
                    check = check_generation(sample, scores, defaults)
                    found[kind][way].append([check.mode, check.passed, check.statistic])
            bench.log(f"{kind}: {args.completions} completions")
    finally:
        server.terminate()
        server.wait(30)
        reference.close()
    rows = []
    for kind, by_way in found.items():
        for way, checks in by_way.items():
            z = np.array([statistic for _, _, statistic in checks], dtype=float)
            rows.append([kind, way, checks[0][0], f"{sum(p for _, p, _ in checks)} of {len(z)}",
                         f"{z.mean():+.2f}", f"{z.sum() / math.sqrt(z.size):+.2f}"])
    head = ["requests", "scored with", "mode", "passed", "mean statistic",
            "pooled (sum / sqrt n)"]
    report = {"completions": args.completions, "tokens": args.tokens, "checks": found,
              "machine": bench.machine_info()}
    md = "\n".join([
        "# llama-server's penalties: guard's model of them against the alternatives", "",
        f"`benchmarks/llm_llama_server_penalties.py`: llama-server on SmolLM2 F16 (its built-in "
        f"defaults), {args.completions} healthy completions of {args.tokens} tokens per kind "
        "of request, each prompt said twice. The statistic: z for sampled calls (about N(0, 1) "
        "under agreement), the share of confident positions off the penalized argmax for "
        "greedy ones (0 under agreement).", "", bench.md_table(head, rows), "",
        bench.machine_line(report["machine"], ("llama-cpp-python",)), ""])
    bench.write_results(args.out, "llm_llama_server_penalties", report, md,
                        bench.plain_table(head, rows))


if __name__ == "__main__":
    main()
