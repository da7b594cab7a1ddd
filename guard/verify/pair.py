"""One assembly of a checked pair: a model's reference and primary, and the ``Comparator`` that
compares them (tiers 1 and 3, the fp64 arbiter, tier 2 when configured, the reference's noise
floor). The sidecar's verifier process and ``guard replay`` build it the same way, so a verdict
replayed offline is the verdict the sidecar would have reached.

The reference pins determinism with ``mirror.threads`` (its CPU budget); both backends load in
parallel (derivation and compilation take seconds); a load error names the model and role.
"""

from __future__ import annotations

from guard.backends import Backend, create_backend
from guard.backends.loading import load_all
from guard.backends.signatures import check_pair
from guard.config import ModelConfig
from guard.errors import BackendError
from guard.verify.arbitrate import build_arbiter
from guard.verify.noise import NoiseFloor, measure_noise_floor
from guard.verify.pipeline import Comparator


class CheckedPair:
    def __init__(self, config: ModelConfig):
        if config.reference is None:
            raise BackendError(f"models[{config.name}]: checking needs a 'reference' backend; "
                               "this model has none")
        self.name = config.name
        self.config = config
        self.backends: dict[str, Backend] = {
            "reference": create_backend(config.reference, "reference", config.mirror.threads),
            "primary": create_backend(config.primary, "primary"),
        }
        self.comparator = Comparator.for_model(config, arbiter=build_arbiter(config),
                                             backends=self.backends)
        self.activation_tier = self.comparator.tier("activation")
        self.noise_floor: NoiseFloor | None = None

    @property
    def reference(self) -> Backend:
        return self.backends["reference"]

    @property
    def primary(self) -> Backend:
        return self.backends["primary"]

    def load(self) -> "CheckedPair":
        """Load both backends, then measure the noise floor when configured."""
        self.load_backends()
        if self.config.checks.tensor.noise_floor.enabled:
            self.measure_noise_floor()
        return self

    def load_backends(self) -> None:
        load_all(self.name, self.config, self.backends)
        check_pair(self.name, self.reference.describe(), self.primary.describe())

    def measure_noise_floor(self) -> NoiseFloor:
        """The reference against itself; tier 1 then allows the floor. A floor that cannot be
        measured is reported as skipped, never fatal."""
        try:
            floor = measure_noise_floor(self.reference, self.config.reference,
                                        self.config.checks.tensor.noise_floor)
        except Exception as exc:
            floor = NoiseFloor(skipped=f"measurement failed: {type(exc).__name__}: {exc}")
        self.noise_floor = floor
        if not floor.skipped:
            self.comparator.set_noise_floor(floor.per_output)
        return floor

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
