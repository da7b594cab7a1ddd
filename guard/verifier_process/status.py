"""The verifier's half of a model's admin status: route policy, windows, repair, mirror counts.

The serving process adds its half (the backends that answer, requests per route) and answers
``guard.v1.Admin/GetStatus`` with the merged message (guard/serve/admin.py).
"""

from __future__ import annotations

import json

from guard.observe.metrics import counts
from guard.v1 import admin_pb2 as pb


def model_status(model) -> pb.ModelStatus:
    """``model``: a guard.verifier_process.model.VerifiedModel."""
    policy = model.policy
    status = pb.ModelStatus(
        name=model.name, route=policy.route, override=policy.override,
        action=model.config.policy.action, probing=policy.probing,
    )
    status.tier_actions.update(model.config.policy.actions)
    for w in policy.windows():
        status.windows.add(tier=w.tier, samples=w.samples, failures=w.failures,
                           drift_ratio=w.ratio, window=model.config.policy.window,
                           min_samples=model.config.policy.min_samples,
                           since_unix_time=policy.windows_since)
    last = policy.last_transition
    if last is not None:
        status.has_last_transition = True
        status.last_transition.CopyFrom(pb.Transition(
            from_route=last.from_route, to_route=last.to_route, trigger=last.trigger,
            reason=last.reason, unix_time=last.unix_time))
    reference = model.backends.get("reference")
    if reference is not None:
        info = reference.describe()
        status.backends.add(role="reference", backend=info.backend, precision=info.precision,
                            device=info.device, artifact=info.artifact)
    if model.pair is not None:
        status.outputs_matched.update(model.pair.output_match.renamed)
    if model.ops is not None:
        status.ops_kept_back.extend(model.ops.kept)
        status.repairing = model.ops.repairing
    status.mirror.update(counts(model.metrics.mirror, model.name, "outcome"))
    window = getattr(model, "window", None)  # a generation model's KLD window
    if window is not None:
        figures = window.figures()
        status.has_generation = True
        status.generation.CopyFrom(pb.GenerationWindow(
            completions=figures["completions"], window=figures["window"],
            mean_kld=figures["mean_kld"], kld_p99=figures["kld_p99"],
            top1_agreement=figures["top1_agreement"], not_comparable=figures["not_comparable"],
            sampled_completions=figures["sampled_completions"], z_pooled=figures["z_pooled"],
            last_divergence_json=json.dumps(window.last_divergence, ensure_ascii=False)
            if window.last_divergence else ""))
    return status
