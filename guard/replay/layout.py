"""The replay report's content as blocks, laid out once and rendered twice: report.md renders
them as Markdown (plain text for logs and CI), report.html as a page (real tables, links to the
plots, the plots themselves; guard/replay/report.py). Figures exist only on the page; a
``Rendered`` block brings its own form for each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class Code(str):
    """Inline code: `x` in Markdown, <code> on the page."""


class Strong(str):
    """**x** in Markdown, <strong> on the page."""


@dataclass(frozen=True)
class Link:
    """Text that links to an anchor on the page (plain text in Markdown)."""
    text: str
    target: str


@dataclass
class Heading:
    level: int
    text: list
    anchor: str = ""


@dataclass
class Para:
    text: list


@dataclass
class Bullets:
    items: list  # each a list of inline pieces


@dataclass
class Table:
    head: list[str]
    right: list[bool]  # per column: numbers are right-aligned
    rows: list  # each row a list of cells, each a list of inline pieces
    caption: str = ""
    page_only: tuple[int, ...] = ()  # columns of links to the plots: not in Markdown
    wrap: tuple[int, ...] = ()  # free-text columns: long words break anywhere on the page


@dataclass
class Figure:
    anchor: str
    svg: str  # inline SVG or an HTML paragraph; not in Markdown


@dataclass
class Rendered:
    """A block with one form per rendering: ``html`` on the page, ``markdown`` (text, written
    as it is) in report.md (a completion shaded token by token, and its plain text)."""
    html: str
    markdown: str


def fmt(value) -> str:
    """A figure as the tables show it (3 significant digits; "-" for none)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def anchor(*parts) -> str:
    """An id that is unique by construction (callers pass an index) and readable."""
    return "-".join(re.sub(r"[^A-Za-z0-9_]+", "_", str(p)).strip("_") or "x" for p in parts)
