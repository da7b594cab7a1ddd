"""Many compared completions summed up: the report's figures (``summarize``: KLD, same top-1,
pass counts, perplexities), by position, and the flagged completions of a replay
(:class:`GenerationFigures`)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from guard.verify.generation.verdict import GenerationCheck


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _joined(arrays) -> np.ndarray:
    arrays = [a for a in arrays if a is not None]
    return np.concatenate(arrays) if arrays else np.zeros(0)


def perplexities(checks: Sequence[GenerationCheck]) -> dict[str, float | None]:
    """llama-perplexity's PPL figures over the completions' tokens where the primary said its
    logprob: ``PPL(Q) = exp(mean(-log p_primary))``, ``PPL(base) = exp(mean(-log
    p_reference))`` over the same tokens, and their ratio. Mind what the tokens are: the
    primary's own completion (llama-perplexity scores a fixed text), so a drifting primary
    shows as a ratio below 1: the reference finds the text less likely than the primary that
    wrote it did. Agreeing models give about 1."""
    primary, reference = [], []
    for c in checks:
        if c.per_token_primary_logprob is not None and c.per_token_surprise is not None and \
                len(c.per_token_primary_logprob) == len(c.per_token_surprise):
            primary.append(-c.per_token_primary_logprob)
            reference.append(c.per_token_surprise)
    nll_primary, nll_reference = _joined(primary), _joined(reference)
    if not nll_primary.size:
        return {"ppl_primary": None, "ppl_reference": None, "ppl_ratio": None,
                "ppl_tokens": 0}
    return {"ppl_primary": float(np.exp(nll_primary.mean())),
            "ppl_reference": float(np.exp(nll_reference.mean())),
            "ppl_ratio": float(np.exp(nll_primary.mean() - nll_reference.mean())),
            "ppl_tokens": int(nll_primary.size)}


def pooled_z(zs: Sequence[float]) -> float:
    """Completions' z pooled: their sum over the square root of their number, about N(0, 1)
    while the primary samples the reference's distribution (NaN for none)."""
    return float(np.sum(zs) / math.sqrt(len(zs))) if len(zs) else math.nan


def summarize(checks: Sequence[GenerationCheck], records: Sequence[int] | None = None
              ) -> dict[str, Any]:
    """The report's ``tiers.generation`` block over many completions (CONTRACT.md): checks
    and passes counted over the completions with a verdict (scored, or failed on a
    tokenization mismatch; the not comparable ones are counted apart), KLD and Δp over every
    token (not a mean of means), and the first divergence of the first completion that had
    one (``records`` numbers the completions; their positions in ``checks`` otherwise).
    Beside the contract's fields, llama-perplexity's summary: KLD p99.9, median and maximum,
    mean Δp, and the perplexities (:func:`perplexities`); and the sampled completions' z
    (mean, standard deviation, pooled: the sum over the square root of their number; 0, 1
    and about N(0, 1) when the primary samples the reference's distribution)."""
    scored = [c for c in checks if c.comparable]
    counted = [c for c in checks if c.comparable or c.mode == "tokenization_mismatch"]
    kld = _joined(c.per_token_kld for c in scored)
    delta = _joined(c.per_token_delta_p for c in scored)
    bound = _joined(c.per_token_kld_lower_bound for c in scored)
    reverse = _joined(c.per_token_kld_reverse for c in scored)
    compared = sum(c.top1_compared for c in scored)
    agreeing = sum(c.top1_agreement * c.top1_compared for c in scored if c.top1_compared)
    # The sampled mode's figure (no KLD there, and no same top-1): each completion's z is
    # about N(0, 1) when the primary samples the reference's distribution.
    zs = [z for z in (c.sampled_z for c in scored) if z is not None]
    first = None
    for index, check in enumerate(checks):
        if check.first_divergence is not None:
            record = records[index] if records is not None else index
            first = replace(check.first_divergence, record=record).as_dict()
            break
    return {
        "checks": len(counted), "passed": sum(c.passed for c in counted),
        "not_comparable": sum(c.mode == "not_comparable" for c in checks),
        # why, by cause (the metric's reason label): what a user fixes first
        "not_comparable_reasons": dict(sorted(Counter(
            c.cause for c in checks if c.mode == "not_comparable").items())),
        "tokenization_mismatches": sum(c.mode == "tokenization_mismatch" for c in checks),
        # completions with each finding (the prompt's, and tokenization_mismatch)
        "findings": {name: sum(name in c.findings for c in checks)
                     for name in sorted({f for c in checks for f in c.findings})},
        "modes": {mode: sum(c.mode == mode for c in checks)
                  for mode in sorted({c.mode for c in checks})},
        "tokens": sum(c.tokens for c in scored),
        "mean_kld": float(kld.mean()) if kld.size else None,
        "kld_p99": _percentile(kld, 99),
        "kld_p999": _percentile(kld, 99.9),
        "kld_median": _percentile(kld, 50),
        "kld_max": float(kld.max()) if kld.size else None,
        "kld_tokens": int(kld.size),
        "mean_kld_lower_bound": float(bound.mean()) if bound.size else None,
        "mean_kld_reverse": float(reverse.mean()) if reverse.size else None,
        "top1_agreement": agreeing / compared if compared else None,
        "delta_p_rms": float(np.sqrt(np.mean(delta ** 2))) if delta.size else None,
        "delta_p_mean": float(delta.mean()) if delta.size else None,
        "z_completions": len(zs),
        "z_mean": float(np.mean(zs)) if zs else None,
        "z_sd": float(np.std(zs)) if len(zs) > 1 else None,
        "z_pooled": pooled_z(zs) if zs else None,
        **perplexities(scored),
        "first_divergence": first,
    }


def by_position(checks: Sequence[GenerationCheck]) -> dict[str, list]:
    """Per completion position (0 = the first generated token), over the scored completions
    long enough to have it: how many, the mean and the largest KLD (logprobs mode), the mean
    surprise of the reference at the primary's token (every scored mode)."""
    # (surprise, kld) per scored completion; kld only in logprobs mode
    scored = [(c.per_token_surprise, c.per_token_kld) for c in checks
              if c.comparable and c.per_token_surprise is not None]
    length = max((len(surprise) for surprise, _ in scored), default=0)
    out: dict[str, list] = {"completions": [], "kld_mean": [], "kld_max": [],
                            "surprise_mean": []}
    for t in range(length):
        surprise = [s[t] for s, _ in scored if len(s) > t]
        kld = [k[t] for _, k in scored if k is not None and len(k) > t]
        out["completions"].append(len(surprise))
        out["surprise_mean"].append(float(np.mean(surprise)))
        out["kld_mean"].append(float(np.mean(kld)) if kld else None)
        out["kld_max"].append(float(np.max(kld)) if kld else None)
    return out


# The failing completions the replay report shows token by token (the rest are counted).
MAX_FLAGGED = 10


class GenerationFigures:
    """The replay report's ``tiers.generation`` figures of one model (the kind's ``figures``):
    each record's tier report (``details``: :meth:`GenerationCheck.details`) and where it came
    from are added in record order; ``as_dict`` is :func:`summarize` over them, KLD by
    position (:func:`by_position`) and the first ``MAX_FLAGGED`` failing completions with
    their tokens (``flagged``; ``flagged_total`` counts them all)."""

    def __init__(self):
        self.checks: list[GenerationCheck] = []
        self.records: list[int] = []
        self.flagged: list[dict[str, Any]] = []
        self.flagged_total = 0

    def add(self, report, where: Mapping[str, Any] | None = None) -> None:
        check = GenerationCheck.from_dict(report.details)
        record = int(where["index"]) if where else len(self.records)
        if not check.passed:
            self.flagged_total += 1
            if len(self.flagged) < MAX_FLAGGED:
                self.flagged.append(_flagged(record, check, report.details, where or {}))
        self.checks.append(replace(check, per_token_text=()))  # texts: the flagged ones only
        self.records.append(record)

    def as_dict(self) -> dict[str, Any]:
        out = summarize(self.checks, self.records)
        out["by_position"] = by_position(self.checks)
        out["flagged"] = self.flagged
        out["flagged_total"] = self.flagged_total
        return out


def _flagged(record: int, check: GenerationCheck, details: Mapping[str, Any],
             where: Mapping[str, Any]) -> dict[str, Any]:
    first = check.first_divergence
    return {"record": record, "request_id": where.get("request_id", ""),
            "source": where.get("source", ""), "prompt": details.get("prompt"),
            "mode": check.mode, "reason": check.reason, "tokens": check.tokens,
            "statistic": check.statistic,
            "mean_kld": None if math.isnan(check.mean_kld) else check.mean_kld,
            "per_token": check.per_token_dict() if check.per_token_text else None,
            "first_divergence": None if first is None else replace(first, record=record)
            .as_dict()}


def by_cause(counts: Mapping[str, int] | None) -> str:
    """Not-comparable counts as the report and a replay's verdict say them:
    "logprobs_mode 3, tools 1" ("" for none)."""
    return ", ".join(f"{cause} {count}" for cause, count in (counts or {}).items())
