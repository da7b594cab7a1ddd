"""Capture by the running sidecar (real gRPC server, tritonclient traffic), then replay of what it
wrote: the report must count what the sidecar counted live on /metrics."""

from __future__ import annotations

import json
import logging

import numpy as np

from fixture_models import DRIFT_TRIGGER, SLEEP_TRIGGER
from guard.capture.inspect import summarise
from guard.cli import main

from support import metric, model_block, running, scrape, wait_for, x_input

ROW = "replay_fixtures:row_affine"


def row_backend(**kwargs) -> dict:
    return {"backend": "torch", "path": ROW, "options": {"kwargs": kwargs}}


def traffic(client, n: int, drift_every: int, rng) -> int:
    """n requests of 1-3 rows; every drift_every-th has a drifting row. Returns how many drift."""
    drifting = 0
    for i in range(n):
        rows = rng.normal(size=(1 + i % 3, 4)).astype(np.float32)
        if drift_every and i % drift_every == 0:
            rows[-1, 0] = DRIFT_TRIGGER
            drifting += 1
        client.infer("m", [x_input(rows)], request_id=f"req-{i}")
    return drifting


def test_sidecar_capture_replays_to_the_counts_seen_live(tmp_path, rng):
    model = model_block(
        primary=row_backend(drift_on_trigger=True), reference=row_backend(),
        checks={"tensor": {"atol": 1e-3, "rtol": 0.0}},
        capture={"dir": "capture", "sample_rate": 1.0},
    )
    n = 45
    with running(tmp_path, [model]) as (srv, client):
        drifting = traffic(client, n, drift_every=4, rng=rng)
        live = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_capture_records_total", model="m", outcome="written") == n and v)
    assert metric(live, "guard_mirror_total", model="m", outcome="compared") == n
    live_pass = metric(live, "guard_checks_total", model="m", tier="tensor", result="pass")
    live_fail = metric(live, "guard_checks_total", model="m", tier="tensor", result="fail")
    assert live_fail == drifting and live_pass == n - drifting
    assert metric(live, "guard_capture_records_total", model="m", outcome="dropped") == 0
    assert metric(live, "guard_capture_bytes", model="m") > 0

    summary = summarise([str(tmp_path / "capture")])
    assert summary["models"]["m"]["records"] == n
    assert summary["models"]["m"]["mirrored"] == n
    assert summary["models"]["m"]["live_failed"] == drifting

    report_dir = tmp_path / "report"
    code = main(["replay", "--config", str(tmp_path / "guard.yaml"), str(tmp_path / "capture"),
                 "--report-dir", str(report_dir), "--quiet"])
    report = json.loads((report_dir / "report.json").read_text())
    m = report["models"]["m"]
    assert m["samples"] == metric(live, "guard_requests_total", model="m", route="primary")
    tensor = m["tiers"]["tensor"]
    assert tensor["checks"] == live_pass + live_fail
    assert tensor["passed"] == live_pass
    assert m["live_agreement"]["compared"] == n
    assert m["live_agreement"]["both_pass"] + m["live_agreement"]["both_fail"] == n
    # 12 of 45 drift (27%) > trip_ratio 0.2: the gate says drift, as the sidecar's alert did.
    assert m["verdict"] == "drift" and code == 1
    assert report["config"]["hash"] and report["inputs"]["skipped_bytes"] == 0


def test_failures_mode_records_only_failing_samples(tmp_path, rng):
    model = model_block(
        primary=row_backend(drift_on_trigger=True), reference=row_backend(),
        checks={"tensor": {"atol": 1e-3, "rtol": 0.0}},
        capture={"dir": "capture", "mode": "failures"},
    )
    with running(tmp_path, [model]) as (srv, client):
        drifting = traffic(client, 20, drift_every=5, rng=rng)
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_mirror_total", model="m",
                                outcome="compared") == 20)
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_capture_records_total",
                                model="m", outcome="written") == drifting)
    summary = summarise([str(tmp_path / "capture")])
    assert summary["models"]["m"]["records"] == drifting == summary["models"]["m"]["live_failed"]


def test_unwritable_capture_dir_disables_capture_and_serving_goes_on(tmp_path, rng, caplog):
    (tmp_path / "blocked").write_text("a file, not a folder")
    model = model_block(capture={"dir": "blocked/capture", "sample_rate": 1.0})
    with caplog.at_level(logging.INFO, logger="guard.events"):
        with running(tmp_path, [model]) as (srv, client):
            for _ in range(6):
                result = client.infer("m", [x_input(rng.normal(size=(1, 4)))])
                assert result.as_numpy("y").shape == (1, 3)
            values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
                v, "guard_capture_records_total", model="m", outcome="disabled") == 6 and v)
            assert metric(values, "guard_capture_enabled", model="m") == 0
            assert metric(values, "guard_requests_total", model="m", route="primary") == 6
            assert client.is_server_ready()
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "guard.events"]
    assert [e["model"] for e in events if e["event"] == "capture_disabled"] == ["m"]


def test_one_record_per_request_when_the_mirror_drops_samples(tmp_path):
    """A reference too slow for the traffic: the mirror's queue (one item) drops most samples.
    Each request is recorded once, whether it was compared or dropped (issue 28: a dropped
    sample was recorded by the mirror's listener and again by the ring reader)."""
    from guard.capture.reader import FileStats, expand_paths, read_records

    n = 30
    model = model_block(
        reference={"backend": "torch", "path": "fixture_models:affine",
                   "options": {"kwargs": {"sleep_on_trigger": 0.2}}},
        mirror={"sample_rate": 1.0, "queue_size": 1, "timeout_s": 5.0},
        capture={"dir": "capture", "sample_rate": 1.0},
    )
    rows = np.full((1, 4), SLEEP_TRIGGER, np.float32)
    with running(tmp_path, [model]) as (srv, client):
        for i in range(n):
            client.infer("m", [x_input(rows)], request_id=f"req-{i}")
        live = wait_for(lambda: (v := scrape(srv.metrics_port)) and sum(
            metric(v, "guard_mirror_total", model="m", outcome=o)
            for o in ("compared", "dropped", "error", "timeout")) == n and v)
    assert metric(live, "guard_mirror_total", model="m", outcome="dropped") > 0
    stats = FileStats()
    ids = [r.request_id for path in expand_paths([tmp_path / "capture"])
           for r in read_records(path, stats)]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n))
