"""guard replay end to end on captures written by the real writer, through the CLI entry point,
with real torch backends (tests/replay_fixtures.py's row-wise affine model)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from fixture_models import DRIFT_TRIGGER, FAIL_TRIGGER
from guard.capture.segment import HEADER_SIZE, encode_frame
from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
from guard.cli import main
from guard.config import CaptureConfig
from guard.observe.metrics import GuardMetrics
from guard.v1 import capture_pb2

ROW = "replay_fixtures:row_affine"
TIGHT = {"tensor": {"atol": 1e-3, "rtol": 0.0}}


def backend(**kwargs) -> dict:
    return {"backend": "torch", "path": ROW, "options": {"kwargs": kwargs}}


def write_config(folder: Path, models: list[dict] | None = None, trip_ratio: float = 0.2) -> Path:
    models = models or [{
        "name": "m", "primary": backend(drift_on_trigger=True, fail_on_trigger=True),
        "reference": backend(), "checks": TIGHT,
        "policy": {"window": 10, "min_samples": 5, "trip_ratio": trip_ratio,
                   "recover_ratio": 0.0},
    }]
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": models}, sort_keys=False))
    return path


def rows_for(i: int, drift: bool = False, rows: int = 2) -> np.ndarray:
    x = np.random.default_rng(i).normal(size=(rows, 4)).astype(np.float32)
    if drift:
        x[0, 0] = DRIFT_TRIGGER
    return x


def write_capture(folder: Path, batches: list[np.ndarray], model: str = "m",
                  start_nanos: int | None = None, step_nanos: int = 10**9) -> Path:
    """Records as the sidecar writes them (inputs and the primary's answer, not mirrored)."""
    metrics = GuardMetrics("test")
    writer = CaptureWriter(model, CaptureConfig(dir=str(folder)), metrics, {})
    writer.start()
    t0 = start_nanos if start_nanos is not None else time.time_ns()
    for i, x in enumerate(batches):
        tag = CaptureTag(f"req-{i}", t0 + i * step_nanos, 0.001, True)
        writer.submit(PendingRecord(tag, "primary", 0, {"x": x}, {"y": x[:, :3]}))
    writer.close()
    assert metrics.registry.get_sample_value(
        "guard_capture_records_total", {"model": model, "outcome": "written"}) == len(batches)
    return folder / model


def run(config: Path, *inputs, report: Path, extra: tuple = ()) -> tuple[int, dict]:
    code = main(["replay", "--config", str(config), *map(str, inputs), "--report-dir",
                 str(report), "--quiet", *extra])
    return code, json.loads((report / "report.json").read_text())


@pytest.fixture
def config(tmp_path) -> Path:
    return write_config(tmp_path)


# -- verdicts and report ---------------------------------------------------------------------
def test_clean_capture_passes_with_contract_fields(tmp_path, config):
    capture = write_capture(tmp_path / "cap", [rows_for(i) for i in range(12)])
    code, report = run(config, capture, report=tmp_path / "r")
    assert code == 0 and report["verdict"] == "pass" and report["exit_code"] == 0
    m = report["models"]["m"]
    assert m["samples"] == 12 and m["verdict"] == "pass"
    assert m["tiers"]["tensor"]["checks"] == 12 and m["tiers"]["tensor"]["passed"] == 12
    assert m["tiers"]["tensor"]["max_abs_error"] < 1e-5
    activation = m["tiers"]["activation"]
    assert (activation["checks"], activation["passed"]) == (0, 0)
    assert activation["first_divergence"] is None
    assert m["tiers"]["task"]["checks"] == 0 and m["tiers"]["task"]["metrics"] == {}
    assert report["guard_version"] and set(report["models"]) == {"m"}
    assert m["backends"]["primary"].startswith("torch/fp32/cpu")
    for name in ("report.md", "report.html"):
        assert (tmp_path / "r" / name).stat().st_size > 500


def test_drift_over_trip_ratio_exits_1_and_names_the_output(tmp_path, config):
    batches = [rows_for(i, drift=(i % 3 == 0)) for i in range(12)]  # 4 of 12 fail: 33% > 20%
    capture = write_capture(tmp_path / "cap", batches)
    code, report = run(config, capture, report=tmp_path / "r")
    assert code == 1 and report["verdict"] == "drift"
    m = report["models"]["m"]
    assert (m["tiers"]["tensor"]["checks"], m["tiers"]["tensor"]["passed"]) == (12, 8)
    assert m["tiers"]["tensor"]["failing_share"] == pytest.approx(4 / 12)
    assert "tensor: 4 of 12 failed" in m["verdict_reason"]
    y = m["tiers"]["tensor"]["outputs"]["y"]
    assert y["checks"] == 12 and y["passed"] == 8 and y["max_abs_error"] == pytest.approx(1.0)
    assert sum(y["histogram"]) == 12
    assert [e["request_id"] for e in m["failing_examples"]] == ["req-0", "req-3", "req-6",
                                                              "req-9"]


def test_failing_share_at_the_trip_ratio_still_passes(tmp_path):
    config = write_config(tmp_path, trip_ratio=0.25)
    capture = write_capture(tmp_path / "cap", [rows_for(i, drift=(i % 4 == 0))
                                               for i in range(8)])  # exactly 25%
    code, report = run(config, capture, report=tmp_path / "r")
    assert code == 0 and report["models"]["m"]["tiers"]["tensor"]["passed"] == 6


def test_batched_replay_equals_record_by_record(tmp_path, config):
    batches = [rows_for(i, drift=(i % 4 == 1), rows=1 + i % 3) for i in range(20)]
    capture = write_capture(tmp_path / "cap", batches)
    _, batched = run(config, capture, report=tmp_path / "a", extra=("--batch-size", "16"))
    _, single = run(config, capture, report=tmp_path / "b", extra=("--batch-size", "1"))
    for report in (batched, single):
        tensor = report["models"]["m"]["tiers"]["tensor"]
        assert (tensor["checks"], tensor["passed"]) == (20, 15)


def test_primary_errors_fail_the_tensor_tier(tmp_path, config):
    bad = rows_for(0)
    bad[:, 0] = FAIL_TRIGGER
    capture = write_capture(tmp_path / "cap", [rows_for(1), bad, rows_for(2), rows_for(3)])
    code, report = run(config, capture, report=tmp_path / "r")
    m = report["models"]["m"]
    assert m["status"]["primary_error"] == 1 and m["status"]["checked"] == 3
    assert (m["tiers"]["tensor"]["checks"], m["tiers"]["tensor"]["passed"]) == (4, 3)
    assert code == 1  # 25% > 20%
    assert "primary raised: RuntimeError" in m["failing_examples"][0]["why"]


def test_records_that_do_not_fit_the_model_are_reported(tmp_path, config):
    capture = write_capture(tmp_path / "cap", [rows_for(0), np.zeros((2, 5), np.float32)])
    code, report = run(config, capture, report=tmp_path / "r")
    m = report["models"]["m"]
    assert m["status"]["input_error"] == 1 and "shape [2, 5]" in m["error_examples"][0]["error"]
    assert code == 0
    code, _ = run(config, capture, report=tmp_path / "s", extra=("--strict",))
    assert code == 2


# -- bad input -------------------------------------------------------------------------------
def corrupt(files: list[Path]) -> None:
    """Flip a byte in one record, put garbage between records, and tear off the last one."""
    data = bytearray(files[0].read_bytes())
    data[HEADER_SIZE + 40] ^= 0xFF
    data[600:600] = b"garbage" * 20
    files[0].write_bytes(bytes(data[:-30]))


def test_corrupted_capture_is_replayed_around_the_damage(tmp_path, config, capsys):
    batches = [rows_for(i) for i in range(10)]
    capture = write_capture(tmp_path / "cap", batches)
    (segment,) = sorted(capture.glob("*.gcap"))
    corrupt([segment])
    code, report = run(config, capture, report=tmp_path / "r")
    assert code == 0  # skips do not change the exit code...
    inputs = report["inputs"]
    assert inputs["skipped_regions"] == 3 and inputs["skipped_bytes"] > 140
    assert inputs["files"][0]["truncated_tail"]
    assert report["models"]["m"]["samples"] == inputs["replayed"] == 7
    assert any("damaged byte(s) skipped" in p for p in report["problems"])
    code, _ = run(config, capture, report=tmp_path / "s", extra=("--strict",))
    assert code == 2  # ...unless --strict
    main(["capture", "inspect", str(segment)])
    out = capsys.readouterr().out
    assert "7 record(s)" in out and "skipped" in out and "payload CRC mismatch" in out


def test_inspect_of_files_that_are_not_captures_is_a_usage_error(tmp_path, capsys):
    """A model file given to `capture inspect` by mistake: one line and exit 2, not a
    summary of 0 records that exits 0."""
    model = tmp_path / "net.onnx"
    model.write_bytes(bytes(range(256)) * 40)
    assert main(["capture", "inspect", str(model)]) == 2
    err = capsys.readouterr().err
    assert "no capture record in 1 file(s) (10240 bytes" in err and "Traceback" not in err
    empty = tmp_path / "empty.gcap"
    empty.write_bytes(b"")  # an empty capture (nothing written yet) is not an error
    assert main(["capture", "inspect", str(empty)]) == 0


def crafted_record(request_id: str, shape: list[int], datatype: str = "FP32",
                   raw: bytes = b"") -> bytes:
    """A frame with good CRCs around a record whose tensor cannot be rebuilt."""
    record = capture_pb2.CaptureRecord(model="m", request_id=request_id)
    record.inputs.add(name="x", datatype=datatype, shape=shape, raw=raw)
    return encode_frame(record.SerializeToString())


def test_records_with_overflowing_shapes_are_skipped_and_counted(tmp_path, config):
    capture = write_capture(tmp_path / "cap", [rows_for(i) for i in range(3)])
    (segment,) = sorted(capture.glob("*.gcap"))
    with segment.open("ab") as handle:
        handle.write(crafted_record("zero-but-huge", [0, 2**62, 2**62]))
        handle.write(crafted_record("wraps-to-zero", [2**32, 2**32]))  # int64 product wraps
        handle.write(crafted_record("negative", [-1, 4], raw=b"\x00" * 16))
        handle.write(crafted_record("bad-bytes", [2], datatype="BYTES", raw=b"\x09\x00"))
    code, report = run(config, capture, report=tmp_path / "r")
    assert code == 0
    inputs = report["inputs"]
    assert inputs["records_read"] == 7 and inputs["replayed"] == 3
    assert inputs["unreadable_records"] == 4
    assert report["models"]["m"]["samples"] == 3
    assert any("4 unreadable record(s)" in p for p in report["problems"])


def test_unknown_model_is_reported_not_fatal_unless_strict(tmp_path, config):
    write_capture(tmp_path / "cap", [rows_for(i) for i in range(4)])
    write_capture(tmp_path / "cap", [rows_for(i) for i in range(3)], model="ghost")
    code, report = run(config, tmp_path / "cap", report=tmp_path / "r")
    assert code == 0 and report["unknown_models"] == {"ghost": 3}
    assert report["models"]["m"]["samples"] == 4
    assert any("ghost (3)" in p for p in report["problems"])
    code, report = run(config, tmp_path / "cap", report=tmp_path / "s", extra=("--strict",))
    assert code == 2 and report["verdict"] == "error"


def test_missing_capture_and_bad_flags_are_usage_errors(tmp_path, config, capsys):
    assert main(["replay", "--config", str(config), str(tmp_path / "none.gcap")]) == 2
    assert "no such file" in capsys.readouterr().err
    capture = write_capture(tmp_path / "cap", [rows_for(0)])
    assert main(["replay", "--config", str(config), str(capture), "--models", "zzz"]) == 2
    assert "'zzz' is not a model" in capsys.readouterr().err
    assert main(["replay", "--config", str(config), str(capture), "--since", "yesterday"]) == 2
    assert "--since: cannot read 'yesterday'" in capsys.readouterr().err


def test_a_report_folder_that_cannot_be_made_is_one_line_and_the_usage_code(tmp_path, config,
                                                                           capsys):
    """An OSError guard did not foresee (here a report folder under a file; a permission, a
    full disk) is the usage code and one line, never a traceback and exit 1, which a CI gate
    reads as drift."""
    capture = write_capture(tmp_path / "cap", [rows_for(i) for i in range(2)])
    (tmp_path / "a-file").write_text("")
    code = main(["replay", "--config", str(config), str(capture), "--report-dir",
                 str(tmp_path / "a-file" / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("guard:")] == [
        f"guard: {tmp_path / 'a-file' / 'out'}: Not a directory"]


# -- filters ---------------------------------------------------------------------------------
def test_time_model_and_count_filters(tmp_path):
    models = [{"name": n, "primary": backend(), "reference": backend(), "checks": TIGHT}
              for n in ("a", "b")]
    config = write_config(tmp_path, models)
    t0 = 1_700_000_000 * 10**9  # 2023-11-14T22:13:20Z, one record a minute
    write_capture(tmp_path / "cap", [rows_for(i) for i in range(10)], "a", t0, 60 * 10**9)
    write_capture(tmp_path / "cap", [rows_for(i) for i in range(5)], "b", t0, 60 * 10**9)
    cap = tmp_path / "cap"

    _, report = run(config, cap, report=tmp_path / "r1", extra=("--models", "b"))
    assert set(report["models"]) == {"b"} and report["inputs"]["filtered"] == {"model": 10}

    _, report = run(config, cap, report=tmp_path / "r2",
                    extra=("--since", "2023-11-14T22:15:20Z", "--until", "2023-11-14T22:18:20"))
    assert report["models"]["a"]["samples"] == 4 and report["models"]["b"]["samples"] == 3

    _, report = run(config, cap, report=tmp_path / "r3", extra=("--max-records", "12"))
    assert report["models"]["a"]["samples"] == 10 and report["models"]["b"]["samples"] == 2
    assert report["inputs"]["stopped_at_max_records"]
    # Every record read is replayed or said why not (the 13th, taken to see the limit, is not
    # one read).
    assert report["inputs"]["records_read"] == report["inputs"]["replayed"] == 12

    code, report = run(config, cap, report=tmp_path / "r4", extra=("--since", "1h"))
    assert code == 2 and "no record was replayed" in report["problems"][0]


# -- .npz input sets -------------------------------------------------------------------------
def test_npz_input_set_replays_like_traffic(tmp_path, config):
    x = np.random.default_rng(0).normal(size=(25, 4)).astype(np.float32)
    x[::5, 0] = DRIFT_TRIGGER  # 5 of 25 drift: 20%, not over the trip ratio
    np.savez(tmp_path / "set.npz", x=x)
    code, report = run(config, tmp_path / "set.npz", report=tmp_path / "r")
    assert code == 0
    m = report["models"]["m"]
    assert m["samples"] == 25 and m["tiers"]["tensor"]["passed"] == 20
    assert m["timeline"]["axis"] == "index"
    assert report["inputs"]["files"][0]["kind"] == "npz"


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.zeros((3, 4), np.float32), "extra": np.zeros((3, 1), np.float32)},
     "array 'extra' is not an input of model 'm'"),
    ({"z": np.zeros((3, 4), np.float32)}, "array 'z' is not an input"),
    ({"x": np.zeros((3, 5), np.float32)}, "array 'x': samples of shape [1, 5]"),
    ({"x": np.zeros((3, 4), np.float64)}, "array 'x' holds float64"),
    ({"x": np.zeros((3, 2, 2, 4), np.float32)}, "array 'x' of shape [3, 2, 2, 4]"),
])
def test_npz_that_does_not_fit_exits_2_naming_the_array(tmp_path, config, capsys, arrays,
                                                        message):
    np.savez(tmp_path / "bad.npz", **arrays)
    assert main(["replay", "--config", str(config), str(tmp_path / "bad.npz"), "--report-dir",
                 str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_npz_with_several_models_needs_models_flag(tmp_path, capsys):
    models = [{"name": n, "primary": backend(), "reference": backend()} for n in ("a", "b")]
    config = write_config(tmp_path, models)
    np.savez(tmp_path / "set.npz", x=np.zeros((2, 4), np.float32))
    assert main(["replay", "--config", str(config), str(tmp_path / "set.npz")]) == 2
    assert "pass --models NAME" in capsys.readouterr().err
    code, report = run(config, tmp_path / "set.npz", report=tmp_path / "r",
                       extra=("--models", "b"))
    assert code == 0 and report["models"]["b"]["samples"] == 2
