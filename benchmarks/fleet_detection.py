"""Fleet evidence: does a fleet of replicas at a low sample rate, pooled by the fleet rules
(``guard deploy rules --fleet``), alert about as fast as one replica sampling their sum?

A simulation (no servers): Poisson traffic, Bernoulli check failures at p0, then drift to p1 on
every replica at once (the image). Three ways to notice, each held to the same false-alarm rate
per day (``--false-alarms-per-day``, per model and tier):

- (fleet) the pooled rule exactly as generated (guard/deploy/fleet.py): per-minute counts summed
  over ``--replicas`` replicas sampling ``--fleet-rate`` each, the log-likelihood ratio of p1
  against p0 over each window (5m, 30m, 2h) evaluated every minute, alarm at the threshold the
  generator derives, with at least ``policy.min_samples`` (20) pooled checks. Counts are exact
  per minute (Prometheus's ``increase()`` extrapolation aside);
- (one) one replica sampling ``replicas x fleet-rate`` of the same traffic (e.g. 20%), with
  guard's own detector: a Bernoulli CUSUM from p0 to p0 + shift (policy.shift), its threshold
  exact for the ARL0 that gives the same false alarms per day at its sample rate;
- (own) what the fleet's replicas do alone: each its own CUSUM at its own rate (ARL0 for the
  fleet's false alarms per day shared among them), the first of them to trip.

Each is given twice: when the detector decides, and when its alert fires. The CUSUMs decide on
the replica at once; their alert (GuardDriftOverThreshold) fires at the first rule evaluation
after that (every minute) plus its ``for`` (``--drift-for``, 2 minutes). The pooled rule decides
in Prometheus and alerts at once (no ``for``): comparing alerts is comparing what an on-call
engineer sees. (Scrape delay is left out of all three alike.)

Also the pooled rule's false alarms per day, measured over ``--days`` of in-control traffic,
next to the bound the threshold promises.

Usage: ``.venv/bin/python benchmarks/fleet_detection.py [--replicas 20] [--rps 50]
[--fleet-rate 0.01] [--p0 0.005] [--trials 400]``. Results: ``fleet_detection.json`` and
``.md`` under ``--out`` (default ``benchmarks/results``). Pure computation: the figures do not
depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import numpy as np

from guard.deploy.fleet import FleetSettings, seconds
from guard.policy.detector import exact_threshold

HERE = Path(__file__).resolve().parent
MIN_SAMPLES = 20  # policy.min_samples' default
SHIFT = 0.02  # policy.shift's default


def llr_steps(p0: float, p1: float) -> tuple[float, float]:
    return math.log(p1 / p0), math.log((1 - p1) / (1 - p0))


def fleet_delays(rng, lam_min: float, p0: float, p_drift: float, p1: float, h: float,
                 windows_min: list[int], trials: int, horizon_min: int) -> np.ndarray:
    """Minutes from the drift's start (uniform within a minute) to the pooled rule's first
    alarm after it; inf where none within the horizon."""
    history = max(windows_min)
    columns = history + horizon_min
    start = rng.random(trials)  # the drift starts this far into minute ``history``
    n = rng.poisson(lam_min, size=(trials, columns))
    rate = np.full((trials, columns), p0)
    rate[:, history + 1:] = p_drift
    # The minute the drift starts in: its samples before the start at p0, after at p_drift.
    rate[:, history] = p0 + (p_drift - p0) * (1 - start)
    f = rng.binomial(n, rate)
    up, down = llr_steps(p0, p1)
    alarm = pooled_alarms(n, up * f + down * (n - f), windows_min, h, MIN_SAMPLES)
    # Evaluations at the end of each minute from the drift's minute on.
    after = alarm[:, history:]
    first = np.where(after.any(axis=1), after.argmax(axis=1), np.inf)
    return first + 1 - start  # the evaluation closing minute k is k + 1 minutes in


def alerted(rng, decided_min: np.ndarray, for_min: float) -> np.ndarray:
    """Minutes from the drift's start to the alert on a replica's decision: the next rule
    evaluation (every minute; the drift starts uniformly within one), then ``for``."""
    start = rng.random(decided_min.shape)
    return np.ceil(start + decided_min) - start + for_min


def cusum_delays(rng, samples_per_s: float, p0: float, p_drift: float, p1: float,
                 arl0: float, trials: int, max_samples: int, copies: int = 1) -> np.ndarray:
    """Minutes from the drift's start to the first alarm of ``copies`` independent CUSUMs
    (each sampling ``samples_per_s``), each started at S = 0 when the drift starts."""
    h = exact_threshold(p0, p1, arl0)
    up, down = llr_steps(p0, p1)
    s = np.zeros((trials, copies))
    alarmed = np.full((trials, copies), -1, dtype=np.int64)
    for k in range(max_samples):
        fails = rng.random((trials, copies)) < p_drift
        s = np.maximum(0.0, s + np.where(fails, up, down))
        newly = (s >= h) & (alarmed < 0)
        alarmed[newly] = k + 1
        if (alarmed >= 0).all():
            break
    # Samples to alarm -> time: the k-th sample of a Poisson stream arrives at Gamma(k, rate).
    k = np.where(alarmed >= 0, alarmed, 0)
    t = np.where(alarmed >= 0, rng.gamma(np.maximum(k, 1), 1.0 / samples_per_s), np.inf)
    return t.min(axis=1) / 60.0


def fleet_false_alarms(rng, lam_min: float, p0: float, p1: float, h: float,
                       windows_min: list[int], days: int) -> float:
    """Alarm episodes (not-alarmed -> alarmed) per day of in-control pooled traffic."""
    minutes = days * 1440
    n = rng.poisson(lam_min, size=minutes)
    f = rng.binomial(n, p0)
    up, down = llr_steps(p0, p1)
    return episodes(pooled_alarms(n, up * f + down * (n - f), windows_min, h, MIN_SAMPLES)) / days


def pooled_alarms(counts: np.ndarray, llr: np.ndarray, windows_min: list[int], h: float,
                  min_samples: int) -> np.ndarray:
    """The pooled rule at each minute's evaluation (the last axis is minutes): per window, the
    summed per-minute log-likelihood ratio (or log e-value) at or over ``h`` with at least
    ``min_samples`` samples in it; a window counts once it is full."""
    shape = counts.shape[:-1] + (1,)
    cn = np.concatenate([np.zeros(shape), np.cumsum(counts, axis=-1)], axis=-1)
    cl = np.concatenate([np.zeros(shape), np.cumsum(llr, axis=-1)], axis=-1)
    alarm = np.zeros(counts.shape, dtype=bool)
    for w in windows_min:
        nw, lw = cn[..., w:] - cn[..., :-w], cl[..., w:] - cl[..., :-w]
        alarm[..., w - 1:] |= (lw >= h) & (nw >= min_samples)
    return alarm


def episodes(alarm: np.ndarray) -> int:
    """Alarm episodes in a minute series: not-alarmed -> alarmed, and an alarm at the start."""
    return int(np.count_nonzero(alarm[1:] & ~alarm[:-1]) + alarm[0])


def summary(minutes: np.ndarray) -> dict:
    finite = minutes[np.isfinite(minutes)]
    return {"median_min": float(np.median(minutes)), "p90_min": float(np.percentile(minutes, 90)),
            "detected": float(finite.size / minutes.size)}


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    fleet = FleetSettings(false_alarms_per_day=args.false_alarms_per_day)
    windows = [int(seconds(w) // 60) for w in fleet.windows]
    h = fleet.threshold
    p0, p1 = args.p0, args.p0 + SHIFT
    pooled_per_s = args.replicas * args.rps * args.fleet_rate
    replica_per_s = args.rps * args.fleet_rate
    arl0_one = pooled_per_s * 86400 / args.false_alarms_per_day
    arl0_own = replica_per_s * 86400 / (args.false_alarms_per_day / args.replicas)
    rows = []
    for p_drift in [float(x) for x in args.drift.split(",")]:
        fleet_min = fleet_delays(rng, pooled_per_s * 60, p0, p_drift, p1, h, windows,
                                 args.trials, args.horizon_min)
        one_min = cusum_delays(rng, pooled_per_s, p0, p_drift, p1, arl0_one, args.trials,
                               int(pooled_per_s * 60 * args.horizon_min))
        own_min = cusum_delays(rng, replica_per_s, p0, p_drift, p1, arl0_own, args.trials,
                               int(replica_per_s * 60 * args.horizon_min), args.replicas)
        rows.append({"p_drift": p_drift, "fleet": summary(fleet_min), "one": summary(one_min),
                     "own": summary(own_min),
                     "one_alert": summary(alerted(rng, one_min, args.drift_for)),
                     "own_alert": summary(alerted(rng, own_min, args.drift_for))})
        r = rows[-1]
        print(f"p0 {p0:g} -> {p_drift:g}: median minutes to decide (to alert): fleet rule "
              f"{r['fleet']['median_min']:.1f}, one replica at "
              f"{args.replicas * args.fleet_rate:.0%} {r['one']['median_min']:.1f} "
              f"({r['one_alert']['median_min']:.1f}), first own detector "
              f"{r['own']['median_min']:.1f} ({r['own_alert']['median_min']:.1f})", flush=True)
    measured = fleet_false_alarms(rng, pooled_per_s * 60, p0, p1, h, windows, args.days)
    print(f"fleet rule: {measured:.4f} false alarms per day measured over {args.days} days "
          f"(bound {args.false_alarms_per_day:g})")
    return {"settings": vars(args) | {"windows": list(fleet.windows),
                                      "evaluation_interval": fleet.evaluation_interval,
                                      "threshold": h, "p1": p1, "pooled_samples_per_s":
                                      pooled_per_s, "arl0_one": arl0_one, "arl0_own": arl0_own},
            "rows": rows, "false_alarms_per_day_measured": measured,
            "machine": {"python": platform.python_version(), "numpy": np.__version__}}


def markdown(report: dict) -> str:
    st = report["settings"]
    share = st["replicas"] * st["fleet_rate"]
    lines = [
        "# Fleet evidence: the pooled rule against one replica sampling as much", "",
        "Generated by `benchmarks/fleet_detection.py` (a simulation: no machine dependence). "
        f"{st['replicas']} replicas at {st['rps']:g} req/s each, sampling "
        f"{st['fleet_rate']:.0%} ({st['pooled_samples_per_s']:g} checks/s pooled); p0 "
        f"{st['p0']:g}, the detectors' p1 = p0 + {SHIFT} = {st['p1']:g}; every way held to "
        f"{st['false_alarms_per_day']:g} false alarms per day per model and tier; "
        f"{st['trials']} trials per drift.", "",
        f"- (fleet) the generated pooled rule: windows {', '.join(st['windows'])} evaluated "
        f"every {st['evaluation_interval']}, threshold {st['threshold']:.2f} nats, at least "
        f"{MIN_SAMPLES} pooled checks;",
        f"- (one) one replica sampling {share:.0%} of the same traffic, guard's CUSUM (exact "
        f"threshold, ARL0 {st['arl0_one']:.3g} samples);",
        f"- (own) the {st['replicas']} replicas' own CUSUMs at {st['fleet_rate']:.0%} each "
        f"(ARL0 {st['arl0_own']:.3g} samples each: the fleet's false alarms shared): the first "
        "to trip.", "",
        "Minutes from the drift's start, median / p90: to the decision, and to the alert (the "
        f"replicas' GuardDriftOverThreshold: next minute's evaluation + `for: "
        f"{st['drift_for']:g}m`; the pooled rule has no `for`: its alert is its decision).", "",
        "| drift p0 -> | (fleet) decides = alerts | (one) decides | (one) alerts | "
        "(own) decides | (own) alerts | fleet / one, alerts |",
        "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        cells = [f"{r[k]['median_min']:.1f} / {r[k]['p90_min']:.1f}"
                 for k in ("fleet", "one", "one_alert", "own", "own_alert")]
        lines.append(f"| {r['p_drift']:g} | " + " | ".join(cells) + " | "
                     f"{r['fleet']['median_min'] / r['one_alert']['median_min']:.2f}x |")
    lines += ["", f"The pooled rule's false alarms, measured over {st['days']} simulated days of "
              f"in-control traffic: {report['false_alarms_per_day_measured']:.4f} per day "
              f"(the threshold's bound: {st['false_alarms_per_day']:g})."]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=20)
    p.add_argument("--rps", type=float, default=50.0, help="requests/s per replica (50)")
    p.add_argument("--fleet-rate", type=float, default=0.01, help="mirror.sample_rate (0.01)")
    p.add_argument("--p0", type=float, default=0.005)
    p.add_argument("--drift", default="0.015,0.025,0.05,0.2",
                   help="failure rates after the drift")
    p.add_argument("--false-alarms-per-day", type=float, default=0.1)
    p.add_argument("--drift-for", type=float, default=2.0,
                   help="minutes of the replicas' drift alert's `for` (drift_for: 2m)")
    p.add_argument("--trials", type=int, default=400)
    p.add_argument("--horizon-min", type=int, default=360)
    p.add_argument("--days", type=int, default=365)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    report["settings"]["out"] = str(args.out)
    (args.out / "fleet_detection.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "fleet_detection.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
