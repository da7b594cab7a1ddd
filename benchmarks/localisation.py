"""Tier 2 localisation on a seeded fault corpus, beside Polygraphy.

For every case of ``guard.zoo.faults.corpus`` (seeded MLPs, the zoo CNN, the zoo detector's
tie-broken NMS, MiniLM, silero-vad, and the field's architectures: a hand-written pre-norm
encoder and torchvision-layout ResNet, BERT, ViT, ResNet, ConvNeXt, MobileNetV2, Whisper's
encoder and a Llama decoder from ``transformers`` configs, each exported with both exporters,
faults in leaf modules at every depth, torch vs ONNX, ONNX vs ONNX, fp16 variants and clean
pairs; ``guard.zoo.faults.family_cases``; and ``encoder_ort``, the encoder's export through ONNX
Runtime's transformer optimiser as the primary, q/k/v packed into one Attention node,
``guard.zoo.faults.packed_attention_cases``; and the hand-written layouts eager vs
torch.compile, ``guard.zoo.faults.compiled_cases``; GRU and LSTM sequence classifiers, the
recurrent module one ONNX op, among the layouts; and SmolLM2-135M's GGUF run by llama.cpp, its
graph captured by the eval callback, against the transformers reference, one tensor requantized
or perturbed, ``guard.zoo.faults.gguf_cases``): tier 2 as
``checks.activation: {on_failure: true}`` builds it (every other key at its default, tier-1
tolerances of the case's deployment), on real ONNX Runtime sessions and torch modules. Per case:
tier 1's verdict (tier 2 applies tier 1's tolerances to the aligned outputs; for a model with
adapters, tier 1 through them is passed in as the mirror worker does), the layer named and on
what basis (over its allowance, the largest contributor, or within the budget: the first
layer measurably beyond the reference's own noise),
the rank of the true layer (first divergence, then the suspects), the time of the check (the
first check of a fresh checker: capture sessions, per-layer noise and isolation included).

On the ONNX-vs-ONNX cases, in the same run: Polygraphy (``polygraphy`` from PyPI, the
benchmark's optional extra ``guard[bench]``), as ``polygraphy run --onnxrt --onnx-outputs mark
all`` does it: every tensor marked as an output on both models, the reference's outputs compared
with the primary's at Polygraphy's default tolerances (rtol 1e-5, atol 1e-5, elementwise); its
answer is the first failing tensor in the reference graph's order, mapped to the node that
produces it. Polygraphy cannot run the torch-vs-ONNX cases.

A layer named counts as right when it is the broken one or a unit tier 2 compared as one that
holds it (``layer2.0.conv1+layer2.0.bn1``: the exporter folded the BatchNorm into the Conv;
``blocks.1.attn.{q,k,v}``: the optimiser packed the three projections into one node).

    python benchmarks/localisation.py [--quick] [--no-real] [--no-families] [--no-compiled]
                                      [--no-gguf] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guard.verify.activation.decide import (  # noqa: E402
    MEASURABLE_FLOOR,
    MEASURABLE_NOISE_FACTOR,
    PEER_FACTOR,
)


def polygraphy_first_failure(case) -> tuple[str | None, float]:
    """The producer node of the first tensor Polygraphy reports failing, and its time."""
    import onnx
    from polygraphy import constants
    from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs, OnnxFromPath
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, CompareFunc

    primary = case.primary_variant()
    started = time.perf_counter()
    runners = [OnnxrtRunner(SessionFromOnnx(BytesFromOnnx(ModifyOutputs(
        OnnxFromPath(str(path)), outputs=constants.MARK_ALL))), name=name)
        for name, path in (("reference", case.reference), ("primary", primary))]
    results = Comparator.run(runners, data_loader=[case.inputs])
    accuracy = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple())
    seconds = time.perf_counter() - started
    verdicts = next(iter(accuracy[0].values()))[0]  # one compare func, one pair, iteration 0
    graph = onnx.load(str(case.reference), load_external_data=False).graph
    for node in graph.node:  # graph order: the first failing tensor
        for value in node.output:
            if value in verdicts and not bool(verdicts[value]):
                return node.name or value, seconds
    return None, seconds


def _containers(report) -> set[str]:
    """Layers of a torch side that are modules holding other compared modules."""
    return {layer.name for layer in report.layers if any(
        other.module.startswith(layer.module + ".") for other in report.layers)}


def run_case(case) -> dict:
    from guard.zoo.faults import FAMILIES, checker_for, rank_of_true_layer, tier1_for

    checker = checker_for(case)
    tier1 = tier1_for(case)  # cases with adapters: tier 1 as the Comparator runs it
    started = time.perf_counter()
    report = checker.check(case.inputs, tier1=tier1[0] if tier1 else None)
    seconds = time.perf_counter() - started
    checker.close()
    first = report.first_divergence
    isolated = [(layer.isolated.rel_error, layer.noise, layer.name) for layer in report.layers
                if layer.isolated is not None]
    true_iso = next((e for e, _, n in isolated if n == case.true_layer), None)
    row = {
        "case": case.name, "kind": case.kind, "model": case.model, "precision": case.precision,
        "onnx_pair": case.onnx_pair, "true_layer": case.true_layer,
        "compiled": case.compiled is not None, "gguf": case.gguf,
        "tier1_failed": report.budget.tier1_failed if report.budget else None,
        "budget": report.budget.relative if report.budget else None,
        "named": first.name if first else None, "basis": report.basis,
        "right": case.names_true_layer(first.name if first else None),
        "named_container": (not case.onnx_pair and first is not None
                            and first.name in _containers(report)),
        "family": case.model.rsplit("-", 1)[0] in FAMILIES,
        "undetermined": report.undetermined, "error": report.error,
        "rank": rank_of_true_layer(case, report) if case.true_layer else None,
        "within_budget": report.within_budget, "passed": report.passed,
        "within_budget_note": report.within_budget_note,
        # the margins of the within-budget rule: the largest isolated error of any layer, that
        # over the reference's own noise on the layer, and the true layer's isolated error
        "max_isolated": max((e for e, _, _ in isolated), default=None),
        "max_isolated_over_noise": max(((e / n) if n else (float("inf") if e else 0.0)
                                        for e, n, _ in isolated), default=None),
        "true_isolated": true_iso,
        "seconds": round(seconds, 4),
    }
    if tier1 is not None:
        row["raw_tier1_passed"] = tier1[1]  # without the adapters
    if case.onnx_pair:
        try:
            row["polygraphy"], poly_s = polygraphy_first_failure(case)
            row["polygraphy_seconds"] = round(poly_s, 4)
        except Exception as exc:
            row["polygraphy"], row["polygraphy_error"] = None, f"{type(exc).__name__}: {exc}"
    return row


def _family_score(rows: list[dict]) -> dict:
    """The field's architectures alone: torch vs ONNX and ONNX vs ONNX faults, clean pairs."""
    faults = [r for r in rows if r["true_layer"] is not None and r["family"]]
    clean = [r for r in rows if r["true_layer"] is None and r["family"]]

    def group(items):
        n = len(items)
        return {"cases": n,
                "top1": round(sum(r["right"] for r in items) / n, 4) if n else None,
                "top3": round(sum(1 for r in items if r["rank"] and r["rank"] <= 3) / n, 4)
                if n else None,
                "polygraphy_top1": round(sum(r.get("polygraphy") == r["true_layer"]
                                             for r in items) / n, 4)
                if n and all(r["onnx_pair"] for r in items) else None,
                "wrong": [r["case"] for r in items if not r["right"]]}

    torch_pairs = [r for r in faults if not r["onnx_pair"]]
    onnx_pairs = [r for r in faults if r["onnx_pair"]]
    return {"families": sorted({r["model"].rsplit("-", 1)[0] for r in faults + clean}),
            "torch_onnx": group(torch_pairs), "onnx_onnx": group(onnx_pairs),
            "clean_cases": len(clean),
            "clean_blames": sum(1 for r in clean if r["named"] is not None),
            "named_containers": [r["case"] for r in faults if r["named_container"]],
            "cases_polygraphy_right_guard_wrong": [
                r["case"] for r in onnx_pairs
                if r.get("polygraphy") == r["true_layer"] and not r["right"]]}


def _compiled_score(rows: list[dict], key: str = "compiled") -> dict:
    """Eager vs torch.compile (guard.zoo.faults.compiled_cases); with ``key="gguf"``, llama.cpp
    vs transformers (guard.zoo.faults.gguf_cases)."""
    faults = [r for r in rows if r.get(key) and r["true_layer"] is not None]
    clean = [r for r in rows if r.get(key) and r["true_layer"] is None]
    n = len(faults)
    return {"cases": n,
            "top1": round(sum(r["right"] for r in faults) / n, 4) if n else None,
            "top3": round(sum(1 for r in faults if r["rank"] and r["rank"] <= 3) / n, 4)
            if n else None,
            "clean_cases": len(clean),
            "clean_blames": sum(1 for r in clean if r["named"] is not None),
            "wrong": [r["case"] for r in faults if not r["right"]]}


def _recurrent_score(rows: list[dict]) -> dict:
    """The GRU and LSTM classifiers (a fault in the recurrent module or around it)."""
    faults = [r for r in rows if r["model"].split("-")[0] in ("gru", "lstm")
              and r["true_layer"] is not None]
    clean = [r for r in rows if r["model"].split("-")[0] in ("gru", "lstm")
             and r["true_layer"] is None]
    inside = [r for r in faults if r["case"].split("-")[2].startswith("rnn.")]
    n = len(faults)
    return {"cases": n, "in_the_rnn": len(inside),
            "top1": round(sum(r["right"] for r in faults) / n, 4) if n else None,
            "top1_in_the_rnn": round(sum(r["right"] for r in inside) / len(inside), 4)
            if inside else None,
            "clean_cases": len(clean),
            "clean_blames": sum(1 for r in clean if r["named"] is not None),
            "wrong": [r["case"] for r in faults if not r["right"]]}


def _failed_row(case, exc: Exception) -> dict:
    from guard.zoo.faults import FAMILIES

    return {"case": case.name, "kind": case.kind, "model": case.model,
            "precision": case.precision, "onnx_pair": case.onnx_pair,
            "compiled": case.compiled is not None, "gguf": case.gguf,
            "true_layer": case.true_layer, "tier1_failed": None, "budget": None, "named": None,
            "basis": "", "right": False, "named_container": False,
            "family": case.model.rsplit("-", 1)[0] in FAMILIES, "undetermined": "",
            "error": f"{type(exc).__name__}: {exc}", "rank": None, "within_budget": False,
            "passed": False, "within_budget_note": "", "max_isolated": None,
            "max_isolated_over_noise": None, "true_isolated": None, "seconds": 0.0}


def score(rows: list[dict]) -> dict:
    faults = [r for r in rows if r["true_layer"] is not None]
    visible = [r for r in faults if r["tier1_failed"]]
    clean = [r for r in rows if r["true_layer"] is None]
    onnx = [r for r in faults if r["onnx_pair"]]

    def share(items, test):
        return round(sum(1 for r in items if test(r)) / len(items), 4) if items else None

    within = [r for r in faults if r["tier1_failed"] is False]
    clean32 = [r for r in clean if r["precision"] == "fp32"]
    clean_reduced = [r for r in clean if r["precision"] != "fp32"]

    return {
        "cases": len(rows), "fault_cases": len(faults), "clean_cases": len(clean),
        "tier1_failing_fault_cases": len(visible),
        "top1": share(faults, lambda r: r["right"]),
        "top1_when_tier1_fails": share(visible, lambda r: r["right"]),
        "tier1_passing_fault_cases": len(within),
        "top1_when_tier1_passes": share(within, lambda r: r["right"]),
        "named_within_budget": sum(1 for r in rows if r["within_budget"]),
        "top3": share(faults, lambda r: r["rank"] is not None and r["rank"] <= 3),
        "clean_blames": sum(1 for r in clean if r["named"] is not None),
        "clean_failed_tier2": sum(1 for r in clean if not r["passed"]),
        "measurable_floor": MEASURABLE_FLOOR,
        "clean_fp32_pairs": len(clean32),
        "clean_fp32_max_isolated": max((r["max_isolated"] or 0.0 for r in clean32),
                                       default=None),
        "clean_fp32_max_isolated_over_noise": max(
            (r["max_isolated_over_noise"] or 0.0 for r in clean32), default=None),
        "clean_reduced_min_max_isolated": min((r["max_isolated"] or 0.0 for r in clean_reduced),
                                              default=None),
        "within_budget_faults_min_true_isolated": min(
            (r["true_isolated"] for r in within if r["true_isolated"] is not None),
            default=None),
        "cases_that_could_not_run": [r["case"] for r in rows if r["error"]
                                     and r["tier1_failed"] is None],
        "silent_none_when_tier1_fails": sum(1 for r in visible
                                            if r["named"] is None and not r["undetermined"]),
        "onnx_cases": len(onnx),
        "guard_top1_onnx": share(onnx, lambda r: r["right"]),
        "polygraphy_top1_onnx": share(onnx, lambda r: r.get("polygraphy") == r["true_layer"]),
        "polygraphy_clean_blames": sum(1 for r in clean if r["onnx_pair"] and r.get("polygraphy")),
        "cases_polygraphy_right_guard_wrong": [
            r["case"] for r in onnx
            if r.get("polygraphy") == r["true_layer"] and not r["right"]],
        "torch_onnx_cases_polygraphy_cannot_run": sum(1 for r in faults if not r["onnx_pair"]
                                                      and not r.get("compiled")
                                                      and not r.get("gguf")),
        "compiled": _compiled_score(rows),
        "gguf": _compiled_score(rows, "gguf"),
        "recurrent": _recurrent_score(rows),
        "median_seconds_guard": _median([r["seconds"] for r in rows]),
        "median_seconds_polygraphy": _median([r["polygraphy_seconds"] for r in rows
                                              if "polygraphy_seconds" in r]),
        "field_architectures": _family_score(rows),
    }


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _margins(s: dict) -> list[str]:
    """The `noise` rule's margins, where the run had the cases to measure them."""
    floor = s["measurable_floor"]
    clean, ratio = s["clean_fp32_max_isolated"], s["clean_fp32_max_isolated_over_noise"]
    fault = s["within_budget_faults_min_true_isolated"]
    reduced = s["clean_reduced_min_max_isolated"]
    lines = ["Margins of the `noise` rule (isolated relative L2 error):", ""]
    if clean is not None:
        lines.append(f"- clean fp32 pairs ({s['clean_fp32_pairs']}): largest isolated error of any "
                     f"layer {clean:.3g}, at most {ratio:.3g}x the reference's own noise on that "
                     f"layer; the floor {floor:g} is "
                     + (f"{floor / clean:.0f}x above it." if clean else "above (all exactly 0)."))
    if fault is not None:
        lines.append(f"- faults inside tier 1's budget: the true layer adds at least {fault:.3g}, "
                     f"{fault / floor:.0f}x the floor.")
    if reduced is not None:
        lines.append(f"- reduced-precision clean pairs: the largest layer error of each pair is at "
                     f"least {reduced:.3g}: above the floor by design, hence no `noise` rule for "
                     "them.")
    return lines + [""]


def _field(f: dict) -> list[str]:
    """The field's architectures' figures (guard.zoo.faults.family_cases)."""
    if not f["torch_onnx"]["cases"] and not f["onnx_onnx"]["cases"]:
        return []
    t, o = f["torch_onnx"], f["onnx_onnx"]
    return [
        f"The field's architectures ({', '.join(f['families'])}; both exporters):", "",
        "| figure | value |", "| --- | --- |",
        f"| torch-vs-ONNX faults: top-1 / top-3 | {_pct(t['top1'])} / {_pct(t['top3'])} "
        f"({t['cases']} cases) |",
        f"| ONNX-vs-ONNX faults: top-1 / top-3 | {_pct(o['top1'])} / {_pct(o['top3'])} "
        f"({o['cases']} cases) |",
        f"| ONNX-vs-ONNX faults: Polygraphy top-1 | {_pct(o['polygraphy_top1'])} |",
        f"| clean pairs blamed | {f['clean_blames']} of {f['clean_cases']} |",
        f"| a container named | {', '.join(f['named_containers']) or 'never'} |",
        f"| named wrong | {', '.join(t['wrong'] + o['wrong']) or 'none'} |",
        f"| Polygraphy right, guard wrong | "
        f"{', '.join(f['cases_polygraphy_right_guard_wrong']) or 'none'} |",
        ""]


def markdown(result: dict) -> str:
    s = result["score"]
    lines = [
        "# Tier 2 localisation on a seeded fault corpus, beside Polygraphy",
        "",
        f"Machine: {result['machine']}; {result['date']}; polygraphy {result['polygraphy']}.",
        f"Command: `{result['command']}`",
        "",
        "| figure | value |", "| --- | --- |",
        f"| cases (faults / clean) | {s['cases']} ({s['fault_cases']} / {s['clean_cases']}) |",
        f"| top-1, all fault cases | {s['top1']:.1%} |",
        f"| top-1 where tier 1 fails ({s['tier1_failing_fault_cases']} cases) | "
        f"{s['top1_when_tier1_fails']:.1%} |",
        f"| top-1 where tier 1 passes ({s['tier1_passing_fault_cases']} cases) | "
        f"{_pct(s['top1_when_tier1_passes'])} |",
        f"| named within the budget (basis noise; tier 2 passes) | {s['named_within_budget']} |",
        f"| top-3, all fault cases | {s['top3']:.1%} |",
        f"| clean pairs blamed (guard) | {s['clean_blames']} of {s['clean_cases']} |",
        f"| clean pairs failing tier 2 | {s['clean_failed_tier2']} |",
        f"| tier 1 failed, no layer and no reason | {s['silent_none_when_tier1_fails']} |",
        f"| cases that could not run | {', '.join(s['cases_that_could_not_run']) or 'none'} |",
        f"| ONNX-vs-ONNX fault cases: guard top-1 | {s['guard_top1_onnx']:.1%} "
        f"({s['onnx_cases']} cases) |",
        f"| ONNX-vs-ONNX fault cases: Polygraphy top-1 | {s['polygraphy_top1_onnx']:.1%} |",
        f"| ONNX clean pairs blamed (Polygraphy) | {s['polygraphy_clean_blames']} |",
        "| Polygraphy right, guard wrong | "
        f"{', '.join(s['cases_polygraphy_right_guard_wrong']) or 'none'} |",
        f"| torch-vs-ONNX fault cases (Polygraphy cannot run) | "
        f"{s['torch_onnx_cases_polygraphy_cannot_run']} |",
        *([f"| eager vs torch.compile faults: top-1 / top-3 | {_pct(s['compiled']['top1'])} / "
           f"{_pct(s['compiled']['top3'])} ({s['compiled']['cases']} cases; clean blamed "
           f"{s['compiled']['clean_blames']} of {s['compiled']['clean_cases']}) |"]
          if s["compiled"]["cases"] else []),
        *([f"| GRU/LSTM classifiers: top-1 (fault in the recurrent module) | "
           f"{_pct(s['recurrent']['top1'])} ({_pct(s['recurrent']['top1_in_the_rnn'])}); "
           f"{s['recurrent']['cases']} cases, {s['recurrent']['in_the_rnn']} in it; clean "
           f"blamed {s['recurrent']['clean_blames']} of {s['recurrent']['clean_cases']} |"]
          if s["recurrent"]["cases"] else []),
        *([f"| GGUF (llama.cpp vs transformers) faults: top-1 / top-3 | "
           f"{_pct(s['gguf']['top1'])} / {_pct(s['gguf']['top3'])} ({s['gguf']['cases']} "
           f"cases; clean blamed {s['gguf']['clean_blames']} of {s['gguf']['clean_cases']}; "
           f"wrong: {', '.join(s['gguf']['wrong']) or 'none'}) |"]
          if s["gguf"]["cases"] else []),
        f"| median time per case: guard / Polygraphy | {s['median_seconds_guard']:.3f} s / "
        f"{s['median_seconds_polygraphy'] or 0:.3f} s |",
        "",
        "Basis: `exceeds` (isolated error over its allowance), `largest` (tier 1 failed, no layer",
        "alone over: the largest contributor), `noise` (every layer within its allowance and",
        "tier 1 passes: the first layer whose isolated error is beyond the reference's own noise,",
        "`max(" + f"{MEASURABLE_NOISE_FACTOR:g}" + " x noise, " + f"{MEASURABLE_FLOOR:g}" + ")`,"
        " named with `within_budget: true`; tier 2 still passes). Only fp32 pairs get `noise`:",
        "a reduced-precision primary within its budget names none (`-`). `peers` (a GGUF run by",
        "llama.cpp: the isolated error over " + f"{PEER_FACTOR:g}" + " x the median of the same"
        " module's in the other blocks).",
        "",
        *_field(s["field_architectures"]),
        *_margins(s),
        "| case | kind | t1 fail | true layer | guard names | rank | basis | Polygraphy | s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        poly = (r.get("polygraphy", "n/a (torch)") if r["onnx_pair"] else
                "n/a (gguf)" if r.get("gguf") else "n/a (torch)")
        basis = ("noise" if r["within_budget"] else
                 "peers" if r["basis"].startswith("isolated error stands out") else
                 "exceeds" if r["basis"].startswith("isolated") else
                 "largest" if r["basis"] else (r["undetermined"][:40] or "-"))
        # "-": no tier-1 verdict (torch vs torch: tier 2 applies tier 1 to ONNX outputs only)
        t1 = "-" if r["tier1_failed"] is None else "yes" if r["tier1_failed"] else "no"
        if "raw_tier1_passed" in r:
            t1 += " (raw: " + ("pass" if r["raw_tier1_passed"] else "fail") + ")"
        lines.append(f"| {r['case']} | {r['kind']} | {t1} | "
                     f"`{r['true_layer']}` | `{r['named']}` | {r['rank'] or '-'} | {basis} | "
                     f"`{poly}` | {r['seconds']:.3f} |")
    return "\n".join(lines) + "\n"


def _lscpu() -> str:
    """``lscpu | head -20``: the machine the figures come from, kept beside them."""
    import subprocess

    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                               timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return f"{platform.processor() or platform.machine()} (lscpu unavailable)\n"
    return "\n".join(lines[:20]) + "\n"


def main(argv: list[str] | None = None) -> int:
    from guard.machine import cpu_model
    from guard.zoo import faults

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--no-real", action="store_true", help="skip MiniLM and silero-vad")
    parser.add_argument("--no-families", action="store_true",
                        help="skip the field's architectures (hand-written and transformers)")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip eager vs torch.compile (inductor compiles, minutes)")
    parser.add_argument("--no-gguf", action="store_true",
                        help="skip SmolLM2's GGUF cases (llama.cpp vs transformers, minutes)")
    parser.add_argument("--quick", action="store_true", help="the six small weight faults only")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    import polygraphy
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # its per-tensor histograms: thousands of lines

    with tempfile.TemporaryDirectory(prefix="guard-localisation-") as tmp:
        folder = Path(tmp)
        cases = (faults.small_weight_cases(folder) if args.quick
                 else faults.corpus(folder, real=not args.no_real,
                                    families=not args.no_families,
                                    compiled=not args.no_compiled, gguf=not args.no_gguf))
        rows = []
        for case in cases:
            try:
                rows.append(run_case(case))
            except Exception as exc:  # a case that cannot run is a miss, said as such
                rows.append(_failed_row(case, exc))
            r = rows[-1]
            print(f"{r['case']:60s} named={r['named']} true={r['true_layer']} rank={r['rank']} "
                  f"poly={r.get('polygraphy', 'n/a')} {r['seconds']:.2f}s", flush=True)
    result = {"machine": f"{cpu_model()} ({platform.machine()})",
              "date": _dt.date.today().isoformat(), "polygraphy": polygraphy.__version__,
              "command": "python benchmarks/localisation.py " + " ".join(argv or sys.argv[1:]),
              "score": score(rows), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "localisation_quick" if args.quick else "localisation"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    (out / f"{stem}_machine.txt").write_text(_lscpu())
    print(json.dumps(result["score"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
