"""A generative model's part of the replay report (its ``tiers.generation`` section, built by the
tier's figures, guard/verify/generation/summary.py ``GenerationFigures``), laid out as blocks
(guard/replay/layout.py):

- llama-perplexity's summary table for the run (``--kl-divergence``'s statistics: PPL(Q),
  PPL(base) and their ratio, mean, maximum, p99.9, p99 and median KLD, mean and RMS Δp, same
  top p), over every compared token;
- the first divergent token of the run, linked to its completion;
- a plot of KLD by completion position (mean and maximum over the completions that reach it;
  the reference's mean surprise where no completion carried the primary's logprobs);
- each flagged (failing) completion, its prompt and text with every token shaded by the
  reference's surprise at it (-log p, nats), the first divergent token outlined, and beside it
  the primary's token and the reference's top-5. report.md gets the same as plain text.
"""

from __future__ import annotations

import math
from html import escape

from guard.protocol.generation import divergent_token_phrase, divergent_token_words
from guard.replay import svg
from guard.replay.layout import Code, Figure, Heading, Link, Para, Rendered, Table, anchor
from guard.verify.generation.summary import by_cause

# Surprise (nats) at which a token's shade is full: p = e^-8, 0.03%; a token the reference
# expected (p near 1) stays white. Linear in between: surprise is already a log scale.
FULL_SHADE_NATS = 8.0
_SHADE = (217, 83, 79)  # the report's "drift" red
_MAX_ALPHA = 0.85

CSS = (
    ".completion{white-space:pre-wrap;font-family:monospace;font-size:.9em;line-height:1.7;"
    "border:1px solid #ccc;padding:.5rem;margin:.25rem 0}"
    ".completion .prompt{color:#777}"
    ".tok{border-radius:2px}"
    ".tok.first{outline:2px solid #7a1d1a;outline-offset:1px;font-weight:bold;"
    "position:relative}"
    ".tok.first::before{content:'\\25BC';color:#7a1d1a;font-size:.7em;position:absolute;"
    "left:50%;transform:translateX(-50%);top:-1.3em}"
    "table.divergence td.token{font-family:monospace;white-space:pre}"
    ".shade-scale{display:inline-block;width:10rem;height:.8em;vertical-align:middle;"
    f"background:linear-gradient(to right,rgba{_SHADE + (0.0,)},rgba{_SHADE + (_MAX_ALPHA,)})}}"
)


def _nats(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _share(value) -> str:
    return "-" if value is None else f"{value:.2%}"


def summary_rows(g: dict) -> list[tuple[str, str]]:
    """llama-perplexity's statistics of the run, as (name, value)."""
    return [
        ("completions with a verdict", f"{g['checks']} ({g['passed']} pass)"),
        ("not comparable / tokenization mismatches",
         f"{g.get('not_comparable', 0)} / {g.get('tokenization_mismatches', 0)}"
         + (f" ({why})" if (why := by_cause(g.get("not_comparable_reasons"))) else "")),
        ("prompt findings", ", ".join(f"{name} {count}" for name, count in
                                      (g.get("findings") or {}).items()) or "none"),
        ("tokens compared", str(g.get("tokens", 0))),
        ("Mean PPL(Q) (primary, its own tokens)", _nats(g.get("ppl_primary"))),
        ("Mean PPL(base) (reference, the same tokens)", _nats(g.get("ppl_reference"))),
        ("Mean PPL(Q)/PPL(base)", _nats(g.get("ppl_ratio"))),
        ("Mean KLD (nats)", _nats(g.get("mean_kld"))),
        ("Maximum KLD", _nats(g.get("kld_max"))),
        ("99.9% KLD", _nats(g.get("kld_p999"))),
        ("99.0% KLD", _nats(g.get("kld_p99"))),
        ("Median KLD", _nats(g.get("kld_median"))),
        ("Mean Δp", _share(g.get("delta_p_mean"))),
        ("RMS Δp", _share(g.get("delta_p_rms"))),
        ("Same top p", _share(g.get("top1_agreement"))),
        *_sampled_rows(g),
    ]


def _sampled_rows(g: dict) -> list[tuple[str, str]]:
    """The sampled completions' z (no KLD, no same top-1 there), where the run had any."""
    if not g.get("z_completions"):
        return []
    return [("sampled completions (z: about N(0, 1) when they agree)", str(g["z_completions"])),
            ("Mean z", _nats(g.get("z_mean"))), ("SD of z", _nats(g.get("z_sd"))),
            ("Pooled z (sum / sqrt(n))", _nats(g.get("z_pooled")))]


def _top5(first: dict) -> str:
    return ", ".join(f"{t!r} {p:.3f}" for t, p in first["reference_top"])


def generation_layout(g: dict, limits: dict, model_anchor: str) -> list:
    """The blocks of a model's generation section (``g``: its ``tiers.generation``)."""
    flagged_anchor = anchor(model_anchor, "flagged")
    blocks: list = [Heading(3, ["Generation (tier ", Code("generation"), ")"])]
    if "mean_kld" not in g:  # no record reached the tier
        return blocks + [Para(["No completion was checked: no figures."])]
    blocks.append(Table(
        ["statistic", "value"], [False, True], [[[name], [value]] for name, value in
                                                summary_rows(g)],
        caption="llama-perplexity --kl-divergence's statistics over every compared token; "
        "KLD is KL(primary || reference) over the primary's top-k plus the rest of its mass "
        "(docs/generation.md), Δp the primary's probability of its token minus the "
        "reference's."))
    first = g.get("first_divergence")
    if first:
        target = anchor(model_anchor, "record", first["record"])
        shown = any(f["record"] == first["record"] for f in g.get("flagged", ()))
        record = Link(f"record {first['record']}", target) if shown else \
            f"record {first['record']}"
        before, after = divergent_token_words(first)
        blocks.append(Para(["First divergent token: ", record, f", position {first['position']}"
                            f": {before}", Code(repr(first["primary_token"])), after,
                            " where the reference's top-5 was ", Code(_top5(first)), "."]))
    blocks.append(Figure(anchor(model_anchor, "kld-position"),
                         _position_svg(g, limits.get("max_mean_kld"))))
    flagged = g.get("flagged") or []
    total = g.get("flagged_total", len(flagged))
    blocks.append(Heading(3, [f"Flagged completions ({len(flagged)} of {total} shown)"],
                          flagged_anchor))
    if not flagged:
        return blocks + [Para(["No completion failed."])]
    blocks.append(Rendered(
        "<p>Each token is shaded by the reference's surprise at it (-log p): white where the "
        "reference expected it, <span class='shade-scale'></span> full at "
        f"{FULL_SHADE_NATS:g} nats (p {math.exp(-FULL_SHADE_NATS):.2%}) and beyond; hover a "
        "token for its figures. The first divergent token is outlined (&#9660;).</p>", ""))
    for f in flagged:
        blocks += _flagged(f, model_anchor)
    return blocks


def _flagged(f: dict, model_anchor: str) -> list:
    title = [f"record {f['record']}"]
    if f.get("request_id"):
        title += [" ", Code(f["request_id"])]
    why = f.get("reason") or "failed"
    blocks: list = [Heading(4, title, anchor(model_anchor, "record", f["record"])),
                    Para([f"mode {f['mode']}, {f['tokens']} tokens: {why}"])]
    tokens = f.get("per_token")
    if tokens:
        blocks.append(Rendered(shaded_html(f), plain_text(f)))
    return blocks


def _shade(surprise: float | None) -> str:
    if surprise is None or not math.isfinite(surprise):
        return ""
    alpha = _MAX_ALPHA * min(max(surprise, 0.0) / FULL_SHADE_NATS, 1.0)
    return f" style='background:rgba{_SHADE + (round(alpha, 3),)}'"


def _shown(text: str) -> str:
    """A token's text as the page shows it: a newline marked, an empty token visible."""
    return text.replace("\n", "\u21b5\n") if text else "\u2205"


def shaded_html(f: dict) -> str:
    """One flagged completion: prompt, tokens shaded by surprise, the first divergence."""
    tokens = f["per_token"]
    first = f.get("first_divergence")
    position = first["position"] if first else None
    surprise = tokens.get("surprise") or [None] * len(tokens["text"])
    kld = tokens.get("kld")
    spans = []
    for t, text in enumerate(tokens["text"]):
        s = surprise[t]
        tip = f"#{t}" if s is None else \
            f"#{t}: surprise {s:.2f} nats (reference p {math.exp(-s):.3g})"
        if kld is not None and kld[t] is not None:
            tip += f", KLD {kld[t]:.3g}"
        cls = "tok first" if t == position else "tok"
        spans.append(f"<span class='{cls}'{_shade(s)} title='{escape(tip)}'>"
                     f"{escape(_shown(text))}</span>")
    prompt = f"<span class='prompt'>{escape(f['prompt'])}</span>" if f.get("prompt") else ""
    out = f"<div class='completion'>{prompt}{''.join(spans)}</div>"
    if first:
        at = surprise[first["position"]]
        rows = [(divergent_token_words(first)[0].strip(), first["primary_token"],
                 None if at is None else math.exp(-at))]
        rows += [(f"reference #{k + 1}", t, p) for k, (t, p) in
                 enumerate(first["reference_top"])]
        cells = "".join(f"<tr><td>{escape(who)}</td><td class='token'>{escape(repr(t))}</td>"
                        f"<td class='num'>{'-' if p is None else f'{p:.3f}'}</td></tr>"
                        for who, t, p in rows)
        out += (f"<table class='divergence'><caption>first divergent token, position "
                f"{position}: the reference's probabilities</caption><thead><tr><th></th>"
                f"<th>token</th><th class='num'>p (reference)</th></tr></thead>"
                f"<tbody>{cells}</tbody></table>")
    return out


def plain_text(f: dict) -> str:
    """The same completion for report.md: prompt, text, and the first divergence."""
    lines = ["```text"]
    if f.get("prompt"):
        lines.append(f"prompt: {f['prompt']}")
    lines.append("completion: " + "".join(f["per_token"]["text"]))
    first = f.get("first_divergence")
    if first:
        lines.append(f"first divergent token at position {first['position']}: "
                     f"{divergent_token_phrase(first)}; reference top-5: {_top5(first)}")
    lines.append("```")
    return "\n".join(lines)


def _position_svg(g: dict, max_mean_kld: float | None) -> str:
    positions = g.get("by_position") or {}
    counts = positions.get("completions") or []
    if not counts:
        return "<p>KLD by position: no scored completion.</p>"
    x_title = (f"completion position (0: the first generated token; {counts[0]} completions "
               f"at 0, {counts[-1]} at {len(counts) - 1})")
    if any(v is not None for v in positions.get("kld_mean", ())):
        return svg.series("KLD by position (nats)",
                          [("mean KLD", positions["kld_mean"], "#4a7ebb"),
                           ("max KLD", positions["kld_max"], "#999999")],
                          x_title=x_title, y_title="KLD (nats)", threshold=max_mean_kld,
                          threshold_label="" if max_mean_kld is None else
                          f"max_mean_kld {max_mean_kld:g}")
    return svg.series("reference surprise by position (no primary logprobs: no KLD)",
                      [("mean surprise", positions["surprise_mean"], "#4a7ebb")],
                      x_title=x_title, y_title="-log p (nats)")
