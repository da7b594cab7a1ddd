"""``policy.action: fallback_ops`` for one verified model: buffer, repair thread, atomic swap.

Runs in the verifier process. A winning variant is loaded by the serving processes first
(``serving.use_primary``, with the rebuilt backend block computed here), then the route word
moves back to the primary; the verifier keeps its own copy of the variant for probes and tier 2.

The policy trips the model to its whole-model fallback as for ``fallback_model``; this then runs
a repair (guard/policy/repair.py) on a thread of its own. When a variant with a few ops kept
back at reference precision passes (ONNX nodes at fp32, torch_compile submodules run eagerly in
fp32, TensorRT layers pinned to fp32: guard/policy/keep_back.py), it becomes the primary in one
dict assignment (requests in flight keep the backend object they were given and finish on it;
the old session is kept, never closed under them) and the route goes back to the primary with
trigger ``repair``. Every step is an event; a fault ends in the whole-model fallback.

A manual override to ``primary`` restores the primary as configured (no ops kept back): the
operator's way to say the drift is gone. A repaired primary that trips again goes to the
whole-model fallback; it is not repaired twice.
"""

from __future__ import annotations

import logging
import threading

from guard.observe.events import emit
from guard.policy.repair import OpRepair, RepairBuffer
from guard.runtime.priority import lower_current_thread

log = logging.getLogger("guard.ops_fallback")


class OpsFallback:
    def __init__(self, model):
        self.model = model
        self.config = model.config.policy.repair
        self.buffer = RepairBuffer(self.config.buffer, self.config.buffer_bytes)
        self.kept: list[str] = []
        self.original = None  # the primary as configured, while a repaired one serves
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def repairing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- fed by the mirror worker -----------------------------------------------------------------
    def observe(self, inputs, failed: bool) -> None:
        self.buffer.add(inputs, failed)

    def on_trip(self, epoch: int) -> None:
        """The policy just moved the model to its fallback (starting ``epoch``)."""
        with self._lock:
            if self.kept:
                emit("repair_skipped", model=self.model.name, ops_kept_fp32=self.kept,
                     reason="the primary already keeps ops back: the whole-model fallback "
                            "serves until the primary recovers or is reset")
                return
            if self.repairing or self._stopping.is_set():
                return
            self._thread = threading.Thread(target=self._repair, args=(epoch,),
                                            name=f"guard-repair-{self.model.name}", daemon=True)
            self._thread.start()

    # -- the repair thread ------------------------------------------------------------------------
    def _repair(self, epoch: int) -> None:
        model = self.model
        lower_current_thread(model.config.mirror.nice)  # rebuilds and validation yield the CPU
        samples = self.buffer.snapshot()
        emit("repair_started", model=model.name, buffered=len(samples),
             failing=sum(s.failed for s in samples))
        repair = OpRepair(
            model.config.primary, model.backends["reference"], self._validate, self.config,
            activation=model.activation,
            on_step=lambda step: emit("repair_step", model=model.name, **step),
        )
        outcome = repair.run(samples)
        if self._stopping.is_set():
            return
        if not outcome.ok:
            emit("repair_failed", model=model.name, **outcome.evidence(),
                 note="the whole-model fallback keeps serving")
            return
        with self._lock:
            policy = model.policy
            if policy.epoch != epoch or policy.route != "fallback":
                emit("repair_discarded", model=model.name, ops_kept_fp32=outcome.kept,
                     reason="the route moved while the repair ran")
                return
            # The serving processes load the same variant first: the route moves to it only
            # once they answer with it.
            refused = model.serving.use_primary(model.name, list(outcome.kept),
                                                self.rebuilt_spec(outcome.kept))
            if refused:
                emit("repair_failed", model=model.name, ops_kept_fp32=outcome.kept,
                     error=f"the serving process could not load the repaired primary: {refused}",
                     note="the whole-model fallback keeps serving")
                return
            original = model.backends["primary"]
            model.backends["primary"] = outcome.backend  # atomic: in-flight keep the old one
            if model.mirror is not None:
                model.mirror.primary = outcome.backend
            reason = (f"kept back at fp32 after repair: {', '.join(outcome.kept)} "
                      f"({outcome.candidates_tried} candidates, {outcome.seconds:.1f}s)")
            transition = policy.repaired(epoch, reason, outcome.evidence())
            if transition is None:  # the route moved in between: put the primary back
                model.serving.use_primary(model.name, [])
                model.backends["primary"] = original
                if model.mirror is not None:
                    model.mirror.primary = original
                emit("repair_discarded", model=model.name, ops_kept_fp32=outcome.kept,
                     reason="the route moved while the repair was swapped in")
                return
            self.original, self.kept = original, list(outcome.kept)
        model.metrics.fallback_active.labels(model.name, "ops").set(1)
        model._record(transition, transition.evidence)

    def _validate(self, reference: dict, outputs: dict, inputs: dict) -> bool:
        return self.model.comparator.check(reference, outputs, inputs).passed

    # -- admin ------------------------------------------------------------------------------------
    def restore(self, reason: str) -> None:
        """Back to the primary as configured (no ops kept back)."""
        with self._lock:
            if not self.kept:
                return
            model = self.model
            repaired = model.backends["primary"]
            model.backends["primary"] = self.original
            if model.mirror is not None:
                model.mirror.primary = self.original
            kept, self.kept, self.original = self.kept, [], None
            model.serving.use_primary(model.name, [])
        model.metrics.fallback_active.labels(model.name, "ops").set(0)
        emit("ops_fallback_cleared", model=model.name, ops_kept_fp32=kept,
             reason=reason or "manual override to the primary",
             repaired_artifact=repaired.describe().artifact)

    def rebuilt_spec(self, kept: list[str]):
        """The primary's backend block with ``kept`` held back, as the serving processes
        build it (the primary's own options: not the repair's thread budget)."""
        from guard.policy.keep_back import keep_back_for

        return keep_back_for(self.model.config.primary).rebuild_spec(kept)

    def resume(self, kept: list[str]) -> None:
        """A restarted verifier whose serving processes still answer with a repaired primary:
        build the same variant for the probes, so the repair state survives the restart."""
        from guard.backends import create_backend

        model = self.model
        backend = create_backend(self.rebuilt_spec(kept), "primary")
        backend.load()
        with self._lock:
            self.original = model.backends["primary"]
            model.backends["primary"] = backend
            if model.mirror is not None:
                model.mirror.primary = backend
            self.kept = list(kept)
        model.metrics.fallback_active.labels(model.name, "ops").set(1)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
