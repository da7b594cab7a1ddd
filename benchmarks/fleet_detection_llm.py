"""Fleet evidence for an LLM: does a fleet of replicas at a low sample rate, pooled by the fleet
rules (``guard deploy rules --fleet``: each replica's completions' detector steps, summed), alert
about as fast as one replica sampling their sum, and stay as quiet?

Two halves.

1. Measured: the generation tier's per-completion detector steps on real completions. SmolLM2's
   healthy Q8_0 build and a mildly drifting one (Q4_K_M, requantized from the shipped Q4_1: mean
   KLD ~0.06 per token, where the tier's default fails a completion at 0.05) in llama.cpp,
   sampled with llama.cpp's server defaults, scored by the transformers fp32 reference through
   the sidecar's own parts (benchmarks/llm_detection.py's ``Run``: the config as ``guard serve``
   parses it, the registry's tier, ``detector_score``), each completion's step
   ``ln(1 + bet (score / in_control_ratio - 1))`` (guard/policy/detector.py ``ScoreSpec.step``):
   what ``guard_detector_evidence_nats_total`` sums.
2. Simulated with those steps (bootstrap): Poisson sampled completions, ``--replicas`` replicas
   at ``--per-replica`` completions a minute each, the drift on every replica at once (the
   image). Held to the same false alarms per day (``--false-alarms-per-day``):

   - (fleet) the pooled rule as generated (guard/deploy/fleet.py): per-minute sums of the
     replicas' steps, windows 5m, 30m, 2h evaluated every minute, its threshold, at least
     ``min_samples`` (5) pooled completions; it alerts as it decides (no ``for``);
   - (one) one replica sampling as much as the fleet, with guard's own detector (the score
     CUSUM, threshold ln(ARL0) for the ARL0 that gives the same false alarms per day at its
     rate); its alert fires at the next minute's rule evaluation plus ``for: 2m``;
   - (own) the fleet's replicas alone, each its own CUSUM (the false alarms shared among
     them), the first to trip, alerting the same way.

   And the pooled rule's false alarms per day over ``--days`` of healthy completions.

Usage: ``.venv/bin/python benchmarks/fleet_detection_llm.py [--completions 150]
[--replicas 20] [--per-replica 0.6] [--trials 300] [--days 365]``. Results under ``--out``
(default benchmarks/results): fleet_detection_llm.json (the measured steps too) and .md; the
simulation alone again from the saved steps: ``--steps-from FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNGS = {"healthy": "Q8_0", "drifting": "Q4_K_M"}
DRIFT_FOR_MIN = 2  # GuardDriftOverThreshold's `for`


def measure_steps(completions: int, threads: int) -> dict:
    """Per rung, each sampled completion's detector step, scored as the sidecar scores it."""
    from llm_detection import Run, model_config

    from guard.backends import create_backend
    from guard.verifier_process.generation_model import detector_score, generation_score_spec
    from guard.verify.pipeline import Comparator
    from guard.zoo.llm import quant_ladder, smollm2_gguf

    config = model_config(smollm2_gguf())
    gen, spec = config.checks.generation, generation_score_spec(config)
    reference = create_backend(config.reference, "reference", threads)
    reference.load()
    comparator = Comparator.for_model(config)
    ladder = quant_ladder(tuple(RUNGS.values()))
    out = {"in_control_ratio": gen.in_control_ratio, "bet": gen.bet,
           "min_samples": config.policy.min_samples, "arl0": config.policy.arl0}
    try:
        for label, rung in RUNGS.items():
            run = Run(config, reference, comparator, ladder[rung], threads)
            steps, klds, started = [], [], time.time()
            try:
                for i in range(completions):
                    check, _ = run.completion(i, seed=70_000 + i)
                    score = detector_score(check, run.limits)
                    if score is None:
                        continue  # not scored: no step, as in the verifier
                    steps.append(spec.step(score))
                    klds.append(check.mean_kld)
                    if (i + 1) % 25 == 0:
                        print(f"  {rung}: {i + 1}/{completions}, {time.time() - started:.0f}s",
                              flush=True)
            finally:
                run.close()
            out[label] = {"rung": rung, "steps": steps, "mean_kld": float(np.nanmean(klds))}
    finally:
        reference.close()
    return out


def pooled_sums(rng, steps: np.ndarray, rate_per_min: float, minutes: int) -> tuple:
    """Per minute: how many completions the fleet scored and the sum of their steps."""
    counts = rng.poisson(rate_per_min, minutes)
    draws = rng.choice(steps, int(counts.sum()))
    sums = np.add.reduceat(draws, np.r_[0, np.cumsum(counts)[:-1]]) if draws.size else \
        np.zeros(minutes)
    sums[counts == 0] = 0.0  # reduceat repeats the next value where a minute is empty
    return counts, sums


def cusum_first(steps: np.ndarray, threshold: float) -> int | None:
    """The index of the step at which a clamped sum first reaches ``threshold``."""
    s = 0.0
    for i, step in enumerate(steps):
        s = max(0.0, s + step)
        if s >= threshold:
            return i
    return None


def delays(rng, measured: dict, args, h: float, windows: list[int]) -> dict:
    """Minutes from the drift's start to each way's decision and alert, per trial."""
    from fleet_detection import alerted, pooled_alarms

    healthy, drifting = (np.asarray(measured[k]["steps"]) for k in ("healthy", "drifting"))
    fleet_rate = args.replicas * args.per_replica
    # ln ARL0 for the fleet's false alarms per day: one replica at the fleet's rate, or the
    # replicas alone sharing them (each ARL0 = the fleet's completions a day / its share).
    threshold = math.log(fleet_rate * 1440 / args.false_alarms_per_day)
    history, horizon = max(windows), args.horizon
    fleet, one, own = [], [], []
    for _ in range(args.trials):
        # The drift starts at t = 0, within the minute before evaluation 1 (at 1 - start).
        start = rng.uniform(0, 1)
        c0, s0 = pooled_sums(rng, healthy, fleet_rate, history)
        c1, s1 = pooled_sums(rng, drifting, fleet_rate, horizon)
        hit = pooled_alarms(np.r_[c0, c1], np.r_[s0, s1], windows, h, args.min_samples)
        first = np.flatnonzero(hit[history:])
        fleet.append(first[0] + 1 - start if first.size else math.inf)
        # One replica at the fleet's rate, and each replica alone (the first to trip).
        one.append(cusum_decides(rng, drifting, fleet_rate, horizon, threshold))
        own.append(min(cusum_decides(rng, drifting, args.per_replica, horizon, threshold)
                       for _ in range(args.replicas)))
    one_decides, own_decides = np.array(one), np.array(own)
    ways = {"fleet": np.array(fleet), "one_decides": one_decides,
            "one_alerts": alerted(rng, one_decides, DRIFT_FOR_MIN), "own_decides": own_decides,
            "own_alerts": alerted(rng, own_decides, DRIFT_FOR_MIN)}
    return {k: [float(v) for v in vals] for k, vals in ways.items()} | {
        "one_threshold": threshold, "own_threshold": threshold}


def cusum_decides(rng, steps: np.ndarray, rate_per_min: float, horizon: int,
                  threshold: float) -> float:
    """Minutes from the drift's start to a replica's detector deciding, its completions a
    Poisson stream at ``rate_per_min`` with steps drawn from ``steps``; inf past the horizon."""
    n = rng.poisson(rate_per_min * horizon)
    times = np.sort(rng.uniform(0, horizon, n))
    index = cusum_first(rng.choice(steps, n), threshold)
    return float(times[index]) if index is not None else math.inf


def false_alarms_per_day(rng, measured: dict, args, h: float, windows: list[int]) -> float:
    """The pooled rule's alarm episodes per day over ``args.days`` of healthy completions (an
    episode: a run of evaluations where the rule holds)."""
    from fleet_detection import episodes, pooled_alarms

    healthy = np.asarray(measured["healthy"]["steps"])
    counts, sums = pooled_sums(rng, healthy, args.replicas * args.per_replica,
                               int(args.days * 1440))
    return episodes(pooled_alarms(counts, sums, windows, h, args.min_samples)) / args.days


def summary(values: list[float]) -> str:
    finite = np.array([v for v in values if math.isfinite(v)])
    missed = len(values) - finite.size
    if not finite.size:
        return "none"
    text = f"{np.median(finite):.1f} / {np.percentile(finite, 90):.1f}"
    return text + (f" ({missed} missed)" if missed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completions", type=int, default=150,
                        help="completions measured per rung (default 150)")
    parser.add_argument("--steps-from", type=Path, help="reuse the steps of a saved run")
    parser.add_argument("--replicas", type=int, default=20)
    parser.add_argument("--per-replica", type=float, default=0.6,
                        help="sampled completions a minute per replica (default 0.6: 1%% of "
                        "one request a second)")
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--horizon", type=int, default=240, help="minutes simulated per trial")
    parser.add_argument("--days", type=float, default=365.0)
    parser.add_argument("--false-alarms-per-day", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()

    from guard.deploy.fleet import FleetSettings, seconds
    from guard.machine import cpu_model
    from guard.observe.logformat import silence_library_progress

    silence_library_progress()  # transformers' loading bar, as in guard's own processes

    if args.steps_from:
        measured = json.loads(args.steps_from.read_text())["measured"]
    else:
        measured = measure_steps(args.completions, args.threads)
    args.min_samples = measured["min_samples"]
    fleet = FleetSettings(false_alarms_per_day=args.false_alarms_per_day)
    windows = [int(seconds(w) // 60) for w in fleet.windows]
    h = fleet.threshold
    rng = np.random.default_rng(args.seed)
    result = delays(rng, measured, args, h, windows)
    observed = false_alarms_per_day(rng, measured, args, h, windows)
    report = {"machine": f"{cpu_model()}, {platform.platform()}", "measured": measured,
              "replicas": args.replicas, "per_replica_per_min": args.per_replica,
              "fleet_threshold": h, "windows_min": windows, "trials": args.trials,
              "delays_min": result, "false_alarms_per_day": observed, "days": args.days,
              "bound_per_day": args.false_alarms_per_day}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_detection_llm.json").write_text(json.dumps(report, indent=1) + "\n")
    steps = {k: np.asarray(measured[k]["steps"]) for k in ("healthy", "drifting")}
    rate = args.replicas * args.per_replica
    lines = [
        "# Fleet evidence for an LLM: the pooled rule against one replica sampling as much", "",
        f"Generated by `benchmarks/fleet_detection_llm.py`. Steps measured on {report['machine']}"
        f" (accuracy figures: the machine's load does not change them); the rest simulated.", "",
        f"Measured, per sampled completion (<= 64 tokens, llama.cpp's server defaults, scored "
        f"by the transformers fp32 reference with task generation's defaults: in_control_ratio "
        f"{measured['in_control_ratio']}, bet {measured['bet']}):", "",
        "| build | completions scored | mean KLD per token | mean step (nats) "
        "| share of steps > 0 |",
        "| --- | --- | --- | --- | --- |"]
    for key in ("healthy", "drifting"):
        lines.append(f"| {measured[key]['rung']} ({key}) | {steps[key].size} | "
                     f"{measured[key]['mean_kld']:.4f} | {steps[key].mean():+.3f} | "
                     f"{np.mean(steps[key] > 0):.0%} |")
    lines += [
        "", f"Simulated: {args.replicas} replicas at {args.per_replica:g} sampled completions a "
        f"minute each ({rate:g} a minute pooled), the build switched from {RUNGS['healthy']} to "
        f"{RUNGS['drifting']} on all at once; {args.trials} trials; every way held to "
        f"{args.false_alarms_per_day:g} false alarms per day:", "",
        f"- (fleet) the generated pooled rule: windows {', '.join(fleet.windows)} evaluated "
        f"every {fleet.evaluation_interval}, threshold {h:.2f} nats, at least "
        f"{args.min_samples} pooled completions; alerts as it decides;",
        f"- (one) one replica sampling {rate:g} completions a minute, guard's score CUSUM at "
        f"threshold {result['one_threshold']:.2f} (ln ARL0); alert at the next evaluation + "
        f"`for: {DRIFT_FOR_MIN}m`;",
        f"- (own) the {args.replicas} replicas' own CUSUMs at threshold "
        f"{result['own_threshold']:.2f}, the first to trip; alert likewise.", "",
        "Minutes from the drift's start, median / p90:", "",
        "| (fleet) decides = alerts | (one) decides | (one) alerts | (own) decides | (own) alerts"
        " | fleet / one, alerts |", "| --- | --- | --- | --- | --- | --- |"]
    d = result
    finite_fleet = [v for v in d["fleet"] if math.isfinite(v)]
    finite_one = [v for v in d["one_alerts"] if math.isfinite(v)]
    ratio = (np.median(finite_fleet) / np.median(finite_one)) if finite_fleet and finite_one \
        else float("nan")
    lines.append(f"| {summary(d['fleet'])} | {summary(d['one_decides'])} | "
                 f"{summary(d['one_alerts'])} | {summary(d['own_decides'])} | "
                 f"{summary(d['own_alerts'])} | {ratio:.2f}x |")
    lines += ["", f"The pooled rule's false alarms over {args.days:g} simulated days of the "
              f"healthy build's completions: {observed:.4f} per day (the threshold's bound: "
              f"{args.false_alarms_per_day:g}).", "",
              f"Reproduce: `.venv/bin/python benchmarks/fleet_detection_llm.py --completions "
              f"{steps['healthy'].size}` (measuring takes minutes on 2 cores); the simulation "
              f"alone: `--steps-from benchmarks/results/fleet_detection_llm.json`."]
    (args.out / "fleet_detection_llm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
