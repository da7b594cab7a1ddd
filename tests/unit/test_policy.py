"""guard/policy: the count window and the route state machine (fake clock, no sleeps)."""

from __future__ import annotations

import threading
import time

import pytest

from guard.config import PolicyConfig
from guard.policy.route import RoutePolicy, Transition, WindowFigures
from guard.policy.window import CountWindow


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(action="fallback_model", window=10, min_samples=5, trip=0.2, recover=0.05, dwell=30.0,
         has_fallback=True, tiers=("tensor",), max_dwell=None, actions=None):
    """A window-detector policy (the v0 rule these tests pin down; the sequential detectors
    are tested in test_detectors.py)."""
    clock = FakeClock()
    config = PolicyConfig(action=action, detector="window", window=window,
                          min_samples=min_samples, trip_ratio=trip, recover_ratio=recover,
                          dwell_s=dwell, max_dwell_s=max_dwell, actions=actions or {})
    policy = RoutePolicy("m", config, tiers=tiers, has_fallback=has_fallback, clock=clock)
    return policy, clock


def feed(policy: RoutePolicy, results, tier="tensor", epoch=None) -> list[Transition]:
    """Observe each result (True = failed) in the current (or given) epoch; collect transitions."""
    out = []
    for failed in results:
        t = policy.observe(tier, failed, policy.epoch if epoch is None else epoch)
        if t is not None:
            out.append(t)
    return out


def trip(policy: RoutePolicy) -> Transition:
    (t,) = feed(policy, [True] * policy.config.min_samples)
    return t


# -- CountWindow ----------------------------------------------------------------------------------
def test_count_window_empty():
    w = CountWindow(3)
    assert (w.samples, w.failures, w.ratio) == (0, 0, 0.0)


def test_count_window_counts_and_evicts_oldest():
    w = CountWindow(3)
    for failed in (True, False, True):
        w.add(failed)
    assert (w.samples, w.failures) == (3, 2)
    assert w.ratio == pytest.approx(2 / 3)
    w.add(False)  # evicts the first True
    assert (w.samples, w.failures) == (3, 1)
    w.add(False)  # evicts False
    assert (w.samples, w.failures) == (3, 1)
    w.add(False)  # evicts the last True
    assert (w.samples, w.failures, w.ratio) == (3, 0, 0.0)


def test_count_window_failures_always_match_contents():
    w = CountWindow(7)
    pattern = [i % 3 == 0 or i % 5 == 0 for i in range(100)]
    for i, failed in enumerate(pattern):
        w.add(failed)
        kept = pattern[max(0, i - 6): i + 1]
        assert w.samples == len(kept)
        assert w.failures == sum(kept)


def test_count_window_size_one_and_clear():
    w = CountWindow(1)
    w.add(True)
    assert (w.samples, w.failures, w.ratio) == (1, 1, 1.0)
    w.add(False)
    assert (w.samples, w.failures, w.ratio) == (1, 0, 0.0)
    w.add(True)
    w.clear()
    assert (w.samples, w.failures, w.ratio) == (0, 0, 0.0)
    w.add(True)
    assert w.failures == 1


# -- tripping --------------------------------------------------------------------------------------
def test_starts_on_primary_with_nothing_recorded():
    policy, _ = make()
    assert policy.route == "primary"
    assert policy.override == "auto"
    assert policy.epoch == 0
    assert policy.last_transition is None
    assert not policy.probing
    assert policy.can_switch


def test_no_decision_before_min_samples():
    policy, _ = make(min_samples=5)
    assert feed(policy, [True] * 4) == []
    assert policy.route == "primary"
    (fig,) = policy.windows()
    assert (fig.samples, fig.failures, fig.ratio) == (4, 4, 1.0)


def test_trips_to_fallback_at_min_samples():
    policy, _ = make(min_samples=5)
    transitions = feed(policy, [True] * 5)
    assert len(transitions) == 1
    t = transitions[0]
    assert (t.model, t.from_route, t.to_route, t.trigger) == ("m", "primary", "fallback", "policy")
    assert "trip_ratio" in t.reason
    assert t.evidence == {"tier": "tensor", "action": "fallback_model", "samples": 5,
                          "failures": 5, "drift_ratio": 1.0,
                          "trips_in_a_row": 1, "dwell_s": 30.0}
    assert t.unix_time > 0
    assert policy.route == "fallback"
    assert policy.epoch == 1
    assert policy.last_transition == t
    # The window starts over for the new epoch.
    assert [(f.samples, f.failures) for f in policy.windows()] == [(0, 0)]


def test_ratio_equal_to_trip_ratio_does_not_trip():
    policy, _ = make(window=10, min_samples=10, trip=0.2)
    # A period-10 pattern with 2 failures keeps every full window at exactly 2/10 = trip_ratio.
    assert feed(policy, ([True, True] + [False] * 8) * 5) == []
    assert policy.route == "primary"
    assert policy.windows()[0].ratio == pytest.approx(0.2)


def test_trips_just_above_trip_ratio():
    policy, _ = make(window=10, min_samples=10, trip=0.2)
    assert feed(policy, [False] * 7 + [True] * 2) == []  # 9 samples < min_samples
    transitions = feed(policy, [True])  # 3/10 = 0.3 > 0.2
    assert len(transitions) == 1 and policy.route == "fallback"
    assert transitions[0].evidence["failures"] == 3


def test_mostly_passing_traffic_never_trips():
    policy, _ = make(window=10, min_samples=5, trip=0.2)
    assert feed(policy, ([False] * 9 + [True]) * 20) == []
    assert policy.route == "primary" and policy.epoch == 0


def test_no_fallback_configured_only_alerts():
    policy, _ = make(action="fallback_model", has_fallback=False)
    assert not policy.can_switch
    (t,) = feed(policy, [True] * 5)
    assert t.trigger == "alert"
    assert policy.route == "primary"


# -- action alert ----------------------------------------------------------------------------------
def test_alert_never_switches_and_alerts_once_per_crossing():
    policy, _ = make(action="alert", window=10, min_samples=5, trip=0.2, recover=0.05)
    assert not policy.can_switch
    transitions = feed(policy, [True] * 10)
    assert len(transitions) == 1
    t = transitions[0]
    assert t.trigger == "alert"
    assert (t.from_route, t.to_route) == ("primary", "primary")
    assert t.evidence["tier"] == "tensor"
    assert policy.route == "primary"
    assert policy.epoch == 0  # an alert is not a route change
    assert policy.last_transition is None
    # Still over: no repeat.
    assert feed(policy, [True] * 20) == []
    # Back under recover_ratio (a clean window) re-arms the alert ...
    assert feed(policy, [False] * 10) == []
    # ... and the next crossing alerts again.
    again = feed(policy, [True] * 3)
    assert [x.trigger for x in again] == ["alert"]
    assert policy.route == "primary"


def test_alert_not_rearmed_between_recover_and_trip():
    policy, _ = make(action="alert", window=10, min_samples=10, trip=0.3, recover=0.1)
    assert len(feed(policy, [True] * 10)) == 1
    # Drop to 2/10 = 0.2: between recover (0.1) and trip (0.3), still armed-off.
    assert feed(policy, [False] * 8) == []
    # Cross again: no new alert, because it never went back under recover_ratio.
    assert feed(policy, [True] * 8) == []


# -- an action per tier (policy.actions) -----------------------------------------------------------
def tiered(**kw):
    """Tensor failures alert, task failures switch (the default action: fallback_model)."""
    return make(tiers=("tensor", "task"), actions={"tensor": "alert"}, dwell=10, **kw)


def test_tensor_failures_alert_and_task_failures_switch():
    policy, _ = tiered()
    assert policy.can_switch
    (alert,) = feed(policy, [True] * 10, tier="tensor")
    assert alert.trigger == "alert" and alert.evidence["tier"] == "tensor"
    assert alert.evidence["action"] == "alert"
    assert policy.route == "primary" and policy.epoch == 0  # clients keep the primary
    assert feed(policy, [True] * 10, tier="tensor") == []  # once per crossing of the tier
    (switch,) = feed(policy, [True] * 5, tier="task")
    assert (switch.trigger, switch.to_route) == ("policy", "fallback")
    assert switch.evidence["tier"] == "task" and switch.evidence["action"] == "fallback_model"
    assert policy.route == "fallback"


def test_the_alerting_tier_does_not_bring_the_model_back():
    """On the fallback because the task tier drifted: clean tensor probes are not its call."""
    policy, clock = tiered()
    feed(policy, [True] * 5, tier="task")
    clock.advance(10)
    assert policy.probing
    assert feed(policy, [False] * 20, tier="tensor") == []
    assert policy.route == "fallback"
    (back,) = feed(policy, [False] * 5, tier="task")
    assert back.to_route == "primary" and back.evidence["tier"] == "task"


def test_each_tier_rearms_its_own_alert():
    policy, _ = make(action="alert", tiers=("tensor", "task"))
    (first,) = feed(policy, [True] * 5, tier="tensor")
    (second,) = feed(policy, [True] * 5, tier="task")  # the tensor alert does not mute it
    assert (first.evidence["tier"], second.evidence["tier"]) == ("tensor", "task")
    assert feed(policy, [False] * 10, tier="tensor") == []  # tensor re-armed, task still over
    assert [t.evidence["tier"] for t in feed(policy, [True] * 3, tier="tensor")] == ["tensor"]
    assert feed(policy, [True] * 10, tier="task") == []


def test_a_switching_tier_without_a_fallback_alerts():
    policy, _ = make(action="alert", actions={"task": "fallback_model"}, has_fallback=False,
                     tiers=("tensor", "task"))
    assert not policy.can_switch
    (t,) = feed(policy, [True] * 5, tier="task")
    assert t.trigger == "alert" and policy.route == "primary"


def test_only_alerting_tiers_still_come_back_after_a_pin():
    """Pinned to the fallback and handed back to auto with no tier that switches: any tier's
    recovery routes back (nothing else ever would)."""
    policy, clock = make(action="alert", tiers=("tensor", "task"), dwell=0)
    policy.set_override("fallback", "pin")
    policy.set_override("auto", "release")
    (back,) = feed(policy, [False] * 5, tier="tensor")
    assert back.to_route == "primary"


def test_actions_say_what_each_tier_does():
    config = PolicyConfig(action="alert", actions={"task": "fallback_ops"})
    assert (config.action_for("tensor"), config.action_for("task")) == ("alert", "fallback_ops")
    assert config.uses("fallback_ops") and config.uses("alert")
    assert not config.uses("fallback_model")
    with pytest.raises(ValueError, match="not a tier name"):
        PolicyConfig(actions={"tier 1": "alert"})
    with pytest.raises(ValueError):
        PolicyConfig(actions={"task": "reboot"})


# -- epochs ----------------------------------------------------------------------------------------
def test_results_from_old_epoch_ignored_after_transition():
    policy, _ = make(min_samples=5)
    trip(policy)
    assert policy.epoch == 1
    # Stale failures (epoch 0) and stale passes are ignored entirely.
    assert feed(policy, [True] * 20, epoch=0) == []
    assert feed(policy, [False] * 20, epoch=0) == []
    assert [(f.samples, f.failures) for f in policy.windows()] == [(0, 0)]
    assert policy.route == "fallback"


def test_result_from_future_epoch_ignored():
    policy, _ = make()
    assert policy.observe("tensor", True, epoch=5) is None
    assert policy.windows()[0].samples == 0


# -- dwell and probing ---------------------------------------------------------------------------
def test_probing_false_during_dwell_true_after():
    policy, clock = make(dwell=30.0)
    assert not policy.probing  # on primary: never probing
    trip(policy)
    assert not policy.probing
    clock.advance(29.9)
    assert not policy.probing
    clock.advance(0.1)
    assert policy.probing  # dwell_s reached
    clock.advance(1000)
    assert policy.probing


def test_zero_dwell_probes_at_once():
    policy, _ = make(dwell=0.0)
    trip(policy)
    assert policy.probing


def test_primary_never_probing_even_after_long_time():
    policy, clock = make(dwell=1.0)
    clock.advance(100)
    assert not policy.probing


# -- recovery and hysteresis ---------------------------------------------------------------------
def test_routes_back_when_probe_window_recovers():
    policy, clock = make(window=10, min_samples=5, trip=0.2, recover=0.05, dwell=10)
    trip(policy)
    clock.advance(10)
    assert policy.probing
    assert feed(policy, [False] * 4) == []  # under min_samples
    (back,) = feed(policy, [False])
    assert (back.from_route, back.to_route, back.trigger) == ("fallback", "primary", "policy")
    assert "recover_ratio" in back.reason
    assert back.evidence["samples"] == 5 and back.evidence["failures"] == 0
    assert policy.route == "primary"
    assert policy.epoch == 2
    assert policy.last_transition == back
    assert not policy.probing


def test_recovery_at_exactly_recover_ratio():
    policy, _ = make(window=10, min_samples=10, trip=0.5, recover=0.1)
    trip_results = feed(policy, [True] * 10)
    assert trip_results and policy.route == "fallback"
    (back,) = feed(policy, [True] + [False] * 9)  # 1/10 == recover_ratio
    assert back.to_route == "primary"


def test_hysteresis_ratio_between_recover_and_trip_stays_on_fallback():
    policy, clock = make(window=10, min_samples=10, trip=0.3, recover=0.1, dwell=0)
    feed(policy, [True] * 10)
    assert policy.route == "fallback"
    # 2 of every 10 probes fail: 0.2, under trip (0.3) but over recover (0.1).
    assert feed(policy, ([True, False, False, False, False] * 2) * 10) == []
    assert policy.route == "fallback"
    fig = policy.windows()[0]
    assert fig.samples == 10 and fig.ratio == pytest.approx(0.2)
    # Clean probes push the ratio under recover_ratio: back to primary.
    back = feed(policy, [False] * 10)
    assert len(back) == 1 and policy.route == "primary"


def test_failing_probes_keep_fallback():
    policy, _ = make(dwell=0)
    trip(policy)
    assert feed(policy, [True] * 50) == []
    assert policy.route == "fallback" and policy.epoch == 1


def test_full_cycle_trip_recover_trip():
    policy, clock = make(window=10, min_samples=5, dwell=5, max_dwell=5)  # a fixed dwell
    first = trip(policy)
    clock.advance(5)
    back = feed(policy, [False] * 5)
    again = feed(policy, [True] * 5)
    assert [first.to_route, back[0].to_route, again[0].to_route] == ["fallback", "primary",
                                                                     "fallback"]
    assert policy.epoch == 3
    assert policy.last_transition == again[0]
    # Fresh dwell for the second stay.
    assert not policy.probing
    clock.advance(5)
    assert policy.probing


# -- manual override -----------------------------------------------------------------------------
def test_override_to_fallback_switches_and_pins():
    policy, clock = make(dwell=0)
    t = policy.set_override("fallback", "maintenance")
    assert t is not None
    assert (t.from_route, t.to_route, t.trigger, t.reason) == ("primary", "fallback", "manual",
                                                               "maintenance")
    assert policy.route == "fallback" and policy.override == "fallback"
    assert policy.last_transition == t
    # Perfect probes do not route back while pinned.
    assert feed(policy, [False] * 50) == []
    assert policy.route == "fallback"


def test_override_to_primary_pins_against_drift():
    policy, _ = make()
    trip(policy)
    t = policy.set_override("primary", "")
    assert t.to_route == "primary" and t.trigger == "manual"
    assert "pinned" in t.reason  # default reason when none is given
    assert policy.route == "primary"
    transitions = feed(policy, [True] * 50)
    assert policy.route == "primary"  # pinned: no switch
    assert all(x.trigger == "alert" for x in transitions)  # it may still alert
    assert len(transitions) <= 1


def test_override_to_current_route_starts_new_epoch():
    policy, _ = make()
    feed(policy, [True] * 3)
    epoch = policy.epoch
    t = policy.set_override("primary", "pin")
    assert t is not None and (t.from_route, t.to_route, t.trigger) == ("primary", "primary",
                                                                       "manual")
    assert policy.epoch == epoch + 1
    assert policy.windows()[0].samples == 0
    assert policy.route == "primary" and policy.override == "primary"


def test_auto_hands_back_to_policy():
    policy, _ = make()
    policy.set_override("primary", "pin")
    feed(policy, [True] * 10)
    assert policy.route == "primary"
    t = policy.set_override("auto", "")
    assert t is not None and t.trigger == "manual"
    assert (t.from_route, t.to_route) == ("primary", "primary")
    assert policy.override == "auto"
    assert policy.windows()[0].samples == 0  # fresh evidence from here on
    (tripped,) = feed(policy, [True] * 5)
    assert tripped.trigger == "policy" and policy.route == "fallback"


def test_auto_from_pinned_fallback_lets_probes_route_back():
    policy, clock = make(dwell=10)
    policy.set_override("fallback", "pin")
    clock.advance(5)
    epoch = policy.epoch
    policy.set_override("auto", "release")
    assert policy.epoch == epoch + 1
    assert policy.route == "fallback"
    assert not policy.probing  # the dwell restarts with the hand-back
    clock.advance(10)
    assert policy.probing
    (back,) = feed(policy, [False] * 5)
    assert back.to_route == "primary"


def test_auto_when_already_auto_returns_none_but_resets_window():
    policy, _ = make()
    feed(policy, [True] * 3)
    assert policy.set_override("auto", "") is None
    assert policy.windows()[0].samples == 0


def test_stale_epoch_after_override_ignored():
    policy, _ = make()
    old = policy.epoch
    policy.set_override("fallback", "x")
    assert policy.observe("tensor", False, old) is None
    assert policy.windows()[0].samples == 0


# -- window figures, tiers, concurrency ------------------------------------------------------------
def test_window_figures_per_tier():
    policy, _ = make(tiers=("tensor", "task"), min_samples=5)
    feed(policy, [True, False, False], tier="tensor")
    feed(policy, [True, True], tier="task")
    figs = policy.windows()
    assert all(isinstance(f, WindowFigures) for f in figs)
    by_tier = {f.tier: f for f in figs}
    assert (by_tier["tensor"].samples, by_tier["tensor"].failures) == (3, 1)
    assert by_tier["tensor"].ratio == pytest.approx(1 / 3)
    assert (by_tier["task"].samples, by_tier["task"].failures) == (2, 2)


def test_any_tier_can_trip():
    policy, _ = make(tiers=("tensor", "task"), min_samples=5)
    feed(policy, [False] * 10, tier="tensor")
    (t,) = feed(policy, [True] * 5, tier="task")
    assert t.evidence["tier"] == "task" and policy.route == "fallback"
    assert all(f.samples == 0 for f in policy.windows())


def test_window_is_bounded_by_config():
    policy, _ = make(window=10, min_samples=5, trip=0.9, recover=0.0, action="alert")
    feed(policy, [False] * 25)
    assert policy.windows()[0].samples == 10


def test_transition_as_dict():
    policy, _ = make()
    t = trip(policy)
    d = t.as_dict()
    assert d["model"] == "m" and d["to_route"] == "fallback" and d["trigger"] == "policy"
    assert d["evidence"]["samples"] == 5


def test_concurrent_observers_trip_exactly_once():
    policy, _ = make(window=100, min_samples=20, trip=0.2)
    transitions: list[Transition] = []
    lock = threading.Lock()
    epoch = policy.epoch

    def worker():
        for _ in range(200):
            t = policy.observe("tensor", True, epoch)
            if t is not None:
                with lock:
                    transitions.append(t)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(transitions) == 1
    assert policy.route == "fallback" and policy.epoch == 1


def test_a_tier_that_never_failed_does_not_bring_the_model_back():
    """Both tiers switch; tier 1 sent the model away. Tier 3 passing on every probe (an int8
    primary keeps its top-1 classes) is no sign that tier 1's drift is gone."""
    policy, clock = make(tiers=("tensor", "task"), dwell=10, recover=0.0)
    (trip,) = feed(policy, [True] * 5, tier="tensor")
    assert trip.evidence["tier"] == "tensor" and policy.route == "fallback"
    clock.advance(10)
    for _ in range(20):  # each probe: tier 1 still fails, tier 3 passes
        assert policy.observe("tensor", True, policy.epoch) is None
        assert policy.observe("task", False, policy.epoch) is None
    assert policy.route == "fallback"
    (back,) = feed(policy, [False] * 10, tier="tensor")  # tier 1 clean: it brings it back
    assert back.to_route == "primary" and back.evidence["tier"] == "tensor"


def test_recovery_waits_while_another_switching_tier_is_in_alarm():
    """Pinned to the fallback and handed back: any switching tier may bring the model back, but
    not while another one's trip detector is in alarm on the same probes."""
    policy, _ = make(tiers=("tensor", "task"), dwell=0, recover=0.0)
    policy.set_override("fallback", "pin")
    policy.set_override("auto", "release")
    for _ in range(10):
        policy.observe("task", True, policy.epoch)  # the task tier drifts on the probes
        assert policy.observe("tensor", False, policy.epoch) is None
    assert policy.route == "fallback"


def test_the_windows_say_since_when_they_count():
    """windows_since (admin status' "n/m failing since ..."): the wall-clock time the count
    windows last started empty: at start, then at each route change and override, never at a
    plain verdict."""
    policy, _ = make()
    started = policy.windows_since
    assert abs(started - time.time()) < 60
    feed(policy, [False] * 3)
    assert policy.windows_since == started
    (tripped,) = feed(policy, [True] * 5)  # (the verdicts after the trip count afresh)
    assert started <= policy.windows_since and abs(policy.windows_since - tripped.unix_time) < 1
    switched = policy.windows_since
    feed(policy, [True] * 2)
    assert policy.windows_since == switched
    policy.set_override("fallback", "pin")
    assert policy.windows_since >= switched and policy.windows()[0].samples == 0


# -- carry_on (a reload of the mirroring alone) ------------------------------------------------
def test_carry_on_goes_on_from_the_previous_policys_state_and_freezes_it():
    """The route, its epoch, the dwell under way and the window go on in the successor; what
    the previous one is told afterwards counts nowhere, and carrying twice is refused."""
    previous, clock = make(dwell=30.0)
    trip(previous)
    feed(previous, [False, True])
    clock.advance(10.0)
    successor = RoutePolicy("m", previous.config, clock=clock)
    assert successor.carry_on(previous)
    assert (successor.route, successor.epoch) == ("fallback", previous.epoch)
    assert not successor.probing  # 10 s of the 30 s dwell spent: the dwell did not restart
    clock.advance(20.0)
    assert successor.probing
    assert [(w.samples, w.failures) for w in successor.windows()] == [(2, 1)]
    assert feed(previous, [True] * 10) == []
    assert [(w.samples, w.failures) for w in successor.windows()] == [(2, 1)]
    assert not RoutePolicy("m", previous.config, clock=clock).carry_on(previous)


def test_carry_on_refuses_a_policy_of_other_tiers():
    previous, clock = make(tiers=("tensor", "task"))
    feed(previous, [True, False])
    successor = RoutePolicy("m", previous.config, tiers=("tensor",), clock=clock)
    assert not successor.carry_on(previous)
    assert [(w.samples, w.failures) for w in successor.windows()] == [(0, 0)]
    assert len(feed(previous, [True] * 5)) == 1  # the previous one still counts
