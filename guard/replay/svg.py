"""Small inline-SVG charts for report.html: no plotting library, no server, no script.

Inline SVG keeps the report one self-contained file that any browser opens from disk, and the
charts are simple enough (bars, one line) that a few lines of SVG beat a heavy dependency.
"""

from __future__ import annotations

import math
from html import escape

W, H = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 28, 44
PLOT_W, PLOT_H = W - LEFT - RIGHT, H - TOP - BOTTOM
FONT = 'font-family="sans-serif" font-size="11"'
HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'  # text readable over a bar


def _frame(title: str, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" role="img" aria-label="{escape(title)}">'
        f'<rect width="{W}" height="{H}" fill="white"/>'
        f'<text x="{LEFT}" y="16" {FONT} font-weight="bold">{escape(title)}</text>'
        f'<line x1="{LEFT}" y1="{TOP + PLOT_H}" x2="{LEFT + PLOT_W}" y2="{TOP + PLOT_H}" '
        f'stroke="#444"/><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + PLOT_H}" '
        f'stroke="#444"/>' + "".join(body) + "</svg>"
    )


def _ylabel(value: float, y: float, text: str) -> str:
    return (f'<text x="{LEFT - 4}" y="{y + 4:.1f}" {FONT} text-anchor="end">{escape(text)}'
            f'</text><line x1="{LEFT - 2}" y1="{y:.1f}" x2="{LEFT + PLOT_W}" y2="{y:.1f}" '
            f'stroke="#eee"/>')


def bars(title: str, labels: list[str], values: list[float], *, x_title: str = "",
         highlight: int | None = None, marker: float | None = None,
         marker_label: str = "", tips: list[str] | None = None,
         label_every: int | None = None, edge_labels: bool = False,
         log: bool = False) -> str:
    """Vertical bars; ``marker`` draws a dashed vertical line at that bar position
    (fractional index), e.g. the tolerance on an error histogram. ``tips`` are the hover texts
    (default: the labels); ``label_every`` thins the axis labels (default: about 8 shown);
    ``edge_labels`` puts each label at its bar's left edge (histogram bin boundaries); ``log``
    draws heights on a log scale from a tenth of the smallest positive value (errors that span
    decades)."""
    tips = tips or labels
    n = max(1, len(values))
    step = PLOT_W / n
    positive = [v for v in values if v > 0]
    if log and positive:
        floor, top = min(positive) / 10, max(positive)
        span = math.log10(top / floor) or 1.0

        def height(v: float) -> float:
            return PLOT_H * math.log10(v / floor) / span if v > floor else 0.0

        body = [_ylabel(0, TOP + PLOT_H, f"{floor:.1e}"), _ylabel(top, TOP, f"{top:.1e}")]
    else:
        top = max(values, default=0) or 1

        def height(v: float) -> float:
            return PLOT_H * v / top

        body = [_ylabel(0, TOP + PLOT_H, "0"), _ylabel(top, TOP, f"{top:g}")]
    for k, value in enumerate(values):
        h = height(value)
        x = LEFT + k * step
        colour = "#d9534f" if k == highlight else "#4a7ebb"
        body.append(f'<rect x="{x + 1:.1f}" y="{TOP + PLOT_H - h:.1f}" '
                    f'width="{max(1.0, step - 2):.1f}" height="{h:.1f}" fill="{colour}">'
                    f'<title>{escape(tips[k])}: {value:g}</title></rect>')
    every = label_every or max(1, math.ceil(n / 8))
    offset = 0.0 if edge_labels else 0.5
    shown = set(range(0, n, every))
    if highlight is not None:  # the highlighted bar is always named; neighbours give way
        shown = {k for k in shown if abs(k - highlight) >= every} | {highlight}
    for k in sorted(shown):
        if labels[k]:
            style = ' fill="#d9534f" font-weight="bold"' if k == highlight else ""
            body.append(f'<text x="{LEFT + (k + offset) * step:.1f}" y="{TOP + PLOT_H + 14}" '
                        f'{FONT} text-anchor="middle"{style}>{escape(labels[k])}</text>')
    if marker is not None:
        x = LEFT + marker * step
        body.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + PLOT_H}" '
                    f'stroke="#d9534f" stroke-dasharray="4 3"/><text x="{x + 3:.1f}" '
                    f'y="{TOP + 10}" {FONT} fill="#d9534f" {HALO}>{escape(marker_label)}</text>')
    return _frame(title, body + _x_title(x_title))


def line(title: str, xs: list[float], ys: list[float], *, x_labels: tuple[str, str],
         x_title: str = "", threshold: float | None = None, threshold_label: str = "") -> str:
    """A line of ``ys`` in [0, 1] over ``xs`` (any scale), with dots; an optional horizontal
    dashed threshold."""
    body = [_ylabel(0, TOP + PLOT_H, "0%"), _ylabel(0.5, TOP + PLOT_H / 2, "50%"),
            _ylabel(1, TOP, "100%")]
    if xs:
        lo, hi = min(xs), max(xs)
        span = (hi - lo) or 1.0

        def px(x: float) -> float:
            return LEFT + PLOT_W * ((x - lo) / span if hi > lo else 0.5)

        def py(y: float) -> float:
            return TOP + PLOT_H * (1 - y)

        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        body.append(f'<polyline points="{points}" fill="none" stroke="#4a7ebb" '
                    f'stroke-width="1.5"/>')
        body += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="#4a7ebb">'
                 f'<title>{y:.1%}</title></circle>' for x, y in zip(xs, ys)]
    if threshold is not None:
        body.append(_threshold(TOP + PLOT_H * (1 - threshold), threshold_label))
    body.append(f'<text x="{LEFT}" y="{TOP + PLOT_H + 14}" {FONT}>{escape(x_labels[0])}</text>')
    body.append(f'<text x="{LEFT + PLOT_W}" y="{TOP + PLOT_H + 14}" {FONT} '
                f'text-anchor="end">{escape(x_labels[1])}</text>')
    return _frame(title, body + _x_title(x_title))


def _threshold(y: float, label: str) -> str:
    """A dashed horizontal line at ``y`` with its label at the right end."""
    return (f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_W}" y2="{y:.1f}" '
            f'stroke="#d9534f" stroke-dasharray="4 3"/><text x="{LEFT + PLOT_W}" '
            f'y="{y - 3:.1f}" {FONT} fill="#d9534f" text-anchor="end" {HALO}>'
            f'{escape(label)}</text>')


def _x_title(text: str) -> list[str]:
    return [f'<text x="{LEFT + PLOT_W / 2}" y="{H - 6}" {FONT} text-anchor="middle">'
            f'{escape(text)}</text>'] if text else []


def series(title: str, lines: list[tuple[str, list[float | None], str]], *, x_title: str = "",
           y_title: str = "", threshold: float | None = None, threshold_label: str = "") -> str:
    """Lines over a shared integer x axis (0, 1, 2...: e.g. a completion's positions), each
    ``(label, values, colour)`` with None for a missing point, on a linear y axis from 0 to the
    largest value; an optional horizontal dashed threshold. A legend names the lines."""
    n = max((len(values) for _, values, _ in lines), default=0)
    finite = [v for _, values, _ in lines for v in values if v is not None and math.isfinite(v)]
    top = max(finite + ([threshold] if threshold is not None else []), default=0.0) or 1.0
    body = [_ylabel(0, TOP + PLOT_H, "0"), _ylabel(top / 2, TOP + PLOT_H / 2, f"{top / 2:.3g}"),
            _ylabel(top, TOP, f"{top:.3g}")]

    def px(k: float) -> float:
        return LEFT + PLOT_W * (k / (n - 1) if n > 1 else 0.5)

    def py(v: float) -> float:
        return TOP + PLOT_H * (1 - v / top)

    for number, (label, values, colour) in enumerate(lines):
        points = [(k, v) for k, v in enumerate(values) if v is not None and math.isfinite(v)]
        if len(points) > 1:
            body.append('<polyline points="' + " ".join(f"{px(k):.1f},{py(v):.1f}"
                                                        for k, v in points)
                        + f'" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        body += [f'<circle cx="{px(k):.1f}" cy="{py(v):.1f}" r="2.5" fill="{colour}">'
                 f'<title>{escape(label)} at {k}: {v:.4g}</title></circle>' for k, v in points]
        x = LEFT + 8 + 170 * number
        body.append(f'<line x1="{x}" y1="{TOP + 6}" x2="{x + 16}" y2="{TOP + 6}" '
                    f'stroke="{colour}" stroke-width="2"/><text x="{x + 20}" y="{TOP + 10}" '
                    f'{FONT} {HALO}>{escape(label)}</text>')
    if threshold is not None:
        body.append(_threshold(py(threshold), threshold_label))
    step = max(1, math.ceil(n / 8))
    ticks = [k for k in range(0, n, step) if k == 0 or n - 1 - k >= step] + [n - 1]
    for k in sorted(set(ticks)) if n else ():
        body.append(f'<text x="{px(k):.1f}" y="{TOP + PLOT_H + 14}" {FONT} '
                    f'text-anchor="middle">{k}</text>')
    body += _x_title(x_title)
    if y_title:
        body.append(f'<text x="12" y="{TOP + PLOT_H / 2}" {FONT} text-anchor="middle" '
                    f'transform="rotate(-90 12 {TOP + PLOT_H / 2})">{escape(y_title)}</text>')
    return _frame(title, body)
