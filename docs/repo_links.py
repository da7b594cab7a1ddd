"""mkdocs hook: links from a docs page to a repository file outside docs/.

A page links to a file such as ``../benchmarks/results/localisation.md`` so that the link works
where people read the repository (a code host, an editor). mkdocs cannot resolve such a link (the
file is not part of the site) and ``--strict`` would fail on it. This hook checks that the file
exists in the checkout (a missing one is a warning, which fails a strict build, as a broken link
inside the docs does) and renders the link in the site as the file's repository path.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")

# [text](../path#anchor): a relative link whose target climbs out of docs/.
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    repo_root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_uri).parent

    def replace(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = (page_dir / target).resolve()
        try:
            rel = path.relative_to(repo_root).as_posix()
        except ValueError:
            log.warning("%s links to %s, outside the repository", page.file.src_uri, target)
            return match.group(0)
        if path.is_relative_to(docs_dir):
            return match.group(0)  # inside the docs: mkdocs checks it itself
        if not path.exists():
            log.warning("%s links to %s, which is not in the repository",
                        page.file.src_uri, rel)
            return match.group(0)
        if text.strip("`") == rel or text.strip("`") == rel.rstrip("/"):
            return f"`{rel}`"
        return f"{text} (`{rel}`)"

    return LINK.sub(replace, markdown)
