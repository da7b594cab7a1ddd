"""Tier 2: activation alignment that localises drift (see checker.py)."""

from guard.verify.activation.checker import ActivationChecker, build_side
from guard.verify.activation.report import ActivationReport, LayerResult, Unaligned
from guard.verify.activation.tier import ActivationTier, build_tier
from guard.backends.activations.torch import CaptureUnsupported

__all__ = ["ActivationChecker", "ActivationReport", "ActivationTier", "CaptureUnsupported",
           "LayerResult", "Unaligned", "build_side", "build_tier"]
