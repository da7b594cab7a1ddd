"""An action per tier (``policy.actions``) through the real sidecar: tensor failures alert and
leave clients on the primary, task failures switch the model to its fallback (issue 28, 11).

The primary is the fixture's affine model (tests/fixture_models.py, in its ONNX form:
tests/affine_onnx.py): on one input it moves every logit by 1.0 (tier 1 fails, the top-1 class
stays: tier 3 passes), on another it rolls the logits by one class (the top-1 changes: tier 3
fails too)."""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from fixture_models import DRIFT_TRIGGER, ROLL_TRIGGER
from guard.admin_client import format_model_status, get_status

from support import affine_backend, metric, model_block, running, scrape, wait_for, x_input


def route_of(result) -> str:
    return result.get_response().parameters["guard_route"].string_param


def events(caplog, name: str) -> list[dict]:
    found = [json.loads(r.getMessage()) for r in caplog.records if r.name == "guard.events"]
    return [e for e in found if e["event"] == name]


def test_tensor_failures_alert_and_task_failures_switch(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    model = model_block(
        task="classification",
        primary=affine_backend(drift_on_trigger=True, roll_on_trigger=True),
        fallback=affine_backend(),
        policy={"action": "fallback_model", "actions": {"tensor": "alert"},
                "detector": "window", "window": 10, "min_samples": 5, "trip_ratio": 0.2,
                "recover_ratio": 0.0, "dwell_s": 600.0})
    shifted = np.full((1, 4), DRIFT_TRIGGER, np.float32)  # every logit + 1: top-1 kept
    rolled = np.full((1, 4), ROLL_TRIGGER, np.float32)  # logits rolled: top-1 changes
    with running(tmp_path, [model]) as (srv, client):
        # Tensor drift alone: an alert, and clients keep getting the primary's answers.
        for _ in range(6):
            assert route_of(client.infer("m", [x_input(shifted)])) == "primary"
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_mirror_total", model="m", outcome="compared") == 6 and v)
        assert metric(values, "guard_checks_total", model="m", tier="tensor", result="fail") == 6
        assert metric(values, "guard_checks_total", model="m", tier="task", result="pass") == 6
        wait_for(lambda: events(caplog, "drift_alert"))
        (alert,) = events(caplog, "drift_alert")
        assert alert["action"] == "alert" and alert["evidence"]["tier"] == "tensor"
        assert metric(values, "guard_fallback_active", model="m", scope="model") == 0
        assert route_of(client.infer("m", [x_input(shifted)])) == "primary"

        # Task drift: the fallback answers from the switch on.
        for _ in range(6):
            client.infer("m", [x_input(rolled)])
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_fallback_active", model="m", scope="model") == 1 and v)
        assert metric(values, "guard_fallback_transitions_total", model="m",
                      to="fallback_model") == 1
        assert route_of(client.infer("m", [x_input(rolled)])) == "fallback"
        # The verifier sets the gauge, then its event travels to this process's log.
        (switch,) = wait_for(lambda: events(caplog, "route_transition"))
        assert (switch["to_route"], switch["trigger"]) == ("fallback", "policy")
        assert switch["evidence"]["tier"] == "task"
        assert switch["evidence"]["action"] == "fallback_model"
        assert len(events(caplog, "drift_alert")) == 1  # the tensor tier was alerting already

        (status,) = get_status(f"127.0.0.1:{srv.admin_port}").models
        assert dict(status.tier_actions) == {"tensor": "alert"}
        text = format_model_status(status)
        assert "action=fallback_model (tensor: alert)" in text
        # The windows started empty at the switch (the counts since are the probes'), and the
        # status says since when.
        switched = status.last_transition.unix_time
        assert {w.tier for w in status.windows} == {"tensor", "task"}
        assert all(abs(w.since_unix_time - switched) < 1.0 for w in status.windows)
        since = time.strftime("%H:%M:%S", time.localtime(status.windows[0].since_unix_time))
        assert f"failing since {since} (" in text, text
