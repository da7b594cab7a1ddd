"""What one comparison returns: a :class:`GenerationCheck` (verdict, statistic, per-token
figures, the first divergent token) and why a completion was not compared."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import numpy as np


# The verifier's reasons a completion is not compared (the HTTP edge counts its own: n, echo,
# tools, reasoning, stateful, input, prompt_list, upstream_error, incomplete, endpoint).
NOT_COMPARABLE_CAUSES = (
    "unaligned",         # the primary's tokens cannot be aligned with the reference's
    "too_short",         # fewer completion tokens than checks.generation.min_tokens
    "sampling_unknown",  # a sampling field neither the request nor the declared defaults say
    "penalties",         # the server's penalties cannot be applied to these scores
    "no_distribution",   # a sampled completion without logprobs, a remote reference
    "constrained",       # no logprobs, and a grammar, schema, logit bias ... chose the tokens
    "sampler",           # no logprobs, and a sampler guard does not model (mirostat ...)
    "logprobs_mode",     # the primary's logprobs are not what options.logprobs_mode says
    "tools",             # a chat that offered tools, whose prompt the server did not tell
)


@dataclass(frozen=True)
class FirstDivergence:
    position: int
    text_before: str
    primary_token: str
    reference_top: tuple[tuple[str, float], ...]  # (token text, probability), best first
    record: int | None = None  # set by whoever numbers the samples (replay)
    # False where the server said its completion's text alone: ``primary_token`` is then the
    # reference's tokenization of that text there, not a token the server said it sampled
    # (guard/protocol/generation.py divergent_token_phrase words it so).
    split_known: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"record": self.record, "position": self.position,
                "text_before": self.text_before, "primary_token": self.primary_token,
                "reference_top": [[t, p] for t, p in self.reference_top],
                "split_known": self.split_known}


@dataclass
class GenerationCheck:
    """One completion's comparison. ``statistic`` is what a detector accumulates (None when
    the completion was not scored); the metric fields are NaN where the mode has none."""

    passed: bool
    mode: str  # logprobs | sampled | greedy | not_comparable | tokenization_mismatch
    reason: str = ""
    # Why a not_comparable completion was not scored, as a metric label
    # (guard_generation_not_comparable_total{reason}): one of NOT_COMPARABLE_CAUSES.
    cause: str = ""
    tokens: int = 0
    statistic: float | None = None
    mean_kld: float = math.nan
    kld_p99: float = math.nan
    # The lumped top-k figure (never above the full-vocabulary KLD) and llama-perplexity's
    # direction, KL(reference || primary), estimated alike (_topk_kld).
    mean_kld_lower_bound: float = math.nan
    mean_kld_reverse: float = math.nan
    kld_exact: bool = False
    top1_agreement: float = math.nan
    delta_p_rms: float = math.nan
    mean_delta_logprob: float = math.nan
    z: float = math.nan
    out_of_support: int = 0
    confident_positions: int = 0
    confident_disagreements: int = 0
    first_divergence: FirstDivergence | None = None
    findings: tuple[str, ...] = ()
    approximate: bool = False
    top1_compared: int = 0  # positions where both top-1s are known (top1_agreement's count)
    # Per completion token (what the replay report shades and plots): its text, the
    # reference's surprise at it (-log p, nats), the primary's logprob of it where it said,
    # the top-k KLD and delta p (logprobs mode).
    per_token_text: tuple[str, ...] = field(default=(), repr=False)
    per_token_surprise: np.ndarray | None = field(default=None, repr=False)
    per_token_primary_logprob: np.ndarray | None = field(default=None, repr=False)
    per_token_kld: np.ndarray | None = field(default=None, repr=False)
    per_token_kld_lower_bound: np.ndarray | None = field(default=None, repr=False)
    per_token_kld_reverse: np.ndarray | None = field(default=None, repr=False)
    per_token_delta_p: np.ndarray | None = field(default=None, repr=False)

    @property
    def comparable(self) -> bool:
        return self.statistic is not None

    @property
    def sampled_z(self) -> float | None:
        """The z of a completion checked in the sampled mode (its one figure: no KLD, no same
        top-1 there); None for any other."""
        return self.z if self.mode == "sampled" and not math.isnan(self.z) else None

    def summary(self) -> str:
        """One line: why it failed, or its mode's figure."""
        if not self.passed or self.mode == "tokenization_mismatch":
            return self.reason or self.mode
        if self.mode == "logprobs":
            return f"mean KLD {self.mean_kld:.3g} nats over {self.tokens} tokens"
        if self.mode == "greedy":
            return (f"{self.confident_disagreements} of {self.confident_positions} confident "
                    "positions off the reference's argmax")
        if self.mode == "sampled":
            return f"z {self.z:.2f} over {self.tokens} tokens"
        return f"{self.mode}: {self.reason}" if self.reason else self.mode

    def as_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if not k.startswith("per_token")}
        data["first_divergence"] = (None if self.first_divergence is None
                                    else self.first_divergence.as_dict())
        data["findings"] = list(self.findings)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in data.items()}

    def per_token_dict(self) -> dict[str, list | None]:
        """The per-token figures as JSON-able lists (6 significant digits; None: not known)."""
        def values(array: np.ndarray | None) -> list[float] | None:
            return None if array is None else [float(f"{v:.6g}") for v in array.tolist()]

        return {"text": list(self.per_token_text),
                "surprise": values(self.per_token_surprise),
                "primary_logprob": values(self.per_token_primary_logprob),
                "kld": values(self.per_token_kld), "delta_p": values(self.per_token_delta_p)}

    def details(self) -> dict[str, Any]:
        """What the capture record and the replay report keep of this check: ``as_dict()``
        and, for a scored completion, ``per_token`` (:meth:`per_token_dict`)."""
        data = self.as_dict()
        if self.per_token_text:
            data["per_token"] = self.per_token_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GenerationCheck":
        """The check :meth:`details` (or ``as_dict``) described; ValueError for what is not
        one (a record's details from another guard version)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
            raise ValueError("generation check: expected an object with a 'mode'")
        names = {f.name: f for f in fields(cls) if not f.name.startswith("per_token")}
        values: dict[str, Any] = {}
        for name, spec in names.items():
            if name not in data:
                continue
            value = data[name]
            if value is None and spec.type == "float":
                value = math.nan
            values[name] = value
        first = data.get("first_divergence")
        values["first_divergence"] = None if not first else FirstDivergence(
            int(first["position"]), str(first["text_before"]), str(first["primary_token"]),
            tuple((str(t), float(p)) for t, p in first.get("reference_top") or ()),
            first.get("record"), bool(first.get("split_known", True)))
        values["findings"] = tuple(data.get("findings") or ())
        per_token = data.get("per_token") or {}

        def array(key: str) -> np.ndarray | None:
            found = per_token.get(key)
            return None if found is None else np.asarray(found, dtype=np.float64)

        return cls(**values, per_token_text=tuple(per_token.get("text") or ()),
                   per_token_surprise=array("surprise"),
                   per_token_primary_logprob=array("primary_logprob"),
                   per_token_kld=array("kld"), per_token_delta_p=array("delta_p"))
