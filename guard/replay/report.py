"""Writing the replay report: REPORT_DIR/report.json (CONTRACT.md fields and more), report.md
for humans and CI logs, and report.html with inline-SVG plots that open from disk.

The JSON is strict (no NaN/Infinity: a non-finite figure is written as null). Fields that
depend on how the replay ran rather than on what it found (``generated_at``, ``engine``,
``timing``) are grouped so that two runs of one capture can be compared without them.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from guard.replay import svg
from guard.replay.aggregate import HIST_EDGES

RUN_DEPENDENT = ("generated_at", "engine", "timing")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _iso(unix_nanos: float) -> str:
    return datetime.fromtimestamp(unix_nanos / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def write_report(report: dict, folder: str | Path) -> dict[str, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "md": folder / "report.md",
             "html": folder / "report.html"}
    clean = _finite(report)
    paths["json"].write_text(json.dumps(clean, indent=2, allow_nan=False) + "\n")
    paths["md"].write_text(markdown(clean))
    paths["html"].write_text(html(clean))
    return paths


# -- markdown --------------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _tier_cell(figures: dict) -> str:
    if not figures["checks"]:
        return "no checks"
    return f"{figures['passed']}/{figures['checks']} pass"


def markdown(r: dict) -> str:
    out = [f"# guard replay report: {r['verdict'].upper()}", ""]
    out.append(f"guard {r['guard_version']}, config `{r['config']['path']}` "
               f"(hash {r['config']['hash'] or '-'}), engine {r['engine']['name']}, "
               f"{r['timing']['records']} record(s) in {r['timing']['seconds']:.1f} s "
               f"({r['timing']['records_per_second']:.0f}/s). Exit code {r['exit_code']}.")
    out.append("")
    for problem in r["problems"]:
        out.append(f"- **problem**: {problem}")
    if r["problems"]:
        out.append("")
    out += ["| model | samples | verdict | tensor | max abs error | activation | task |",
            "| --- | ---: | --- | --- | ---: | --- | --- |"]
    for name, m in r["models"].items():
        t = m["tiers"]
        out.append(f"| {name} | {m['samples']} | **{m['verdict']}** | {_tier_cell(t['tensor'])} "
                   f"| {_fmt(t['tensor']['max_abs_error'])} | {_tier_cell(t['activation'])} | "
                   f"{_tier_cell(t['task'])} |")
    out.append("")
    for name, m in r["models"].items():
        out += [f"## {name}: {m['verdict']}", "", m["verdict_reason"], ""]
        for role, summary in m["backends"].items():
            out.append(f"- {role}: {summary}")
        if m.get("tiers_run"):
            out.append(f"- tiers run: {', '.join(m['tiers_run'])}")
        floor = m.get("noise_floor")
        if floor:
            figures = ", ".join(f"{k} {_fmt(v)}" for k, v in floor["per_output"].items())
            out.append("- reference noise floor (allowed on top of atol + rtol): " + (
                figures or "0") if not floor["skipped"] else
                f"- reference noise floor not measured: {floor['skipped']}")
        s = m["status"]
        out.append(f"- records: {s['checked']} checked, {s['primary_error']} primary errors, "
                   f"{s['reference_error']} reference errors, {s['input_error']} input errors")
        live = m["live_agreement"]
        if live["compared"]:
            out.append(f"- against the sidecar's live verdicts ({live['compared']} mirrored "
                       f"records): {live['both_pass']} both pass, {live['both_fail']} both "
                       f"fail, {live['live_pass_replay_fail']} now fail, "
                       f"{live['live_fail_replay_pass']} now pass")
        out.append("")
        outputs = m["tiers"]["tensor"]["outputs"]
        if outputs:
            out += ["| output | checks | passed | max abs error | mean of max abs | allowed "
                    "(max) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
            for oname, o in outputs.items():
                out.append(f"| {oname} | {o['checks']} | {o['passed']} | "
                           f"{_fmt(o['max_abs_error'])} | {_fmt(o['mean_max_abs_error'])} | "
                           f"{_fmt(o['allowed_max'])} |")
            out.append("")
        act = m["tiers"]["activation"]
        if act["checks"]:
            first = act["first_divergence"]
            out.append("First divergent layer: " + (
                f"`{first['layer']}` (error {_fmt(first['error'])})" if first else "none"))
        else:
            out.append("Tier 2 (activation) produced no data in this replay: no per-layer "
                       "profile.")
        task = m["tiers"]["task"]
        if task["checks"]:
            metrics = ", ".join(f"{k} {_fmt(v)}" for k, v in task["metrics"].items())
            out.append(f"Task metrics (mean over samples): {metrics or '-'}")
        out.append("")
        for ex in m["failing_examples"]:
            out.append(f"- failing: record {ex['index']} (id `{ex['request_id'] or '-'}`, "
                       f"{Path(ex['source']).name}): {ex['why']}")
        for ex in m["error_examples"]:
            out.append(f"- {ex['status']}: record {ex['index']} (id "
                       f"`{ex['request_id'] or '-'}`): {ex['error']}")
        out.append("")
    i = r["inputs"]
    out += ["## Inputs", "",
            f"{len(i['files'])} file(s), {i['records_read']} record(s) read, {i['replayed']} "
            f"replayed; skipped {i['skipped_bytes']} damaged byte(s) in "
            f"{i['skipped_regions']} region(s); {i['unreadable_records']} unreadable record(s)."]
    if i["filtered"]:
        out.append("Left out by filters: " + ", ".join(f"{k} {v}" for k, v in
                                                         i["filtered"].items()) + ".")
    if i["stopped_at_max_records"]:
        out.append("Stopped at --max-records.")
    if r["unknown_models"]:
        out.append("Records of models the config lacks (not replayed): " + ", ".join(
            f"{k} {v}" for k, v in r["unknown_models"].items()) + ".")
    out.append("")
    for f in i["files"]:
        line = f"- `{f['path']}` ({f['kind']}): {f.get('records', 0)} record(s)"
        if f.get("skipped_bytes"):
            line += (f", skipped {f['skipped_bytes']} byte(s) in {f['skipped_regions']} "
                     "region(s)" + (", ends inside a record" if f.get("truncated_tail") else ""))
        out.append(line)
    out.append("")
    return "\n".join(out)


# -- html ------------------------------------------------------------------------------------
def _bin_label(k: int) -> str:
    """The label at bar k's left edge: bin k >= 1 starts at HIST_EDGES[k - 1] = 10**((k-25)/2),
    labelled at whole decades only to keep the axis readable. Bin 0 holds exact zeros."""
    if k == 0:
        return ""
    exponent = (k - 1 - 24) / 2
    return f"1e{int(exponent)}" if exponent == int(exponent) else ""


def _histogram_svg(name: str, o: dict) -> str:
    counts = o["histogram"]
    allowed = o.get("allowed_max") or 0.0
    # Bar k spans [k, k+1) and values [10**((k-25)/2), 10**((k-24)/2)): where the tolerance is.
    marker = 2 * math.log10(allowed) + 25 if allowed > 0 else None
    shown = [k for k, c in enumerate(counts) if c] + ([int(marker)] if marker else [])
    lo = max(0, min(shown, default=0) - 1)
    hi = min(len(counts) - 1, max(shown, default=0) + 1)
    return svg.bars(
        f"{name}: max abs error per sample ({o['checks']} samples)",
        [_bin_label(k) for k in range(lo, hi + 1)], counts[lo:hi + 1],
        x_title="max |primary - reference| per sample (log bins, half a decade)",
        marker=None if marker is None else marker - lo,
        marker_label=f"allowed {allowed:.2g}" if marker is not None else "",
        tips=[_bin_range(k) for k in range(lo, hi + 1)], label_every=1, edge_labels=True,
    )


def _bin_range(k: int) -> str:
    if k == 0:
        return "exactly 0"
    if k == len(HIST_EDGES):
        return f">= {HIST_EDGES[-1]:.2g} or not finite"
    low = HIST_EDGES[k - 1] if k >= 2 else 0.0  # bin 1 also takes anything below its edge
    return f"[{low:.2g}, {HIST_EDGES[k]:.2g})"


def _timeline_svg(m: dict) -> str:
    tl = m["timeline"]
    if not tl["buckets"]:
        return "<p>No checked samples.</p>"
    xs = [b["start"] for b in tl["buckets"]]
    ys = [b["passed"] / b["checks"] for b in tl["buckets"]]
    if tl["axis"] == "unix_nanos":
        ends = (_iso(tl["start"]), _iso(tl["end"]))
        title = "capture time (UTC)"
    else:
        ends = (f"record {int(tl['start'])}", f"record {int(tl['end'])}")
        title = "record order (no timestamps)"
    trip = m["thresholds"]["trip_ratio"]
    return svg.line("pass rate over time (all tiers)", xs, ys, x_labels=ends, x_title=title,
                    threshold=1 - trip, threshold_label=f"1 - trip_ratio ({1 - trip:.0%})")


def _profile_svg(m: dict) -> str:
    act = m["tiers"]["activation"]
    if not act["checks"]:
        return ("<p>Per-layer error profile: tier 2 (activation) produced no data in this "
                "replay (it did not run for this model), so there is no first divergence to "
                "profile.</p>")
    if not act["profile"]:
        return "<p>Per-layer error profile: no layer diverged.</p>"
    layers = [p["layer"] for p in act["profile"]]
    errors = [float(p["error"]) for p in act["profile"]]
    first = act["first_divergence"]["layer"] if act["first_divergence"] else None
    highlight = layers.index(first) if first in layers else None
    return svg.bars(f"per-layer error of the first divergence (first: {first})", layers, errors,
                    x_title="layer (network order), error on a log scale", highlight=highlight,
                    log=True)


def html(r: dict) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>guard replay: {escape(r['verdict'])}</title>",
             "<style>body{font-family:sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}"
             ".drift{color:#b52b27}.pass{color:#2b7a2b}svg{display:block;margin:.5rem 0}"
             "</style></head><body>"]
    colour = "pass" if r["verdict"] == "pass" else "drift"
    parts.append(f"<h1>guard replay: <span class='{colour}'>{escape(r['verdict'].upper())}"
                 "</span></h1>")
    # The markdown already says everything in words; reuse it as preformatted text under the
    # plots rather than maintaining a second prose layout.
    for name, m in r["models"].items():
        verdict_class = "pass" if m["verdict"] == "pass" else "drift"
        parts.append(f"<h2>{escape(name)}: <span class='{verdict_class}'>"
                     f"{escape(m['verdict'])}</span></h2><p>{escape(m['verdict_reason'])}</p>")
        for oname, o in m["tiers"]["tensor"]["outputs"].items():
            parts.append(_histogram_svg(oname, o))
        if not m["tiers"]["tensor"]["outputs"]:
            parts.append("<p>No tensor checks: no error distribution.</p>")
        parts.append(_timeline_svg(m))
        parts.append(_profile_svg(m))
    parts.append("<h2>Details</h2><pre>" + escape(markdown(r)) + "</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
