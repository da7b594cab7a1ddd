"""``policy.action: fallback_ops`` for one verified model: buffer, repair thread, atomic swap.

Runs in the verifier process. A winning variant is put in by the model's ``CurrentPrimary``
(guard/verifier_process/primary.py: the serving processes load it first, from the rebuilt
backend block computed here, then the verifier's own copy for probes and tier 2 swaps), then the
route word moves back to the primary. What this needs of its model is named in the constructor:
the primary's owner, the route policy, the checks and a callback for the transition.

The policy trips the model to its whole-model fallback as for ``fallback_model``; this then runs a
repair (guard/policy/repair.py) on a thread of its own. When a variant with a few ops kept back at
reference precision passes (ONNX nodes at fp32, torch_compile submodules run eagerly in fp32,
TensorRT layers pinned to fp32: guard/policy/keep_back.py), it becomes the primary
(``CurrentPrimary.use``) and the route goes back to the primary with trigger ``repair``. Every step
is an event; a fault ends in the whole-model fallback.

A manual override to ``primary`` restores the primary as configured (no ops kept back): the
operator's way to say the drift is gone. A repaired primary that trips again goes to the
whole-model fallback; it is not repaired twice.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from guard.backends import Backend
from guard.config import BackendConfig, ModelConfig
from guard.observe.events import emit
from guard.policy.repair import OpRepair, RepairBuffer
from guard.policy.route import RoutePolicy, Transition
from guard.runtime.priority import lower_current_thread
from guard.verifier_process.primary import CurrentPrimary

log = logging.getLogger("guard.ops_fallback")


class OpsFallback:
    def __init__(self, config: ModelConfig, primary: CurrentPrimary, policy: RoutePolicy,
                 reference: Callable[[], Backend], check: Callable[[dict, dict, dict], bool],
                 activation: Callable[[], object], on_transition: Callable[[Transition], None]):
        """``config``: the model's (its repair settings, its primary block, the mirror's nice);
        ``primary``: the one owner of the primary that serves; ``policy``: the model's route
        policy (its epoch and route, ``repaired``); ``reference()``: the reference backend;
        ``check(reference, outputs, inputs)``: whether a candidate's answer passes the model's
        checks; ``activation()``: tier 2's checker (built at load); ``on_transition``: records
        the route transition a repair made (publish, metrics, event)."""
        self.name = config.name
        self.config = config.policy.repair
        self.primary_config = config.primary
        self.nice = config.mirror.nice
        self.primary = primary
        self.policy = policy
        self.reference = reference
        self.check = check
        self.activation = activation
        self.on_transition = on_transition
        self.buffer = RepairBuffer(self.config.buffer, self.config.buffer_bytes)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def kept(self) -> list[str]:
        return self.primary.kept

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
                emit("repair_skipped", model=self.name, ops_kept_fp32=self.kept,
                     reason="the primary already keeps ops back: the whole-model fallback "
                            "serves until the primary recovers or is reset")
                return
            if self.repairing or self._stopping.is_set():
                return
            self._thread = threading.Thread(target=self._repair, args=(epoch,),
                                            name=f"guard-repair-{self.name}", daemon=True)
            self._thread.start()

    # -- the repair thread ------------------------------------------------------------------------
    def _repair(self, epoch: int) -> None:
        lower_current_thread(self.nice)  # rebuilds and validation yield the CPU
        samples = self.buffer.snapshot()
        emit("repair_started", model=self.name, buffered=len(samples),
             failing=sum(s.failed for s in samples))
        repair = OpRepair(
            self.primary_config, self.reference(), self.check, self.config,
            activation=self.activation(),
            on_step=lambda step: emit("repair_step", model=self.name, **step),
        )
        outcome = repair.run(samples)
        if self._stopping.is_set():
            return
        if not outcome.ok:
            emit("repair_failed", model=self.name, **outcome.evidence(),
                 note="the whole-model fallback keeps serving")
            return
        assert outcome.backend is not None, "a repair that succeeded built its variant"
        with self._lock:
            policy = self.policy
            if policy.epoch != epoch or policy.route != "fallback":
                emit("repair_discarded", model=self.name, ops_kept_fp32=outcome.kept,
                     reason="the route moved while the repair ran")
                return
            # The serving processes load the same variant first: the route moves to it only
            # once they answer with it.
            refused = self.primary.use(outcome.kept, outcome.backend,
                                       self.rebuilt_spec(outcome.kept))
            if refused:
                emit("repair_failed", model=self.name, ops_kept_fp32=outcome.kept,
                     error=f"the serving process could not load the repaired primary: {refused}",
                     note="the whole-model fallback keeps serving")
                return
            reason = (f"kept back at fp32 after repair: {', '.join(outcome.kept)} "
                      f"({outcome.candidates_tried} candidates, {outcome.seconds:.1f}s)")
            transition = policy.repaired(epoch, reason, outcome.evidence())
            if transition is None:  # the route moved in between: put the primary back
                self.primary.restore()
                emit("repair_discarded", model=self.name, ops_kept_fp32=outcome.kept,
                     reason="the route moved while the repair was swapped in")
                return
        self.on_transition(transition)

    # -- admin ------------------------------------------------------------------------------------
    def restore(self, reason: str) -> None:
        """Back to the primary as configured (no ops kept back)."""
        with self._lock:
            restored = self.primary.restore()
        if restored is None:
            return
        kept, variant = restored
        emit("ops_fallback_cleared", model=self.name, ops_kept_fp32=kept,
             reason=reason or "manual override to the primary",
             repaired_artifact=variant.describe().artifact)

    def rebuilt_spec(self, kept: list[str]) -> BackendConfig:
        """The primary's backend block with ``kept`` held back, as the serving processes
        build it (the primary's own options: not the repair's thread budget)."""
        from guard.policy.keep_back import keep_back_for

        return keep_back_for(self.primary_config).rebuild_spec(kept)

    def resume(self, kept: list[str]) -> None:
        """A restarted verifier whose serving processes still answer with a repaired primary:
        build the same variant for the probes, so the repair state survives the restart."""
        from guard.backends import create_backend

        backend = create_backend(self.rebuilt_spec(kept), "primary")
        backend.load()
        with self._lock:
            self.primary.adopt(kept, backend)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
