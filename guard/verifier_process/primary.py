"""``CurrentPrimary``: which primary a verified model serves, its one owner.

The primary as configured, or a repair's variant with a few ops kept back at full precision
(``policy.action: fallback_ops``, guard/verifier_process/ops_fallback.py). One object answers
for it: the serving processes are told first (``UsePrimary``, through the serving pool to every
serving process alike: guard/serve/processes.py, which records it for a serving process or a
verifier started again), then the verifier's own copy swaps, the one the mirror's probes run
(the mirror calls ``infer`` here, so it always runs the current one) and tier 2 compares.

A swap is one attribute assignment: a probe in flight keeps the backend object it was given and
finishes on it; the replaced backend is kept, never closed under it.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol

from guard.backends import Backend
from guard.config import BackendConfig


class Serving(Protocol):
    def use_primary(self, model: str, kept: list[str],
                    primary: BackendConfig | None = None) -> str:
        """Every serving process serves this primary; "" when done, otherwise why not."""


class CurrentPrimary:
    def __init__(self, model: str, configured: Backend, serving: Serving,
                 repaired: Callable[[bool], None] = lambda on: None):
        """``configured``: the primary as configured (owned by the checked pair, which closes
        it); ``serving``: the link to the serving processes; ``repaired(on)``: told when a
        variant starts or stops serving (``guard_fallback_active{kind="ops"}``)."""
        self.model = model
        self.configured = configured
        self.backend = configured  # the one the checks run now
        self.kept: list[str] = []  # the ops it keeps back ([]: as configured)
        self.serving = serving
        self.repaired = repaired
        self._lock = threading.Lock()

    def infer(self, inputs):
        """The current primary's answer (the mirror's probes)."""
        return self.backend.infer(inputs)

    def describe(self):
        return self.backend.describe()

    def use(self, kept: list[str], backend: Backend, block: BackendConfig) -> str:
        """Serve the variant ``backend`` (built from ``block``, keeping ``kept`` back): the
        serving processes first, then here; "" when done, otherwise why not (nothing moved)."""
        with self._lock:
            refused = self.serving.use_primary(self.model, list(kept), block)
            if refused:
                return refused
            self.backend, self.kept = backend, list(kept)
        self.repaired(True)
        return ""

    def adopt(self, kept: list[str], backend: Backend) -> None:
        """A restarted verifier: the serving processes still serve this variant; the checks
        run it too from now on."""
        with self._lock:
            self.backend, self.kept = backend, list(kept)
        self.repaired(True)

    def restore(self) -> tuple[list[str], Backend] | None:
        """Back to the primary as configured, everywhere; (the ops it kept, the variant that
        served), or None when the configured one serves already."""
        with self._lock:
            if not self.kept:
                return None
            variant, kept = self.backend, self.kept
            self.backend, self.kept = self.configured, []
            self.serving.use_primary(self.model, [])
        self.repaired(False)
        return kept, variant
