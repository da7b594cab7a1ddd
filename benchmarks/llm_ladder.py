"""The generation tier on a real quant ladder, and what scoring a completion costs.

SmolLM2-135M-Instruct (guard/zoo/llm.py): the shipped Q4_1 GGUF and its requantizations F16,
Q8_0, Q4_K_M, Q3_K_M, Q2_K, each the primary in llama.cpp (llama-cpp-python in-process, the
engine its server runs), against the fp32 reference: transformers on the same GGUF,
dequantized. Mind: every rung holds the shipped Q4_1 weights, so the fp32 reference is the
shipped Q4_1 dequantized (not the original bf16 checkpoint), and F16 is that model in 16 bits:
these are not llama.cpp's F16-based tables.

1. Per rung, over the prompts: greedy completions with the top-20 logprobs an OpenAI server
   returns, scored by the tier in each mode: ``logprobs`` (guard's mean KLD per token from the
   top-20: the tail-corrected estimate, its lumped lower bound and the estimate of
   llama-perplexity's direction; p99, same top-1, RMS Δp), ``greedy`` (the same completions
   without logprobs: argmax agreement where the reference is confident) and, beside guard's
   figures, the full-vocabulary KLD in both directions computed from both sides' full logits
   (the primary teacher-forced on its own text). Pass counts at the tier's defaults.
2. Per rung, sampled completions (llama.cpp's default transform: temperature 0.8, top_k 40,
   top_p 0.95, min_p 0.05) without logprobs: the reference-only z-score and pass counts.
3. Cost (issue 29's target: scoring a sampled completion costs <= 0.25x the primary's CPU to
   generate it, 128 tokens, so 10% sampling adds <= 2.5% CPU): CPU seconds of this process
   from /proc/self/stat (user + system, every thread; not wall time) to generate a 128-token
   completion with the shipped Q4_1 primary in llama.cpp (as a server generates without
   logprobs), and to score it (the reference's
   teacher-forced pass, then the tier's check in sampled mode, the costliest, and in logprobs
   mode) with the transformers fp32 and the llama_cpp F16 references, side by side, all on
   one thread; the fp32 reference twice: its linear layers by oneDNN (its default,
   ``options.onednn_linear``) and by torch's own kernels; the F16 reference twice: as stored,
   and held as F32 (``options.upcast``).

Usage: .venv/bin/python benchmarks/llm_ladder.py [--prompts 10] [--tokens 32] [--samples 10]
Writes benchmarks/results/llm_ladder.json and .md with the machine and its load average
noted. Accuracy figures (KLD) do not depend on load; the CPU figures are per process and do
not count other processes' work, but a loaded machine still slows caches and clocks: rerun
them on a quiet machine before quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from guard.backends import create_backend
from guard.config.backend import BackendConfig
from guard.machine import cpu_model
from guard.matrix.columns import LlamaColumn, sample_from_distributions
from guard.matrix.generation import kld_rows
from guard.protocol.generation import GenerationSample, SamplingParams
from guard.verify.generation import SERVER_DEFAULTS, GenerationThresholds, check_generation
from guard.zoo.llm import PROMPTS, SHIPPED, complete, quant_ladder, sample_from_response, \
    smollm2_gguf

RESULTS = Path(__file__).resolve().parent / "results"
# The references whose scoring cost is measured, as the tables name them.
COST_REFERENCES = (
    ("transformers fp32 reference (Q4_1 dequantized)", "transformers_fp32"),
    ("transformers fp32 reference, torch's linear kernels (options.onednn_linear: false)",
     "transformers_fp32_torch_kernels"),
    ("llama_cpp F16 reference (Q4_1 in 16 bits)", "llama_cpp_f16"),
    ("llama_cpp F16 reference held as F32 (options.upcast)", "llama_cpp_f16_upcast"),
    ("llama_cpp BF16 reference (Q4_1 rounded to bfloat16: its drift is the BF16 rung's)",
     "llama_cpp_bf16"),
)
RUNGS = ("F16", "BF16", "Q8_0", SHIPPED, "Q4_K_M", "Q3_K_M", "Q2_K")
REFERENCE_NOTE = ("fp32 reference = transformers on the shipped Q4_1 GGUF, dequantized (every "
                  "rung holds those weights: not llama.cpp's F16-based tables)")
TOP_LOGPROBS = 20  # what OpenAI and vLLM return at most
LLAMA = SERVER_DEFAULTS["llama.cpp"]
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """This process's CPU time, user + system, all threads, from /proc/self/stat."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def scorer(backend: str, path: Path, threads: int = 1, **options):
    spec = BackendConfig(backend=backend, path=str(path), options=options)
    built = create_backend(spec, "reference", threads)
    built.load()
    return built


def strip_logprobs(sample: GenerationSample) -> GenerationSample:
    return replace(sample, tokens=tuple(replace(t, logprob=None, top=()) for t in sample.tokens),
                   sampling=replace(sample.sampling, logprobs=None))


def rung_figures(rung: str, path: Path, reference, prompts, tokens: int, samples: int,
                 threads: int) -> dict:
    column = LlamaColumn(scorer("llama_cpp", path, threads, context_length=512))
    limits = GenerationThresholds()
    guard, bound, reverse, full, full_reverse = [], [], [], [], []
    same_top, delta_p, top1 = [], [], []
    logprob_pass = greedy_pass = 0
    greedy_stats = []
    for prompt in prompts:
        sample = column.complete(prompt, tokens, TOP_LOGPROBS)
        scores = reference.score(sample)
        check = check_generation(sample, scores, LLAMA, limits)
        logprob_pass += check.passed
        guard.extend(check.per_token_kld.tolist())
        bound.extend(check.per_token_kld_lower_bound.tolist())
        reverse.extend(check.per_token_kld_reverse.tolist())
        top1.append((check.top1_agreement, check.top1_compared))
        # The independent figures: the primary's full distribution at the same positions.
        primary = column.logprobs(list(scores.prompt_token_ids) + list(scores.token_ids),
                                  len(scores.prompt_token_ids))
        full.extend(kld_rows(primary, scores.logprobs).tolist())
        full_reverse.extend(kld_rows(scores.logprobs, primary).tolist())
        same_top.extend((scores.logprobs.argmax(-1) == primary.argmax(-1)).tolist())
        ids = np.arange(len(scores.token_ids)), np.asarray(scores.token_ids)
        delta_p.extend((np.exp(primary[ids]) - np.exp(scores.logprobs[ids])).tolist())
        greedy = check_generation(strip_logprobs(sample), scores, LLAMA, limits)
        greedy_pass += greedy.passed
        greedy_stats.append(greedy.statistic)
    zs, sampled_pass = [], 0
    for seed in range(samples):
        prompt = prompts[seed % len(prompts)]
        sample = complete(column.scorer.llm, prompt, tokens, SamplingParams(), seed=seed)
        check = check_generation(sample, reference.score(sample), LLAMA, limits)
        if check.comparable:
            zs.append(check.statistic)
            sampled_pass += check.passed
    column.close()
    full_pq, full_qp = np.array(full), np.array(full_reverse)
    guard_top1 = sum(a * n for a, n in top1) / max(1, sum(n for _, n in top1))
    return {
        "rung": rung, "completions": len(prompts), "tokens": len(full),
        # guard's figures from the top-20 (what the tier sees online):
        "guard_mean_kld": float(np.mean(guard)),
        "guard_mean_kld_lower_bound": float(np.mean(bound)),
        "guard_mean_kld_reverse": float(np.mean(reverse)),
        "guard_kld_p99": float(np.percentile(guard, 99)), "guard_same_top1": guard_top1,
        # the same from full logits: KL(primary || reference), guard's direction ...
        "full_mean_kld": float(full_pq.mean()),
        # ... and KL(reference || primary), llama-perplexity's:
        "full_mean_kld_reverse": float(full_qp.mean()),
        "full_kld_reverse_p99": float(np.percentile(full_qp, 99)),
        "guard_over_full": float(np.mean(guard) / full_pq.mean()) if full_pq.mean() else None,
        "bound_over_full": float(np.mean(bound) / full_pq.mean()) if full_pq.mean() else None,
        "reverse_over_full": (float(np.mean(reverse) / full_qp.mean()) if full_qp.mean()
                              else None),
        "same_top1": float(np.mean(same_top)),
        "delta_p_rms": float(np.sqrt(np.mean(np.square(delta_p)))),
        "logprobs_passed": logprob_pass, "greedy_passed": greedy_pass,
        "greedy_disagreement_mean": float(np.mean(greedy_stats)),
        "sampled_completions": len(zs), "sampled_passed": sampled_pass,
        "z_mean": float(np.mean(zs)) if zs else None,
        "z_max_abs": float(np.max(np.abs(zs))) if zs else None,
    }


def cost_references(f16: Path, bf16: Path, fp32_source: Path, threads: int) -> dict:
    """The references whose scoring cost is measured (COST_REFERENCES' keys), loaded: the
    transformers fp32 one on ``fp32_source`` (a GGUF, dequantized), the llama_cpp one on the
    F16 file as stored and held as F32, and on the BF16 file (llama.cpp's BF16 products use
    AVX512_BF16's dot product where the build has it: a reference whose own drift from fp32
    is measured on the ladder's BF16 rung). Prompt caches off: every score costs its whole
    sequence."""
    llama = dict(context_length=512, cache_prompt=False)
    return {"transformers_fp32": scorer("transformers", fp32_source, threads,
                                        cache_prompt=False),
            "transformers_fp32_torch_kernels": scorer("transformers", fp32_source, threads,
                                                      cache_prompt=False, onednn_linear=False),
            "llama_cpp_f16": scorer("llama_cpp", f16, threads, **llama),
            "llama_cpp_f16_upcast": scorer("llama_cpp", f16, threads, upcast=True, **llama),
            "llama_cpp_bf16": scorer("llama_cpp", bf16, threads, **llama)}


def timed_completion(primary, prompt: str, tokens: int, seed: int) -> tuple[dict, float]:
    """A completion of ``prompt`` sampled by ``primary`` (a llama_cpp ``Llama``, temperature
    0.8) and the CPU seconds it took. EOS banned: every completion is the full ``tokens``
    long, the length the cost is quoted for."""
    primary.reset()
    start = cpu_seconds()
    response = primary.create_completion(prompt, max_tokens=tokens, seed=seed, temperature=0.8,
                                         logit_bias={primary.token_eos(): -1e9})
    return response, cpu_seconds() - start


def scoring_cost(ladder: dict, tokens: int, repeat: int, threads: int) -> dict:
    """CPU seconds (/proc) to generate a ``tokens``-token sampled completion with the Q4_1
    primary, and to score it with each reference: the teacher-forced pass, then the check in
    sampled mode (no logprobs) and in logprobs mode (top-5, as guard asks on sampled calls).

    The primary generates as a server does without logprobs (``logits_all`` off):
    llama-cpp-python computes logprobs by sorting the vocabulary in Python, which a C++ server
    does not, and that would inflate the denominator. The top-5 a server would return are
    taken afterwards, untimed, from the primary teacher-forced on its completion."""
    from guard.backends.llama_cpp import open_llama

    primary = open_llama(ladder[SHIPPED], context_length=512, threads=threads,
                         logits_all=False)
    primary_scorer = scorer("llama_cpp", ladder[SHIPPED], threads, context_length=512)
    # Each completion is scored twice below (once per mode), which no sampled call is: the
    # references' prompt caches are off, so that the second score costs what the first does
    # (benchmarks/llm_prompt_cache.py measures the cache on a shared prompt).
    references = cost_references(ladder["F16"], ladder["BF16"], smollm2_gguf(), threads)
    modes = ("sampled", "logprobs")
    totals = {"generate": 0.0, **{f"{name}_{part}_{mode}": 0.0 for name in references
                                  for part in ("score", "check") for mode in modes}}
    produced = 0
    for seed in range(repeat):
        prompt = PROMPTS[seed % len(PROMPTS)]
        response, spent = timed_completion(primary, prompt, tokens, seed)
        totals["generate"] += spent
        sampled = sample_from_response(prompt, response, SamplingParams())
        prompt_ids = primary_scorer.encode_prompt(prompt)
        ids = primary_scorer.vocab.encode(sampled.completion_text)
        produced += len(ids)
        with_logprobs = replace(
            sample_from_distributions(prompt, ids, primary_scorer.forward(prompt_ids + ids,
                                                                          len(prompt_ids)),
                                      primary_scorer.vocab, 5, primary_scorer.decode),
            sampling=SamplingParams(logprobs=5))
        for name, reference in references.items():
            for mode, sample in zip(modes, (sampled, with_logprobs)):
                start = cpu_seconds()
                scores = reference.score(sample)
                middle = cpu_seconds()
                assert check_generation(sample, scores, LLAMA).mode == mode
                totals[f"{name}_score_{mode}"] += middle - start
                totals[f"{name}_check_{mode}"] += cpu_seconds() - middle
    primary.close()
    primary_scorer.close()
    for reference in references.values():
        reference.close()
    per = {key: value / repeat for key, value in totals.items()}
    out = {"tokens": tokens, "tokens_generated_mean": produced / repeat, "repeat": repeat,
           "threads": threads, "cpu_source": "/proc/self/stat utime+stime",
           "generate_cpu_s": per["generate"]}
    for name in references:
        out[name] = {}
        for mode in modes:
            score, check = per[f"{name}_score_{mode}"], per[f"{name}_check_{mode}"]
            out[name][mode] = {"score_cpu_s": score, "check_cpu_s": check,
                               "ratio": (score + check) / per["generate"]}
    return out


def llama_cpp_build() -> str:
    """The vector extensions the installed llama.cpp was built for (the Makefile's
    LLAMA_CPP_ISA): both the primaries and the llama_cpp references run on them."""
    from guard.backends.llama_cpp import build_features

    return " ".join(sorted(name for name in build_features()
                           if name.startswith(("AVX", "AMX"))))


def built_for(m: dict) -> str:
    """", llama.cpp built for ..." where the record kept the build (older ones did not)."""
    return f", llama.cpp built for {m['llama_cpp_build']}" if "llama_cpp_build" in m else ""


def machine() -> dict:
    return {"cpu": cpu_model(platform.processor()), "cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "llama_cpp_build": llama_cpp_build(),
            "loadavg": [round(v, 2) for v in os.getloadavg()]}


def cost_machine(m: dict | None) -> str:
    """Where the cost figures were taken (older records kept no machine of their own: the
    ladder's, nor the llama.cpp build's extensions)."""
    return f" on {m['cpu']}, {m['cores']} cores, {m['platform']}{built_for(m)}" if m else ""


def markdown(record: dict) -> list[str]:
    rows, cost, limits = record["ladder"], record["cost"], record["defaults"]
    m = record["machine"]
    lines = [
        "# The generation tier on SmolLM2-135M-Instruct's quant ladder", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}{built_for(m)}; load average "
        f"{m['loadavg_start']} at the start, {m['loadavg']} at the end (shared with other "
        f"work: the CPU figures below are to be rerun on a quiet machine; the KLD figures do "
        f"not depend on load). {record['prompts']} prompts x {record['tokens_per_completion']} "
        f"greedy tokens per rung (primaries in llama.cpp, top-{TOP_LOGPROBS} logprobs as an "
        f"OpenAI server returns them); {record['samples_per_rung']} sampled completions per "
        f"rung (llama.cpp's "
        f"default transform, no logprobs). Against the {REFERENCE_NOTE}.", "",
        f"Defaults: max_mean_kld {limits['max_mean_kld']}, max_abs_z {limits['max_abs_z']}, "
        f"margin_floor {limits['margin_floor']}, max_greedy_disagreement "
        f"{limits['max_greedy_disagreement']}.", "",
        "KLD, nats per token, KL(primary ‖ reference) unless said: guard's figure from the "
        "top-20 (the tier's estimate: the lumped top-20 + tail bucket, plus the tail "
        "correction), the full-vocabulary value over the same tokens, their ratio, the lumped "
        "bound's ratio; then llama-perplexity's direction KL(reference ‖ primary), full and "
        "guard's estimate of it.", "",
        "| primary (vs fp32 reference, Q4_1 dequantized) | guard KLD | full KLD | guard / full "
        "| lumped / full | KLD(ref‖prim) full | guard's est. / full | p99 (ref‖prim) | "
        "same top-1 | RMS Δp | logprobs passed | greedy passed | sampled passed | sampled "
        "max abs z |", "| --- |" + " --- |" * 13]
    for r in rows:
        z = "n/a" if r["z_max_abs"] is None else f"{r['z_max_abs']:.2f}"

        def ratio(value):
            return "n/a" if value is None else f"{value:.3f}"

        lines.append(
            f"| {r['rung']} | {r['guard_mean_kld']:.5f} | {r['full_mean_kld']:.5f} | "
            f"{ratio(r['guard_over_full'])} | {ratio(r['bound_over_full'])} | "
            f"{r['full_mean_kld_reverse']:.5f} | {ratio(r['reverse_over_full'])} | "
            f"{r['full_kld_reverse_p99']:.4f} | {r['same_top1']:.1%} | "
            f"{r['delta_p_rms']:.2%} | {r['logprobs_passed']}/{r['completions']} | "
            f"{r['greedy_passed']}/{r['completions']} | "
            f"{r['sampled_passed']}/{r['sampled_completions']} | {z} |")
    lines += [
        "", f"Scoring cost of one {cost['tokens']}-token sampled completion, CPU seconds of "
        f"this process from {cost['cpu_source']}"
        f"{cost_machine(cost.get('machine'))} (mean of {cost['repeat']}, "
        f"{cost['threads']} thread; load average {m['loadavg_cost']} when it was taken); the "
        "primary is the shipped Q4_1 in llama.cpp, generating as a server does without "
        "logprobs (the top-5 of the logprobs-mode sample taken afterwards, untimed). Scoring "
        "is the reference's teacher-forced pass plus the tier's check, in sampled mode (no "
        "logprobs: the z-score, the costliest check) and in logprobs mode (top-5, as guard asks "
        "on sampled calls). Target: scoring <= 0.25x generating (10% sampling adds <= 2.5% "
        "CPU).", "",
        "| | pass, CPU s | check, CPU s | x generating |", "| --- | --- | --- | --- |",
        f"| generate (Q4_1 primary, llama.cpp) | {cost['generate_cpu_s']:.3f} | | 1 |"]
    for label, key in COST_REFERENCES:
        if key not in cost:  # records from before that reference was measured
            continue
        for mode in ("sampled", "logprobs"):
            c = cost[key][mode]
            lines.append(f"| score with the {label}, {mode} mode | {c['score_cpu_s']:.3f} | "
                         f"{c['check_cpu_s']:.3f} | {c['ratio']:.3f} |")
    lines += ["", f"Reproduce: `PYTHONPATH=$PWD .venv/bin/python benchmarks/llm_ladder.py "
              f"--prompts {record['prompts']} --tokens {record['tokens_per_completion']} "
              f"--samples {record['samples_per_rung']}` (the ladder took {record['seconds']} s "
              "here); `--cost-only` reruns the CPU figures alone."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--samples", type=int, default=10, help="sampled completions per rung")
    parser.add_argument("--cost-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    parser.add_argument("--cost-only", action="store_true",
                        help="rerun the CPU figures only (a quiet machine), keeping the ladder "
                        "of the existing llm_ladder.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "llm_ladder.json"
    rungs = tuple(args.rungs.split(","))
    started, load_start = time.time(), [round(v, 2) for v in os.getloadavg()]
    ladder = quant_ladder(tuple(dict.fromkeys(rungs + (SHIPPED, "F16", "BF16"))))
    if args.cost_only:
        record = json.loads(path.read_text())
    else:
        reference = scorer("transformers", smollm2_gguf(), args.threads)
        prompts = PROMPTS[:args.prompts]
        rows = []
        for rung in rungs:
            row = rung_figures(rung, ladder[rung], reference, prompts, args.tokens,
                               args.samples, args.threads)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        record = {
            "machine": {**machine(), "loadavg_start": load_start},
            "reference": REFERENCE_NOTE, "defaults": GenerationThresholds().__dict__,
            "prompts": len(prompts), "tokens_per_completion": args.tokens,
            "samples_per_rung": args.samples, "top_logprobs": TOP_LOGPROBS, "ladder": rows,
            "cost": None, "seconds": round(time.time() - started, 1),
        }
        path.write_text(json.dumps(record, indent=2) + "\n")  # kept if the cost part fails
    record["machine"]["loadavg_cost"] = [round(v, 2) for v in os.getloadavg()]
    record["cost"] = scoring_cost(ladder, args.cost_tokens, args.repeat, args.threads)
    record["cost"]["machine"] = machine()  # --cost-only may run on another machine than the ladder
    record["machine"]["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    path.write_text(json.dumps(record, indent=2) + "\n")
    text = "\n".join(markdown(record)) + "\n"
    (args.out / "llm_ladder.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
