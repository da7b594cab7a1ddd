"""One verified generative model (``task: generation``), in the verifier process: its reference
scorer, the generation tier, the route policy and its route word, capture and events.

The loop is the tensor models' (guard/verifier_process/model.py), with a completion as the
sample. The ring reader hands each sampled call over (``accept``: a bounded put, it
never waits); the mirror worker (``GenerationMirror``, the shared queue, byte budget, watchdog
and timeouts of guard/verifier_process/mirror.py) asks the primary again when the fallback
serves (a probe, guard/backends/openai_generate.py), scores the completion with the
reference (ONE teacher-forced pass, ``Scorer.score``) and runs the tier
(guard/verify/generation/). The result then feeds, as for every tier:

- ``guard_checks_total{tier="generation"}`` and the window (guard_drift_ratio) with the
  completion's verdict;
- the detector with its *score*: the tier's statistic over the level at which one completion
  fails (mean KLD / max_mean_kld with the primary's logprobs; the share of confident argmax
  flips / max_greedy_disagreement for greedy calls; z^2 / max_abs_z^2 for sampled ones), so
  that 1 is the failing level in every mode and ``checks.generation.in_control_ratio`` the
  in-control mean the ARL0 promise is made for (guard/policy/detector.py ``ScoreCusum``);
- the guard_generation_* series, events (``generation_divergence`` with the first divergent
  token, at most one per 10 s; ``route_transition`` / ``drift_alert`` with it as evidence) and
  capture (the sample as JSON; it holds no header, so no Authorization can be stored).

A completion the tier cannot compare (unknown sampling transform, too short) is counted
(``guard_mirror_total{outcome="not_comparable"}``), never scored; a tokenization mismatch is a
failure of its own (a finding, never fed to the detector as noise).

Tier 2 (``checks.activation`` with ``primary_gguf``: the GGUF the upstream serves) runs in the
same mirror worker after the generation tier, on that completion's tokens (``on_failure``: a
failing completion, while the queue has room; ``sample_rate``: a share of them), on capture
sides of its own built at load (llama.cpp in-process with its eval callback, the transformers
reference hooked on a copy), never on the request path: ``guard_checks_total{tier="activation"}``,
``activation_divergence`` events and the evidence of the next route transition, as for a tensor
model (guard/verifier_process/model.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, cast

import numpy as np

from guard.backends import create_backend
from guard.backends.base import backend_details
from guard.backends.loading import load_all
from guard.capture.records import GENERATION_INPUT, PROBED_OUTPUT, generation_tensor
from guard.capture.writer import CaptureTag, CaptureWriter, PendingRecord
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.ipc import routes
from guard.ipc.wire import CAPTURE, MIRROR, Generation, Sample
from guard.observe import tracing
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.policy.detector import ScoreSpec
from guard.policy.route import RoutePolicy
from guard.protocol.generation import GenerationSample, rendered_as_served
from guard.verifier_process.mirror import Mirror, MirrorSample, _Abandoned
from guard.verifier_process.model import VerifiedModel
from guard.verify.generation.summary import pooled_z
from guard.verify.pipeline import Comparator

if TYPE_CHECKING:
    from guard.backends.scoring import ReferenceScores, Scorer
    from guard.verify.activation.report import ActivationReport
    from guard.verify.activation.tier import ActivationTier
    from guard.verify.generation import GenerationCheck, GenerationThresholds, GenerationTier

log = logging.getLogger("guard.verifier_process.generation_model")
TIER = "generation"
_EVENT_INTERVAL_S = 10.0  # at most one generation_divergence event per model per 10 s


def detector_score(check, limits) -> float | None:
    """The tier's statistic on one scale for every mode: 1 at the level where a completion
    fails, 0 for perfect agreement (None: not scored)."""
    if check.statistic is None:
        return None
    if check.mode == "logprobs":
        return max(check.statistic, 0.0) / limits.max_mean_kld
    if check.mode == "greedy":
        return max(check.statistic, 0.0) / limits.max_greedy_disagreement
    if check.mode == "sampled":
        return check.statistic ** 2 / limits.max_abs_z ** 2
    return None


def generation_score_spec(config: ModelConfig) -> ScoreSpec:
    """The generation tier's score detector: ``checks.generation``'s in-control ratio and bet,
    failing at a score of 1."""
    gen = config.checks.generation
    return ScoreSpec(gen.in_control_ratio, 1.0, gen.bet)


def generation_policy(config: ModelConfig) -> RoutePolicy:
    """A generative model's route policy: its detector accumulates the tier's per-completion
    score (``detector_score``) against ``checks.generation``'s in-control ratio."""
    return RoutePolicy(config.name, config.policy, (TIER,),
                       has_fallback=config.fallback is not None,
                       sample_rate=config.mirror.sample_rate,
                       scores={TIER: generation_score_spec(config)})


@dataclass
class GenerationMirrorSample(MirrorSample):
    generation: GenerationSample = field(kw_only=True)


@dataclass
class GenerationResult:
    sample: GenerationMirrorSample
    # What was compared (the probe's, when the primary was probed), as the server answered it
    # (the server's prompt ids where they were asked; before the engine's rendering arguments).
    completion: GenerationSample
    check: GenerationCheck
    reference_seconds: float
    probed: bool
    activation: ActivationReport | None = None  # tier 2's, when it ran on this completion


@dataclass(frozen=True)
class GenerationReport:
    """A completion's verdict as capture records it (the shape of a tier report)."""

    passed: bool
    summary: str
    details: dict = field(default_factory=dict)
    outputs: tuple = ()


class GenerationMirror(Mirror):
    """The shared mirror (queue, byte budget, watchdog, timeouts), with a completion as the
    sample: probe the primary when the fallback answered, score, run the tier. One completion
    at a time: scoring one is a forward pass over its tokens, which no stacking amortises."""

    def __init__(self, model: str, config, scorer: Scorer,
                 probe: Callable[[GenerationSample], GenerationSample] | None,
                 check: Callable[[GenerationSample, ReferenceScores],
                                 tuple[GenerationCheck, ActivationReport | None]], metrics,
                 on_result: Callable[[GenerationResult], None],
                 on_unchecked: Callable[[GenerationMirrorSample, str], None], on_span,
                 on_finished: Callable[[GenerationMirrorSample], None],
                 engine: str = "unknown",
                 prompts: Callable[[GenerationSample], GenerationSample] | None = None,
                 probe_streamed_tool_chats: bool = False):
        super().__init__(model, config, scorer, None, None, metrics, on_result, on_unchecked,
                         on_span, on_finished)
        self.scorer, self.probe, self.check = scorer, probe, check
        self.engine = engine  # the primary's (options.engine): how its server renders chats
        # The primary server's own rendering of a sample's prompt, where it is asked
        # (guard/backends/llama_server_prompts.py); None: the answer's ids or the reference's.
        self.prompts = prompts
        # The primary asked again for a streamed chat that lists tools, whose answer has no
        # output ids (options.probe_streamed_tool_chats: the edge hands such calls on).
        self.probe_streamed_tool_chats = probe_streamed_tool_chats and probe is not None

    def _limit(self) -> int:
        return 1

    def _handle(self, hand) -> None:
        for held in hand:
            try:
                self._process(held.sample, held.span)
            except _Abandoned:
                raise
            except Exception:  # a bug here must not kill the worker
                log.exception("mirror worker for %s failed on a sample", self.model)
                self._outcomes["error"].inc()
            self._finished(held.sample)
            if held.span is not None and self.on_span is not None:  # (a span only with on_span)
                self.on_span(held.span.end())

    def _process(self, sample: GenerationMirrorSample, span) -> None:
        stage = "reference"
        completion = sample.generation
        probed = sample.route != "primary" or self._probes(completion)
        try:
            if probed:
                stage = "primary probe"
                probe = self.probe
                if probe is None:
                    raise BackendError("no primary to probe")
                completion = self._call(lambda _: probe(sample.generation), sample, stage, span)
            prompts = self.prompts
            if prompts is not None:
                stage = "primary prompt"
                asked = completion
                completion = self._call(lambda _: prompts(asked), sample, stage, span)
                if not probed:  # its capture record holds the prompt the server read
                    sample.generation = completion
            if completion.tools and completion.prompt_token_ids is None:
                self._untold_tool_prompt(sample, completion, probed)
                return
            stage = "reference"
            compared = completion
            completion = rendered_as_served(completion, self.engine)
            started = time.perf_counter()
            scores = self._call(lambda _: self.scorer.score(completion), sample, stage, span)
            seconds = time.perf_counter() - started
        except _Abandoned:
            raise
        except TimeoutError:
            self._timed_out(sample, stage, span)
            return
        except Exception as exc:
            self._failed(sample, stage, exc)
            return
        self._reference_seconds.observe(seconds)
        check, activation = self.check(completion, scores)
        if span is not None:
            tracing.set_attributes(span, {
                "guard.verdict": "pass" if check.passed else "fail",
                "guard.tier.generation.mode": check.mode, "guard.probed": probed,
                "guard.reference_seconds": seconds})
        try:
            self.on_result(GenerationResult(sample, compared, check, seconds, probed,
                                            activation))
        except Exception:
            log.exception("handling a generation result for %s failed", self.model)

    def _probes(self, completion: GenerationSample) -> bool:
        """A streamed tool chat the primary answered without the output's ids, to be compared
        on the primary's answer to the same call asked again (not streamed, with logprobs)."""
        return self.probe_streamed_tool_chats and completion.tools and completion.streamed \
            and not (completion.tokens and all(t.token_id is not None
                                               for t in completion.tokens))

    def _untold_tool_prompt(self, sample: GenerationMirrorSample, completion: GenerationSample,
                            probed: bool) -> None:
        """A chat that offered tools, whose prompt the server did not tell (the ask of its
        rendering failed: guard/backends/llama_server_prompts.py): compared only on the
        server's rendering of the tools, so not comparable (``tools``), never scored on the
        reference's own."""
        from guard.verify.generation import GenerationCheck

        check = GenerationCheck(
            passed=True, mode="not_comparable", tokens=len(completion.tokens), cause="tools",
            reason="a chat that offered tools is compared on the prompt's token ids as the "
                   "server rendered it, which the server did not tell")
        try:
            self.on_result(GenerationResult(sample, completion, check, 0.0, probed))
        except Exception:
            log.exception("handling a generation result for %s failed", self.model)


class KldWindow:
    """The last ``size`` compared completions' mean KLD and top-1 share (admin status)."""

    def __init__(self, size: int):
        self._kld: deque[float] = deque(maxlen=size)
        self._top1: deque[float] = deque(maxlen=size)
        self._z: deque[float] = deque(maxlen=size)  # the sampled completions' (no KLD there)
        self.size = size
        self.not_comparable = 0
        self.last_divergence: dict | None = None
        self._lock = threading.Lock()

    def add(self, check: GenerationCheck) -> None:
        with self._lock:
            if not math.isnan(check.mean_kld):
                self._kld.append(check.mean_kld)
            if not math.isnan(check.top1_agreement):
                self._top1.append(check.top1_agreement)
            if check.sampled_z is not None:
                self._z.append(check.sampled_z)
            if check.first_divergence is not None and not check.passed:
                self.last_divergence = check.first_divergence.as_dict()

    def figures(self) -> dict:
        with self._lock:
            kld = np.asarray(self._kld, dtype=np.float64)
            top1 = np.asarray(self._top1, dtype=np.float64)
            z = tuple(self._z)
        # NaN where nothing was measured (admin status then says so): a 0 would read as
        # perfect agreement on a model whose completions are all sampled without logprobs.
        return {"completions": int(kld.size), "window": self.size,
                "mean_kld": float(kld.mean()) if kld.size else math.nan,
                "kld_p99": float(np.percentile(kld, 99)) if kld.size else math.nan,
                "top1_agreement": float(top1.mean()) if top1.size else math.nan,
                "sampled_completions": len(z), "z_pooled": pooled_z(z),
                "not_comparable": self.not_comparable}


class VerifiedGenerationModel(VerifiedModel):
    """``VerifiedModel`` with a completion as the sample: the same surface for the verifier
    process and admin (``publish``, ``set_override``, the route transitions' metrics and
    events, the in-hand count, tier 2's events and evidence are inherited); its own assembly
    (no tensor pair, no op repair), mirror, results and capture records.
    ``VerifiedModel.__init__`` is not run: it builds a tensor pair."""

    ops = None  # no op repair for an LLM
    pair = comparator = activation_tier = activation = None

    def __init__(self, config: ModelConfig, metrics: GuardMetrics, table: routes.RouteTable,
                 slot: int, serving, config_hash: str = ""):
        self.name = config.name
        self.config = config
        self.metrics = metrics
        self.table = table
        self.slot = slot
        self.serving = serving
        self._config_hash = config_hash
        self.policy_tiers = (TIER,)
        self.policy = generation_policy(config)
        self.backends: dict = {}
        self.mirror: GenerationMirror | None = None
        self.capture: CaptureWriter | None = None
        # What the primary's llama-server reported at load (the keys guard reads), else None.
        self._server_settings: dict | None = None
        self.window = KldWindow(config.policy.window)
        self._limits: GenerationThresholds | None = None
        self._in_hand = 0
        self._in_hand_lock = threading.Lock()
        self._last_event = 0.0
        self._suppressed_events = 0
        self._last_failure: tuple[int, dict] | None = None  # (epoch, evidence): latest failure
        self._last_activation = None  # (epoch, ActivationReport) of the latest tier-2 check
        self._last_activation_event = 0.0
        self._suppressed_activation_events = 0
        tiers = self.policy_tiers + (("activation",) if config.checks.activation.enabled
                                     and config.reference is not None else ())
        metrics.declare_model(self.name, tiers, self.policy_tiers)
        metrics.declare_generation_model(self.name)
        metrics.mirror.labels(self.name, "not_comparable")
        self._checks = {(tier, r): metrics.checks.labels(self.name, tier, r)
                        for tier in tiers for r in ("pass", "fail")}
        self._kld = metrics.generation_kld.labels(self.name)
        self._top1 = metrics.generation_top1_agreement.labels(self.name)
        self._sampled_z = metrics.generation_sampled_z.labels(self.name)
        self._divergence = metrics.generation_first_divergence.labels(self.name)
        self._not_comparable = metrics.mirror.labels(self.name, "not_comparable")
        self._fleet_evidence = {d: metrics.detector_evidence.labels(self.name, TIER, d)
                                for d in ("for", "against")}
        self._score_spec = generation_score_spec(config)
        for gauge, figure in ((metrics.drift_ratio, "ratio"),
                              (metrics.detector_statistic, "statistic"),
                              (metrics.detector_threshold, "threshold"),
                              (metrics.detector_samples, "samples")):
            gauge.labels(self.name, TIER).set_function(partial(self._figure, TIER, figure))

    # -- lifecycle -------------------------------------------------------------------------------
    def carry_on(self, previous: VerifiedModel) -> None:
        """As a tensor model's, and admin status's window of the last completions' KLD too."""
        if isinstance(previous, VerifiedGenerationModel):
            self.window = previous.window
        super().carry_on(previous)

    def load(self, resume_word: int | None = None, kept: list[str] | None = None,
             start_capture: bool = True) -> None:
        config = self.config
        if config.reference is not None:
            # (a scorer: the plan refuses any other reference for a generation model,
            # guard/plan/serving.py llm_role_problems)
            scorer = cast("Scorer", create_backend(config.reference, "reference",
                                                   config.mirror.threads))
            load_all(self.name, config, {"reference": scorer})  # (errors name the key)
            self.backends["reference"] = scorer
            # The registered tiers that take a sampled call (guard/verify/tiers.py): the
            # generation tier, with the primary server's declared sampling defaults.
            self.comparator = Comparator.for_model(config)
            tier = cast("GenerationTier", self.comparator.tier(TIER))  # (the registry's)
            self._limits = tier.limits
            if tier.reads_the_server:  # (kept with each capture record: see _pending)
                from guard.backends.openai import base_url, reported_settings

                self._server_settings = tier.take_report(
                    self.name, base_url(config.primary.target or ""),
                    reported_settings(config.primary))
            self._say_what_is_unknown(tier)
            comparator = self.comparator
            self.activation_tier = cast("ActivationTier | None", comparator.tier("activation"))
            if self.activation_tier is not None:
                self._load_activation()  # a pair tier 2 cannot capture fails at start-up

            def check(sample, scores):
                tiers = comparator.check(scores, sample).tiers
                return tiers[TIER], tiers.get("activation")

            if config.mirror.sample_rate > 0:
                from guard.backends import llama_server_prompts
                from guard.backends.openai import primary_options
                from guard.backends.openai_generate import PrimaryProbe

                options = primary_options(config.primary)
                streamed_tools = bool(options and options.probes_streamed_tool_chats)
                probe = (PrimaryProbe(config.primary, config.mirror.timeout_s)
                         if config.fallback is not None or streamed_tools else None)
                self.mirror = GenerationMirror(
                    self.name, config.mirror, scorer, probe, check, self.metrics,
                    self._on_completion, self._completion_unchecked, self.serving.span,
                    self._finished, config.primary.options.get("engine", "unknown"),
                    llama_server_prompts.for_primary(config.primary, config.mirror.timeout_s),
                    streamed_tools)
                if self.activation_tier is not None:  # on_failure waits for room in the queue
                    self.activation_tier.queue_fill = self.mirror.queue_fill
        if resume_word is not None:
            self.resume(resume_word)
        if config.capture is not None:
            self.capture = CaptureWriter(
                self.name, config.capture, self.metrics,
                {role: b.describe() for role, b in self.backends.items()}, self._config_hash)
            if start_capture:
                self.capture.start()
        if self.mirror is not None:
            self.mirror.start()
        self.publish()
        emit("model_verifier_loaded", model=self.name, task=TIER,
             backends={role: b.describe().summary() for role, b in self.backends.items()},
             details=backend_details(self.backends),
             mirror_rate=config.mirror.sample_rate if self.mirror else 0.0,
             action=config.policy.action, resumed=resume_word is not None)

    def _say_what_is_unknown(self, tier: "GenerationTier") -> None:
        """Once at load: a server whose sampling defaults are not known leaves its sampled
        calls without logprobs uncompared (counted by reason), which an operator should hear
        before wondering why the tier sees nothing."""
        from guard.verify.generation import UNDECLARED_ADVICE, undeclared_sampling

        options = self.config.primary.options
        unknown = undeclared_sampling(options, tier.defaults)
        if unknown is not None:
            emit("generation_defaults_unknown", model=self.name,
                 engine=options.get("engine", "unknown"), unknown=unknown,
                 reason=UNDECLARED_ADVICE)

    def close(self) -> None:  # (no pair or repair to close)
        if self.mirror is not None:
            self.mirror.stop()
        if self.activation is not None:
            self.activation.close()
        if self.capture is not None:
            self.capture.close()
        for backend in self.backends.values():
            backend.close()

    # -- fed by the ring reader ------------------------------------------------------------------
    def accept(self, sample: Sample, request: tuple = ((), ())) -> None:
        """A sampled call a serving process handed off (``sample.payload``: a
        ``wire.Generation``): to the mirror and/or to capture."""
        payload = sample.payload
        assert isinstance(payload, Generation), "a generation model's ring record is a call"
        call: GenerationSample = payload.call
        capture = self.capture
        tag = None
        if capture is not None:
            tag = CaptureTag(sample.request_id, sample.unix_nanos, sample.request_seconds,
                             bool(sample.flags & CAPTURE))
        mirrored = False
        if sample.flags & MIRROR and self.mirror is not None:
            self._took()
            # Handed to the mirror, the call is its to account for (checked, or told back as
            # dropped / error / timeout, which records it): never recorded here as well.
            mirrored = True
            self.mirror.accept(GenerationMirrorSample(
                {}, {}, sample.route, sample.epoch, time.monotonic(), (), sample.traceparent,
                tag, sample.size, generation=call))
        if capture is not None and tag is not None and tag.record and not mirrored:
            capture.submit(self._pending(tag, sample.route, sample.epoch, call))

    # -- mirror worker ---------------------------------------------------------------------------
    def _on_completion(self, result: GenerationResult) -> None:
        """A scored completion: counted first, recorded last, whatever fails between (the
        mirror logs it): never a sample that neither the metrics nor the capture hold."""
        check = result.check
        compared = check.comparable or check.mode == "tokenization_mismatch"
        if compared:
            self.metrics.mirror.labels(self.name, "compared").inc()
        else:
            self._not_comparable.inc()
            self.metrics.generation_not_comparable.labels(self.name,
                                                          check.cause or "other").inc()
            self.window.not_comparable += 1
        try:
            # The verdict that ran tier 2 is counted before tier 2's own count and event, so
            # that whoever reads an activation_divergence finds the failure behind it on
            # /metrics; the policy steps last, with tier 2's finding in its evidence.
            if compared:
                self._count(result)
            if result.activation is not None:
                self._on_activation(result.activation, result.sample.epoch)
            if compared:
                self._step(result)
        finally:
            self._capture_completion(result)

    def _count(self, result: GenerationResult) -> None:
        """A compared completion's figures and verdict: metrics, window, event."""
        check, sample = result.check, result.sample
        if not math.isnan(check.mean_kld):
            self._kld.observe(check.mean_kld)
        if not math.isnan(check.top1_agreement):
            self._top1.observe(check.top1_agreement)
        if check.sampled_z is not None:
            self._sampled_z.observe(check.sampled_z)
        self.window.add(check)
        self._checks[TIER, "pass" if check.passed else "fail"].inc()
        if not check.passed:
            if check.first_divergence is not None:
                self._divergence.observe(check.first_divergence.position + 1)
            self._last_failure = (sample.epoch, self._evidence(result))
            self._announce(result)

    def _step(self, result: GenerationResult) -> None:
        """The detectors' and the policy's step on a compared completion."""
        check, sample = result.check, result.sample
        score = detector_score(check, self._limits)
        if score is not None:
            # Every scored completion of the primary (a probe's too, and whatever the route's
            # epoch): the fleet rules pool these steps over replicas (guard/deploy/fleet.py).
            step = self._score_spec.step(score)
            self._fleet_evidence["for" if step > 0 else "against"].inc(abs(step))
        transition = self.policy.observe(TIER, not check.passed, sample.epoch, score=score)
        if transition is not None:
            evidence = dict(transition.evidence)
            if self._last_failure is not None and self._last_failure[0] == sample.epoch:
                evidence["last_failure"] = self._last_failure[1]
            evidence.update(self._activation_evidence(sample.epoch))
            self.record(transition, evidence)

    def _evidence(self, result: GenerationResult) -> dict:
        check = result.check
        out = {"mode": check.mode, "reason": check.reason, "tokens": check.tokens,
               "probed": result.probed, "request_id": result.sample.generation.request_id}
        for key in ("mean_kld", "kld_p99", "top1_agreement", "z"):
            value = getattr(check, key)
            if not math.isnan(value):
                out[key] = round(value, 6)
        if check.first_divergence is not None:
            out["first_divergence"] = check.first_divergence.as_dict()
        if check.findings:
            out["findings"] = list(check.findings)
        return out

    def _announce(self, result: GenerationResult) -> None:
        now = time.monotonic()
        if now - self._last_event < _EVENT_INTERVAL_S:
            self._suppressed_events += 1
            return
        emit("generation_divergence", model=self.name, **self._evidence(result),
             suppressed_since_last=self._suppressed_events)
        self._last_event = now
        self._suppressed_events = 0

    def _pending(self, tag, route: str, epoch: int, sample: GenerationSample,
                 result: GenerationResult | None = None) -> PendingRecord:
        """A capture record of a call: the sample as JSON (it holds no header: nothing of the
        client's Authorization can be stored), the compared completion and the verdict."""
        reports = {}
        outputs = {}
        if self._server_settings is not None:  # (the sample, and the probe's completion)
            sample = replace(sample, server_settings=self._server_settings)
        if result is not None:
            check = result.check
            reports[TIER] = GenerationReport(check.passed, check.reason or check.mode,
                                             check.as_dict())
            if result.activation is not None:
                from guard.verify.pipeline import tier_report

                report = tier_report("activation", result.activation)
                reports["activation"] = GenerationReport(report.passed, report.summary,
                                                         report.details)
            if result.probed:
                probed = result.completion if self._server_settings is None else replace(
                    result.completion, server_settings=self._server_settings)
                outputs[PROBED_OUTPUT] = generation_tensor(probed)
        return PendingRecord(tag, route, epoch, {GENERATION_INPUT: generation_tensor(sample)},
                             outputs, tier_reports=reports,
                             reference_seconds=result.reference_seconds if result else 0.0,
                             probed=bool(result and result.probed))

    def _capture_completion(self, result: GenerationResult) -> None:
        if not self._wants_capture(result.sample.tag, result.check.passed):
            return
        s = result.sample
        assert self.capture is not None and s.tag is not None  # (_wants_capture)
        self.capture.submit(self._pending(s.tag, s.route, s.epoch, s.generation, result))

    def _completion_unchecked(self, sample: GenerationMirrorSample, outcome: str) -> None:
        tag = sample.tag
        if self.capture is not None and tag is not None and tag.record:
            self.capture.submit(self._pending(tag, sample.route, sample.epoch, sample.generation))
