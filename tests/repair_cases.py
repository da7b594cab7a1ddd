"""One selective-op-fallback case for the repair unit tests: a model block parsed as guard
would, its reference loaded, its buffered samples (all marked failing, as after a trip), the
model's own tier-1/3 checks and tier 2 as the sidecar builds it for a repair (capturing the
primary's stand-in where tier 2 cannot hook the primary itself)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from guard.backends import create_backend
from guard.config import RepairConfig, parse_config
from guard.policy.keep_back import keep_back_for
from guard.policy.repair import BufferedSample, OpRepair
from guard.verify.activation import ActivationChecker
from guard.verify.pipeline import Verifier


def repair_case(model: dict, folder: Path, input_name: str, rows: np.ndarray) -> dict:
    config = parse_config({"version": 1, "models": [model]}, folder).models[0]
    reference = create_backend(config.reference, "reference")
    reference.load()
    samples = [BufferedSample({input_name: rows[i:i + 1]}, True) for i in range(len(rows))]
    capture = keep_back_for(config.primary).capture_spec()
    return {"config": config, "reference": reference, "verifier": Verifier(config.checks),
            "samples": samples,
            "activation": ActivationChecker.for_model(config, primary_spec=capture)}


def make_repair(case: dict, **overrides) -> OpRepair:
    """An OpRepair on the case; ``config`` overrides RepairConfig fields, the rest OpRepair's."""
    config = RepairConfig(**overrides.pop("config", {}))
    return OpRepair(case["config"].primary, case["reference"],
                    lambda ref, out, inputs: case["verifier"].check(ref, out, inputs).passed,
                    config, activation=case["activation"], **overrides)


def failing(case: dict, backend) -> int:
    """Buffered samples on which ``backend`` fails the model's checks."""
    return sum(not case["verifier"].check(case["reference"].infer(s.inputs),
                                          backend.infer(s.inputs)).passed
               for s in case["samples"])
