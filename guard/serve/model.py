"""One guarded model: its backends, route policy, mirror and the bookkeeping between them.

The request path touches two methods only: ``backend_for_request()`` and ``after_response()``.
Everything else runs in the mirror worker (``_on_result``) or the admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from guard.backends import Backend, BackendInfo, TensorSpec, create_backend
from guard.backends.derive import file_sha256
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
        if config.reference is not None:
            activation = load_activation_tier(config, self.backends)  # tier 2, when it exists
            if activation is not None:
                self.verifier.add_tier(activation)
        self.noise_floor: NoiseFloor | None = None
        self.policy = RoutePolicy(
            self.name, config.policy, self.verifier.tiers, has_fallback="fallback" in self.backends
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
        metrics.declare_model(self.name, self.verifier.tiers)

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        """Load every backend (in parallel: derivation and compilation take seconds)."""
        self._verify_artifacts()
        with ThreadPoolExecutor(max_workers=len(self.backends)) as pool:
            futures = {role: pool.submit(b.load) for role, b in self.backends.items()}
        for role, future in futures.items():
            exc = future.exception()
            if exc is not None:
                spec = getattr(self.config, role)
                if isinstance(exc, BackendError):
                    raise BackendError(f"models[{self.name}].{role}: {exc}") from exc
                raise BackendError(
                    f"models[{self.name}].{role}: cannot load {spec.describe()}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        self._check_signatures()
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

    def _verify_artifacts(self) -> None:
        """The sha256 pinned in the config must match the file, before anything loads it."""
        for role in self.backends:
            spec = getattr(self.config, role)
            if spec.sha256 is None or spec.path is None or spec.is_factory:
                continue
            actual = file_sha256(Path(spec.path))
            if actual != spec.sha256:
                raise BackendError(f"models[{self.name}].{role}.sha256: {spec.path} has sha256 "
                                   f"{actual}, the config expects {spec.sha256}")

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
        if self.mirror is not None:
            self.mirror.stop()
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
        transition = None
        for tier, tier_result in check.tiers.items():
            if tier not in self.verifier.tiers:
                continue
            m.checks.labels(self.name, tier, "pass" if tier_result.passed else "fail").inc()
            transition = self.policy.observe(tier, not tier_result.passed,
                                             result.sample.epoch) or transition
        for figures in self.policy.windows():
            m.drift_ratio.labels(self.name, figures.tier).set(figures.ratio)
        if check.arbitration is not None:
            emit("arbitration", model=self.name, verdict=check.arbitration.as_dict())
        if transition is not None:
            evidence = dict(transition.evidence)
            if not check.passed:
                evidence["last_failure"] = check.summary()
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

    # -- admin -------------------------------------------------------------------------------
    def set_override(self, override: Override, reason: str) -> Transition | None:
        transition = self.policy.set_override(override, reason)
        if transition is not None:
            self._record(transition, transition.evidence)
        return transition

    def _record(self, transition: Transition, evidence: dict) -> None:
        m = self.metrics
        if transition.trigger == "alert":
            emit("drift_alert", model=self.name, reason=transition.reason,
                 action=self.config.policy.action, evidence=evidence)
            return
        if transition.from_route != transition.to_route:
            to = "fallback_model" if transition.to_route == "fallback" else "primary"
            m.fallback_transitions.labels(self.name, to).inc()
            m.fallback_active.labels(self.name, "model").set(transition.to_route == "fallback")
            self._notify_watchers(transition)
        emit("route_transition", model=self.name, from_route=transition.from_route,
             to_route=transition.to_route, trigger=transition.trigger, reason=transition.reason,
             evidence=evidence)
