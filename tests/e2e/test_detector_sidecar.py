"""The default detector (CUSUM) through the sidecar: gauges show the statistic climbing to
its threshold, the model trips, and clean probes route it back."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from fixture_models import DRIFT_TRIGGER
from guard.policy.detector import exact_threshold

from support import affine_backend, metric, model_block, running, scrape, wait_for, x_input


def test_cusum_trips_exports_its_statistic_and_recovers(tmp_path, rng):
    model = model_block(
        primary=affine_backend(drift_on_trigger=True),
        fallback=affine_backend(),
        # CUSUM from p0 = 1% to p1 = 3% (the default shift): each failure adds ln 3. No
        # min_samples gate: the test counts the CUSUM's own steps to its threshold.
        policy={"action": "fallback_model", "p0": 0.01, "arl0": 1000, "recover_arl0": 10,
                "dwell_s": 0.2, "min_samples": 1},
    )
    drifting = np.full((1, 4), DRIFT_TRIGGER, np.float32)
    with running(tmp_path, [model]) as (srv, client):
        values = scrape(srv.metrics_port)
        # The default threshold is exact: the smallest h whose in-control ARL is >= 1000.
        threshold = metric(values, "guard_detector_threshold", model="m", tier="tensor")
        assert threshold == pytest.approx(exact_threshold(0.01, 0.03, 1000))
        assert threshold < math.log(1000)
        needed = math.ceil(threshold / math.log(3))  # failures in a row to reach it
        for _ in range(needed - 1):
            client.infer("m", [x_input(drifting)])
        values = wait_for(lambda: (v := scrape(srv.metrics_port)) and metric(
            v, "guard_checks_total", model="m", tier="tensor", result="fail") == needed - 1
            and v)
        statistic = metric(values, "guard_detector_statistic", model="m", tier="tensor")
        assert statistic == pytest.approx((needed - 1) * math.log(3))
        assert metric(values, "guard_fallback_active", model="m", scope="model") == 0
        client.infer("m", [x_input(drifting)])
        wait_for(lambda: metric(scrape(srv.metrics_port), "guard_fallback_active", model="m",
                                scope="model") == 1)
        time.sleep(0.25)  # past the dwell: the primary is probed on clean traffic
        # Recovery: from 3% back to 1%; each clean probe adds ln(0.99/0.97) toward ln(10).
        probes = math.ceil(math.log(10) / math.log(0.99 / 0.97))

        def back_on_primary():
            client.infer("m", [x_input(rng.normal(size=(1, 4)))])
            return metric(scrape(srv.metrics_port), "guard_fallback_transitions_total",
                          model="m", to="primary") == 1

        wait_for(back_on_primary, timeout=60, interval=0.0)
        values = scrape(srv.metrics_port)
        assert metric(values, "guard_fallback_active", model="m", scope="model") == 0
        assert metric(values, "guard_requests_total", model="m", route="fallback") >= probes
