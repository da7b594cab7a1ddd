"""Which layer diverges: each layer's *isolated* error against what it would be without a fault.

A fixed share (``||primary - ref|| / ||ref|| > 0.05``) misses faults that break tier 1 with a
smaller per-layer error, and blames the layer after a fault once the error it was fed has grown.
Here a layer is judged on the error it adds itself (its primary computation fed the reference's
own inputs), against its own allowance:

    allowance = budget + multiplier * noise

- ``budget``: the relative error tier 1 allows at the output, ``allowed / max|ref|`` (``atol +
  rtol * max|ref| + floor`` over the output's scale), the smallest over outputs. A layer that adds
  more error than the whole output may carry is divergent whatever follows it.
- ``noise``: the reference's own relative error on that layer against itself (batch 1 vs
  batched, thread counts; ``guard.verify.noise.layer_noise``), times the tier-1 floor multiplier.

The first divergence is the first layer, in network order, whose isolated error exceeds its
allowance. When tier 1 failed and no layer alone exceeds its allowance (several small errors that
add up, or a fault whose effect grows downstream), the first divergence is the layer with the
largest isolated error relative to its allowance, up to the first layer whose propagated error
crosses the budget (where the drift becomes visible): ``basis`` says which rule named it. When
none can be named, ``undetermined`` says exactly why (nothing aligned, nothing isolated, no layer
adds error: the drift arises where there is no counterpart). A layer whose alignment is unsure
(align.py: a neighbour without a scope of its own may be computed in its counterpart) is never
named: the rule that would name it says so in ``undetermined``, and a layer over its allowance
still fails the check (``unsure_divergence``).

Within the budget (tier 1 passed, or its verdict is unknown, and no layer exceeds its
allowance): a fault can be real and still small enough for the output to stay inside what the
deployment allows (a 0.1% weight perturbation). The first layer, in network order, whose
isolated error is *measurable*, i.e. beyond

    measurable = max(MEASURABLE_NOISE_FACTOR * noise, MEASURABLE_FLOOR)

is then named as the first measurable divergence (``basis`` BASIS_NOISE, the report's
``within_budget`` true). It is information, not a failure: the layer is not ``divergent``, the
report still ``passed``, and metrics, events and route decisions stay driven by the budget.
``MEASURABLE_FLOOR`` (1e-5, ~84 fp32 ulps relative) sits between what clean fp32 pairs show
and what the smallest seeded fault adds (benchmarks/results/localisation.md gives both and the
margins): on the corpus's clean fp32 pairs (the same file twice, torch vs its export, the
detector's tie-broken NMS, ONNX Runtime at other batch sizes and thread counts) isolated errors
are 0 or at the reference's own noise (~1e-7), while the 0.1% perturbations add 5e-4 or more.
The rule applies only when both sides compute in fp32: a reduced-precision primary (int8, fp16,
bf16) changes every layer it runs measurably by design, so within the budget it names none and
``within_budget_note`` says so; its suspects are still ranked. A fixed ``rel_error`` turns the
rule off too (the user's threshold decides). Clean pairs name none.

Against its peers (an alignment that gives them: a quantized GGUF, gguf_align.py): every matmul
of such a model adds error by design, and how much is known only from the model itself. A layer
with enough peers (at least ``MIN_PEERS`` layers of its group with an isolated figure: the same
module in every block, else every module of its class) gets

    allowance = max(budget + multiplier * noise, PEER_FACTOR * median isolated error of its peers)

so that a layer diverges where its own error stands out from theirs (``basis`` BASIS_PEERS). On
SmolLM2-135M's Q4_1 against its fp32 reference the projections' isolated errors are 0.3-3%, the
largest 1.7x its group's median (2.3x: the F16 file's lm_head against every Linear); a
``blk.3.ffn_down`` requantized to Q2_K adds 28%, 35x (docs/tier2.md). When tier 1 failed and
no layer stands out, none is named: an error that every layer adds alike, or that only
accumulates, is the model's, not one layer's (``undetermined`` says so); nor is a layer named
within the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from guard.verify.activation.report import ActivationReport, LayerResult

BASIS_EXCEEDS = "isolated error exceeds its allowance"
BASIS_LARGEST = ("largest isolated error relative to its allowance up to where the propagated "
                 "error crosses the budget (no layer alone exceeds its allowance)")
BASIS_FIXED = "isolated error exceeds the fixed rel_error"
BASIS_NOISE = ("isolated error within its allowance but beyond the reference's own noise: the "
               "first measurable divergence, the output within tier 1's budget")

BASIS_PEERS = ("isolated error stands out from its peers' (over PEER_FACTOR x the median "
               "isolated error of the same module in the other blocks)")
# A layer's own error against its peers': clean quantized projections reach 2.3x their group's
# median on the corpus, one requantized tensor 35x (see above). At least MIN_PEERS of them make a
# median worth judging by.
PEER_FACTOR = 4.0
MIN_PEERS = 4

# What an fp32 layer may add and still count as computing what the reference computes.
MEASURABLE_FLOOR = 1e-5
MEASURABLE_NOISE_FACTOR = 10.0


def measurable_threshold(noise: float) -> float:
    """The isolated error beyond which a layer differs measurably from the reference."""
    return max(MEASURABLE_NOISE_FACTOR * noise, MEASURABLE_FLOOR)


@dataclass
class Budget:
    """The relative error tier 1 allows at the output, and whether tier 1 failed."""

    relative: float
    source: str
    tier1_failed: bool | None = None  # None: not known (tier 2 called on its own)

    def as_dict(self) -> dict:
        return {"relative": _round(self.relative), "source": self.source,
                "tier1_failed": self.tier1_failed}


def _round(value: float) -> float:
    return value if not math.isfinite(value) else float(f"{value:.6g}")


def budget_from_tier1(tier1) -> Budget | None:
    """From a tier-1 ``TensorCheck``: the smallest ``allowed / max|ref|`` over its outputs."""
    shares = [o.allowed / o.ref_max_abs for o in getattr(tier1, "outputs", [])
              if o.ref_max_abs > 0 and math.isfinite(o.ref_max_abs) and o.allowed > 0]
    if not shares:
        return None
    return Budget(min(shares), "tier 1 (allowed / max|ref| at the output)", not tier1.passed)


def budget_from_outputs(pairs: list[tuple[str, np.ndarray, np.ndarray]], atol: float,
                        rtol: float, per_output: dict[str, tuple[float, float]]) -> Budget | None:
    """Tier 1's rule applied by tier 2 itself to the aligned graph outputs (name, ref, prim):
    for a check called without a tier-1 result (a repair, a benchmark)."""
    shares, failed = [], False
    for name, ref, prim in pairs:
        r = np.asarray(ref, dtype=np.float64)
        p = np.asarray(prim, dtype=np.float64)
        if r.shape != p.shape or not r.size:
            failed = True
            continue
        a, o = per_output.get(name, (atol, rtol))
        finite = np.isfinite(r)
        scale = float(np.abs(r[finite]).max()) if finite.any() else 0.0
        allowed = a + o * scale
        with np.errstate(invalid="ignore"):
            diff = np.abs(p - r)
        bad = ~np.isfinite(diff) & ~((np.isnan(p) & np.isnan(r)) | (p == r))
        if bad.any() or float(np.nanmax(np.where(np.isfinite(diff), diff, 0.0))) > allowed:
            failed = True
        if scale > 0 and allowed > 0:
            shares.append(allowed / scale)
    if not shares:
        return None
    return Budget(min(shares), "tier 1's tolerances applied to the aligned outputs", failed)


def decide(report: ActivationReport, budget: Budget, noise: dict[str, float],
           keys: dict[str, str], multiplier: float, fixed: float | None = None,
           precision: str = "fp32", peers: dict[str, tuple[str, ...]] | None = None) -> None:
    """Set each layer's allowance and ``divergent`` flag, and the report's first divergence
    (``basis``) or why there is none (``undetermined``). ``keys``: layer value -> the
    reference's noise key; ``precision``: what the pair computes in (``fp32`` when both
    sides do, else the reduced one); ``peers``: layer value -> its peer groups (judged
    against them, see above)."""
    report.budget = budget
    report.threshold = fixed if fixed is not None else budget.relative
    levels = peer_levels(report.layers, peers) if peers and fixed is None else {}
    for layer in report.layers:
        layer.noise = noise.get(keys.get(layer.value, layer.value), 0.0)
        layer.allowance = fixed if fixed is not None else budget.relative + multiplier * layer.noise
        if layer.value in levels:
            layer.peer_level, layer.peer_group = levels[layer.value]
            layer.allowance = max(layer.allowance, PEER_FACTOR * layer.peer_level)
        layer.divergent = (layer.isolated is not None
                           and layer.isolated.rel_error > layer.allowance)
    first = next((layer for layer in report.layers if layer.divergent), None)
    if first is not None:
        report.basis = (BASIS_FIXED if fixed is not None else
                        BASIS_PEERS if first.peer_group else BASIS_EXCEEDS)
        report.first = first
    elif peers and fixed is None:
        if budget.tier1_failed:
            report.undetermined = _spread(report)
    elif budget.tier1_failed:
        report.undetermined = _fallback(report, budget)
    elif fixed is None:
        _first_measurable(report, precision)
    _withhold_unsure(report)


def peer_levels(layers: list[LayerResult], peers: dict[str, tuple[str, ...]]
                ) -> dict[str, tuple[float, str]]:
    """Per layer value: the median isolated error of its first group with at least MIN_PEERS
    isolated members, and that group."""
    errors: dict[str, list[float]] = {}
    for layer in layers:
        if layer.isolated is not None and math.isfinite(layer.isolated.rel_error):
            for group in peers.get(layer.value, ()):
                errors.setdefault(group, []).append(layer.isolated.rel_error)
    out: dict[str, tuple[float, str]] = {}
    for layer in layers:
        for group in peers.get(layer.value, ()):
            if len(errors.get(group, ())) >= MIN_PEERS:
                out[layer.value] = (float(np.median(errors[group])), group)
                break
    return out


def _spread(report: ActivationReport) -> str:
    """Tier 1 failed, judged against peers, and no layer stands out: why none is named."""
    if not report.layers:
        return "no layer was captured on both sides"
    largest = max(report.layers, key=lambda layer: layer.ratio)
    if largest.isolated is None:
        return "no layer could be run in isolation (see isolation notes)"
    return ("no layer's isolated error stands out from its peers' (the largest, "
            f"{largest.name}, is {largest.ratio:.2g}x its allowance): the error is spread over "
            "the model's layers or accumulates along them, not one layer's")


def _withhold_unsure(report: ActivationReport) -> None:
    """A layer whose alignment is unsure (its counterpart may hold a neighbour's computation
    too) is never named: the report says undetermined, and why."""
    first = report.first
    if first is None or not first.unsure:
        return
    report.undetermined = (f"the first divergence would be {first.name} ({report.basis}), but "
                           f"its alignment is unsure: {first.unsure}")
    report.unsure_divergence = first.divergent
    report.first = None
    report.basis = ""
    report.within_budget = False


def _first_measurable(report: ActivationReport, precision: str) -> None:
    """Within the budget: the first layer whose isolated error is beyond the reference's own
    noise (fp32 pairs only), named with ``within_budget``; never a failure."""
    above: list[tuple[LayerResult, float]] = []  # (layer, its isolated error)
    for layer in report.layers:
        layer.measurable = measurable = measurable_threshold(layer.noise)
        if layer.isolated is not None and layer.isolated.rel_error > measurable:
            above.append((layer, layer.isolated.rel_error))
    if not above:
        return
    if precision != "fp32":
        largest = max(error for _, error in above)
        report.within_budget_note = (
            f"the pair computes in {precision}: {len(above)} layer(s) differ measurably (isolated "
            f"error up to {largest:.3g}), as that precision does by design; within tier 1's "
            "budget none is named (see suspects)")
        return
    report.first = above[0][0]
    report.basis = BASIS_NOISE
    report.within_budget = True


def _fallback(report: ActivationReport, budget: Budget) -> str:
    """Tier 1 failed and no layer alone exceeds its allowance: name the largest contributor
    up to where the drift crosses the budget, or say why no layer can be named."""
    if not report.layers:
        return (f"no layer has a counterpart on the other side ({len(report.unaligned)} "
                "unaligned; see unaligned)" if report.unaligned else
                "no layer was captured on both sides")
    crossing = next((i for i, layer in enumerate(report.layers)
                     if layer.propagated.rel_error > budget.relative), len(report.layers) - 1)
    window = [(layer, layer.isolated) for layer in report.layers[: crossing + 1]
              if layer.isolated is not None]
    if not window:
        notes = sorted({layer.isolation_note for layer in report.layers[: crossing + 1]
                        if layer.isolation_note})
        return ("no layer up to where the error crosses the budget "
                f"({report.layers[crossing].name}) could be run in isolation: "
                + ("; ".join(notes) or "no isolated figures"))
    best, isolated = max(window, key=lambda item: item[0].ratio)
    if isolated.rel_error <= measurable_threshold(best.noise):
        # Not the culprit's successor blamed for what it was fed: none of them adds error.
        return ("no aligned layer up to where the error crosses the budget "
                f"({report.layers[crossing].name}) adds a measurable error of its own (the "
                f"largest, {best.name}, adds {isolated.rel_error:.3g}): the drift arises "
                "in layers without a counterpart"
                + (f" ({', '.join(u.name for u in report.unaligned[:5])})"
                   if report.unaligned else ""))
    best.divergent = True
    report.first = best
    report.basis = BASIS_LARGEST
    return ""


def rank_suspects(layers: list[LayerResult], top_k: int) -> list[LayerResult]:
    """Layers by isolated error over allowance (plain isolated error without one)."""
    ranked = [(layer, layer.isolated.rel_error) for layer in layers if layer.isolated is not None]
    ranked.sort(key=lambda item: (item[0].ratio, item[1]), reverse=True)
    return [layer for layer, _ in ranked[:top_k]]
