"""``guard localise``: tier 2 on one input, offline: which layer of a model's primary diverges
from its reference, as the verifier's tier 2 would say it.

- A generation model: ``--prompt TEXT`` (the prompt, with a completion after it if wanted),
  tokenized as llama.cpp tokenizes the GGUF the upstream serves
  (``checks.activation.primary_gguf``); llama.cpp runs that file in-process with its eval
  callback, the transformers reference is hooked on a copy (docs/tier2.md#gguf).
- A tensor model: ``--inputs FILE.npz`` (one array per input name, the first axis the batch).

The capture sides are built from the config as the verifier builds them (the model's
``checks.activation`` keys, whether or not the block turns tier 2 on), nothing served is asked.
Exit 0 when no layer diverges, 1 when one does (or tier 2 cannot decide while tier 1's budget is
broken), 2 on a usage error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from guard.errors import GuardError

EXIT_OK, EXIT_DIVERGES = 0, 1


def _model(config, name: str | None):
    if name is None:
        if len(config.models) != 1:
            raise GuardError("--model: the config has several models: "
                             f"{', '.join(m.name for m in config.models)}")
        return config.models[0]
    for model in config.models:
        if model.name == name:
            return model
    raise GuardError(f"--model: no model '{name}' in the config "
                     f"({', '.join(m.name for m in config.models)})")


def _inputs(model, checker, prompt: str | None, npz: str | None) -> dict[str, np.ndarray]:
    if model.task == "generation":
        if prompt is None or npz is not None:
            raise GuardError(f"model '{model.name}' is a generation model: give --prompt TEXT")
        return {"input_ids": np.asarray([checker.primary.tokenize(prompt)], dtype=np.int64)}
    if npz is None or prompt is not None:
        raise GuardError(f"model '{model.name}' takes tensors: give --inputs FILE.npz")
    return _tensor_inputs(model, Path(npz))


def _tensor_inputs(model, path: Path) -> dict[str, np.ndarray]:
    """The ``.npz``'s arrays, checked against the primary's inputs as replay checks them
    (names, datatypes, shapes: a file that does not fit is one line naming the array, never a
    capture side's own error after a report that says nothing diverged). A model whose inputs
    take a batch axis gets the arrays whole (one batch); one that takes single samples gets
    the file's one sample."""
    from guard.backends import create_backend
    from guard.backends.loading import load_all
    from guard.replay.source import NpzInput

    primary = create_backend(model.primary, "primary")
    try:
        load_all(model.name, model, {"primary": primary})
        npz = NpzInput(path, model.name, primary.describe().inputs)
    finally:
        primary.close()
    if npz.batched:
        return npz.arrays
    if npz.count != 1:
        raise GuardError(f"{path}: model '{model.name}' takes one sample per input (no batch "
                         f"axis); the file holds {npz.count}: give it one")
    return npz.sample(0)


def localise(config_path: str | Path, model_name: str | None = None, prompt: str | None = None,
             npz: str | None = None, as_json: bool = False, out=None) -> int:
    """The command: load, check once, print; the exit code."""
    from guard.plan.complete import load_config
    from guard.verify.activation import ActivationChecker, CaptureUnsupported

    out = out or sys.stdout
    model = _model(load_config(config_path), model_name)
    if model.reference is None:
        raise GuardError(f"model '{model.name}' has no reference to compare with")
    if model.task == "generation" and model.checks.activation.primary_gguf is None:
        raise GuardError(f"model '{model.name}': set checks.activation.primary_gguf to the "
                         "GGUF its upstream serves (tier 2 runs that file with llama.cpp)")
    try:
        checker = ActivationChecker.for_model(model, model.mirror.threads)
    except CaptureUnsupported as exc:
        raise GuardError(str(exc)) from None
    try:
        report = checker.check(_inputs(model, checker, prompt, npz))
    finally:
        checker.close()
    if as_json:
        json.dump({"model": model.name, **report.as_dict()}, out, indent=1, default=str)
        out.write("\n")
    elif not report.error:  # (a capture that failed has no layers to describe)
        out.write(describe(model.name, report))
    if report.error:
        raise GuardError(f"model '{model.name}': {report.error}")
    return EXIT_OK if report.passed else EXIT_DIVERGES


def describe(name: str, report) -> str:
    """The report as an operator reads it: the pair, the first divergence and its basis, why
    none where none is named, the suspects."""
    lines = [f"{name}: {report.pair}, {len(report.layers)} layer(s) aligned, "
             f"{len(report.unaligned)} unaligned, {report.seconds:.1f} s"]
    first = report.first_divergence
    if first is not None:
        peers = (f"; peers {first.peer_group}, median {first.peer_level:.3g}"
                 if first.peer_group else "")
        lines.append(f"first divergence: {first.name} ({first.op}): isolated error "
                     f"{first.isolated.rel_error:.3g}, allowance {first.allowance:.3g}{peers}")
        lines.append(f"  basis: {report.basis}")
    else:
        lines.append("first divergence: none" + (f" ({report.undetermined})"
                                                 if report.undetermined else ""))
    for rank, layer in enumerate(report.suspects, 1):
        lines.append(f"  suspect {rank}: {layer.name}  isolated {layer.isolated.rel_error:.3g}"
                     f"  allowance {layer.allowance:.3g}  propagated "
                     f"{layer.propagated.rel_error:.3g}")
    return "\n".join(lines) + "\n"
