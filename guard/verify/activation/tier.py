"""Tier 2 as a registered tier (``TIER``, guard/verify/tiers.py).

The same tier serves the sidecar's mirror worker and offline replay: ``check`` decides per
sample whether tier 2 runs (``checks.activation.sample_rate``, and ``on_failure`` when tier 1 or
3 failed and the mirror queue has room) and returns None when it does not, so a sample without
tier 2 carries no activation result. The capture sides are built on first use, or at load with
``prepare()`` (the sidecar does, so that a pair tier 2 cannot capture fails at start-up).

A generative model's sample (a completion) is checked on its prompt and completion tokens as the
reference scored them, after the generation tier (``on_failure``: when that check failed), its
primary the GGUF the upstream serves (``checks.activation.primary_gguf``, gguf_align.py).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from guard.config import ModelConfig
from guard.verify.activation.checker import ActivationChecker
from guard.verify.activation.report import ActivationReport


class ActivationTier:
    name = "activation"

    def __init__(self, config: ModelConfig, threads: int = 1):
        self.model_config = config
        self.threads = threads
        self.checker: ActivationChecker | None = None
        # How full the mirror queue is (0..1); the sidecar sets it, replay has no queue.
        self.queue_fill: Callable[[], float] = lambda: 0.0
        self._lock = threading.Lock()

    def prepare(self) -> ActivationChecker:
        with self._lock:
            if self.checker is None:
                self.checker = ActivationChecker.for_model(self.model_config, self.threads)
            return self.checker

    def check(self, sample) -> ActivationReport | None:
        generation = self.model_config.task == "generation"
        inputs = token_inputs(sample.reference) if generation else sample.inputs
        if inputs is None:
            return None  # tier 2 re-runs both sides on the inputs; without them it cannot
        failed = any(not result.passed for result in sample.results.values())
        checker = self.prepare()
        if not checker.due(failed, self.queue_fill()):
            return None
        return checker.check(inputs, tier1=sample.results.get(
            "generation" if generation else "tensor"))

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()


def token_inputs(scores) -> dict[str, np.ndarray] | None:
    """A generation sample's inputs for tier 2: prompt and completion as the reference scored
    them (``ReferenceScores``), one sequence of token ids; None where nothing was scored (a
    tokenization mismatch) or no prompt tokens are known."""
    if scores is None or getattr(scores, "mismatch", None) is not None:
        return None
    ids = list(scores.prompt_token_ids) + list(scores.token_ids)
    if not scores.prompt_token_ids or not ids:
        return None
    return {"input_ids": np.asarray([ids], dtype=np.int64)}


def build_tier(config: ModelConfig, backends: dict) -> ActivationTier | None:
    """The pipeline hook: tier 2 for a model that enables it and has a reference."""
    if config.reference is None or not config.checks.activation.enabled:
        return None
    return ActivationTier(config, config.mirror.threads)


def _build(setup) -> ActivationTier | None:
    return build_tier(setup.model, setup.backends or {}) if setup.model is not None else None


def _details(report) -> dict:
    """Tier 2's report reduced to what capture and replay keep: the first divergence and the
    per-layer error profile (propagated relative error), in network order."""
    details = report.as_dict() if hasattr(report, "as_dict") else {}
    first = report.first_divergence_dict() if hasattr(report, "first_divergence_dict") else \
        details.get("first_divergence")
    layers = []
    for layer in details.get("layers", []):
        error = layer.get("error")
        if error is None:
            error = (layer.get("propagated") or {}).get("rel_error")
        if error is not None:
            layers.append({"layer": layer.get("layer", ""), "error": float(error)})
    return {"first_divergence": first, "layers": layers}


def _summary(report, details: dict) -> str:
    """Tier 2 summarises as a dict of evidence; its line names the first divergence."""
    summary = report.summary()
    if isinstance(summary, str):
        return summary
    first = details["first_divergence"]
    if first is None:
        return "no layer diverges"
    if first.get("within_budget"):  # measurable, but inside tier 1's budget
        return f"first measurable divergence at {first['layer']} (within budget)"
    return f"first divergence at {first['layer']}"


def _declare():
    from guard.verify.tiers import TierKind

    # It runs on a biased sub-sample (failures): evidence, not a detector's input.
    return TierKind("activation", build=_build, takes=("tensors", "generation"),
                    detector=False, details=_details, summary=_summary)


TIER = _declare()
