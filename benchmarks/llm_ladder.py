"""The generation tier on a real quant ladder, and what scoring a completion costs.

SmolLM2-135M-Instruct (guard/zoo/llm.py): the shipped Q4_1 GGUF and its requantizations F16,
Q8_0, Q4_K_M, Q3_K_M, Q2_K, each the primary in llama.cpp (llama-cpp-python in-process, the
engine its server runs), against the fp32 reference: transformers on the same GGUF,
dequantized. Mind: every rung holds the shipped Q4_1 weights, so the fp32 reference is the
shipped Q4_1 dequantized (not the original bf16 checkpoint), and F16 is that model in 16 bits.

1. Per rung, over the prompts: greedy completions with the top-20 logprobs an OpenAI server
   returns, scored by the tier in each mode: ``logprobs`` (mean KLD per token over the top-20
   plus a tail bucket, p99, same top-1, RMS Δp), ``greedy`` (the same completions without
   logprobs: argmax agreement where the reference is confident) and, beside guard's top-20
   figure, the full-vocabulary KLD computed independently here from both sides' full logits
   (the primary teacher-forced on its own text). Pass counts at the tier's defaults.
2. Per rung, sampled completions (llama.cpp's default transform: temperature 0.8, top_k 40,
   top_p 0.95, min_p 0.05) without logprobs: the reference-only z-score and pass counts.
3. Cost: CPU seconds (getrusage, all threads of this process) to generate a 128-token
   completion with the Q4_1 primary, and to score it (score + check) with the transformers fp32
   and the llama_cpp F16 references, side by side. Target: scoring <= 0.25x generating.

Usage: .venv/bin/python benchmarks/llm_ladder.py [--prompts 10] [--tokens 48] [--samples 10]
Writes benchmarks/results/llm_ladder.json and .md with the machine noted.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from guard.backends import create_backend
from guard.config.backend import BackendConfig
from guard.machine import cpu_model
from guard.protocol.generation import GenerationSample, SamplingParams
from guard.verify.generation import SERVER_DEFAULTS, GenerationThresholds, check_generation
from guard.zoo.llm import PROMPTS, SHIPPED, complete, quant_ladder, smollm2_gguf

RESULTS = Path(__file__).resolve().parent / "results"
RUNGS = ("F16", "Q8_0", SHIPPED, "Q4_K_M", "Q3_K_M", "Q2_K")
REFERENCE_NOTE = ("fp32 reference = transformers on the shipped Q4_1 GGUF, dequantized (every "
                  "rung holds those weights)")
TOP_LOGPROBS = 20  # what vLLM returns at most by default (max_logprobs)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def scorer(backend: str, path: Path, threads: int = 1, **options):
    spec = BackendConfig(backend=backend, path=str(path), options=options)
    built = create_backend(spec, "reference", threads)
    built.load()
    return built


def strip_logprobs(sample: GenerationSample) -> GenerationSample:
    return replace(sample, tokens=tuple(replace(t, logprob=None, top=()) for t in sample.tokens),
                   sampling=replace(sample.sampling, logprobs=None))


def full_kld(reference: np.ndarray, primary: np.ndarray) -> np.ndarray:
    """KL(reference || primary) per position from full log-softmax rows (float64)."""
    def normalized(rows: np.ndarray) -> np.ndarray:
        # Re-normalized in float64: float32 rows sum to 1 only within ~1e-6, the size of an
        # F16 rung's whole KLD.
        wide = rows.astype(np.float64)
        return wide - np.logaddexp.reduce(wide, axis=-1, keepdims=True)

    ref, prim = normalized(reference), normalized(primary)
    return np.sum(np.exp(ref) * (ref - prim), axis=-1)


def rung_figures(rung: str, path: Path, reference, prompts, tokens: int, samples: int,
                 threads: int) -> dict:
    from guard.backends.llama_cpp import open_llama

    llm = open_llama(path, context_length=512, threads=threads)
    self_scorer = scorer("llama_cpp", path, threads, context_length=512)
    limits, llama = GenerationThresholds(), SERVER_DEFAULTS["llama.cpp"]
    per_token_guard, per_token_full, per_token_reverse, same_top, delta_p = [], [], [], [], []
    logprob_pass = greedy_pass = 0
    greedy_stats = []
    for prompt in prompts:
        sample = complete(llm, prompt, tokens, SamplingParams(temperature=0.0),
                          logprobs=TOP_LOGPROBS)
        scores = reference.score(sample)
        check = check_generation(sample, scores, llama, limits)
        logprob_pass += check.passed
        per_token_guard.extend(check.per_token_kld.tolist())
        # The independent figure: the primary's full distribution at the same positions.
        primary = self_scorer.score(sample)
        per_token_full.extend(full_kld(scores.logprobs, primary.logprobs).tolist())
        per_token_reverse.extend(full_kld(primary.logprobs, scores.logprobs).tolist())
        same_top.extend((scores.top_ids[:, 0] == primary.top_ids[:, 0]).tolist())
        ids = np.arange(len(scores.token_ids)), np.asarray(scores.token_ids)
        delta_p.extend((np.exp(primary.logprobs[ids]) - np.exp(scores.logprobs[ids])).tolist())
        greedy = check_generation(strip_logprobs(sample), scores, llama, limits)
        greedy_pass += greedy.passed
        greedy_stats.append(greedy.statistic)
    zs, sampled_pass = [], 0
    for seed in range(samples):
        prompt = prompts[seed % len(prompts)]
        sample = complete(llm, prompt, tokens, SamplingParams(), seed=seed)
        check = check_generation(sample, reference.score(sample), llama, limits)
        if check.comparable:
            zs.append(check.statistic)
            sampled_pass += check.passed
    llm.close()
    self_scorer.close()
    guard_kld, full = np.array(per_token_guard), np.array(per_token_full)
    reverse = np.array(per_token_reverse)
    return {
        "rung": rung, "completions": len(prompts), "tokens": len(full),
        "mean_kld_guard_top20": float(guard_kld.mean()),
        # llama-perplexity's direction, KL(reference || primary), from full logits:
        "mean_kld_full": float(full.mean()), "kld_p99_full": float(np.percentile(full, 99)),
        # guard's direction, KL(primary || reference), from full logits (what the top-20
        # figure estimates):
        "mean_kld_primary_reference_full": float(reverse.mean()),
        "same_top1": float(np.mean(same_top)), "delta_p_rms": float(np.sqrt(np.mean(
            np.square(delta_p)))),
        "logprobs_passed": logprob_pass, "greedy_passed": greedy_pass,
        "greedy_disagreement_mean": float(np.mean(greedy_stats)),
        "sampled_completions": len(zs), "sampled_passed": sampled_pass,
        "z_mean": float(np.mean(zs)) if zs else None,
        "z_max": float(np.max(zs)) if zs else None,
    }


def scoring_cost(ladder: dict, reference_fp32, tokens: int, repeat: int, threads: int) -> dict:
    """CPU seconds to generate a ``tokens``-token completion with the Q4_1 primary, and to
    score it with each reference."""
    from guard.backends.llama_cpp import open_llama

    primary = open_llama(ladder[SHIPPED], context_length=512, threads=threads,
                         logits_all=False)
    f16 = scorer("llama_cpp", ladder["F16"], threads, context_length=512)
    generate, fp32_cost, f16_cost = [], [], []
    llama = SERVER_DEFAULTS["llama.cpp"]
    for seed in range(repeat):
        prompt = PROMPTS[seed % len(PROMPTS)]
        start = cpu_seconds()
        primary.reset()
        # EOS banned: every completion is the full length measured.
        response = primary.create_completion(prompt, max_tokens=tokens, seed=seed,
                                             temperature=0.8,
                                             logit_bias={primary.token_eos(): -1e9})
        generate.append(cpu_seconds() - start)
        from guard.zoo.llm import sample_from_response

        text = response["choices"][0]["text"]
        sample = sample_from_response(prompt, {"choices": [{"text": text}]},
                                      SamplingParams())
        for reference, costs in ((reference_fp32, fp32_cost), (f16, f16_cost)):
            start = cpu_seconds()
            check_generation(sample, reference.score(sample), llama)
            costs.append(cpu_seconds() - start)
    primary.close()
    f16.close()
    gen = statistics.median(generate)
    return {"tokens": tokens, "repeat": repeat, "threads": threads,
            "generate_cpu_s": gen,
            "score_transformers_fp32_cpu_s": statistics.median(fp32_cost),
            "score_llama_cpp_f16_cpu_s": statistics.median(f16_cost),
            "ratio_transformers_fp32": statistics.median(fp32_cost) / gen,
            "ratio_llama_cpp_f16": statistics.median(f16_cost) / gen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--samples", type=int, default=10, help="sampled completions per rung")
    parser.add_argument("--cost-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rungs = tuple(args.rungs.split(","))
    ladder = quant_ladder(tuple(r for r in rungs if r != SHIPPED) + (SHIPPED, "F16"))
    started = time.time()
    reference = scorer("transformers", smollm2_gguf(), args.threads)
    prompts = PROMPTS[:args.prompts]
    rows = []
    for rung in rungs:
        row = rung_figures(rung, ladder[rung], reference, prompts, args.tokens, args.samples,
                           args.threads)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    cost = scoring_cost(ladder, reference, args.cost_tokens, args.repeat, args.threads)
    limits = GenerationThresholds()
    record = {
        "machine": {"cpu": cpu_model(platform.processor()), "platform": platform.platform(),
                    "python": platform.python_version()},
        "reference": REFERENCE_NOTE, "defaults": limits.__dict__,
        "prompts": len(prompts), "tokens_per_completion": args.tokens,
        "top_logprobs": TOP_LOGPROBS, "ladder": rows, "cost": cost,
        "seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_ladder.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# The generation tier on SmolLM2-135M-Instruct's quant ladder", "",
        f"Machine: {record['machine']['cpu']}, {record['machine']['platform']}. "
        f"{len(prompts)} prompts x {args.tokens} greedy tokens per rung (primaries in "
        f"llama.cpp, top-{TOP_LOGPROBS} logprobs as an OpenAI server returns them); "
        f"{args.samples} sampled completions per rung (llama.cpp's default transform, no "
        f"logprobs). Against the {REFERENCE_NOTE}.", "",
        f"Defaults: max_mean_kld {limits.max_mean_kld}, max_abs_z {limits.max_abs_z}, "
        f"margin_floor {limits.margin_floor}, max_greedy_disagreement "
        f"{limits.max_greedy_disagreement}.", "",
        "KLD columns, nats per token: llama-perplexity's KL(reference || primary) from full "
        "logits, its p99, then KL(primary || reference) from full logits and guard's estimate "
        "of it from the top-20 logprobs plus a tail bucket (what the tier sees online).", "",
        "| primary (vs fp32 reference, Q4_1 dequantized) | KLD(ref‖prim) | p99 | "
        "KLD(prim‖ref) | guard's top-20 KLD(prim‖ref) | same top-1 | RMS Δp | "
        "logprobs mode passed | greedy mode passed | sampled: passed | sampled: mean z |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        z = "n/a" if row["z_mean"] is None else f"{row['z_mean']:.2f}"
        lines.append(
            f"| {row['rung']} | {row['mean_kld_full']:.5f} | {row['kld_p99_full']:.4f} | "
            f"{row['mean_kld_primary_reference_full']:.5f} | "
            f"{row['mean_kld_guard_top20']:.5f} | {row['same_top1']:.1%} | "
            f"{row['delta_p_rms']:.2%} | {row['logprobs_passed']}/{row['completions']} | "
            f"{row['greedy_passed']}/{row['completions']} | "
            f"{row['sampled_passed']}/{row['sampled_completions']} | {z} |")
    lines += [
        "", f"Scoring cost of one {cost['tokens']}-token completion, CPU seconds (median of "
        f"{cost['repeat']}, {cost['threads']} thread(s)); the primary is the shipped Q4_1 in "
        f"llama.cpp. Target: scoring <= 0.25x generating.", "",
        "| | CPU s | x generating |", "| --- | --- | --- |",
        f"| generate (Q4_1 primary, llama.cpp) | {cost['generate_cpu_s']:.3f} | 1 |",
        f"| score: transformers fp32 reference (Q4_1 dequantized) | "
        f"{cost['score_transformers_fp32_cpu_s']:.3f} | {cost['ratio_transformers_fp32']:.3f} |",
        f"| score: llama_cpp F16 reference (Q4_1 in 16 bits) | "
        f"{cost['score_llama_cpp_f16_cpu_s']:.3f} | {cost['ratio_llama_cpp_f16']:.3f} |",
        "", f"Reproduce: `.venv/bin/python benchmarks/llm_ladder.py --prompts {args.prompts} "
        f"--tokens {args.tokens} --samples {args.samples}`.",
    ]
    (args.out / "llm_ladder.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
