"""mkdocs hook: links from a docs page to a repository file outside docs/, clickable on the site.

A page links to a file such as ``../benchmarks/results/localisation.md`` so that the link works
where people read the repository (a code host, an editor). The site has no such file, so this
hook puts it there: every repository file a docs page links to (and, from a linked Markdown file,
what that one links to: a summary's heat map) is added to the site under ``repo/`` with its
repository path (``repo/benchmarks/results/localisation.md``; Markdown is rendered as a page
outside the navigation, anything else copied as it is), and the link is rewritten to it. A link
to a file that is not in the checkout is a warning, which fails a strict build, as a broken link
inside the docs does; a link to a folder is shown as its path.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

log = logging.getLogger("mkdocs.hooks.repo_links")

PREFIX = "repo"  # where the repository's files go on the site
# [text](target#anchor) or ![alt](target): relative targets only (no scheme, no leading / or #).
LINK = re.compile(r"(!?)\[([^\]]*)\]\((?![a-zA-Z][a-zA-Z0-9+.-]*:|[/#])([^)\s#]+)(#[^)\s]*)?\)")
_included: dict[str, Path] = {}  # repository path -> file, for this build


def _roots(config) -> tuple[Path, Path]:
    docs_dir = Path(config["docs_dir"]).resolve()
    return docs_dir, docs_dir.parent


def on_files(files, config, **kwargs):
    """Add every repository file the docs reach by links (see the module docstring)."""
    docs_dir, root = _roots(config)
    _included.clear()
    todo = [Path(f.abs_src_path) for f in files.documentation_pages() if f.abs_src_path]
    while todo:
        source = todo.pop()
        for match in LINK.finditer(source.read_text(encoding="utf-8")):
            path = (source.parent / match.group(3)).resolve()
            if (not path.is_relative_to(root) or path.is_relative_to(docs_dir)
                    or not path.is_file()):
                continue  # outside the checkout, a docs page, missing or a folder: see below
            rel = path.relative_to(root).as_posix()
            if rel not in _included:
                _included[rel] = path
                if path.suffix == ".md":
                    todo.append(path)
    for rel, path in sorted(_included.items()):
        files.append(File.generated(config, f"{PREFIX}/{rel}", abs_src_path=str(path),
                                    inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    docs_dir, root = _roots(config)
    source = Path(page.file.abs_src_path).resolve()
    from_repo = not source.is_relative_to(docs_dir)  # a page this hook added
    page_dir = Path(page.file.src_uri).parent

    def link_to(site_path: str) -> str:
        return Path(os.path.relpath(site_path, page_dir)).as_posix()

    def replace(match: re.Match) -> str:
        bang, text, target, anchor = match.group(1), match.group(2), match.group(3), \
            match.group(4) or ""
        path = (source.parent / target).resolve()
        if path.is_relative_to(docs_dir):
            if not from_repo:
                return match.group(0)  # a docs page's link inside the docs: mkdocs checks it
            return f"{bang}[{text}]({link_to(path.relative_to(docs_dir).as_posix())}{anchor})"
        if not path.is_relative_to(root):
            log.warning("%s links to %s, outside the repository", page.file.src_uri, target)
            return match.group(0)
        rel = path.relative_to(root).as_posix()
        if rel in _included:
            return f"{bang}[{text}]({link_to(f'{PREFIX}/{rel}')}{anchor})"
        if path.is_dir():  # a folder has no page of its own: its repository path
            return text if text.strip("`").rstrip("/") == rel.rstrip("/") else \
                f"{text} (`{rel}/`)"
        log.warning("%s links to %s, which is not in the repository", page.file.src_uri, rel)
        return match.group(0)

    return LINK.sub(replace, markdown)
