"""fp64 arbitration: when primary and reference disagree, which one is further from the truth?

torch._dynamo's accuracy checker asks a float64 run before blaming the compiled model; so do
we. The truth is the reference's own model run in float64 (inputs cast to float64 too). With
``err(x) = max over outputs of max|x - fp64|`` (after the model's adapters, on both):

    primary acceptable  <=>  err(primary) <= multiplier * err(reference) + atol / 10

When it holds, the disagreement is within what the reference itself gets wrong: the verdict is
``wrong: reference``. Otherwise ``wrong: primary``. When no fp64 run can be made the verdict is
``wrong: undetermined`` with the reason. The fp64 run is the reference backend's declaration
(``BackendKind.fp64``, guard/backends/kind.py): torch converts its module with ``.double()``
(not a ``.pt2`` program, which runs as exported); ONNX Runtime has no fp64 mode of a float32
model.

The fp64 copy loads lazily on the first disagreement and is kept; it runs on the mirror worker.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

import numpy as np

from guard.backends import Backend
from guard.backends.kind import Unsupported
from guard.config import ArbitrationConfig, BackendConfig
from guard.verify.tensor import TensorCheck


@dataclass
class Verdict:
    wrong: str  # "primary" | "reference" | "undetermined"
    primary_error: float = math.nan
    reference_error: float = math.nan
    multiplier: float = 2.0
    tolerance: float = 0.0
    reason: str = ""
    forgiven: bool = False

    def summary(self) -> str:
        if self.wrong == "undetermined":
            return f"undetermined ({self.reason})"
        return (f"{self.wrong} is wrong: primary error vs fp64 {self.primary_error:.3g}, "
                f"reference error {self.reference_error:.3g} (rule: primary <= "
                f"{self.multiplier:g} x reference + {self.tolerance:.3g})")

    def as_dict(self) -> dict:
        return asdict(self)


def fp64_unavailable_reason(spec: BackendConfig) -> str:
    """Why a reference on ``spec`` has no fp64 run at all ("" when its backend declares one)."""
    from guard.backends import backend_kind, backend_kinds

    if backend_kind(spec.backend).fp64 is None:
        able = ", ".join(name for name, kind in backend_kinds().items() if kind.fp64)
        return (f"no fp64 run for a reference on backend '{spec.backend}' "
                f"(only {able} models convert to fp64)")
    return ""


def _max_error(side: dict[str, np.ndarray], truth: dict[str, np.ndarray]) -> float:
    worst = 0.0
    for name, value in truth.items():
        if name not in side:
            continue
        a, t = np.asarray(side[name]), np.asarray(value)
        if a.shape != t.shape or not np.issubdtype(a.dtype, np.number):
            continue
        a64, t64 = a.astype(np.float64), t.astype(np.float64)
        both = np.isfinite(a64) & np.isfinite(t64)
        if both.any():
            worst = max(worst, float(np.max(np.abs(a64[both] - t64[both]))))
    return worst


class Fp64Arbiter:
    def __init__(self, spec: BackendConfig, config: ArbitrationConfig, atol: float):
        self.spec = spec
        self.config = config
        self.atol = atol
        self._model: Backend | None = None  # the fp64 run, loaded at the first judgement
        self._lock = threading.Lock()
        self._broken = fp64_unavailable_reason(spec)

    def _load(self) -> Backend:
        from guard.backends import backend_kind

        fp64 = backend_kind(self.spec.backend).fp64
        if fp64 is None:  # (fp64_unavailable_reason said so first)
            raise Unsupported(fp64_unavailable_reason(self.spec))
        model = fp64(self.spec)
        model.load()
        return model

    def judge(self, inputs, reference, primary, tensor: TensorCheck, adapters) -> Verdict:
        m, tol = self.config.multiplier, self.atol / 10.0
        if self._broken:
            return Verdict("undetermined", multiplier=m, tolerance=tol, reason=self._broken)
        try:
            with self._lock:
                if self._model is None:
                    self._model = self._load()
                truth = self._model.infer(inputs)
            truth = adapters.apply(truth) if adapters else truth
        except Unsupported as exc:  # the backend says why this block has no fp64 run
            self._broken = str(exc)
            return Verdict("undetermined", multiplier=m, tolerance=tol, reason=self._broken)
        except Exception as exc:  # a model that cannot run in fp64 says so once, then stops trying
            self._broken = f"fp64 run failed: {type(exc).__name__}: {exc}"
            return Verdict("undetermined", multiplier=m, tolerance=tol, reason=self._broken)
        p_err, r_err = _max_error(primary, truth), _max_error(reference, truth)
        primary_ok = p_err <= m * r_err + tol
        verdict = Verdict("reference" if primary_ok else "primary", p_err, r_err, m, tol)
        verdict.forgiven = primary_ok and self.config.forgive
        return verdict


def build_arbiter(model_config) -> Fp64Arbiter | None:
    """The arbiter for a model when ``checks.tensor.arbitration.enabled`` and it has a reference."""
    arb = model_config.checks.tensor.arbitration
    if not arb.enabled or model_config.reference is None:
        return None
    return Fp64Arbiter(model_config.reference, arb, model_config.checks.tensor.atol)
