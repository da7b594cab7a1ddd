"""Sequential detectors (CUSUM, e-detector, window) and the route policy driven by them."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from guard.config import PolicyConfig
from guard.plan.complete import parse_config
from guard.errors import ConfigError
from guard.policy.detector import (
    BernoulliCusum,
    EDetector,
    WindowDetector,
    cusum_arl,
    default_alternatives,
    exact_threshold,
    wilson_upper,
)
from guard.policy.route import RoutePolicy

from test_policy import FakeClock, feed


def alarms(detector, stream) -> int:
    """Alarms over a stream, restarting the detector after each (as the policy does)."""
    count = 0
    for failed in stream:
        if detector.update(bool(failed)):
            count += 1
            detector.reset()
    return count


def first_alarm(detector, stream) -> int | None:
    for i, failed in enumerate(stream):
        if detector.update(bool(failed)):
            return i + 1
    return None


# -- CUSUM ---------------------------------------------------------------------------------------
def test_cusum_increments_and_threshold():
    d = BernoulliCusum(0.01, 0.03, math.log(1e5))
    assert d.on_fail == pytest.approx(math.log(3))
    assert d.on_pass == pytest.approx(math.log(0.97 / 0.99))
    # ln(1e5) / ln(3) = 10.48: the 11th failure in a row alarms.
    assert first_alarm(d, [True] * 20) == 11
    assert d.statistic >= d.threshold and d.alarmed


def test_cusum_never_goes_below_zero_and_resets():
    d = BernoulliCusum(0.01, 0.03, 5.0)
    for _ in range(100):
        d.update(False)
    assert d.statistic == 0.0
    d.update(True)
    assert d.statistic == pytest.approx(math.log(3))
    d.reset()
    assert (d.statistic, d.samples) == (0.0, 0)


def test_cusum_false_alarm_rate_is_within_arl0():
    rng = np.random.default_rng(1)
    arl0 = 2000.0
    stream = rng.random(400_000) < 0.01
    count = alarms(BernoulliCusum(0.01, 0.03, math.log(arl0)), stream)
    assert count <= len(stream) / arl0  # 200 allowed; h = ln(ARL0) is conservative


def test_cusum_detects_a_shift_quickly():
    rng = np.random.default_rng(2)
    delays = [first_alarm(BernoulliCusum(0.001, 0.021, math.log(1e5)),
                          rng.random(5000) < 0.021) for _ in range(40)]
    assert all(d is not None for d in delays)
    assert np.median(delays) < 400


def test_recovery_cusum_alarms_when_the_rate_comes_down():
    # Null: still failing at p1 = 0.03; alternative: back at 0.01.
    d = BernoulliCusum(0.03, 0.01, math.log(100))
    per_pass = math.log(0.99 / 0.97)
    assert first_alarm(d, [False] * 1000) == math.ceil(math.log(100) / per_pass)
    d.reset()
    assert first_alarm(d, [True, False] * 500) is None  # 50% failures never "recover"


@pytest.mark.parametrize("p_null,p_alt", [(0.0, 0.1), (0.1, 0.1), (0.1, 1.0)])
def test_cusum_rejects_bad_rates(p_null, p_alt):
    with pytest.raises(ValueError):
        BernoulliCusum(p_null, p_alt, 1.0)


def test_exact_threshold_keeps_arl0_and_is_the_smallest_that_does():
    p0, p1, arl0 = 0.01, 0.03, 1e5
    h = exact_threshold(p0, p1, arl0)
    up, down = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
    assert cusum_arl(p0, up, down, h) >= arl0
    assert cusum_arl(p0, up, down, h + down) < arl0  # one pass step lower falls short
    assert 5.0 < h < math.log(arl0)  # far below the ln(ARL0) bound


def test_cusum_arl_matches_a_dense_markov_solve():
    p, up, down, h = 0.05, math.log(0.1 / 0.05), math.log(0.9 / 0.95), 4.0
    unit = -down
    n, m = math.ceil(h / unit), math.ceil(up / unit)
    q = np.zeros((n, n))
    for i in range(n):
        if i + m < n:
            q[i, i + m] += p
        q[i, max(i - 1, 0)] += 1 - p
    dense = np.linalg.solve(np.eye(n) - q, np.ones(n))[0]
    assert cusum_arl(p, up, down, h) == pytest.approx(dense, rel=1e-9)


def test_exact_threshold_false_alarm_rate_is_near_the_target():
    """Simulated: the exact threshold spends the false-alarm budget (the bound wastes it)."""
    rng = np.random.default_rng(9)
    arl0 = 2000.0
    stream = rng.random(1_000_000) < 0.02
    exact = alarms(BernoulliCusum(0.02, 0.06, exact_threshold(0.02, 0.06, arl0)), stream)
    bound = alarms(BernoulliCusum(0.02, 0.06, math.log(arl0)), stream)
    assert 0.6 * len(stream) / arl0 < exact <= 1.1 * len(stream) / arl0
    assert bound < exact / 10


def test_policy_uses_the_exact_threshold_by_default():
    policy = RoutePolicy("m", PolicyConfig(action="alert", p0=0.01, arl0=1e5))
    assert policy.detectors()[0].threshold == pytest.approx(exact_threshold(0.01, 0.03, 1e5))


# -- e-detector ----------------------------------------------------------------------------------
def test_e_detector_is_a_log_mixture_of_cusums():
    alternatives = [0.02, 0.05]
    e = EDetector(0.01, alternatives, 10.0)
    parts = [BernoulliCusum(0.01, a, 10.0) for a in alternatives]
    for failed in [True, False, True, True, False]:
        e.update(failed)
        for p in parts:
            p.update(failed)
    expected = math.log(sum(math.exp(p.statistic) for p in parts) / 2)
    assert e.statistic == pytest.approx(expected)


@pytest.mark.parametrize("true_rate", [0.005, 0.01], ids=["below-bound", "at-bound"])
def test_e_detector_keeps_arl0_for_any_rate_up_to_the_bound(true_rate):
    rng = np.random.default_rng(3)
    arl0 = 1000.0
    stream = rng.random(300_000) < true_rate
    d = EDetector(0.01, default_alternatives(0.01, 0.02), math.log(arl0))
    assert alarms(d, stream) <= len(stream) / arl0


def test_e_detector_detects_small_and_large_shifts():
    rng = np.random.default_rng(4)
    for rate, bound in ((0.03, 1500), (0.5, 40)):
        delays = [first_alarm(EDetector(0.01, default_alternatives(0.01, 0.02),
                                        math.log(1e5)), rng.random(20000) < rate)
                  for _ in range(20)]
        assert np.median(delays) < bound, (rate, np.median(delays))


def test_default_alternatives_stay_below_one():
    assert default_alternatives(0.001, 0.02) == pytest.approx(
        [0.011, 0.021, 0.041, 0.081, 0.161, 0.321])
    assert all(a < 1 for a in default_alternatives(0.5, 0.2))


# -- window ---------------------------------------------------------------------------------------
def test_window_detector_up_and_down():
    up = WindowDetector(10, 5, 0.2, "up")
    assert first_alarm(up, [True] * 10) == 5
    down = WindowDetector(10, 5, 0.1, "down")
    assert first_alarm(down, [False] * 10) == 5
    assert (up.statistic, up.threshold) == (1.0, 0.2)


def test_wilson_upper_bound():
    assert wilson_upper(0, 500, 1.2816) == pytest.approx(0.00327, abs=1e-4)
    assert 0.05 < wilson_upper(5, 100, 1.2816) < 0.1
    assert wilson_upper(0, 0, 1.2816) == 1.0


# -- the policy with sequential detectors ----------------------------------------------------------
def make(detector="cusum", rng=None, **overrides):
    """A policy whose CUSUM threshold is ln(ARL0) (``threshold: bound``), so that counts of
    failures to a trip are easy to state: ln(1e5) / ln(3) -> the 11th failure trips. These
    tests pin the detectors' own counts, so no min_samples gate (tested on its own below)."""
    clock = FakeClock()
    fields = dict(action="fallback_model", detector=detector, p0=0.01, arl0=1e5,
                  recover_arl0=100, dwell_s=10.0, threshold="bound", min_samples=1)
    fields.update(overrides)
    config = PolicyConfig(**fields)
    return RoutePolicy("m", config, clock=clock, rng=rng or random.Random(0)), clock


def test_cusum_policy_trips_with_detector_evidence():
    policy, _ = make()
    transitions = feed(policy, [True] * 11)
    (t,) = transitions
    assert (t.from_route, t.to_route, t.trigger) == ("primary", "fallback", "policy")
    assert "cusum statistic" in t.reason and "ARL0 1e+05" in t.reason
    detector = t.evidence["detector"]
    assert detector["detector"] == "cusum" and detector["p_null"] == 0.01
    assert detector["p_alt"] == pytest.approx(0.03)
    assert detector["threshold"] == pytest.approx(math.log(1e5), abs=1e-4)
    assert t.evidence["trips_in_a_row"] == 1


def test_detector_figures_show_the_trip_detector():
    policy, _ = make()
    feed(policy, [True] * 3)
    (fig,) = policy.detectors()
    assert (fig.kind, fig.p0) == ("cusum", 0.01)
    assert fig.statistic == pytest.approx(3 * math.log(3))
    assert fig.threshold == pytest.approx(math.log(1e5))
    feed(policy, [True] * 8)  # trips; the new epoch starts from zero
    assert policy.route == "fallback" and policy.detectors()[0].statistic == 0.0
    feed(policy, [True] * 2)  # failing probes of the primary keep counting
    assert policy.detectors()[0].statistic == pytest.approx(2 * math.log(3))


def test_cusum_policy_recovers_on_clean_probes():
    policy, clock = make()
    feed(policy, [True] * 11)
    clock.advance(10)
    assert policy.probing
    needed = math.ceil(math.log(100) / math.log(0.99 / 0.97))
    assert feed(policy, [False] * (needed - 1)) == []
    (back,) = feed(policy, [False])
    assert back.to_route == "primary" and "recovered" in back.reason


def test_e_detector_policy_trips():
    policy, _ = make(detector="e_detector")
    transitions = feed(policy, [True] * 20)
    assert transitions and transitions[0].evidence["detector"]["detector"] == "e_detector"
    assert policy.route == "fallback"


def test_burn_in_measures_p0_and_broken_start_still_trips(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="guard.events")
    policy, _ = make(p0=None, burn_in=200, p0_min=0.001, p0_max=0.05)
    assert policy.detectors()[0].p0 == 0.05  # burn-in runs with p0_max
    assert feed(policy, [False] * 199) == []
    assert policy.detectors()[0].p0 == 0.05
    feed(policy, [False])
    measured = policy.detectors()[0].p0
    assert measured == pytest.approx(wilson_upper(0, 200, 1.2816))
    assert any('"detector_calibrated"' in r.getMessage() for r in caplog.records)
    # A model failing from the start trips during its burn-in.
    broken, _ = make(p0=None, burn_in=500)
    (t,) = feed(broken, [True] * 60)
    assert "during burn-in" in t.reason


def test_burn_in_p0_is_an_upper_bound_clipped_to_the_ceiling():
    # 10% failing during burn-in; p1 = p0_max + shift is far enough that it never trips.
    policy, _ = make(p0=None, burn_in=100, p0_max=0.2, shift=0.3, arl0=1e9)
    feed(policy, ([True] + [False] * 9) * 10)
    upper = wilson_upper(10, 100, 1.2816)
    assert 0.1 < upper < 0.2
    assert policy.detectors()[0].p0 == pytest.approx(upper)
    noisy, _ = make(p0=None, burn_in=100, p0_max=0.12, shift=0.5, arl0=1e9)
    feed(noisy, ([True] + [False] * 9) * 10)
    assert noisy.detectors()[0].p0 == 0.12


def test_dwell_grows_with_repeated_trips_and_is_capped():
    policy, clock = make(dwell_s=10.0, max_dwell_s=25.0)
    dwells = []
    for _ in range(4):
        feed(policy, [True] * 11)
        dwells.append(policy.dwell_s)
        clock.advance(policy.dwell_s)
        assert policy.probing
        feed(policy, [False] * 300)
        assert policy.route == "primary"
    assert dwells == [10.0, 20.0, 25.0, 25.0]


def test_dwell_count_decays_while_healthy_on_primary():
    policy, clock = make(dwell_s=10.0, max_dwell_s=100.0)
    for _ in range(3):
        feed(policy, [True] * 11)
        clock.advance(policy.dwell_s)
        feed(policy, [False] * 300)
    assert policy.dwell_s == 30.0
    clock.advance(25.0)  # two base dwells healthy: two trips forgiven
    feed(policy, [True] * 11)
    assert policy.dwell_s == 20.0


def test_primary_dwell_defers_a_trip_after_routing_back():
    policy, clock = make(primary_dwell_s=5.0)
    assert feed(policy, [True] * 11) == []  # the policy just started: within primary_dwell_s
    clock.advance(5.0)
    (t,) = feed(policy, [True])
    assert t.to_route == "fallback"


def test_dry_run_reports_without_switching():
    policy, _ = make(dry_run_percent=100.0)
    transitions = feed(policy, [True] * 40)
    assert transitions and all(t.trigger == "dry_run" for t in transitions)
    assert all((t.from_route, t.to_route) == ("primary", "fallback") for t in transitions)
    assert policy.route == "primary" and policy.epoch == 0
    assert len(transitions) == 40 // 11  # the detector restarts after each report


def test_dry_run_percentage_is_a_share_of_trips():
    policy, _ = make(dry_run_percent=50.0, rng=random.Random(5))
    outcomes = []
    for _ in range(200):
        (t,) = feed(policy, [True] * 11)
        outcomes.append(t.trigger)
        if policy.route == "fallback":
            policy.set_override("primary", "")
            policy.set_override("auto", "")
    share = outcomes.count("dry_run") / len(outcomes)
    assert 0.4 < share < 0.6


def test_alert_mode_alerts_once_and_rearms_after_recovery():
    policy, _ = make(action="alert")
    (alert,) = feed(policy, [True] * 30)
    assert alert.trigger == "alert" and policy.route == "primary"
    needed = math.ceil(math.log(100) / math.log(0.99 / 0.97))
    assert feed(policy, [False] * needed) == []  # re-armed, quietly
    (again,) = feed(policy, [True] * 11)
    assert again.trigger == "alert"


# -- min_samples: no decision on fewer samples, whatever the detector -----------------------------
def _first_trip(policy: RoutePolicy, limit: int = 500) -> int | None:
    """How many failing samples in a row until the policy trips (None: not within ``limit``)."""
    for i in range(1, limit + 1):
        if feed(policy, [True]):
            return i
    return None


@pytest.mark.parametrize("kind", ["cusum", "e_detector", "window"])
def test_no_detector_trips_before_min_samples_and_each_trips_at_it(kind):
    """On a constant failing stream every detector kind would decide early (the CUSUM at the
    11th sample, the window at the 1st); with min_samples above that it trips at exactly
    min_samples, never before: one gate for all, as policy.min_samples promises. The statistic
    is past its threshold meanwhile (the gauges show it); only the decision waits."""
    ungated = _first_trip(make(kind, window=100)[0])
    assert ungated is not None and ungated < 30
    policy, _ = make(kind, window=100, min_samples=30)
    assert feed(policy, [True] * 29) == []
    (figures,) = policy.detectors()
    assert figures.statistic >= figures.threshold and policy.route == "primary"
    (t,) = feed(policy, [True])
    assert (t.from_route, t.to_route, t.trigger) == ("primary", "fallback", "policy")
    assert t.evidence["samples"] == 30


@pytest.mark.parametrize("kind", ["cusum", "e_detector", "window"])
def test_min_samples_below_a_detectors_own_count_does_not_delay_it(kind):
    ungated = _first_trip(make(kind, window=100)[0])
    assert _first_trip(make(kind, window=100, min_samples=max(1, ungated - 1))[0]) == ungated
    assert _first_trip(make(kind, window=100, min_samples=ungated)[0]) == ungated


@pytest.mark.parametrize("kind", ["cusum", "e_detector", "window"])
def test_min_samples_counts_again_after_a_route_change(kind):
    """A manual route change starts a new epoch and fresh detectors: the gate applies again."""
    policy, _ = make(kind, window=100, min_samples=25)
    assert _first_trip(policy) == 25
    policy.set_override("primary", "back by hand")
    policy.set_override("auto", "")
    assert policy.route == "primary"
    assert _first_trip(policy) == 25


def test_min_samples_also_holds_back_a_sequential_recovery():
    """The recovery CUSUM (3% down to 1%, threshold ln 2) would call clean probes recovered
    after 34; with min_samples 50 the primary comes back at the 50th probe, not before."""
    needed = math.ceil(math.log(2) / math.log(0.99 / 0.97))
    assert needed == 34
    for min_samples, back_at in ((1, needed), (50, 50)):
        policy, clock = make(recover_arl0=2, min_samples=min_samples)
        _first_trip(policy)
        clock.advance(10)
        assert policy.probing
        assert feed(policy, [False] * (back_at - 1)) == []
        (back,) = feed(policy, [False])
        assert back.to_route == "primary"


@pytest.mark.parametrize("build", [
    lambda m: BernoulliCusum(0.01, 0.03, math.log(1e5), min_samples=m),
    lambda m: EDetector(0.01, default_alternatives(0.01, 0.02), math.log(1e5), min_samples=m),
    lambda m: WindowDetector(40, m, 0.2, "up"),
], ids=["cusum", "e_detector", "window"])
def test_each_detector_class_gates_its_own_alarm(build):
    ungated = first_alarm(build(1), [True] * 200)
    assert ungated is not None and ungated < 35
    gated = build(35)
    assert [gated.update(True) for _ in range(35)] == [False] * 34 + [True]
    assert gated.alarmed and gated.statistic >= gated.threshold
    gated.reset()
    assert not gated.alarmed and first_alarm(gated, [True] * 200) == 35
    with pytest.raises(ValueError, match="min_samples"):
        build(0)


# -- config ----------------------------------------------------------------------------------------
def test_cusum_is_the_default_and_arl0_converts_from_false_alarms_per_day():
    assert PolicyConfig().detector == "cusum"
    config = PolicyConfig(false_alarms_per_day=0.5, expected_rps=20.0)
    # 20 rps x 5% sampled x 86400 s = 86400 compared samples a day; 0.5 false alarms a day.
    assert config.arl0_for(0.05) == pytest.approx(172800.0)
    assert PolicyConfig().arl0_for(0.05) == 1e5
    policy = RoutePolicy("m", PolicyConfig(action="alert", false_alarms_per_day=1.0,
                                           expected_rps=100.0, threshold="bound"),
                         sample_rate=0.1)
    assert policy.arl0 == 864000.0
    assert policy.detectors()[0].threshold == pytest.approx(math.log(864000.0))


@pytest.mark.parametrize("policy,message", [
    ({"arl0": 1e5, "false_alarms_per_day": 1, "expected_rps": 1},
     "give arl0 or false_alarms_per_day, not both"),
    ({"false_alarms_per_day": 1}, "false_alarms_per_day and expected_rps go together"),
    ({"p0": 0.05, "p1": 0.01}, "p1 must be in (0.05, 1)"),
    ({"p0_min": 0.1, "p0_max": 0.05}, "p0_min must not exceed p0_max"),
    ({"p1": 0.3, "recover_rate": 0.3}, "recover_rate must be below p1"),
    ({"dwell_s": 100, "max_dwell_s": 50}, "dwell_s must not exceed max_dwell_s"),
    ({"arl0": 1}, "arl0 must be > 1"),
])
def test_policy_config_errors(tmp_path, policy, message):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"")
    doc = {"version": 1, "models": [{"name": "m", "primary": {"backend": "onnxruntime",
                                                                "path": "m.onnx"},
                                      "policy": policy}]}
    with pytest.raises(ConfigError) as err:
        parse_config(doc, tmp_path)
    assert any(message in line for line in err.value.problems), err.value.problems


def test_dry_run_percent_range(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_config({"version": 1, "models": [{
            "name": "m", "primary": {"backend": "torch", "path": "fixture_models:affine"},
            "policy": {"dry_run_percent": 150}}]}, tmp_path)
    assert err.value.problems == ["models[0].policy.dry_run_percent: must be in [0, 100]"]


# -- the detection-delay benchmark simulates these detectors ---------------------------------------
@pytest.fixture(scope="module")
def delay_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "detection_delay.py"
    spec = importlib.util.spec_from_file_location("detection_delay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["cusum", "cusum_bound", "e_detector"])
def test_the_delay_benchmark_holds_alarms_back_until_min_samples_as_guard_does(
        delay_benchmark, kind):
    """The vectorised detectors of benchmarks/detection_delay.py alarm where guard's classes do,
    ``min_samples`` included: with it, a stream failing from its first sample alarms only at
    the min_samples-th result (without it, earlier)."""
    rng = np.random.default_rng(5)
    delay_benchmark.check_against_guard(0.01, 1e5, 40, (100, 0.05), rng)
    always = np.ones(2, dtype=bool)
    first = {}
    for min_samples in (1, 40):
        vec = delay_benchmark.make_vec(kind, 0.01, 1e5, min_samples, 2)
        first[min_samples] = next(t for t in range(1, 100) if vec.step(always).all())
    assert first[1] < 40 and first[40] == 40
