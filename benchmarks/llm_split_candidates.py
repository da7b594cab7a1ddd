"""Text-only answers a server split otherwise than the reference tokenizes them: how many a
healthy pair fails as the split rule's candidates (where the text parts from the reference's
tokenization) widen: the reference's best five, its best 20, and its best 20 with the
vocabulary's tokens that begin the text there (guard's rule now: guard/verify/generation/
checks.py ``_kept_candidate``, ``ReferenceScores.text_pieces``); and what each costs the
detection of a drifting primary.

Why: a completion known by its text alone (llama-server without ``options.sample_logprobs``
answers text, no ids) is scored on the reference's canonical tokenization of the text. Where
the server sampled another split ("one" "three" for the canonical "on" "eth" "reen") the
canonical token may lie outside the server's sampling transform, and every token after it is
scored in a context the server never had: a false drift. The rule scores such a completion up
to the parting position with a kept candidate that may have stood there. Which candidates it
may see is the question here (a kept set holds up to top_k 40 tokens: more than the best 20).

1. Healthy pair: llama-server (the Makefile's build) on the shipped Q4_1, ``guard serve`` in
   front of it (engine llama.cpp, every call sampled and captured, the llama_cpp reference on
   the same file), ``--calls`` text-only calls at the server's sampling defaults on the
   fuzzer's hardest prompts (a token-id prompt after which the model runs number words
   together, ``[0, 0]``, "onethree", a prompt ending in "Ã"). Each captured call is scored
   again here by the same reference and checked each way.
2. Detection: each rung of SmolLM2's ladder as the primary in llama.cpp (in-process),
   ``--completions`` text-only completions of 64 tokens at llama.cpp's defaults, against the
   transformers fp32 reference, checked each way: passes, and the completions' z pooled.

    .venv/bin/python benchmarks/llm_split_candidates.py [--calls 200] [--completions 40]

Writes llm_split_candidates.{json,md} under --out (default benchmarks/results). Accuracy
figures: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench  # noqa: E402
import reliability_llm as reliability  # noqa: E402  (its llama-server and guard serve starters)

import httpx2 as httpx  # noqa: E402  (the HTTP client the openai package itself uses)

PROMPTS = ([1, 27867, 27867, 270, 27867], [0, 0], "onethree", "Ã")
RUNGS = ("F16", "Q8_0", "Q2_K")
BEST_FIVE = 5


# The rule's candidate sets, narrowest first: each a view of the scores the rule then sees.
WAYS = {
    "best_five": lambda scores: replace(scores, text_pieces=(), top_texts=tuple(
        row[:BEST_FIVE] for row in scores.top_texts)),
    "best_20": lambda scores: replace(scores, text_pieces=()),
    "best_20_and_pieces": lambda scores: scores,
}
LABELS = {"best_five": "best five", "best_20": "best 20",
          "best_20_and_pieces": "best 20 and the text's pieces"}


def each_way(sample, scores, defaults) -> dict:
    """The check of ``sample`` as the rule sees ``scores`` each way (WAYS)."""
    from guard.verify.generation import check_generation

    return {name: check_generation(sample, view(scores), defaults)
            for name, view in WAYS.items()}


def healthy_pair(folder: Path, calls: int) -> dict:
    """Part 1: captured calls to a healthy llama-server, checked each way."""
    from guard.backends import create_backend
    from guard.capture.reader import FileStats, expand_paths, read_records
    from guard.capture.records import generation_calls
    from guard.config.backend import BackendConfig
    from guard.verify.generation import SERVER_DEFAULTS
    from guard.zoo.llm import SHIPPED, quant_ladder

    gguf = quant_ladder((SHIPPED,))[SHIPPED]
    binary = Path(sys.prefix) / "bin" / "llama-server"
    server, url = reliability.start_llama_server(binary, gguf, folder, 64)
    blocks = reliability.model_blocks("llama.cpp", url, gguf)
    guard, ports, _ = reliability.start_guard(folder, blocks)
    try:
        with httpx.Client(timeout=120) as client:
            for i in range(calls):
                answer = client.post(f"http://127.0.0.1:{ports['http_port']}/v1/completions",
                                     json={"model": reliability.SERVED, "prompt": PROMPTS[i % 4],
                                           "max_tokens": 24, "seed": i})
                answer.raise_for_status()
        live = reliability.sample_counts(reliability.settled(ports["metrics_port"]))
    finally:
        guard.terminate()
        guard.wait(30)
        server.terminate()
        server.wait(10)
    reference = create_backend(BackendConfig(**blocks["reference"]), "reference", 1)
    reference.load()
    defaults = SERVER_DEFAULTS["llama.cpp"]
    failed: dict[str, list[str]] = {name: [] for name in WAYS}
    checked = 0
    for path in expand_paths([folder / "capture"]):
        for record in read_records(path, FileStats()):
            call, _ = generation_calls(record)
            scores = reference.score(call)
            if not scores.scored:
                continue
            checked += 1
            for name, check in each_way(call, scores, defaults).items():
                if not check.passed:
                    failed[name].append(call.completion_text[:40])
    reference.close()
    return {"calls": calls, "live": live, "checked": checked,
            "failed": {name: len(texts) for name, texts in failed.items()},
            "failed_texts": failed}


def detection(completions: int, tokens: int = 64) -> dict:
    """Part 2: text-only sampled completions of each rung, checked each way."""
    from guard.backends import create_backend
    from guard.backends.llama_cpp import open_llama
    from guard.config.backend import BackendConfig
    from guard.protocol.generation import SamplingParams
    from guard.verify.generation import SERVER_DEFAULTS, pooled_z
    from guard.zoo import llm as smol

    ladder = smol.quant_ladder(RUNGS)
    reference = create_backend(BackendConfig(backend="transformers",
                                             path=str(smol.smollm2_gguf())), "reference", 1)
    reference.load()
    defaults = SERVER_DEFAULTS["llama.cpp"]
    out = {}
    for rung in RUNGS:
        primary = open_llama(ladder[rung], context_length=512)
        checks: dict[str, list] = {name: [] for name in WAYS}
        for i in range(completions):
            sample = replace(smol.complete(primary, smol.PROMPTS[i % len(smol.PROMPTS)], tokens,
                                          SamplingParams(), seed=1000 + i), tokens=())
            scores = reference.score(sample)
            if scores.scored:
                for name, check in each_way(sample, scores, defaults).items():
                    checks[name].append(check)
        primary.close()
        out[rung] = {name: {"completions": len(found),
                            "passed": sum(c.passed for c in found),
                            "tokens_scored": sum(c.tokens for c in found),
                            "pooled_z": pooled_z([c.statistic for c in found])}
                     for name, found in checks.items()}
        bench.log(f"{rung}: {out[rung]}")
    reference.close()
    return out


def markdown(report: dict) -> str:
    pair, ladder = report["healthy_pair"], report["detection"]
    rule = list(WAYS)[-1]  # guard's own
    lines = ["# Text-only answers split otherwise: the split rule's candidates",
             "", f"`benchmarks/llm_split_candidates.py --calls {pair['calls']} --completions "
             f"{report['completions']}`. {bench.machine_line(report['machine'], ('torch',))}",
             "", "## A healthy llama-server, text-only calls on the fuzzer's hardest prompts", "",
             f"{pair['checked']} captured calls scored again by the llama_cpp reference on the "
             f"server's own file (live, through guard serve: {pair['live']['checks']}).", "",
             bench.md_table(["candidates", "failed (false drifts)"],
                            [[LABELS[name], str(n)] for name, n in pair["failed"].items()]),
             "", f"Completions still failing with the {LABELS[rule]}: "
             + ", ".join(f"`{t!r}`" for t in pair["failed_texts"][rule]), "",
             "## Detection: SmolLM2's ladder, text-only sampled completions of 64 tokens", "",
             bench.md_table(["primary", "candidates", "passed", "tokens scored", "pooled z"],
                            [[rung, LABELS[name],
                              f"{v['passed']}/{v['completions']}", str(v["tokens_scored"]),
                              f"{v['pooled_z']:.1f}"]
                             for rung, ways in ladder.items() for name, v in ways.items()]),
             ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls to the healthy server")
    parser.add_argument("--completions", type=int, default=40, help="completions per rung")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="guard-split-") as work:
        pair = healthy_pair(Path(work), args.calls)
    bench.log(f"healthy pair: {pair['failed']}")
    report = {"machine": bench.machine_info(), "completions": args.completions,
              "healthy_pair": pair, "detection": detection(args.completions)}
    md = markdown(report)
    bench.write_results(args.out, "llm_split_candidates", report, md, md)


if __name__ == "__main__":
    main()
