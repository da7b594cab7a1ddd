"""Summary tables of a matrix run: pass rate by tolerance, model x backend (table and heat map
PNG), failure taxonomy, smallest passing atol, tier 2's first divergent layer, latencies.
Written as summary.json and summary.md (and heatmap.png when matplotlib is installed:
``pip install '.[matrix]'``)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from guard.errors import install_hint


def _rate(passed: int, total: int) -> str:
    return f"{100 * passed / total:.1f}% ({passed}/{total})" if total else "n/a"


def summarise(records: list[dict]) -> dict:
    run = [r for r in records if r["status"] != "skip"]
    passed = sum(r["status"] == "pass" for r in run)
    by_tol: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    cells: dict = defaultdict(lambda: [0, 0])
    taxonomy = Counter(r["failure_type"] for r in run if r["status"] == "fail")
    taxonomy_by_backend: dict = defaultdict(Counter)
    min_atol: dict = {}
    latency: dict = {}
    generation: dict = {}
    for r in run:
        ok = r["status"] == "pass"
        key = (r["model"], r["backend"])
        cells[key][0] += ok
        cells[key][1] += 1
        if not ok:
            taxonomy_by_backend[r["backend"]][r["failure_type"]] += 1
        if "latency" in r:
            latency[key] = r["latency"]
        if r["tier"] == "generation":
            generation[f"{r['model']}|{r['backend']}"] = {
                k: r.get(k) for k in ("status", "reason", "reference", "backend_kind",
                                      "precision", "device", "quant", "serve", "samples",
                                      "samples_passed", "stats", "cause")}
            continue
        for tier in (r["tier"], "all"):
            cell = by_tol[f"atol={r['atol']:g} rtol={r['rtol']:g}"][tier]
            cell[0] += ok
            cell[1] += 1
        if r["tier"] == "tensor" and ok:
            current = min_atol.get(key)
            min_atol[key] = r["atol"] if current is None else min(current, r["atol"])
    # Tier 2: the layer named at the loosest tolerance where tier 2 ran (its first failure).
    divergence: dict = {}
    for r in sorted((r for r in run if r["tier"] == "activation"), key=lambda r: r["atol"]):
        first = (r.get("stats") or {}).get("first_divergence")
        divergence[(r["model"], r["backend"])] = (
            first["layer"] if first else ("undetermined" if r["status"] == "fail" else "-"))
    models = list(dict.fromkeys(r["model"] for r in records))
    backends = list(dict.fromkeys(r["backend"] for r in records))
    return {
        "checks": len(run),
        "passed": passed,
        "skipped": len(records) - len(run),
        "pass_rate": passed / len(run) if run else 0.0,
        "models": models,
        "backends": backends,
        "by_tolerance": {t: {tier: {"passed": c[0], "checks": c[1]} for tier, c in v.items()}
                         for t, v in by_tol.items()},
        "cells": {f"{m}|{b}": {"passed": c[0], "checks": c[1]} for (m, b), c in cells.items()},
        "failure_taxonomy": dict(taxonomy),
        "failure_taxonomy_by_backend": {b: dict(c) for b, c in taxonomy_by_backend.items()},
        "min_passing_atol": {f"{m}|{b}": v for (m, b), v in min_atol.items()},
        "latency": {f"{m}|{b}": v for (m, b), v in latency.items()},
        "first_divergence": {f"{m}|{b}": v for (m, b), v in divergence.items()},
        "causes": {r["backend"]: r["cause"] for r in records if r.get("cause")},
        "generation": generation,
        "environment": records[0]["environment"] if records else {},
    }


def markdown(summary: dict, title: str) -> str:
    s = summary
    lines = [f"# guard matrix: {title}", "",
             f"{s['checks']} checks (model x backend x tolerance x tier), {s['passed']} pass: "
             f"**{100 * s['pass_rate']:.1f}%**" + (f"; {s['skipped']} skipped (backend does not "
                                                  f"apply)" if s["skipped"] else "") + ".", ""]
    env = s.get("environment", {})
    if env:
        lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    if s["by_tolerance"]:
        lines += _tensor_sections(s)
    if s.get("generation"):
        lines += _generation_sections(s["generation"])
    lines += ["", "## Failure taxonomy", "", "| failure type | checks |", "| --- | --- |"]
    for kind, count in sorted(s["failure_taxonomy"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {count} |")
    if s["failure_taxonomy_by_backend"]:
        kinds = sorted(s["failure_taxonomy"])
        causes = s.get("causes", {})
        extra = ["cause"] if causes else []
        lines += ["", "| backend | " + " | ".join(kinds + extra) + " |",
                  "| --- |" + " --- |" * len(kinds + extra)]
        for b, c in s["failure_taxonomy_by_backend"].items():
            cells = [str(c.get(k, 0)) for k in kinds] + ([causes.get(b, "")] if causes else [])
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
    def cell_latency(m: str, b: str) -> str:
        lat = s["latency"].get(f"{m}|{b}")
        if not lat or "reference_ms" not in lat:
            return ""
        return f"{lat['reference_ms']:.2f} / {lat['backend_ms']:.2f}"

    if s["by_tolerance"]:
        lines += _model_backend_table("Median latency per sample (ms): reference / backend", s,
                                      cell_latency)
    return "\n".join(lines) + "\n"


def _tensor_sections(s: dict) -> list[str]:
    """Pass rates by tolerance, the model x backend tables, tier 2's layers."""
    lines: list[str] = []
    tiers = sorted({tier for v in s["by_tolerance"].values() for tier in v} - {"all"}) + ["all"]
    lines += ["## Pass rate by tolerance", "", "| tolerance | " + " | ".join(tiers) + " |",
              "| --- |" + " --- |" * len(tiers)]
    for tol, v in s["by_tolerance"].items():
        lines.append(f"| {tol} | " + " | ".join(
            _rate(v[t]["passed"], v[t]["checks"]) if t in v else "" for t in tiers) + " |")
    def cell_count(m: str, b: str) -> str:
        c = s["cells"].get(f"{m}|{b}")
        return f"{c['passed']}/{c['checks']}" if c else "skip"

    def cell_atol(m: str, b: str) -> str:
        v = s["min_passing_atol"].get(f"{m}|{b}")
        return f"{v:g}" if v is not None else ("none" if f"{m}|{b}" in s["cells"] else "skip")

    lines += _model_backend_table(
        "Model x backend (checks passed over all tolerances and tiers)", s, cell_count)
    lines += _model_backend_table("Smallest atol in the grid at which tier 1 passes", s,
                                  cell_atol)
    if s.get("first_divergence"):
        def cell_layer(m: str, b: str) -> str:
            return s["first_divergence"].get(f"{m}|{b}", "skip")

        lines += _model_backend_table(
            "First divergent layer (tier 2, at the loosest tolerance it ran; -: tier 1 passed)",
            s, cell_layer)
    return lines


# Below this mean KLD (nats per token) a column and the reference agree to fp32's rounding (a
# cuda fp32 column: 3e-11 full, 1e-8 from guard's top-20, whose logprobs are rounded floats):
# the ratio of guard's estimate to the full figure says nothing there, and is not printed.
RATIO_FLOOR = 1e-7


def _ratio(stats: dict) -> float | None:
    """guard's KLD over the full-vocabulary figure (the record's), where the latter is above
    fp32's rounding."""
    full = stats.get("full_kld")
    return stats.get("guard_over_full") if full is not None and full >= RATIO_FLOOR else None


def _num(value, spec: str = ".5f") -> str:
    return "n/a" if value is None else format(value, spec)


def _generation_sections(generation: dict) -> list[str]:
    """The generative columns: guard's figures on each column's own completions, and
    llama-perplexity's statistics on the reference's completions."""
    lines: list[str] = []
    by_model: dict = defaultdict(list)
    for key, row in generation.items():
        by_model[key.split("|")[0]].append((key.split("|")[1], row))
    for model, rows in by_model.items():
        reference = rows[0][1]["reference"]
        stats0 = rows[0][1].get("stats") or {}
        lines += [
            "", f"## Generative columns of {model}", "",
            f"Every figure is against the reference **{reference}**, per token in nats (not "
            "llama.cpp's F16-based tables).", "",
            f"Guard's figures, as the generation tier sees them online: each column's own greedy "
            f"completions with their top-{stats0.get('top_logprobs', '?')} logprobs, as an "
            "OpenAI-compatible server returns them; guard's KLD is KL(column || reference) "
            "estimated from those (guard/verify/generation/), beside the full-vocabulary "
            "figure on the same tokens where the column gives its distributions.", "",
            "| column | engine | verdict | completions passed | mean KLD (guard) | full "
            "vocabulary | guard / full | lumped bound | KLD p99 | same top-1 | RMS Δp |",
            "| --- |" + " --- |" * 10]
        for name, row in rows:
            st = row.get("stats") or {}
            served = row.get("serve") and f"({row['serve']} server)"
            as_is = row["backend_kind"] in ("llama_cpp", "openai") and not row.get("quant")
            engine = " ".join(filter(None, [row["backend_kind"], served, row.get("quant") or (
                                                "GGUF as is" if as_is else None),
                                            None if row["precision"] == "fp32" else
                                            row["precision"],
                                            None if (row.get("device") or "cpu") == "cpu" else
                                            f"on {row['device']}"]))
            if not st:
                lines.append(f"| {name} | {engine} | {row['status']}: {row['reason'][:80]} |"
                             + " |" * 8)
                continue
            lines.append(
                f"| {name} | {engine} | {row['status']} | {row['samples_passed']}/"
                f"{row['samples']} | {_num(st['mean_kld'])} | {_num(st.get('full_kld'))} | "
                f"{_num(_ratio(st), '.3f')} | "
                f"{_num(st['mean_kld_lower_bound'])} | {_num(st['kld_p99'], '.4f')} | "
                f"{_num(st['top1_agreement'], '.1%')} | {_num(st['delta_p_rms'], '.2%')} |")
        lines += [
            "", "llama-perplexity's statistics (its `--kl-divergence` figures), on the same "
            "tokens for every column: the reference's own greedy completions of the prompts, "
            "teacher-forced by both; in-process columns only (a server returns no "
            "distributions over a given text).", "",
            "| column | tokens | mean KLD(ref ‖ column) | KLD p99 | RMS Δp | same top p | "
            "PPL(column)/PPL(ref) |", "| --- |" + " --- |" * 6]
        for name, row in rows:
            pp = (row.get("stats") or {}).get("perplexity") or {}
            if not pp:
                lines.append(f"| {name} | n/a |" + " |" * 5)
                continue
            lines.append(f"| {name} | {pp['tokens']} | {_num(pp['mean_kld'])} | "
                         f"{_num(pp['kld_p99'], '.4f')} | {_num(pp['delta_p_rms'], '.2%')} | "
                         f"{_num(pp['same_top1'], '.1%')} | {_num(pp['ppl_ratio'], '.4f')} |")
    return lines


def _model_backend_table(title: str, s: dict, cell) -> list[str]:
    """A section with one row per model and one column per backend; ``cell(model, backend)``."""
    lines = ["", f"## {title}", "", "| model | " + " | ".join(s["backends"]) + " |",
             "| --- |" + " --- |" * len(s["backends"])]
    for m in s["models"]:
        lines.append(f"| {m} | " + " | ".join(cell(m, b) for b in s["backends"]) + " |")
    return lines


def heatmap(summary: dict, path: Path, title: str) -> str:
    """Write the model x backend pass-rate heat map; returns "" or why it was not written."""
    if not summary["models"] or not summary["backends"]:
        return "no check ran (every reference was skipped: the lines above say why)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed: {install_hint('matrix')}"
    import numpy as np

    models, backends = summary["models"], summary["backends"]
    grid = np.full((len(models), len(backends)), np.nan)
    for i, m in enumerate(models):
        for j, b in enumerate(backends):
            c = summary["cells"].get(f"{m}|{b}")
            if c and c["checks"]:
                grid[i, j] = c["passed"] / c["checks"]
    fig, ax = plt.subplots(figsize=(1.3 * len(backends) + 2.5, 0.6 * len(models) + 2))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(backends)), backends, rotation=35, ha="right")
    ax.set_yticks(range(len(models)), models)
    for i, m in enumerate(models):
        for j, b in enumerate(backends):
            c = summary["cells"].get(f"{m}|{b}")
            ax.text(j, i, f"{c['passed']}/{c['checks']}" if c else "skip", ha="center",
                    va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="share of checks passing")
    ax.set_title(f"{title}: {100 * summary['pass_rate']:.1f}% of {summary['checks']} checks pass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def write_report(records: list[dict], output_dir: Path, title: str) -> dict:
    summary = summarise(records)
    why = heatmap(summary, output_dir / "heatmap.png", title)
    text = markdown(summary, title)
    text += ("\n![model x backend](heatmap.png)\n" if not why else f"\nNo heat map: {why}\n")
    (output_dir / "summary.md").write_text(text)
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return summary
