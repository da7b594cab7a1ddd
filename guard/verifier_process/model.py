"""One verified model, in the verifier process: its checked pair, route policy, mirror, capture
and repair, and the route word it publishes for the serving processes.

Fed by the ring reader (``accept``) with samples the serving processes handed off; everything
else runs on the mirror worker (``_on_result``), the capture writer, the repair thread, or a
control request (admin). The request path never touches this object: it reads the route word.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING

from guard.backends.base import backend_details
from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.ipc import routes
from guard.ipc.wire import CAPTURE, MIRROR, Sample
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.policy.route import Override, RoutePolicy, Transition
from guard.verifier_process.mirror import Mirror, MirrorSample, MirrorResult
from guard.verifier_process.primary import CurrentPrimary
from guard.verify.pair import CheckedPair
from guard.verify.pipeline import CheckResult, Comparator
from guard.verify.tiers import detector_tiers

if TYPE_CHECKING:  # (imported where a model uses them)
    from guard.verifier_process.ops_fallback import OpsFallback
    from guard.verify.activation import ActivationChecker
    from guard.verify.activation.report import ActivationReport

log = logging.getLogger("guard.verifier_process.model")
_ACTIVATION_EVENT_INTERVAL_S = 10.0  # at most one activation_divergence event per model per 10 s
# A sample handed off longer ago than this, while the model was checking, is dropped (counted)
# when the ring reader gets to it: the reader leaves samples in the ring while the mirror's
# queue is full (guard/verifier_process/process.py), and a mirror that stays behind the samples
# must check recent traffic, not a backlog that grows to the ring's size. (What waited while a
# verifier restarted is checked, as ever.)
_STALE_NS = 2_000_000_000


class VerifiedModel:
    def __init__(self, config: ModelConfig, metrics: GuardMetrics, table: routes.RouteTable,
                 slot: int, serving, config_hash: str = ""):
        """``serving``: the verifier's link to the serving processes (``use_primary``,
        ``transition``, ``span``: guard/verifier_process/process.py ``ServingLink``)."""
        self.name = config.name
        self.config = config
        self.metrics = metrics
        self.table = table
        self.slot = slot
        self.serving = serving
        self.pair = CheckedPair(config) if config.reference is not None else None
        self.comparator: Comparator | None = self.pair.comparator if self.pair else None
        self.backends = self.pair.backends if self.pair else {}
        self.activation_tier = self.pair.activation_tier if self.pair else None
        # The tiers this model runs (guard/verify/tiers.py); those whose kind says so feed the
        # route detectors (tier 2 runs on a biased sub-sample, failures: evidence only).
        tiers = self.comparator.tiers if self.comparator else ("tensor",)
        self.policy_tiers = detector_tiers(tiers)
        self.policy = RoutePolicy(
            self.name, config.policy, self.policy_tiers,
            has_fallback=config.fallback is not None, sample_rate=config.mirror.sample_rate,
        )
        self.mirror: Mirror | None = None
        self.capture: CaptureWriter | None = None
        self._config_hash = config_hash
        self._born_ns = 2 ** 63  # set when load() ends: what came before is never stale
        self._in_hand = 0  # samples taken from the ring and not yet accounted for
        self._in_hand_lock = threading.Lock()
        metrics.declare_model(self.name, tiers, self.policy_tiers)
        # Children resolved once (the mirror worker updates them for every sample).
        self._checks = {(tier, result): metrics.checks.labels(self.name, tier, result)
                        for tier in tiers for result in ("pass", "fail")}
        self._max_abs_error = metrics.tensor_max_abs_error.labels(self.name)
        # The window and detector gauges read the policy when scraped, so a sample sets none.
        for tier in self.policy_tiers:
            for gauge, figure in ((metrics.drift_ratio, "ratio"),
                                  (metrics.detector_statistic, "statistic"),
                                  (metrics.detector_threshold, "threshold"),
                                  (metrics.detector_samples, "samples"),
                                  (metrics.detector_p0, "null_rate"),
                                  (metrics.detector_p1, "alarm_rate")):
                gauge.labels(self.name, tier).set_function(partial(self._figure, tier, figure))
        self.activation: ActivationChecker | None = None  # tier 2's checker, built at load
        # (epoch, ActivationReport) of the latest tier-2 check
        self._last_activation: tuple[int, ActivationReport] | None = None
        self._last_activation_event = 0.0
        self._suppressed_activation_events = 0
        # The one owner of the primary the checks run (a repair's variant or as configured).
        self.primary = (CurrentPrimary(self.name, self.backends["primary"], serving,
                                       self._repaired) if self.pair else None)
        self.ops: OpsFallback | None = None
        if (config.policy.uses("fallback_ops") and self.primary is not None
                and self.comparator is not None):  # (both come with the pair)
            from guard.verifier_process.ops_fallback import OpsFallback

            comparator = self.comparator
            self.ops = OpsFallback(
                config, self.primary, self.policy, lambda: self.backends["reference"],
                lambda reference, outputs, inputs: comparator.check(
                    reference, outputs, inputs).passed,
                lambda: self.activation, lambda t: self.record(t, t.evidence))

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self, resume_word: int | None = None, kept: list[str] | None = None,
             start_capture: bool = True) -> None:
        """Load the checked pair, tier 2, the noise floor; start capture and the mirror.

        ``resume_word``: the route word a previous verifier left (a restart): the policy goes
        on from that route and epoch instead of starting over on the primary. ``kept``: the
        ops the serving processes keep back in the primary they serve (a repair survived).
        ``start_capture=False`` (a reload): the capture writer queues records but touches no
        file until ``start_capture()``, called once the replaced version's writer has closed,
        so that two writers never share the folder and its disk cap."""
        if self.pair is not None:
            self.pair.load_backends()
            match = self.pair.output_match
            if match.renamed:  # the sides name outputs differently: a naming, never drift
                emit("outputs_matched_by_position", model=self.name, renamed=match.renamed,
                     observed=list(match.observed))
            wants_tier2 = (self.config.checks.activation.enabled
                           or self.config.policy.uses("fallback_ops"))
            if wants_tier2:
                self._load_activation()
            if self.config.checks.tensor.noise_floor.enabled:
                floor = self.pair.measure_noise_floor()
                emit("noise_floor", model=self.name, **floor.as_dict(),
                     multiplier=self.config.checks.tensor.noise_floor.multiplier)
        if resume_word is not None:
            self.resume(resume_word)
        if kept and self.ops is not None:
            self.ops.resume(kept)
        if self.pair is not None and self.config.mirror.sample_rate > 0:
            self.mirror = Mirror(
                self.name, self.config.mirror, self.backends["reference"],
                self.primary, self.comparator, self.metrics, self._on_result,
                self._on_unchecked, on_span=self.serving.span, on_finished=self._finished,
            )
            if self.activation_tier is not None:  # on_failure waits for room in the queue
                self.activation_tier.queue_fill = self.mirror.queue_fill
        if self.config.capture is not None:
            self.capture = CaptureWriter(
                self.name, self.config.capture, self.metrics,
                {role: b.describe() for role, b in self.backends.items()}, self._config_hash,
            )
            if start_capture:
                self.capture.start()
        if self.mirror is not None:
            self.mirror.start()
        self._born_ns = time.time_ns()
        self.publish()
        emit("model_verifier_loaded", model=self.name,
             backends={role: b.describe().summary() for role, b in self.backends.items()},
             details=backend_details(self.backends),
             mirror_rate=self.config.mirror.sample_rate if self.mirror else 0.0,
             action=self.config.policy.action, resumed=resume_word is not None)

    def resume(self, word: int) -> None:
        """Go on from the route word a previous verifier (a restart) or the model's previous
        version (a reload) left: the route, its epoch, the operator's pin, and the gauge that
        says the model is on its fallback (it read 0 after a reload on the fallback)."""
        route, _, epoch = routes.unpack(word)
        self.policy.resume(route, epoch, routes.override_of(word))
        self.metrics.fallback_active.labels(self.name, "model").set(route == "fallback")

    def carry_on(self, previous: VerifiedModel) -> None:
        """Take over ``previous``'s route and detector evidence (a reload that changed only
        the mirroring or capture: guard/serve/reload.py ``evidence_fingerprint``)."""
        if self.policy.carry_on(previous.policy):
            windows = {w.tier: w.samples for w in self.policy.windows()}
            emit("detector_evidence_carried", model=self.name, window_samples=windows)

    def start_capture(self) -> None:
        """Start a capture writer that ``load(start_capture=False)`` left waiting."""
        if self.capture is not None and not self.capture.started:
            self.capture.start()

    def _load_activation(self) -> None:
        """Build tier 2's capture sides now, so that a pair it cannot capture fails at start."""
        from guard.verify.activation import ActivationChecker

        try:
            if self.activation_tier is not None:
                self.activation = self.activation_tier.prepare()
            else:  # fallback_ops without sampled tier 2: the repair still needs the checker
                from guard.policy.keep_back import keep_back_for

                self.activation = ActivationChecker.for_model(
                    self.config, self.config.mirror.threads,
                    keep_back_for(self.config.primary).capture_spec())
        except Exception as exc:
            raise BackendError(f"models[{self.name}].checks.activation: {exc}") from exc

    def close(self) -> None:
        if self.ops is not None:
            self.ops.stop()
        if self.mirror is not None:
            self.mirror.stop()
        if self.activation is not None:
            self.activation.close()
        if self.capture is not None:  # after the mirror: it hands its last samples to capture
            self.capture.close()
        if self.pair is not None:
            self.pair.close()

    # -- the route word --------------------------------------------------------------------------
    def publish(self) -> None:
        """Store the route word the serving processes read (on every change, and on every
        heartbeat, since ``probing`` turns on by the clock when the dwell is over)."""
        policy = self.policy
        self.table.publish(self.slot, policy.route, policy.probing, policy.epoch,
                           policy.override)

    # -- fed by the ring reader --------------------------------------------------------------------
    def accept(self, sample: Sample, request: tuple) -> None:
        """A sample a serving process handed off, with its decoded ``request`` (inputs, the
        outputs the client asked for: ``sample.payload.request()``): to the mirror and/or to
        capture. An upstream's answer is decoded only when the mirror takes it (capture
        decodes it when it writes the record)."""
        self.accept_many([(sample, request)])

    def accept_many(self, samples: list[tuple[Sample, tuple]]) -> None:
        """``accept`` for the samples the ring reader drained for this model, in order: the
        mirrored ones go to the mirror in one hand-off (one wake-up of its worker)."""
        mirror, capture = self.mirror, self.capture
        mirrored: list[MirrorSample] = []
        stale: list[MirrorSample] = []
        # Stale: handed off while this model was checking (not while a verifier restarted or a
        # reload built it: those wait in the ring to be checked) and waited past _STALE_NS.
        stale_before = time.time_ns() - _STALE_NS
        for sample, request in samples:
            inputs, only_outputs = request
            tag = None
            if capture is not None:
                tag = CaptureTag(sample.request_id, sample.unix_nanos, sample.request_seconds,
                                 bool(sample.flags & CAPTURE))
            # Handed to the mirror, the sample is its to account for: checked, or told back
            # through _on_unchecked (dropped, error, timeout), which records it. Recording a
            # dropped sample here as well wrote every dropped request twice.
            if sample.flags & MIRROR and mirror is not None:
                try:
                    outputs = sample.payload.answer()
                except Exception as exc:  # an answer that parses but does not decode: the
                    # mirror's error, never the ring reader's death (found by the fuzzer)
                    self.metrics.mirror.labels(self.name, "error").inc()
                    emit("mirror_undecodable_answer", model=self.name,
                         error=f"{type(exc).__name__}: {exc}"[:300])
                    continue
                taken = MirrorSample(
                    inputs, outputs, sample.route, sample.epoch, time.monotonic(), only_outputs,
                    sample.traceparent, tag, sample.size)
                (stale if self._born_ns < sample.unix_nanos < stale_before
                 else mirrored).append(taken)
            elif capture is not None and tag is not None and tag.record:
                capture.submit(PendingRecord(tag, sample.route, sample.epoch, inputs,
                                             sample.payload.answer))
        if mirror is None:  # (then nothing was mirrored)
            return
        if mirrored or stale:
            self._took(len(mirrored) + len(stale))
        if stale:  # waited in the ring past _STALE_NS: a mirror that stays behind drops
            mirror.drop(stale)
        if mirrored:
            mirror.accept_many(mirrored)

    def _took(self, n: int = 1) -> None:
        with self._in_hand_lock:
            self._in_hand += n
            self.table.set(self.slot, routes.IN_HAND, self._in_hand)

    def _finished(self, sample: MirrorSample) -> None:
        with self._in_hand_lock:
            self._in_hand = max(0, self._in_hand - 1)
            self.table.set(self.slot, routes.IN_HAND, self._in_hand)

    # -- mirror worker -----------------------------------------------------------------------------
    def _on_result(self, result: MirrorResult) -> None:
        check: CheckResult = result.check
        if "tensor" in check.tiers:  # a generative model's samples have no tier 1
            self._max_abs_error.observe(check.max_abs_error)
        if self.ops is not None:
            self.ops.observe(result.sample.inputs, not check.passed)
        transition = None
        for tier, tier_result in check.tiers.items():
            if tier == "activation":  # its events, and the evidence it gives a transition
                self._on_activation(tier_result, result.sample.epoch)
                continue
            self._checks[tier, "pass" if tier_result.passed else "fail"].inc()
            if tier in self.policy_tiers:
                transition = self.policy.observe(tier, not tier_result.passed,
                                                 result.sample.epoch) or transition
        if check.arbitration is not None:
            emit("arbitration", model=self.name, verdict=check.arbitration.as_dict())
        if transition is not None:
            evidence = dict(transition.evidence)
            if not check.passed:
                evidence["last_failure"] = check.summary()
            evidence.update(self._activation_evidence(result.sample.epoch))
            self.record(transition, evidence)
        self._capture_checked(result)

    def _wants_capture(self, tag, passed: bool) -> bool:
        """A checked sample is recorded when capture marked it, or when it failed and capture
        keeps failures (the one rule for every kind of verified model)."""
        if self.capture is None or tag is None:
            return False
        return tag.record or (not passed and self.capture.wants_failure(tag))

    def _capture_checked(self, result: MirrorResult) -> None:
        if not self._wants_capture(result.sample.tag, result.check.passed):
            return
        sample = result.sample
        assert self.capture is not None and sample.tag is not None  # (_wants_capture)
        assert self.comparator is not None  # (a result comes from the pair's checks)
        self.capture.submit(PendingRecord(
            sample.tag, sample.route, sample.epoch, sample.inputs, sample.outputs,
            reference=result.reference, tier_reports=self.comparator.tier_reports(result.check),
            reference_seconds=result.reference_seconds, probed=result.probed,
        ))

    def _on_unchecked(self, sample: MirrorSample, outcome: str) -> None:
        """A mirrored sample that got no verdict (error, timeout, dropped): record the request."""
        tag = sample.tag
        if self.capture is not None and tag is not None and tag.record:
            self.capture.submit(PendingRecord(tag, sample.route, sample.epoch, sample.inputs,
                                              sample.outputs))

    def _figure(self, tier: str, figure: str) -> float:
        """A tier's window ratio or detector figure (statistic, threshold, samples), for its
        gauge at a scrape."""
        figures = self.policy.windows() if figure == "ratio" else self.policy.detectors()
        return next(getattr(f, figure) for f in figures if f.tier == tier)

    def _on_activation(self, report, epoch: int) -> None:
        """A tier-2 report from the Comparator: counted, kept for the evidence, announced."""
        self._last_activation = (epoch, report)
        if report.error:
            emit("activation_error", model=self.name, error=report.error)
            return
        self._checks["activation", "pass" if report.passed else "fail"].inc()
        if not report.passed:
            now = time.monotonic()
            if now - self._last_activation_event >= _ACTIVATION_EVENT_INTERVAL_S:
                emit("activation_divergence", model=self.name, **report.summary(),
                     suppressed_since_last=self._suppressed_activation_events)
                self._last_activation_event = now
                self._suppressed_activation_events = 0
            else:
                self._suppressed_activation_events += 1

    def _activation_evidence(self, epoch: int) -> dict:
        """The latest tier-2 finding of this epoch, for a route transition's evidence."""
        if self._last_activation is None or self._last_activation[0] != epoch:
            return {}
        report = self._last_activation[1]
        return {"first_divergence": report.first_divergence_dict(),
                "activation": report.summary()}

    # -- admin -------------------------------------------------------------------------------
    def set_override(self, override: Override, reason: str) -> Transition | None:
        if override == "primary" and self.ops is not None:
            self.ops.restore(reason)  # "primary" means the primary as configured
        transition = self.policy.set_override(override, reason)
        if transition is not None:
            self.record(transition, transition.evidence)
        else:
            self.publish()
        return transition

    def _repaired(self, on: bool) -> None:
        """A repair's variant serves (or no more): ``guard_fallback_active{kind="ops"}``."""
        self.metrics.fallback_active.labels(self.name, "ops").set(1 if on else 0)

    def record(self, transition: Transition, evidence: dict) -> None:
        """A route transition: published first, then counted and announced."""
        self.publish()  # first: the serving processes switch before anyone reads the event
        m = self.metrics
        tier = transition.evidence.get("tier", "")
        if transition.trigger == "alert":
            emit("drift_alert", model=self.name, reason=transition.reason,
                 action=self.config.policy.action_for(tier), evidence=evidence)
            return
        if transition.trigger == "dry_run":
            emit("drift_dry_run", model=self.name, reason=transition.reason,
                 would_route=transition.to_route, evidence=evidence)
            return
        if transition.from_route == transition.to_route and transition.trigger == "manual":
            return  # a pin to the route in force (admin_route_set says it): no transition
        if transition.from_route != transition.to_route:
            if transition.to_route == "fallback":
                to = "fallback_model"
            else:
                to = "fallback_ops" if transition.trigger == "repair" else "primary"
            m.fallback_transitions.labels(self.name, to).inc()
            m.fallback_active.labels(self.name, "model").set(transition.to_route == "fallback")
            self.serving.transition(self.name, transition)
        emit("route_transition", model=self.name, from_route=transition.from_route,
             to_route=transition.to_route, trigger=transition.trigger, reason=transition.reason,
             evidence=evidence)
        if (self.ops is not None and transition.trigger == "policy"
                and transition.to_route == "fallback"
                and self.config.policy.action_for(tier) == "fallback_ops"):
            self.ops.on_trip(self.policy.epoch)
