"""One assembly of a checked pair: a model's reference and primary, and the ``Comparator`` that
compares them (tiers 1 and 3, the fp64 arbiter, tier 2 when configured, the reference's noise
floor). The sidecar's verifier process and ``guard replay`` build it the same way, so a verdict
replayed offline is the verdict the sidecar would have reached.

The reference pins determinism with ``mirror.threads`` (its CPU budget); both backends load in
parallel (derivation and compilation take seconds); a load error names the model and role.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from guard.backends import Backend, create_backend
from guard.backends.loading import load_all
from guard.backends.signature_match import OutputMatch, generatable, pair_outputs
from guard.backends.signatures import check_pair
from guard.config import BackendConfig, ModelConfig
from guard.errors import BackendError
from guard.verify.arbitrate import build_arbiter
from guard.verify.noise import NoiseFloor, measure_noise_floor
from guard.verify.pipeline import Comparator

if TYPE_CHECKING:  # (tier 2's package is imported only where a model runs it)
    from guard.verify.activation.tier import ActivationTier


def require_reference(config: ModelConfig) -> BackendConfig:
    """The model's reference; BackendError naming the model where it has none: nothing to
    check against."""
    if config.reference is None:
        raise BackendError(f"models[{config.name}]: checking needs a 'reference' backend; "
                           "this model has none")
    return config.reference


class CheckedPair:
    def __init__(self, config: ModelConfig):
        self.reference_config = require_reference(config)
        self.name = config.name
        self.config = config
        self.backends: dict[str, Backend] = {
            "reference": create_backend(self.reference_config, "reference",
                                        config.mirror.threads),
            "primary": create_backend(config.primary, "primary"),
        }
        self.comparator = Comparator.for_model(config, arbiter=build_arbiter(config),
                                             backends=self.backends)
        # (the registry builds tier 2 as an ActivationTier)
        self.activation_tier = cast("ActivationTier | None", self.comparator.tier("activation"))
        self.noise_floor: NoiseFloor | None = None
        # The reference's outputs under the primary's names (guard/backends/signature_match.py),
        # known once both sides are loaded.
        self.output_match = OutputMatch()

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
        self.match_outputs()

    def match_outputs(self) -> None:
        """Once both sides are loaded: match their outputs (guard/backends/signature_match.py),
        check their shapes, and have the comparator rename the reference's by the match."""
        self.output_match = pair_outputs(self.name, self.reference, self.primary)
        check_pair(self.name, self.output_match.rename_info(self.reference.describe()),
                   self.primary.describe())
        self._check_tolerance_names()
        self.comparator.match_reference(self.output_match)

    def _check_tolerance_names(self) -> None:
        """A per-output tolerance must name one of the primary's outputs (the names tier 1
        compares by): one that names none (a typo, the reference's name, an output the model
        lost) was silently never applied, and its output judged by the default tolerance."""
        outputs = sorted(s.name for s in self.primary.describe().outputs)
        if not outputs:  # a primary that cannot tell its outputs' names
            return
        for name in self.config.checks.tensor.outputs:
            if name not in outputs:
                raise BackendError(
                    f"models[{self.name}].checks.tensor.outputs.{name}: the model has no "
                    f"output '{name}' (its outputs, the primary's names: {', '.join(outputs)})")

    def measure_noise_floor(self) -> NoiseFloor:
        """The reference against itself; tier 1 then allows the floor. A floor that cannot be
        measured is reported as skipped, never fatal."""
        specs = self._noise_inputs()
        try:
            floor = measure_noise_floor(self.reference, self.reference_config,
                                        self.config.checks.tensor.noise_floor, specs)
            if specs is not self.reference.describe().inputs and not floor.skipped:
                floor.notes.append(f"inputs generated from the primary's signature: the "
                                   f"reference ({self.reference_config.backend}) declares no "
                                   "datatypes or shapes")
        except Exception as exc:
            floor = NoiseFloor(skipped=f"measurement failed: {type(exc).__name__}: {exc}")
        self.noise_floor = floor
        floor.per_output = self.output_match.apply(floor.per_output)  # the primary's names
        if not floor.skipped:
            self.comparator.set_noise_floor(floor.per_output)
        return floor

    def _noise_inputs(self):
        """The signature the floor's inputs are generated from: the reference's, or, where it
        cannot tell datatypes and shapes (TorchScript without guard.json), the primary's when
        both take the same input names."""
        own = self.reference.describe().inputs
        if generatable(own):
            return own
        other = self.primary.describe().inputs
        if generatable(other) and {s.name for s in other} == {s.name for s in own}:
            return other
        return own

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
