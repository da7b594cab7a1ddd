"""guard/replay/aggregate.py, report.py and progress.py: figures, verdicts and the written files.

Tier 2 and 3 results are built here in the shape ``Comparator.tier_reports`` documents for them
(guard/verify/pipeline.py), so the report's handling of those tiers is checked before the tiers
themselves land."""

from __future__ import annotations

import io
import json
import re
from xml.etree import ElementTree

from guard.config import ModelConfig
from guard.replay.aggregate import HIST_EDGES, ModelAggregate, _bin
from guard.replay.items import CHECKED, REFERENCE_ERROR, RecordOutcome
from guard.replay.progress import Progress
from guard.replay.report import markdown, write_report
from guard.verify.pipeline import TierReport
from guard.verify.tensor import OutputCheck
from report_page import parse, target

MODEL = ModelConfig.model_validate({
    "name": "m", "primary": {"backend": "torch", "path": "x:y"},
    "reference": {"backend": "torch", "path": "x:y"}, "policy": {"trip_ratio": 0.3}})


def outcome(i: int, error: float, allowed: float = 1e-3, activation=None, task=None,
            status: str = CHECKED) -> RecordOutcome:
    passed = error <= allowed
    tiers = {"tensor": TierReport(passed, "ok" if passed else "fail",
                                  [OutputCheck("y", passed, "", max_abs=error, allowed=allowed)],
                                  {"max_abs_error": error})}
    if activation is not None:
        tiers["activation"] = activation
    if task is not None:
        tiers["task"] = task
    return RecordOutcome(index=i, model="m", status=status, unix_nanos=(i + 1) * 10**9,
                         request_id=f"r{i}", tiers=tiers if status == CHECKED else {},
                         error="boom" if status != CHECKED else "")


def report_for(agg: ModelAggregate) -> dict:
    return {"guard_version": "t", "verdict": "pass", "exit_code": 0, "problems": [],
            "config": {"path": "/c.yaml", "hash": "h"}, "filters": {},
            "inputs": {"files": [], "records_read": 0, "replayed": 0, "skipped_bytes": 0,
                       "skipped_regions": 0, "unreadable_records": 0, "filtered": {},
                       "stopped_at_max_records": False},
            "unknown_models": {}, "models": {"m": agg.result()}, "generated_at": "now",
            "engine": {"name": "local", "workers": 1},
            "timing": {"seconds": 1.0, "records": agg.samples, "records_per_second": 1.0}}


def test_histogram_bins_are_half_decades_with_zero_and_overflow():
    assert _bin(0.0) == 0
    assert _bin(1e-20) == 1  # below the lowest edge: first bin
    assert _bin(1e-6) == _bin(2e-6) == _bin(3.1e-6) != _bin(3.2e-6)
    assert _bin(float("inf")) == _bin(1e4) == len(HIST_EDGES)


def test_tensor_figures_verdict_and_reference_errors():
    agg = ModelAggregate(MODEL, {"primary": "p", "reference": "r"})
    for i, err in enumerate([1e-6, 2e-6, 5e-2, 0.0, 1e-5]):
        agg.add(outcome(i, err))
    agg.add(outcome(5, 0.0, status=REFERENCE_ERROR))
    r = agg.result()
    assert r["samples"] == 6 and r["status"]["reference_error"] == 1
    t = r["tiers"]["tensor"]
    assert (t["checks"], t["passed"], t["max_abs_error"]) == (5, 4, 5e-2)
    assert r["verdict"] == "pass"  # 20% <= trip_ratio 30%
    y = t["outputs"]["y"]
    assert y["histogram"][0] == 1 and sum(y["histogram"]) == 5
    assert r["timeline"]["axis"] == "unix_nanos" and sum(
        b["checks"] for b in r["timeline"]["buckets"]) == 5
    agg.add(outcome(6, 1.0))
    assert agg.result()["verdict"] == "drift"  # 2 of 6 = 33% > 30%


def test_activation_and_task_tiers_are_reported_when_present(tmp_path):
    profile = [{"layer": "conv1", "error": 1e-6}, {"layer": "fc1", "error": 0.4},
               {"layer": "fc2", "error": 0.5}]
    agg = ModelAggregate(MODEL)
    agg.add(outcome(0, 1e-6, activation=TierReport(True, "ok", [], {
        "first_divergence": None, "layers": []}), task=TierReport(True, "ok", [], {
            "metrics": {"top1_agreement": 1.0}})))
    agg.add(outcome(1, 1.0, activation=TierReport(False, "fc1", [], {
        "first_divergence": {"layer": "fc1", "error": 0.4}, "layers": profile}),
        task=TierReport(False, "flip", [], {"metrics": {"top1_agreement": 0.0}})))
    r = agg.result()
    act, task = r["tiers"]["activation"], r["tiers"]["task"]
    assert (act["checks"], act["passed"]) == (2, 1)
    assert act["first_divergence"] == {"layer": "fc1", "error": 0.4}
    assert act["profile"] == profile
    assert task["metrics"] == {"top1_agreement": 0.5}
    assert r["verdict"] == "drift" and "activation: 1 of 2" in r["verdict_reason"]
    paths = write_report(report_for(agg), tmp_path)
    page = paths["html"].read_text()
    assert "per-layer error of the first divergence (first: fc1)" in page
    assert "First divergent layer: `fc1`" in paths["md"].read_text()


def test_report_files_are_self_contained_and_strict_json(tmp_path):
    agg = ModelAggregate(MODEL)
    for i in range(30):
        agg.add(outcome(i, 10 ** -(i % 7)))
    agg.add(outcome(30, float("inf")))  # e.g. a shape mismatch
    paths = write_report(report_for(agg), tmp_path)
    data = json.loads(paths["json"].read_text())  # strict: no NaN/Infinity tokens
    assert "Infinity" not in paths["json"].read_text()
    assert data["models"]["m"]["tiers"]["tensor"]["outputs"]["y"]["incomparable"] == 1
    page = paths["html"].read_text()
    assert page.count("<svg") == 2  # error distribution + pass rate over time
    for chart in re.findall(r"<svg.*?</svg>", page, re.S):
        ElementTree.fromstring(chart)  # well-formed: browsers render it inline
    assert "y: max abs error per sample (31 samples)" in page
    assert "pass rate over time" in page
    assert "tier 2 (activation) produced no data" in page
    assert not re.search(r"(src|href)=\"https?:", page)  # nothing fetched from a server
    assert "| m | 31 |" in markdown(data)


def test_html_details_are_tables_linked_to_the_plots(tmp_path):
    profile = [{"layer": "conv1", "error": 1e-6}, {"layer": "fc1", "error": 0.4}]
    failing_activation = TierReport(False, "first divergence at fc1", [], {
        "first_divergence": {"layer": "fc1", "error": 0.4}, "layers": profile})
    agg = ModelAggregate(MODEL, {"primary": "onnxruntime/int8/cpu a.onnx",
                                 "reference": "onnxruntime/fp32/cpu a.onnx"})
    agg.add(outcome(0, 1e-6, activation=TierReport(True, "ok", [], {
        "first_divergence": None, "layers": []})))
    agg.add(outcome(1, 0.5, activation=failing_activation))  # tensor and activation fail
    agg.add(outcome(2, 1e-6, activation=failing_activation))  # activation alone fails
    agg.add(outcome(3, 0.0, status=REFERENCE_ERROR))
    report = report_for(agg)
    report["problems"] = ["a problem | with a pipe"]
    paths = write_report(report, tmp_path)
    page = parse(paths["html"].read_text())
    assert page.pre == 0  # no preformatted dump of report.md
    for href, _ in page.links:
        target(page, href)  # every in-page link lands on an element
    summary = page.table("model")
    assert [c.text for c in summary.rows[0]][:3] == ["m", "4", "drift"]
    assert target(page, summary.rows[0][0].links[0])[0] == "h2"
    outputs = page.table("output")
    assert [c.text for c in outputs.rows[0]] == ["y", "3", "2", "0.5", "0.167", "0.001"]
    y_hist = outputs.rows[0][0].links[0]
    tag, text = target(page, y_hist)
    assert tag == "figure" and "y: max abs error per sample (3 samples)" in text
    # the first divergent layer links to the per-layer profile, which names its record
    first = [href for href, text in page.links if text == "fc1"]
    assert len(first) == 1
    tag, text = target(page, first[0])
    assert tag == "figure" and "per-layer error of the first divergence (first: fc1)" in text
    assert "record 1" in text
    # failing records: one row each, linked to the plots that show why they failed
    failing = page.table("record", "request id", "source", "why", "plots")
    assert [c.text for c in failing.column("record")] == ["1", "2"]
    plots = failing.column("plots")
    assert plots[0].links[0] == y_hist  # record 1 failed tier 1 on output y
    assert target(page, plots[0].links[1]) == target(page, first[0])  # and tier 2
    assert y_hist not in plots[1].links  # record 2 passed tier 1
    assert target(page, plots[1].links[0]) == target(page, first[0])
    assert "pass rate over time" in target(page, plots[1].links[-1])[1]
    errors = page.table("record", "request id", "status")
    assert [c.text for c in errors.rows[0]] == ["3", "r3", "reference_error", "boom"]
    # long words in free text wrap instead of running off the page
    assert failing.column("why")[0].text.startswith("tensor: fail")
    text = paths["html"].read_text()
    assert "overflow-wrap:anywhere" in text and "<td class='wrap'>" in text
    # report.md keeps the same tables as Markdown, without the page's plot links
    md = paths["md"].read_text()
    assert "| record | request id | source | why |\n" in md
    assert "- **problem**: a problem | with a pipe" in md


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_prints_lines_otherwise():
    tty = _Terminal()
    progress = Progress(stream=tty)
    progress.update(10, 0.5)
    progress.finish()
    text = tty.getvalue()
    assert text.startswith("\rreplay [###############...............]  50.0%  10 records")
    assert "records/s  ETA 0:00:00" in text and text.endswith("\x1b[K\n")
    plain = io.StringIO()
    progress = Progress(stream=plain, max_records=40)
    progress.update(10, 0.01)
    progress.finish()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("replay:  25.0%  10 records") and "\r" not in plain.getvalue()
    assert lines[-1].startswith("replay: 10 records in 0:00:00")


def test_tier_reports_carry_task_metrics_from_the_real_verifier():
    import numpy as np

    from guard.verify.pipeline import Comparator

    config = ModelConfig.model_validate({
        "name": "c", "task": "classification", "primary": {"backend": "torch", "path": "x:y"}})
    comparator = Comparator.for_model(config)
    reference = {"logits": np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]], np.float32)}
    primary = {"logits": np.array([[3.0, 1.0, 0.0], [0.0, 1.0, 2.0]], np.float32)}
    reports = comparator.tier_reports(comparator.check(reference, primary))
    assert set(reports) == {"tensor", "task"}
    assert not reports["tensor"].passed and reports["tensor"].outputs[0].name == "logits"
    assert reports["task"].details["metrics"]["top1_agreement"] == 0.5
    assert reports["task"].summary.startswith("fail (classification)")
