"""Tier 2: activation alignment that localises drift (see checker.py)."""

from guard.verify.activation.checker import ActivationChecker, build_side
from guard.verify.activation.report import ActivationReport, LayerResult, Unaligned
from guard.verify.activation.torch_side import CaptureUnsupported

__all__ = ["ActivationChecker", "ActivationReport", "CaptureUnsupported", "LayerResult",
           "Unaligned", "build_side"]
