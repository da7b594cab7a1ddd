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
from guard.replay.generation_report import CSS as GENERATION_CSS
from guard.replay.generation_report import generation_layout
from guard.replay.layout import (
    Bullets,
    Code,
    Figure,
    Heading,
    Link,
    Para,
    Rendered,
    Strong,
    Table,
    anchor,
    fmt,
)

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


def _tier_cell(figures: dict) -> str:
    if not figures["checks"]:
        return "no checks"
    cell = f"{figures['passed']}/{figures['checks']} pass"
    if figures.get("mean_kld") is not None:  # the generation tier's headline figure
        cell += f", mean KLD {figures['mean_kld']:.3g}"
    return cell


class _Anchors:
    """The ids of one model's plot sections, shared by the plots and the links to them."""

    def __init__(self, k: int, name: str, outputs):
        self.model = anchor("model", k, name)
        self.outputs = {o: anchor(self.model, "hist", j, o) for j, o in enumerate(outputs)}
        self.timeline = anchor(self.model, "timeline")
        self.profile = anchor(self.model, "profile")
        self.failing = anchor(self.model, "failing")


def layout(r: dict) -> list:
    t = r["timing"]
    blocks: list = [
        Heading(1, ["guard replay report: ", Strong(r["verdict"].upper())]),
        Para([f"guard {r['guard_version']}, config ", Code(r["config"]["path"]),
              f" (hash {r['config']['hash'] or '-'}), engine {r['engine']['name']}, "
              f"{t['records']} record(s) in {t['seconds']:.1f} s "
              f"({t['records_per_second']:.0f}/s). Exit code {r['exit_code']}."]),
    ]
    if r["problems"]:
        blocks.append(Bullets([[Strong("problem"), f": {p}"] for p in r["problems"]]))
    anchors = {name: _Anchors(k, name, m["tiers"]["tensor"]["outputs"])
               for k, (name, m) in enumerate(r["models"].items())}
    # One column per tier the report holds (every registered one that some model runs: a
    # report of generative models only has no tensor columns), tier 1's error beside it.
    def runs(m: dict, tier: str) -> bool:
        return not m.get("tiers_run") or tier in m["tiers_run"]  # not said: maybe

    shown = [t for t in dict.fromkeys(t for m in r["models"].values() for t in m["tiers"])
             if any(runs(m, t) for m in r["models"].values())]
    tensor = "tensor" in shown
    others = [t for t in shown if t != "tensor"]
    rows = []
    for name, m in r["models"].items():
        tiers = m["tiers"]
        rows.append([[Link(name, anchors[name].model)], [str(m["samples"])],
                     [Strong(m["verdict"])],
                     *([[_tier_cell(tiers["tensor"])], [fmt(tiers["tensor"]["max_abs_error"])]]
                       if tensor else []),
                     *[[_tier_cell(tiers[t]) if t in tiers else "-"] for t in others]])
    head = ["model", "samples", "verdict", *(["tensor", "max abs error"] if tensor else []),
            *others]
    blocks.append(Table(head, [False, True, False, *([False, True] if tensor else []),
                               *[False] * len(others)], rows))
    for name, m in r["models"].items():
        blocks += _model_layout(name, m, anchors[name])
    blocks += _inputs_layout(r)
    return blocks


def _facts(m: dict) -> list:
    facts = [[f"{role}: ", Code(summary)] for role, summary in m["backends"].items()]
    if m.get("tiers_run"):
        facts.append([f"tiers run: {', '.join(m['tiers_run'])}"])
    floor = m.get("noise_floor")
    if floor:
        figures = ", ".join(f"{k} {fmt(v)}" for k, v in floor["per_output"].items())
        facts.append([f"reference noise floor not measured: {floor['skipped']}"]
                     if floor["skipped"] else
                     ["reference noise floor (allowed on top of atol + rtol): " + (figures or "0")])
    s = m["status"]
    facts.append([f"records: {s['checked']} checked, {s['primary_error']} primary errors, "
                  f"{s['reference_error']} reference errors, {s['input_error']} input errors"])
    live = m["live_agreement"]
    if live["compared"]:
        facts.append([f"against the sidecar's live verdicts ({live['compared']} mirrored "
                      f"records): {live['both_pass']} both pass, {live['both_fail']} both "
                      f"fail, {live['live_pass_replay_fail']} now fail, "
                      f"{live['live_fail_replay_pass']} now pass"])
    return facts


def _model_layout(name: str, m: dict, a: _Anchors) -> list:
    tiers = m["tiers"]
    blocks: list = [Heading(2, [f"{name}: ", Strong(m["verdict"])], a.model),
                    Para([m["verdict_reason"]]), Bullets(_facts(m))]
    if "generation" in m.get("tiers_run", ()):  # a generative model: its completions
        blocks += generation_layout(tiers["generation"], m["thresholds"].get("generation", {}),
                                    a.model)
        blocks.append(Figure(a.timeline, _timeline_svg(m)))
        return blocks + _error_records(m)
    # tier 1: per-output figures, then the plots they summarise
    outputs = tiers["tensor"]["outputs"]
    blocks.append(Heading(3, ["Tier 1 (tensor)"]))
    if outputs:
        blocks.append(Table(
            ["output", "checks", "passed", "max abs error", "mean of max abs", "allowed (max)"],
            [False, True, True, True, True, True],
            [[[Link(o, a.outputs[o])], [str(f["checks"])], [str(f["passed"])],
              [fmt(f["max_abs_error"])], [fmt(f["mean_max_abs_error"])],
              [fmt(f["allowed_max"])]] for o, f in outputs.items()]))
        blocks += [Figure(a.outputs[o], _histogram_svg(o, f)) for o, f in outputs.items()]
    else:
        blocks.append(Figure("", "<p>No tensor checks: no error distribution.</p>"))
    blocks.append(Figure(a.timeline, _timeline_svg(m)))
    # tier 2
    act = tiers["activation"]
    blocks.append(Heading(3, ["Tier 2 (activation)"]))
    if act["checks"]:
        first = act["first_divergence"]
        blocks.append(Para(["First divergent layer: "] + (
            [Link(Code(first["layer"]), a.profile), f" (error {fmt(first['error'])})"]
            if first else ["none"])))
        counts = act.get("first_divergence_layers") or {}
        if counts:
            blocks.append(Table(["first divergent layer", "records"], [False, True],
                                [[[Code(layer)], [str(n)]] for layer, n in counts.items()],
                                caption="where each record's error first grew", wrap=(0,)))
    else:
        blocks.append(Para(["Tier 2 (activation) produced no data in this replay: no per-layer "
                            "profile."]))
    blocks.append(Figure(a.profile, _profile_svg(m)))
    # tier 3
    task = tiers["task"]
    if task["checks"]:
        blocks.append(Heading(3, ["Tier 3 (task)"]))
        blocks.append(Table(["task metric (mean over samples)", "value"], [False, True],
                            [[[k], [fmt(v)]] for k, v in task["metrics"].items()])
                      if task["metrics"] else Para(["Task metrics: -"]))
    # failing and erroneous records
    if m["failing_examples"]:
        blocks.append(Heading(3, ["Failing records (first few)"], a.failing))
        blocks.append(Table(["record", "request id", "source", "why", "plots"],
                            [True, False, False, False, False],
                            [_failing_row(ex, a, act) for ex in m["failing_examples"]],
                            page_only=(4,), wrap=(1, 2, 3)))
    return blocks + _error_records(m)


def _error_records(m: dict) -> list:
    if not m["error_examples"]:
        return []
    return [Heading(3, ["Records that could not be checked (first few)"]),
            Table(["record", "request id", "status", "error"], [True, False, False, False],
                  [[[str(ex["index"])], [Code(ex["request_id"] or "-")], [ex["status"]],
                    [ex["error"]]] for ex in m["error_examples"]], wrap=(1, 3))]


def _failing_row(ex: dict, a: _Anchors, act: dict) -> list:
    plots: list = []
    for o in ex.get("failing_outputs", []):
        if o in a.outputs:
            plots += [Link(f"{o} errors", a.outputs[o]), ", "]
    if "activation" in ex.get("failing_tiers", []) and act["profile"]:
        plots += [Link("layer profile", a.profile), ", "]
    plots.append(Link("timeline", a.timeline))
    return [[str(ex["index"])], [Code(ex["request_id"] or "-")], [Path(ex["source"]).name],
            [ex["why"]], plots]


def _inputs_layout(r: dict) -> list:
    i = r["inputs"]
    text = (f"{len(i['files'])} file(s), {i['records_read']} record(s) read, {i['replayed']} "
            f"replayed; skipped {i['skipped_bytes']} damaged byte(s) in "
            f"{i['skipped_regions']} region(s); {i['unreadable_records']} unreadable record(s).")
    if i["filtered"]:
        text += " Left out by filters: " + ", ".join(
            f"{k} {v}" for k, v in i["filtered"].items()) + "."
    if i["stopped_at_max_records"]:
        text += " Stopped at --max-records."
    if r["unknown_models"]:
        text += " Records of models the config lacks (not replayed): " + ", ".join(
            f"{k} {v}" for k, v in r["unknown_models"].items()) + "."
    files = []
    for f in i["files"]:
        line = [Code(f["path"]), f" ({f['kind']}): {f.get('records', 0)} record(s)"]
        if f.get("skipped_bytes"):
            line.append(f", skipped {f['skipped_bytes']} byte(s) in {f['skipped_regions']} "
                        "region(s)" + (", ends inside a record" if f.get("truncated_tail")
                                       else ""))
        if f.get("problems"):  # (the first few: a prompt set's line numbers and why)
            line.append(f", {f.get('unreadable', len(f['problems']))} unreadable: "
                        + "; ".join(f["problems"]))
        files.append(line)
    return [Heading(2, ["Inputs"]), Para([text])] + ([Bullets(files)] if files else [])


# -- markdown --------------------------------------------------------------------------------
def _md_inline(pieces) -> str:
    out = []
    for p in pieces:
        if isinstance(p, Link):
            out.append(_md_inline([p.text]))
        elif isinstance(p, Code):
            out.append(f"`{p}`")
        elif isinstance(p, Strong):
            out.append(f"**{p}**")
        else:
            out.append(p)
    return "".join(out)


def _md_cell(pieces) -> str:
    return _md_inline(pieces).replace("|", "\\|").replace("\n", " ")


def markdown(r: dict) -> str:
    out: list[str] = []
    for b in layout(r):
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + _md_inline(b.text), ""]
        elif isinstance(b, Para):
            out += [_md_inline(b.text), ""]
        elif isinstance(b, Bullets):
            out += [f"- {_md_inline(item)}" for item in b.items] + [""]
        elif isinstance(b, Table):
            keep = [k for k in range(len(b.head)) if k not in b.page_only]
            out.append("| " + " | ".join(b.head[k] for k in keep) + " |")
            out.append("| " + " | ".join("---:" if b.right[k] else "---" for k in keep) + " |")
            out += ["| " + " | ".join(_md_cell(row[k]) for k in keep) + " |" for row in b.rows]
            out.append("")
        elif isinstance(b, Rendered) and b.markdown:
            out += [b.markdown, ""]
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
    record = act.get("profile_record")
    return svg.bars(f"per-layer error of the first divergence (first: {first})", layers, errors,
                    x_title="layer (network order), error on a log scale"
                    + ("" if record is None else f"; record {record}"), highlight=highlight,
                    log=True)


CSS = (
    "body{font-family:sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;"
    "line-height:1.4;overflow-wrap:break-word}"
    "table{border-collapse:collapse;margin:.5rem 0;max-width:100%}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}"
    "th{background:#f4f4f4}td.num,th.num{text-align:right;white-space:nowrap}"
    "td.wrap{overflow-wrap:anywhere;min-width:7em}td a{white-space:nowrap}"
    "caption{caption-side:bottom;text-align:left;font-size:.85em;color:#555}"
    "code{font-size:.9em;background:#f4f4f4;padding:0 2px}"
    ".drift{color:#b52b27}.pass{color:#2b7a2b}"
    "figure{margin:.5rem 0;scroll-margin-top:1rem}figure:target{outline:2px solid #d9534f}"
    "svg{display:block;max-width:100%;height:auto}"
)


def _html_inline(pieces) -> str:
    out = []
    for p in pieces:
        if isinstance(p, Link):
            out.append(f"<a href='#{p.target}'>{_html_inline([p.text])}</a>")
        elif isinstance(p, Code):
            out.append(f"<code>{escape(p)}</code>")
        elif isinstance(p, Strong):
            verdict = p.lower() in ("pass", "drift")  # coloured by what it says
            out.append(f"<strong class='{p.lower()}'>{escape(p)}</strong>" if verdict
                       else f"<strong>{escape(p)}</strong>")
        else:
            out.append(escape(p))
    return "".join(out)


def _html_block(b) -> str:
    if isinstance(b, Heading):
        ident = f" id='{b.anchor}'" if b.anchor else ""
        return f"<h{b.level}{ident}>{_html_inline(b.text)}</h{b.level}>"
    if isinstance(b, Para):
        return f"<p>{_html_inline(b.text)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        def cls(k: int) -> str:
            return " class='num'" if b.right[k] else " class='wrap'" if k in b.wrap else ""
        head = "".join(f"<th{cls(k)}>{escape(h)}</th>" for k, h in enumerate(b.head))
        rows = "".join("<tr>" + "".join(f"<td{cls(k)}>{_html_inline(c)}</td>"
                                        for k, c in enumerate(row)) + "</tr>" for row in b.rows)
        caption = f"<caption>{escape(b.caption)}</caption>" if b.caption else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    if isinstance(b, Rendered):
        return b.html
    ident = f" id='{b.anchor}'" if b.anchor else ""
    return f"<figure{ident}>{b.svg}</figure>"


def html(r: dict) -> str:
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             f"<title>guard replay: {escape(r['verdict'])}</title>",
             f"<style>{CSS}{GENERATION_CSS}</style></head><body>"]
    parts += [_html_block(b) for b in layout(r)]
    parts.append("</body></html>")
    return "\n".join(parts)
