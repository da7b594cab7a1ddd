"""How fast the generation tier's detector catches a drifting LLM, and how quiet it stays on
agreeing ones, with the defaults of ``task: generation`` (nothing lowered for the benchmark).

The targets (issue "guard for LLMs"): a Q2_K primary against the fp32 reference, on real prompts,
is caught within 10 sampled completions of <= 64 tokens; F16 and Q8_0 primaries raise no alarm
over 1,000 completions at the stated ARL0 (1e5 compared completions between false alarms);
Q4_1's measured KLD is reported.

Set-up, the sidecar's own parts: the config is parsed as ``guard serve`` parses it (a generative
model with an ``openai`` primary, its defaults: ``checks.generation``, ``policy`` with task
generation's ``min_samples``), the tier runs through the registry's ``Comparator`` and the route
policy is the verifier's (``generation_policy``: the score CUSUM fed ``detector_score``). The
reference is ``transformers`` fp32 on the shipped Q4_1 GGUF, dequantized (every rung holds those
weights: F16 is that model in 16 bits, not an original bf16 checkpoint). Each primary is the
rung run in llama.cpp in-process (llama-cpp-python: the engine its server runs), sampling with
llama.cpp's server defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) and returning
the top-20 logprobs an OpenAI server gives (the tier's ``logprobs`` mode), up to 64 tokens, a
new seed per completion, the prompts of guard/zoo/llm.py in turn.

- Agreeing rungs (F16, Q8_0; Q4_1 for its figures): ``--completions`` completions each; the
  first alarm's index if any (the detector keeps running on the primary: an alarm is counted,
  the route is put back).
- Q2_K: ``--trials`` independent runs (other seeds and prompt offsets), each until the alarm
  (at most ``--max-to-alarm`` completions, default 64): completions to alarm, median and worst.
- A rung ``RUNG+kv:TYPE`` (``F16+kv:q4_0``) is that rung with llama.cpp's KV cache in ``TYPE``
  (``type_k`` and ``type_v``, flash attention on, which a quantized V cache needs), run as Q2_K
  is: until the alarm. What a team turning ``-ctk q4_0 -ctv q4_0`` on would be told, and when.

Figures are accuracy, not speed: the machine's load does not change them (it is noted anyway).
Usage: .venv/bin/python benchmarks/llm_detection.py [--completions 1000] [--trials 20]
Writes benchmarks/results/llm_detection.json and .md, rung by rung as they finish.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from guard.backends import create_backend
from guard.machine import cpu_model
from guard.plan.complete import parse_config
from guard.protocol.generation import SamplingParams
from guard.verifier_process.generation_model import detector_score, generation_policy
from guard.verify.pipeline import Comparator
from guard.zoo.llm import PROMPTS, SHIPPED, complete, quant_ladder, smollm2_gguf

RESULTS = Path(__file__).resolve().parent / "results"
TIER = "generation"
MAX_TOKENS = 64
TOP_LOGPROBS = 20
SAMPLING = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
REFERENCE_NOTE = ("fp32 reference = transformers on the shipped Q4_1 GGUF, dequantized (every "
                  "rung holds those weights)")


def model_config(reference: Path):
    """The generative model block as guard serve would parse it (defaults untouched)."""
    doc = {"version": 1, "server": {"http_port": 0},
           "models": [{"name": "smol", "task": "generation",
                       "primary": {"backend": "openai", "target": "http://127.0.0.1:9",
                                   "model": "smol", "options": {"engine": "llama.cpp"}},
                       "fallback": {"backend": "openai", "target": "http://127.0.0.1:9",
                                    "model": "smol-fallback"},
                       "reference": {"backend": "transformers", "path": str(reference)}}]}
    return parse_config(doc, Path.cwd(), "llm_detection").models[0]


class Run:
    """One primary rung against the reference, with a fresh detector."""

    def __init__(self, config, reference, comparator, gguf: Path, threads: int,
                 kv_cache: str | None = None):
        import llama_cpp

        self.config, self.reference, self.comparator = config, reference, comparator
        cache = {}
        if kv_cache is not None:  # llama.cpp quantizes V only with flash attention
            ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_cache.upper()}")
            cache = {"type_k": ggml_type, "type_v": ggml_type, "flash_attn": True}
        self.llm = llama_cpp.Llama(str(gguf), n_ctx=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=True, verbose=False,
                                   **cache)
        self.policy = generation_policy(config)
        self.limits = comparator.tier(TIER).limits
        self.epoch = 0

    def completion(self, index: int, seed: int) -> tuple[object, bool]:
        """One sampled completion checked and fed to the detector: (check, alarm)."""
        sample = complete(self.llm, PROMPTS[index % len(PROMPTS)], MAX_TOKENS, SAMPLING,
                          logprobs=TOP_LOGPROBS, seed=seed)
        check = self.comparator.check(self.reference.score(sample), sample).tiers[TIER]
        transition = self.policy.observe(TIER, not check.passed, self.epoch,
                                         score=detector_score(check, self.limits))
        alarm = transition is not None
        if alarm:  # count it, then put the route back and go on watching the primary
            self.policy = generation_policy(self.config)
        return check, alarm

    def close(self) -> None:
        self.llm.close()


def figures(checks: list) -> dict:
    scored = [c for c in checks if c.comparable]
    kld = np.concatenate([c.per_token_kld for c in scored if c.per_token_kld is not None]
                         or [np.zeros(0)])
    why: dict[str, list[int]] = {}  # the completions that could not be compared, by reason
    for i, c in enumerate(checks):
        if not c.comparable:
            why.setdefault(f"{c.mode}: {c.reason}" if c.reason else c.mode, []).append(i)
    return {"completions": len(checks), "scored": len(scored), "not_comparable": why,
            "passed": sum(c.passed for c in scored),
            "mean_kld": float(kld.mean()) if kld.size else None,
            "kld_p99": float(np.percentile(kld, 99)) if kld.size else None,
            "top1_agreement": float(np.mean([c.top1_agreement for c in scored
                                             if not math.isnan(c.top1_agreement)]))
            if scored else None,
            "tokens": int(kld.size)}


def agreeing(run: Run, n: int, label: str) -> dict:
    checks, alarms, started = [], [], time.time()
    for i in range(n):
        check, alarm = run.completion(i, seed=1000 + i)
        checks.append(check)
        if alarm:
            alarms.append(i + 1)
        if (i + 1) % 50 == 0:
            print(f"  {label}: {i + 1}/{n} completions, alarms {alarms}, "
                  f"{time.time() - started:.0f}s", flush=True)
    return {**figures(checks), "alarms": alarms}


def drifting(config, reference, comparator, gguf: Path, trials: int, threads: int,
             label: str, kv_cache: str | None = None, limit: int = 64) -> dict:
    to_alarm, checks = [], []
    for trial in range(trials):
        run = Run(config, reference, comparator, gguf, threads, kv_cache)
        try:
            for i in range(limit):
                check, alarm = run.completion(trial * 7 + i, seed=50_000 + trial * 1000 + i)
                checks.append(check)
                if alarm:
                    to_alarm.append(i + 1)
                    break
            else:
                to_alarm.append(None)
        finally:
            run.close()
        print(f"  {label} trial {trial + 1}/{trials}: alarm after {to_alarm[-1]} completions",
              flush=True)
    caught = [n for n in to_alarm if n is not None]
    return {**figures(checks), "trials": trials, "limit": limit, "completions_to_alarm": to_alarm,
            "median_to_alarm": statistics.median(caught) if caught else None,
            "worst_to_alarm": max(caught) if len(caught) == trials else None}


def write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llm_detection.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# The generation tier's detector on the SmolLM2 quant ladder", "",
             f"{report['machine']}; load average at start {report['load_at_start']}; "
             f"{report['note']}.", "",
             f"Defaults of task generation: min_samples {report['min_samples']}, ARL0 "
             f"{report['arl0']:g} compared completions, in-control score ratio "
             f"{report['in_control_ratio']}; sampled completions (llama.cpp's server defaults), "
             f"<= {MAX_TOKENS} tokens, top-{TOP_LOGPROBS} logprobs.", "",
             "| primary | completions | passed | mean KLD | KLD p99 | same top-1 | alarms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rung, row in report["rungs"].items():
        alarms = (_to_alarm(row) if "trials" in row
                  else (", ".join(map(str, row["alarms"])) or "none"))
        lines.append(f"| {rung} | {row['completions']} | {row['passed']}/{row['scored']} | "
                     f"{_f(row['mean_kld'])} | {_f(row['kld_p99'])} | "
                     f"{_f(row['top1_agreement'], '.1%')} | {alarms} |")
    dates = {rung: row.get("measured") for rung, row in report["rungs"].items()}
    if len(set(dates.values())) > 1:  # rows from several sittings (--add)
        lines.append("\nMeasured in several sittings (`--add`; the machine and load above are "
                     "the last one's): " + "; ".join(
                         f"{rung} {date or 'before dates were kept'}"
                         for rung, date in dates.items()) + ".")
    for rung, row in report["rungs"].items():
        for why, which in row.get("not_comparable", {}).items():
            lines.append(f"\n{rung}: {len(which)} completion(s) not comparable ({why}): "
                         f"number(s) {', '.join(str(i + 1) for i in which[:10])}.")
    (RESULTS / "llm_detection.md").write_text("\n".join(lines) + "\n")


def _to_alarm(row: dict) -> str:
    caught = sum(n is not None for n in row["completions_to_alarm"])
    if not caught:
        return f"none within {row.get('limit', 64)} completions in {row['trials']} trials"
    missed = ("" if caught == row["trials"] else
              f"; {row['trials'] - caught} trial(s) not within {row.get('limit', 64)}")
    return (f"after {row['median_to_alarm']} completions (median of the {caught} of "
            f"{row['trials']} trials that alarmed; worst {row['worst_to_alarm'] or 'n/a'}"
            f"{missed})")


def _f(value, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=1000,
                        help="completions per agreeing rung (default 1000)")
    parser.add_argument("--trials", type=int, default=20,
                        help="independent Q2_K runs until the alarm (default 20)")
    parser.add_argument("--rungs", default=f"Q2_K,F16,Q8_0,{SHIPPED}",
                        help="rungs, in order (default Q2_K,F16,Q8_0,Q4_1)")
    parser.add_argument("--max-to-alarm", type=int, default=64,
                        help="completions per drifting trial before it counts as not caught")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--add", action="store_true",
                        help="add these rungs to the saved results, keeping the other rungs "
                             "(a long ladder in several sittings)")
    args = parser.parse_args()
    rungs = args.rungs.split(",")
    ladder = quant_ladder(tuple(dict.fromkeys(r.partition("+kv:")[0] for r in rungs)))
    config = model_config(smollm2_gguf())
    reference = create_backend(config.reference, "reference", args.threads)
    reference.load()
    comparator = Comparator.for_model(config)
    policy = config.policy
    report = {"machine": f"{cpu_model()} ({os.cpu_count()} cores), {platform.platform()}",
              "load_at_start": round(os.getloadavg()[0], 2), "note": REFERENCE_NOTE,
              "min_samples": policy.min_samples,
              "arl0": policy.arl0_for(config.mirror.sample_rate),
              "in_control_ratio": config.checks.generation.in_control_ratio, "rungs": {}}
    saved = RESULTS / "llm_detection.json"
    if args.add and saved.is_file():
        # Every saved rung in its place: a rung measured again replaces its row where it stood
        # (until then, or if the run stops first, its earlier row stands, dated).
        report["rungs"] = json.loads(saved.read_text())["rungs"]
    for rung in rungs:
        print(f"{rung} ...", flush=True)
        weights, _, kv_cache = rung.partition("+kv:")
        if rung == "Q2_K" or kv_cache:
            row = drifting(config, reference, comparator, ladder[weights], args.trials,
                           args.threads, rung, kv_cache or None, args.max_to_alarm)
        else:
            run = Run(config, reference, comparator, ladder[rung], args.threads)
            try:
                row = agreeing(run, args.completions, rung)
            finally:
                run.close()
        report["rungs"][rung] = {**row, "measured": time.strftime("%Y-%m-%d")}
        write(report)
        shown = {k: v for k, v in row.items() if k != "completions_to_alarm"}
        print(f"{rung}: {json.dumps(shown)}", flush=True)
    reference.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
