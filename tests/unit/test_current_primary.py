"""``CurrentPrimary`` (guard/verifier_process/primary.py), the one owner of the primary a verified
model serves: the serving processes are told first and a refusal moves nothing; the checks (the
mirror's probes call ``infer`` here) run what serves; the configured primary comes back. Real
torch backends; the serving side is the link's interface, recorded."""

from __future__ import annotations

import numpy as np

from fixture_models import DRIFT_TRIGGER
from guard.backends import create_backend
from guard.config import BackendConfig
from guard.verifier_process.primary import CurrentPrimary

AFFINE = "fixture_models:affine"


def _backend(**kwargs):
    spec = BackendConfig.model_validate({"backend": "torch", "path": AFFINE,
                                         "options": {"kwargs": kwargs}})
    backend = create_backend(spec, "primary")
    backend.load()
    return spec, backend


class ServingLink:
    """What the verifier's link to the serving processes is asked (``use_primary``)."""

    def __init__(self, refuse: str = ""):
        self.refuse = refuse
        self.told: list[tuple[str, list[str], BackendConfig | None]] = []

    def use_primary(self, model, kept, primary=None) -> str:
        self.told.append((model, list(kept), primary))
        return self.refuse


def test_a_variant_serves_everywhere_then_the_configured_primary_comes_back():
    _, configured = _backend()
    block, variant = _backend(drift_on_trigger=True)
    link, flags = ServingLink(), []
    primary = CurrentPrimary("m", configured, link, flags.append)
    x = {"x": np.array([[DRIFT_TRIGGER, 0, 0, 0]], dtype=np.float32)}
    before = primary.infer(x)["y"]
    assert primary.use(["linear"], variant, block) == ""
    assert link.told == [("m", ["linear"], block)] and primary.kept == ["linear"]
    np.testing.assert_allclose(primary.infer(x)["y"], before + 1.0, rtol=1e-6)
    assert primary.restore() == (["linear"], variant)
    assert link.told[-1] == ("m", [], None) and primary.backend is configured
    np.testing.assert_allclose(primary.infer(x)["y"], before, rtol=1e-6)
    assert primary.restore() is None  # nothing to restore: nobody is told again
    assert len(link.told) == 2 and flags == [True, False]


def test_a_refusal_of_the_serving_processes_moves_nothing():
    _, configured = _backend()
    block, variant = _backend(drift_on_trigger=True)
    flags: list[bool] = []
    primary = CurrentPrimary("m", configured, ServingLink("serving process 1: no"),
                             flags.append)
    assert primary.use(["linear"], variant, block) == "serving process 1: no"
    assert primary.backend is configured and primary.kept == [] and flags == []
