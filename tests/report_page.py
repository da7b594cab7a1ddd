"""report.html read back with the standard library's html.parser, as a browser would see its
structure: tables (header and cells, with the links in each cell), elements by id (with all the
text inside them, SVG text included), every link, and any <pre>."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Cell:
    text: str = ""
    links: list[str] = field(default_factory=list)  # hrefs


@dataclass
class Table:
    head: list[str] = field(default_factory=list)
    rows: list[list[Cell]] = field(default_factory=list)

    def column(self, name: str) -> list[Cell]:
        k = self.head.index(name)
        return [row[k] for row in self.rows]


@dataclass
class Page:
    tables: list[Table] = field(default_factory=list)
    ids: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (tag, text inside)
    links: list[tuple[str, str]] = field(default_factory=list)  # (href, text)
    pre: int = 0

    def table(self, *headers: str) -> Table:
        """The one table whose header row starts with ``headers``."""
        found = [t for t in self.tables if tuple(t.head[:len(headers)]) == headers]
        assert len(found) == 1, f"{len(found)} tables start with {headers}"
        return found[0]


VOID = {"meta", "br", "img", "hr", "input", "link", "rect", "line", "circle", "polyline"}


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.open_ids: list[list] = []  # [id, tag, depth, text parts]
        self.depth = 0
        self.cell: Cell | None = None
        self.in_head_row = False
        self.link: list | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "pre":
            self.page.pre += 1
        if tag == "table":
            self.page.tables.append(Table())
        elif tag == "thead":
            self.in_head_row = True
        elif tag == "tbody":
            self.in_head_row = False
        elif tag == "tr" and not self.in_head_row:
            self.page.tables[-1].rows.append([])
        elif tag in ("td", "th"):
            self.cell = Cell()
        elif tag == "a" and "href" in a:
            self.link = [a["href"], ""]
            if self.cell is not None:
                self.cell.links.append(a["href"])
        if tag in VOID:
            return
        self.depth += 1
        if "id" in a:
            self.open_ids.append([a["id"], tag, self.depth, []])

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            table = self.page.tables[-1]
            self.cell.text = self.cell.text.strip()
            if tag == "th" and self.in_head_row:
                table.head.append(self.cell.text)
            else:
                table.rows[-1].append(self.cell)
            self.cell = None
        elif tag == "a" and self.link is not None:
            self.page.links.append((self.link[0], self.link[1].strip()))
            self.link = None
        if tag in VOID:
            return
        while self.open_ids and self.open_ids[-1][2] >= self.depth:
            ident, t, _, parts = self.open_ids.pop()
            assert ident not in self.page.ids, f"duplicate id {ident}"
            self.page.ids[ident] = (t, " ".join(parts))
        self.depth -= 1

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.text += data
        if self.link is not None:
            self.link[1] += data
        for entry in self.open_ids:
            entry[3].append(data)


def parse(text: str) -> Page:
    parser = _Parser()
    parser.feed(text)
    parser.close()
    return parser.page


def target(page: Page, href: str) -> tuple[str, str]:
    """The (tag, text) of the element an in-page link points to; fails if there is none."""
    assert href.startswith("#"), href
    assert href[1:] in page.ids, f"link {href} points to no element"
    return page.ids[href[1:]]
