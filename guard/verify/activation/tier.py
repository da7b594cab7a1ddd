"""Tier 2 as the Comparator's extra tier (``guard.verify.pipeline.load_activation_tier``).

The same tier serves the sidecar's mirror worker and offline replay: ``check`` decides per
sample whether tier 2 runs (``checks.activation.sample_rate``, and ``on_failure`` when tier 1 or
3 failed and the mirror queue has room) and returns None when it does not, so a sample without
tier 2 carries no activation result. The capture sides are built on first use, or at load with
``prepare()`` (the sidecar does, so that a pair tier 2 cannot capture fails at start-up).
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

    def check(self, *, inputs: dict[str, np.ndarray] | None, reference, primary,
              results: dict) -> ActivationReport | None:
        if inputs is None:
            return None  # tier 2 re-runs both sides on the inputs; without them it cannot
        failed = any(not result.passed for result in results.values())
        checker = self.prepare()
        if not checker.due(failed, self.queue_fill()):
            return None
        return checker.check(inputs, tier1=results.get("tensor"))

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()


def build_tier(config: ModelConfig, backends: dict) -> ActivationTier | None:
    """The pipeline hook: tier 2 for a model that enables it and has a reference."""
    if config.reference is None or not config.checks.activation.enabled:
        return None
    return ActivationTier(config, config.mirror.threads)
