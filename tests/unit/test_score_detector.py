"""The scored detector (guard/policy/detector.py ``ScoreCusum``) and a scored tier in the route
policy: the generation tier's detector accumulates each completion's mean KLD."""

from __future__ import annotations

import math
import random

import pytest

from guard.config import PolicyConfig
from guard.config.generation import GenerationCheckConfig, with_task_defaults
from guard.policy.detector import ScoreCusum, ScoreSpec
from guard.policy.route import RoutePolicy

DEFAULTS = GenerationCheckConfig()


def _spec() -> ScoreSpec:
    """The generation tier's: scores are the statistic over its failing level."""
    return ScoreSpec(DEFAULTS.in_control_ratio, 1.0, DEFAULTS.bet)


def kld(nats: float) -> float:
    return nats / DEFAULTS.max_mean_kld


def _policy(**policy) -> RoutePolicy:
    config = with_task_defaults(PolicyConfig(action="fallback_model", **policy), "generation")
    return RoutePolicy("smol", config, ("generation",), scores={"generation": _spec()})


def test_each_factor_is_an_e_value_at_the_null_mean():
    """exp(increment) = 1 + bet (x / mu0 - 1): its mean over any scores averaging mu0 is 1,
    and below mu0 less than 1 (what the ARL0 promise rests on)."""
    d = ScoreCusum(0.02, 0.5, 10.0)
    rng = random.Random(7)
    scores = [rng.expovariate(1 / 0.02) for _ in range(2000)]
    mean = sum(scores) / len(scores)
    factors = [math.exp(d.increment(x)) for x in scores]
    assert sum(factors) / len(factors) == pytest.approx(1 + 0.5 * (mean / 0.02 - 1), rel=1e-9)
    assert all(f > 0 for f in factors)
    assert math.exp(d.increment(0.0)) == pytest.approx(0.5)


def test_rejects_what_is_not_a_score():
    d = ScoreCusum(0.02, 0.5, 10.0)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="score"):
            d.update(bad)
    assert d.samples == 0
    with pytest.raises(ValueError):
        ScoreCusum(0.0, 0.5, 10.0)
    with pytest.raises(ValueError):
        ScoreCusum(0.02, 1.0, 10.0)
    with pytest.raises(ValueError):
        ScoreSpec(0.1, 0.05)


def test_in_control_scores_rarely_alarm():
    """Scores with mean 0.005 (a Q8_0-like primary) against the default null 0.02: at
    threshold ln(1000) the chain may alarm at most ~N/1000 times; it stays far below."""
    d = ScoreCusum(0.02, 0.5, math.log(1000.0))
    rng = random.Random(11)
    alarms = 0
    for _ in range(20000):
        if d.update(rng.expovariate(1 / 0.005)):
            alarms += 1
            d.reset()
    assert alarms <= 20


def test_generation_defaults_trip_on_q2k_like_scores_within_ten():
    policy = _policy()
    assert policy.config.min_samples == 5 and policy.arl0 == 1e5
    transitions = []
    for i in range(10):
        t = policy.observe("generation", True, policy.epoch, score=kld(0.3))
        if t is not None:
            transitions.append((i + 1, t))
    assert len(transitions) == 1
    n, t = transitions[0]
    assert n <= 10 and t.to_route == "fallback" and t.trigger == "policy"
    assert "score_cusum" in t.reason and t.evidence["detector"]["arl0"] == 1e5


def test_agreeing_scores_never_trip_and_p0_is_never_calibrated():
    policy = _policy()
    rng = random.Random(3)
    for _ in range(1000):
        assert policy.observe("generation", False, policy.epoch,
                              score=kld(rng.expovariate(1 / 0.004))) is None
    (figures,) = policy.detectors()
    assert figures.kind == "score_cusum" and figures.p0 is None
    assert figures.statistic < figures.threshold == pytest.approx(math.log(1e5))


def test_a_scored_sample_without_a_score_counts_in_the_window_only():
    policy = _policy()
    for _ in range(10):
        assert policy.observe("generation", True, policy.epoch, score=None) is None
    (window,) = policy.windows()
    assert (window.samples, window.failures) == (10, 10)
    assert policy.detectors()[0].samples == 0


def test_probes_with_agreeing_scores_route_back():
    clock = [0.0]
    config = with_task_defaults(PolicyConfig(action="fallback_model", dwell_s=1.0),
                                "generation")
    policy = RoutePolicy("smol", config, ("generation",), clock=lambda: clock[0],
                         scores={"generation": _spec()})
    while policy.route == "primary":
        policy.observe("generation", True, policy.epoch, score=kld(0.5))
    clock[0] += 2.0
    assert policy.probing
    back = None
    for probes in range(1, 100):  # noqa: B007 (read after the loop: where it recovered)
        back = policy.observe("generation", False, policy.epoch, score=kld(0.001))
        if back is not None:
            break
    assert back is not None and back.to_route == "primary"
    # ln(1 + bet) per agreeing probe against ln(recover_arl0)
    assert probes == max(config.min_samples,
                         math.ceil(math.log(config.recover_arl0) / math.log(1.5)))


def test_task_defaults_leave_what_the_config_sets():
    assert with_task_defaults(PolicyConfig(min_samples=12), "generation").min_samples == 12
    assert with_task_defaults(PolicyConfig(), "classification").min_samples == 20
