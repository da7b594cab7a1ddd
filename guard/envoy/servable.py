"""Whether a config's models can be put behind Envoy at all, for the commands that print Envoy's
configuration ahead of time (``guard deploy envoy``, ``guard deploy istio``): Envoy forwards to
upstream servers only, so a model guard answers in its own process (``onnxruntime``,
``torch``...) has no place in a bootstrap. The same problems ``guard serve`` reports in Envoy
mode (guard/config/envoy.py ``check_envoy_mode``), for the models only, whatever the config's
own ``server.data_plane``."""

from __future__ import annotations

from guard.config import GuardConfig
from guard.config.envoy import check_envoy_mode
from guard.errors import GuardError


def require_servable(config: GuardConfig) -> None:
    """``GuardError`` listing every model problem that keeps ``config`` out of Envoy."""
    as_envoy = config.model_copy(update={
        "server": config.server.model_copy(update={"data_plane": "envoy"})})
    problems = [p for p in check_envoy_mode(as_envoy) if p.startswith("models")]
    if problems:
        raise GuardError("not servable through Envoy:\n  " + "\n  ".join(problems))
