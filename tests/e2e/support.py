"""End-to-end helpers: a real guard server on free ports, real tritonclient, real /metrics."""

from __future__ import annotations

import functools
import logging
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import yaml

from guard.plan.complete import load_config
from guard.serve.app import BackgroundServer

AFFINE = "fixture_models:affine"
ONNX_FORMS = {"drift_on_trigger", "roll_on_trigger"}  # the triggers tests/affine_onnx.py builds


def affine_backend(torch: bool = False, **kwargs) -> dict:
    """The fixture's affine model (tests/fixture_models.py) as a backend block: its ONNX file
    where its triggers have an ONNX form (none, drift, roll), so that the verifier that loads
    it imports no torch (most of a verifier's start: tests/affine_onnx.py); the torch module
    where they do not (sleep, fail, repeat) or ``torch`` asks for it (a test of the torch
    backend itself). One intra-op thread, as the torch module has (tests/conftest.py)."""
    if torch or not set(kwargs) <= ONNX_FORMS:
        return {"backend": "torch", "path": AFFINE, "options": {"kwargs": kwargs}}
    from affine_onnx import affine_onnx

    return {"backend": "onnxruntime", "path": str(affine_onnx(**kwargs)),
            "options": {"intra_op_threads": 1}}


def affine_answers(rows, torch: bool = False, **kwargs) -> np.ndarray:
    """What the model of ``affine_backend(torch, **kwargs)`` answers to ``rows`` called
    directly, on the same runtime (ONNX Runtime's Gemm and torch's Linear differ in the last
    bits)."""
    rows = np.asarray(rows, np.float32)
    block = affine_backend(torch, **kwargs)
    if block["backend"] == "torch":
        import torch as torch_module

        from fixture_models import Affine

        with torch_module.inference_mode():
            return Affine(**kwargs)(torch_module.from_numpy(rows)).numpy()
    return _onnx_session(block["path"]).run(None, {"x": rows})[0]


@functools.lru_cache(maxsize=None)
def _onnx_session(path: str):
    """One ONNX Runtime session per file (a test asks for 64 rows' answers one by one)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options)


def model_block(name="m", **overrides) -> dict:
    block = {
        "name": name,
        "primary": affine_backend(),
        "reference": affine_backend(),
        "mirror": {"sample_rate": 1.0, "queue_size": 256, "timeout_s": 5.0},
        "checks": {"tensor": {"atol": 1e-5, "rtol": 1e-4}},
        "policy": {"action": "alert", "detector": "window", "window": 10, "min_samples": 5},
    }
    block.update(overrides)
    return block


def write_config(folder: Path, models: list[dict], **server) -> Path:
    data = {
        "version": 1,
        "server": {"host": "127.0.0.1", "grpc_port": 0, "metrics_port": 0, "admin_port": 0,
                   **server},
        "models": models,
    }
    path = folder / "guard.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def running(folder: Path, models: list[dict], **server):
    config = load_config(write_config(folder, models, **server))
    with BackgroundServer(config) as srv:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
        try:
            yield srv, client
        finally:
            client.close()


def x_input(rows: np.ndarray, name: str = "x") -> grpcclient.InferInput:
    rows = np.asarray(rows, dtype=np.float32)
    tensor = grpcclient.InferInput(name, list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    return tensor


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(values: dict, name: str, **labels) -> float:
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout: float = 30.0, interval: float | None = None):
    """Poll until predicate() is truthy (work that happens off the request path).

    ``interval``: a fixed pause between polls, for a predicate that paces traffic of its own
    (each poll sends a request). Left out, the pause starts at 0.05 s and grows by half each
    poll up to 0.5 s: a quick condition is seen at once, and a long wait (a verifier's backlog
    under the whole suite, minutes) does not scrape /metrics 20 times a second, taking the CPU
    from the very processes it waits for."""
    deadline = time.monotonic() + timeout
    pause = 0.05 if interval is None else interval
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        if interval is None:
            pause = min(pause * 1.5, 0.5)
    raise AssertionError(f"condition not met within {timeout}s")


def image_input(images: np.ndarray) -> grpcclient.InferInput:
    """The zoo classifier's input."""
    return x_input(images, name="image")


def events(caplog, name: str) -> list[dict]:
    """guard's structured events of one kind, from pytest's log capture."""
    import json

    return [e for e in (json.loads(r.getMessage()) for r in caplog.records
                        if r.name == "guard.events") if e["event"] == name]


class Traffic(threading.Thread):
    """A client sending one row after another until stopped, keeping every answer: for tests
    that change a model's route or session while requests flow."""

    def __init__(self, port: int, model: str, make_input, rows: np.ndarray,
                 output: str = "logits"):
        super().__init__(daemon=True)
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.model, self.make_input, self.rows, self.output = model, make_input, rows, output
        self.answers: list[tuple[str, int, np.ndarray]] = []  # (route, row index, output)
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            k = i % len(self.rows)
            try:
                result = self.client.infer(self.model, [self.make_input(self.rows[k:k + 1])])
                route = result.get_response().parameters["guard_route"].string_param
                self.answers.append((route, k, result.as_numpy(self.output)[0]))
            except Exception as exc:  # counted: the tests assert there are none
                self.errors.append(f"{type(exc).__name__}: {exc}")
            i += 1
        self.client.close()


def event_story(caplog) -> list[tuple]:
    """Every guard event as (event, trigger, reason): printed when an assertion fails."""
    import json

    return [(e["event"], e.get("trigger"), e.get("reason", "")[:120])
            for e in (json.loads(r.getMessage()) for r in caplog.records
                      if r.name == "guard.events")]


def ops_fallback_model(name: str, primary: dict, reference: dict, fallback: dict,
                       **repair) -> dict:
    """A model block for the ops-fallback e2e tests: every request mirrored, tier 1 at 5% of the
    largest logit, a CUSUM that trips within a few failing samples (p0 pinned), a dwell long
    enough that only the repair (or a manual reset) brings the primary back. The repair's
    buffer holds the 32 rows the tests' traffic cycles through, so the variant it validates is
    validated on every row the tests then check it on: with 16, a variant passed the half it
    saw and failed the other half on an AVX2 CPU, where ONNX Runtime's int8 convolutions err
    more than with AVX-512 VNNI."""
    return {
        "name": name,
        "task": "classification",
        "primary": primary,
        "reference": reference,
        "fallback": fallback,
        "mirror": {"sample_rate": 1.0, "queue_size": 64},
        "checks": {"tensor": {"atol": 0.0, "rtol": 0.05}},
        "policy": {"action": "fallback_ops", "p0": 0.01, "arl0": 1000, "dwell_s": 600,
                   "repair": {"buffer": 32, **repair}},
    }


def traffic_through_repair(srv, model: str, make_input, rows: np.ndarray,
                           primary_answers: int = 20) -> tuple[dict, Traffic, int]:
    """Send traffic until a repaired primary serves (guard_fallback_active{scope="ops"} == 1)
    and has answered ``primary_answers`` requests; returns the metrics seen at the swap, the
    traffic (its answers and errors) and how many answers came before the swap was seen."""
    traffic = Traffic(srv.grpc_port, model, make_input, rows)
    traffic.start()
    try:
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model=model, scope="ops") == 1 and v, timeout=120)
        served_before = len(traffic.answers)
        wait_for(lambda: sum(r == "primary" for r, _, _ in traffic.answers[served_before:])
                 >= primary_answers, timeout=60)
    finally:
        traffic.stop.set()
        traffic.join(30)
    return values, traffic, served_before


def assert_repaired_once(values: dict, traffic: Traffic, caplog, model: str) -> dict:
    """After ``traffic_through_repair``: no request failed, the model went to its fallback once
    and came back on a repair once, without a failed repair; returns the repair's evidence."""
    assert traffic.errors == []
    story = event_story(caplog)
    assert metric(values, "guard_fallback_transitions_total", model=model,
                  to="fallback_model") == 1, story
    assert metric(values, "guard_fallback_transitions_total", model=model,
                  to="fallback_ops") == 1, story
    assert metric(values, "guard_fallback_active", model=model, scope="model") == 0
    (done,) = [e for e in events(caplog, "route_transition") if e["trigger"] == "repair"]
    assert events(caplog, "repair_started") and not events(caplog, "repair_failed"), story
    return done["evidence"]


def reset_repaired_primary(srv, model: str, kept: list[str], reason: str):
    """Check the admin status of a repaired model (primary route, ``kept`` kept back, no repair
    running), then reset it to the primary as configured; returns the status before the reset."""
    import grpc

    from guard.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{srv.admin_port}") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        status = admin.GetStatus(admin_pb2.GetStatusRequest(model=model)).models[0]
        assert status.route == "primary"
        assert list(status.ops_kept_back) == kept
        assert not status.repairing
        reset = admin.SetRoute(admin_pb2.SetRouteRequest(
            model=model, route=admin_pb2.PRIMARY, reason=reason)).status
        assert list(reset.ops_kept_back) == []
    assert metric(scrape(srv.metrics_port), "guard_fallback_active", model=model,
                  scope="ops") == 0
    return status




class Tracebacks(logging.Handler):
    """Log records that carry a traceback, from every logger while attached (``with``): a
    fuzzed input must be answered, never crash a handler."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)

    def __enter__(self) -> "Tracebacks":
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]
