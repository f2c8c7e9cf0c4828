"""A MkDocs hook: the site's changelog page shows CHANGELOG.md, which lives at the repository's
root where packagers and GitHub expect it, so that the two cannot differ.

docs/changelog.md holds the page's own lines (what the file is, how to read the installed
version); CHANGELOG.md follows them, its title left out and its links to ``docs/`` pages made
relative to the site. mkdocs.yml names this file under ``hooks``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PAGE = "changelog.md"
SOURCE = Path(__file__).resolve().parents[2] / "CHANGELOG.md"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    text = SOURCE.read_text()
    text = re.sub(r"\A# .*\n", "", text)  # the page has its own title
    text = re.sub(r"\]\(docs/", "](", text)  # docs/decide.md -> decide.md, as the site sees it
    return markdown.rstrip() + "\n\n" + text.lstrip()
