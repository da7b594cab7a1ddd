"""Reload races: a replaced model is never closed under a request still inside it."""

from __future__ import annotations

import logging
import threading

import numpy as np
import tritonclient.grpc as grpcclient
import yaml

from fixture_models import SLEEP_TRIGGER
from guard.config import load_config
from guard.serve.app import BackgroundServer
from support import affine_backend, events, model_block, wait_for, write_config, x_input


def test_a_replaced_model_waits_for_its_last_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="guard.events")
    block = model_block(primary=affine_backend(sleep_on_trigger=3.0), reference=None,
                        mirror={"sample_rate": 0.0})
    # inline_below_ms 0: the request sleeps inside the model; inline, it would hold the event
    # loop (and the reload with it) for the whole sleep.
    path = write_config(tmp_path, [block], reload_interval_s=0.1, inline_below_ms=0)
    with BackgroundServer(load_config(path)) as srv:
        srv.reloader.retire_report_s = 0.5  # report early; the wait itself has no limit
        old = srv.models["m"]
        answers, errors = [], []

        def slow_request():
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{srv.grpc_port}")
            try:
                answers.append(client.infer("m", [x_input(np.full((1, 4), SLEEP_TRIGGER))]))
            except Exception as exc:  # asserted below
                errors.append(exc)
            finally:
                client.close()

        thread = threading.Thread(target=slow_request)
        thread.start()
        wait_for(lambda: old.requests_in_flight == 1)
        data = yaml.safe_load(path.read_text())
        data["models"][0]["checks"]["tensor"]["atol"] = 1e-3  # a change: 'm' is rebuilt
        path.write_text(yaml.safe_dump(data))
        wait_for(lambda: srv.models["m"] is not old)
        [waiting] = wait_for(lambda: events(caplog, "model_retire_waiting"))
        assert waiting["requests_in_flight"] == 1
        assert old.ready  # still open: the slow request is inside it
        thread.join(30)
        assert errors == [] and answers[0].as_numpy("y").shape == (1, 3)
        wait_for(lambda: not old.ready)  # closed once the request had finished
