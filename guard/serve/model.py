"""One guarded model: its backends, route policy, mirror and the bookkeeping between them.

The request path touches two methods only: ``backend_for_request()`` and ``after_response()``.
Everything else runs in the mirror worker (``_on_result``) or the admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from guard.backends import Backend, BackendInfo, TensorSpec, create_backend
from guard.capture.writer import CaptureWriter, PendingRecord
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.observe.events import emit
from guard.observe.metrics import GuardMetrics
from guard.policy.route import Override, RoutePolicy, Transition
from guard.serve.mirror import Mirror, Sample, SampleResult
from guard.verify.arbitrate import build_arbiter
from guard.verify.noise import NoiseFloor, measure_noise_floor
from guard.verify.pipeline import CheckResult, Verifier, load_activation_tier

log = logging.getLogger("guard.model")
_ACTIVATION_EVENT_INTERVAL_S = 10.0  # at most one activation_divergence event per model per 10 s


class GuardedModel:
    def __init__(self, config: ModelConfig, metrics: GuardMetrics, config_hash: str = ""):
        self.name = config.name
        self.config = config
        self.metrics = metrics
        self.verifier = Verifier.for_model(config, arbiter=build_arbiter(config))
        threads = config.mirror.threads
        self.backends: dict[str, Backend] = {"primary": create_backend(config.primary, "primary")}
        if config.reference is not None:
            self.backends["reference"] = create_backend(config.reference, "reference", threads)
        if config.fallback is not None:
            self.backends["fallback"] = create_backend(config.fallback, "fallback")
        self.activation_tier = None
        if config.reference is not None:
            activation = load_activation_tier(config, self.backends)  # tier 2, when it exists
            if activation is not None:
                self.verifier.add_tier(activation)
                self.activation_tier = activation
        self.noise_floor: NoiseFloor | None = None
        # Tier 2 localises drift; it runs on a biased sub-sample (failures), so it informs the
        # evidence but does not feed the route detectors.
        self.policy_tiers = tuple(t for t in self.verifier.tiers if t != "activation")
        self.policy = RoutePolicy(
            self.name, config.policy, self.policy_tiers,
            has_fallback="fallback" in self.backends, sample_rate=config.mirror.sample_rate,
        )
        self.mirror: Mirror | None = None
        self.capture: CaptureWriter | None = None
        self._config_hash = config_hash  # recorded in capture records
        self.signature: BackendInfo | None = None
        self.input_specs: dict[str, TensorSpec] = {}
        self.output_names: frozenset[str] = frozenset()
        self.ready = False
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._watchers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._watchers_lock = threading.Lock()
        metrics.declare_model(self.name, self.policy_tiers)
        if self.activation_tier is not None:
            for outcome in ("pass", "fail"):
                metrics.checks.labels(self.name, "activation", outcome)
        self._export_detectors()
        # Tier 2's checker (activation alignment): built at load; the mirror worker runs it
        # through the Verifier, a repair (fallback_ops) asks it directly.
        self.activation = None
        self._last_activation = None  # (epoch, ActivationReport) of the latest tier-2 check
        self._last_activation_event = 0.0
        self._suppressed_activation_events = 0
        # policy.action fallback_ops: the buffer, the repair thread and the swap.
        self.ops = None
        if config.policy.action == "fallback_ops":
            from guard.serve.ops_fallback import OpsFallback

            self.ops = OpsFallback(self)

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        """Load every backend (in parallel: derivation and compilation take seconds)."""
        with ThreadPoolExecutor(max_workers=len(self.backends)) as pool:
            futures = {role: pool.submit(b.load) for role, b in self.backends.items()}
        for role, future in futures.items():
            exc = future.exception()
            if exc is not None:
                spec = getattr(self.config, role)
                if isinstance(exc, BackendError):
                    raise exc.at(f"models[{self.name}].{role}") from exc
                raise BackendError(
                    f"models[{self.name}].{role}: cannot load {spec.describe()}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        self._check_signatures()
        wants_tier2 = (self.config.checks.activation.enabled
                       or self.config.policy.action == "fallback_ops")
        if wants_tier2 and "reference" in self.backends:
            self._load_activation()
        # The request path checks inputs against this; computed once, never per request.
        self.signature = self.backends["primary"].describe()
        self.input_specs = {spec.name: spec for spec in self.signature.inputs}
        self.output_names = frozenset(spec.name for spec in self.signature.outputs)
        if "reference" in self.backends and self.config.checks.tensor.noise_floor.enabled:
            self._measure_noise_floor()
        if "reference" in self.backends and self.config.mirror.sample_rate > 0:
            self.mirror = Mirror(
                self.name, self.config.mirror, self.backends["reference"],
                self.backends["primary"], self.verifier, self.metrics, self._on_result,
                self._on_unchecked,
            )
            if self.activation_tier is not None:  # on_failure waits for room in the queue
                self.activation_tier.queue_fill = self.mirror.queue_fill
        if self.config.capture is not None:
            self.capture = CaptureWriter(
                self.name, self.config.capture, self.metrics,
                {role: b.describe() for role, b in self.backends.items()}, self._config_hash,
            )
            self.capture.start()
        if self.mirror is not None:
            self.mirror.start()
        self.ready = True
        emit("model_loaded", model=self.name,
             backends={role: b.describe().summary() for role, b in self.backends.items()},
             mirror_rate=self.config.mirror.sample_rate if self.mirror else 0.0,
             action=self.config.policy.action)

    async def connect(self) -> None:
        """On the server's event loop, after ``load``: open the request path's channels of
        upstream backends (the primary, the fallback) so the first request does not pay for
        the connection. One that does not connect in time is reported, not fatal."""
        for role in ("primary", "fallback"):
            connect = getattr(self.backends.get(role), "connect", None)
            if connect is not None and not await connect():
                emit("upstream_not_connected", model=self.name, role=role,
                     note="the channel keeps connecting; requests wait for it")

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

    def _measure_noise_floor(self) -> None:
        """The reference against itself, before the mirror starts; tier 1 allows the floor."""
        try:
            floor = measure_noise_floor(self.backends["reference"], self.config.reference,
                                        self.config.checks.tensor.noise_floor)
        except Exception as exc:  # a floor that cannot be measured must not stop the model
            floor = NoiseFloor(skipped=f"measurement failed: {type(exc).__name__}: {exc}")
        self.noise_floor = floor
        if not floor.skipped:
            self.verifier.set_noise_floor(floor.per_output)
        emit("noise_floor", model=self.name, **floor.as_dict(),
             multiplier=self.config.checks.tensor.noise_floor.multiplier)

    def _check_signatures(self) -> None:
        """A fallback must accept what the primary accepts; warn where names cannot be checked."""
        primary = self.describe()
        names = {s.name for s in primary.inputs}
        fallback = self.backends.get("fallback")
        if fallback is not None:
            other = {s.name for s in fallback.describe().inputs}
            if other and names and other != names:
                raise BackendError(
                    f"models[{self.name}].fallback: inputs {sorted(other)} differ from the "
                    f"primary's {sorted(names)}"
                )

    def close(self) -> None:
        self.ready = False
        if self.ops is not None:
            self.ops.stop()
        if self.mirror is not None:
            self.mirror.stop()
        if self.activation is not None:
            self.activation.close()
        if self.capture is not None:  # after the mirror: it hands its last samples to capture
            self.capture.close()
        for backend in self.backends.values():
            backend.close()

    def describe(self) -> BackendInfo:
        return self.signature or self.backends["primary"].describe()

    # -- request path ------------------------------------------------------------------------------
    def backend_for_request(self) -> tuple[str, int, Backend]:
        """(route, epoch, backend) for the next request. Epoch is read first: if a transition
        lands in between, the sample is attributed to the old epoch and ignored, never misfiled."""
        epoch = self.policy.epoch
        route = self.policy.route
        if route == "fallback" and "fallback" in self.backends:
            return "fallback", epoch, self.backends["fallback"]
        return "primary", epoch, self.backends["primary"]

    @contextlib.contextmanager
    def in_flight(self):
        """Counts requests inside a backend, so that a reload closes this model only after them."""
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    @property
    def requests_in_flight(self) -> int:
        return self._in_flight

    def after_response(self, request_id: str, inputs, outputs, route: str, epoch: int,
                       requested_outputs: list[str] | None = None,
                       seconds: float = 0.0) -> bool:
        """Offer the answered request to the mirror and to capture (non-blocking); True when
        the mirror queued it. ``outputs`` may be a callable that decodes them, so that requests
        neither samples pay nothing for it (capture decodes on its writer thread). A request
        taken by both is recorded once the mirror has its verdict (``_on_result``), or without
        one if the mirror gives up on it (``_on_unchecked``)."""
        capture = self.capture
        tag = capture.tag(request_id, seconds) if capture is not None else None
        mirrored = False
        # Within the dwell time on the fallback the primary is left alone: nothing mirrored.
        if self.mirror is not None and (route != "fallback" or self.policy.probing):
            mirrored = self.mirror.offer(request_id, inputs, outputs, route, epoch,
                                         requested_outputs, tag)
        if tag is not None and tag.record and not mirrored:
            capture.submit(PendingRecord(tag, route, epoch, inputs, outputs))
        return mirrored

    # -- route watchers (tap mode) --------------------------------------------------------------
    def watch_routes(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """A queue that receives every route transition from now on (from any thread)."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._watchers_lock:
            self._watchers.append((loop, queue))
        return queue

    def unwatch_routes(self, queue: asyncio.Queue) -> None:
        with self._watchers_lock:
            self._watchers = [(l, q) for l, q in self._watchers if q is not queue]

    def end_watches(self) -> None:
        """Ends every WatchRoute stream (at shutdown, so that it does not wait out the grace)."""
        self._notify_watchers(None)

    def _notify_watchers(self, transition: Transition | None) -> None:
        with self._watchers_lock:
            watchers = list(self._watchers)
        for loop, queue in watchers:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, transition)

    # -- mirror worker -------------------------------------------------------------------------------
    def _on_result(self, result: SampleResult) -> None:
        check: CheckResult = result.check
        m = self.metrics
        m.tensor_max_abs_error.labels(self.name).observe(check.max_abs_error)
        if self.ops is not None:
            self.ops.observe(result.sample.inputs, not check.passed)
        transition = None
        for tier, tier_result in check.tiers.items():
            if tier == "activation":
                self._on_activation(tier_result, result.sample.epoch)
                continue
            if tier not in self.policy_tiers:
                continue
            m.checks.labels(self.name, tier, "pass" if tier_result.passed else "fail").inc()
            transition = self.policy.observe(tier, not tier_result.passed,
                                             result.sample.epoch) or transition
        for figures in self.policy.windows():
            m.drift_ratio.labels(self.name, figures.tier).set(figures.ratio)
        self._export_detectors()
        if check.arbitration is not None:
            emit("arbitration", model=self.name, verdict=check.arbitration.as_dict())
        if transition is not None:
            evidence = dict(transition.evidence)
            if not check.passed:
                evidence["last_failure"] = check.summary()
            evidence.update(self._activation_evidence(result.sample.epoch))
            self._record(transition, evidence)
        self._capture_checked(result)

    def _capture_checked(self, result: SampleResult) -> None:
        tag, capture = result.sample.tag, self.capture
        if capture is None or tag is None:
            return
        if not (tag.record or (not result.check.passed and capture.wants_failure(tag))):
            return
        sample = result.sample
        capture.submit(PendingRecord(
            tag, sample.route, sample.epoch, sample.inputs, sample.outputs,
            reference=result.reference, tier_reports=self.verifier.tier_reports(result.check),
            reference_seconds=result.reference_seconds, probed=result.probed,
        ))

    def _on_unchecked(self, sample: Sample, outcome: str) -> None:
        """A mirrored sample that got no verdict (error, timeout, shutdown): record the request."""
        tag = sample.tag
        if self.capture is not None and tag is not None and tag.record:
            self.capture.submit(PendingRecord(tag, sample.route, sample.epoch, sample.inputs,
                                              sample.outputs))

    def _export_detectors(self) -> None:
        for figures in self.policy.detectors():
            self.metrics.detector_statistic.labels(self.name, figures.tier).set(figures.statistic)
            self.metrics.detector_threshold.labels(self.name, figures.tier).set(figures.threshold)

    def _on_activation(self, report, epoch: int) -> None:
        """A tier-2 report from the Verifier: counted, kept for the evidence, announced."""
        self._last_activation = (epoch, report)
        if report.error:
            emit("activation_error", model=self.name, error=report.error)
            return
        self.metrics.checks.labels(self.name, "activation",
                                   "pass" if report.passed else "fail").inc()
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
            self._record(transition, transition.evidence)
        self._export_detectors()
        return transition

    def _record(self, transition: Transition, evidence: dict) -> None:
        m = self.metrics
        if transition.trigger == "alert":
            emit("drift_alert", model=self.name, reason=transition.reason,
                 action=self.config.policy.action, evidence=evidence)
            return
        if transition.trigger == "dry_run":
            emit("drift_dry_run", model=self.name, reason=transition.reason,
                 would_route=transition.to_route, evidence=evidence)
            return
        if transition.from_route != transition.to_route:
            if transition.to_route == "fallback":
                to = "fallback_model"
            else:
                to = "fallback_ops" if transition.trigger == "repair" else "primary"
            m.fallback_transitions.labels(self.name, to).inc()
            m.fallback_active.labels(self.name, "model").set(transition.to_route == "fallback")
            self._notify_watchers(transition)
        emit("route_transition", model=self.name, from_route=transition.from_route,
             to_route=transition.to_route, trigger=transition.trigger, reason=transition.reason,
             evidence=evidence)
        if (self.ops is not None and transition.trigger == "policy"
                and transition.to_route == "fallback"):
            self.ops.on_trip(self.policy.epoch)
