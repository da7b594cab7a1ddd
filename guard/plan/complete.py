"""A config held against everything declared above config/: the backends (``serving``), then
the checks' own registries: the adapters (guard/verify/adapters.py), the pairs tier 2 can
capture (from what the backends declare they capture, ``BackendKind.activations``), what the
op repair can rebuild (guard/policy/keep_back.py) and the tiers ``policy.actions`` may name
(guard/verify/tiers.py).

What `guard config validate`, the verifier process, replay and the matrix load. A serving
process does not: it runs no check (guard/plan/serving.py), so it imports none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from guard.config import AdapterConfig, ConfigContext, GuardConfig, ModelConfig
from guard.plan import serving
from guard.plan.serving import Check, check_backends


def check_checks(config: GuardConfig) -> list[str]:
    """Each model's adapters, tier 2 and the repair against their registries."""
    problems = []
    for i, model in enumerate(config.models):
        where = f"models[{i}]"
        problems += adapter_problems(model.adapters, where)
        for check in (_repair, _activation, _tier_actions):
            try:
                check(model)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
    return problems


CHECKS: tuple[Check, ...] = (check_backends, check_checks)


def adapter_problems(adapters: list[AdapterConfig], where: str) -> list[str]:
    """``adapters`` (a model's, a matrix model's) against the adapters' registry."""
    from guard.verify.adapters import ADAPTERS, validate_adapter_options

    problems = []
    for j, adapter in enumerate(adapters):
        if adapter.name not in ADAPTERS:
            problems.append(f"{where}.adapters[{j}]: unknown adapter '{adapter.name}' "
                            f"(available: {', '.join(sorted(ADAPTERS))})")
            continue
        found = validate_adapter_options(adapter.name, adapter.options)
        if found:
            problems.append(f"{where}.adapters[{j}]: {'; '.join(found)}")
    return problems


def repairable_kinds() -> str:
    """'onnxruntime precision int8 or fp16 (nodes_to_exclude), ...' from the repair's
    strategies."""
    from guard.policy.keep_back import STRATEGIES

    parts = []
    for name, by_precision in sorted(STRATEGIES.items()):
        precisions = sorted(by_precision, key=["int8", "fp32", "fp16", "bf16"].index)
        option = by_precision[precisions[0]].option
        parts.append(f"{name} precision {' or '.join(precisions)} ({option})")
    return ", ".join(parts)


def _repair(model: ModelConfig) -> None:
    if not model.policy.uses("fallback_ops") or model.reference is None:
        return
    from guard.backends.activations import capturable
    from guard.policy.keep_back import repairable

    primary = model.primary
    if primary.precision not in repairable().get(primary.backend, ()):
        raise ValueError(
            "policy.action 'fallback_ops' rebuilds the primary with ops kept back, which it "
            f"can for {repairable_kinds()}; this primary is {primary.backend} "
            f"{primary.precision} (primary.backend, primary.precision)")
    if model.reference.backend not in capturable():
        raise ValueError(
            "policy.action 'fallback_ops' finds the ops with tier 2, which cannot capture "
            f"reference.backend '{model.reference.backend}'")


def _tier_actions(model: ModelConfig) -> None:
    """``policy.actions`` keys: registered tiers whose failures feed the detectors (a tier that
    is evidence only, tier 2, never trips anything)."""
    from guard.verify.tiers import tier_kind, tier_names

    for tier in model.policy.actions:
        if tier not in tier_names():
            raise ValueError(f"policy.actions.{tier}: unknown tier (registered: "
                             f"{', '.join(tier_names())})")
        if not tier_kind(tier).detector:
            deciding = [t for t in tier_names() if tier_kind(t).detector]
            raise ValueError(f"policy.actions.{tier}: the {tier} tier is evidence only, its "
                             "failures feed no detector and trip nothing (tiers that do: "
                             f"{', '.join(deciding)})")


def _activation(model: ModelConfig) -> None:
    if not model.checks.activation.enabled or model.reference is None:
        return
    from guard.backends import backend_kind
    from guard.backends.activations import capturable

    # What tier 2 captures: a generation model's primary is the GGUF its upstream serves.
    blocks = {"primary": model.activation_primary(), "reference": model.reference}
    for role, other in (("primary", "reference"), ("reference", "primary")):
        backend = blocks[role].backend
        beside = blocks[other].backend
        kind = backend_kind(backend)
        if kind.activations_beside is not None and beside not in kind.activations_beside:
            why = f": {kind.beside_why}" if kind.beside_why else ""
            raise ValueError(
                f"checks.activation: tier 2 cannot capture the intermediate tensors of {role} "
                f"backend '{backend}' beside {other} backend '{beside}' (it aligns beside "
                f"{' or '.join(sorted(kind.activations_beside))} only{why}); set sample_rate: 0 "
                "and on_failure: false for this model")
        if not kind.activations:
            why = f": {kind.no_activations}" if kind.no_activations else ""
            raise ValueError(
                f"checks.activation: tier 2 cannot capture the intermediate tensors of {role} "
                f"backend '{backend}'{why} (it can: {', '.join(sorted(capturable()))}); set "
                "sample_rate: 0 and on_failure: false for this model")


def parse_config(data: Any, base_dir: Path | ConfigContext,
                 source: str | None = None) -> GuardConfig:
    """A parsed YAML document validated and planned against every declaration."""
    return serving.parse_config(data, base_dir, source, CHECKS)


def load_config(path: str | Path) -> GuardConfig:
    """A config file read, validated and planned against every declaration."""
    return serving.load_config(path, CHECKS)


def require_checks(config: GuardConfig, source: str | None = None) -> GuardConfig:
    """``config`` (already planned for serving, e.g. come over the wire) once the checks'
    registries hold it too; ``ConfigError`` otherwise (the verifier process at load)."""
    return serving.planned(config, [], source, (check_checks,))


def notes(config: GuardConfig) -> list[str]:
    """What a valid config will do that its author may not expect, one line each (`guard
    config validate` prints them; the verifier says the same at start-up, as events): a
    generation model whose server's sampling defaults are not declared leaves some sampled
    calls uncompared."""
    from guard.verify.generation import UNDECLARED_ADVICE, undeclared_sampling

    out = []
    for i, model in enumerate(config.models):
        if model.task != "generation" or model.reference is None:
            continue  # (unsampled: nothing goes uncompared)
        unknown = undeclared_sampling(model.primary.options)
        if unknown is not None:
            engine = model.primary.options.get("engine", "unknown")
            out.append(f"models[{i}] ({model.name}): engine {engine}'s {unknown} is not "
                       f"declared: {UNDECLARED_ADVICE}")
        if model.primary.options.get("logprobs_mode") == "processed_logprobs" and \
                model.reference.backend == "openai":
            out.append(f"models[{i}] ({model.name}): primary.options.logprobs_mode "
                       "processed_logprobs with an openai reference: a sampled call's logprobs "
                       "after the transform are compared with the reference's distribution "
                       "under it, which needs a local reference's whole vocabulary "
                       "(transformers, llama_cpp); with a remote one they are not comparable "
                       "(guard_generation_not_comparable_total{reason=\"no_distribution\"})")
    return out
