"""A griffe extension for the site's API reference: Sphinx roles in docstrings, rendered.

poise's docstrings name other objects the Sphinx way (``:class:`Data```, ``:meth:`step```),
which reads well in ``help()`` and in an editor, but mkdocstrings' Markdown prints such a role
as it is written. Before mkdocstrings renders a docstring, each role is rewritten here: into
a link when it names an object the API reference renders (``poise.Session``, ``poise.Data``,
``poise.Step``, ``poise.DeadlineStep`` and their documented public members), else into inline
code (``~`` keeps the last name only, as in Sphinx). mkdocs.yml names this file under the
handler's ``extensions``; tests/e2e/test_docs_site.py fails on a role left in the built site.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# canonical path -> the public name the API reference renders it under (docs/reference/api.md)
RENDERED = {
    "poise.run.session.Session": "poise.Session",
    "poise.run.data.Data": "poise.Data",
    "poise.run.step.Step": "poise.Step",
    "poise.run.step.DeadlineStep": "poise.DeadlineStep",
}
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|obj|exc|const|ref):`([^`]+)`")


def _split(target: str) -> tuple[str, str]:
    """(text shown, target) of a role's content: ``~a.b.C`` shows ``C``; ``text <a.b>`` shows text."""
    custom = re.fullmatch(r"(.+?)\s*<([^>]+)>", target)
    if custom:
        return custom.group(1), custom.group(2)
    if target.startswith("~"):
        target = target[1:]
        return target.rsplit(".", 1)[-1], target
    return target.lstrip("."), target.lstrip(".")


class SphinxRoles(griffe.Extension):
    """Rewrites every role of every loaded docstring (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._short = {public.rsplit(".", 1)[-1]: public for public in RENDERED.values()}

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring is None or ":" not in obj.docstring.value:
            return
        owner = obj if obj.is_class else obj.parent if obj.parent is not None and obj.parent.is_class else None
        obj.docstring.value = ROLE.sub(lambda m: self._render(m.group(1), owner, loader), obj.docstring.value)

    def _render(self, content: str, owner: griffe.Object | None, loader: griffe.GriffeLoader) -> str:
        text, target = _split(content)
        link = self._identifier(target, owner, loader)
        return f"[`{text}`][{link}]" if link else f"`{text}`"

    def _identifier(self, target: str, owner: griffe.Object | None, loader: griffe.GriffeLoader) -> str | None:
        """The rendered identifier ``target`` names (``poise.Session.step``), or None."""
        head, _, member = target.partition(".")
        if target in self._short.values() or target in self._short:
            return self._short.get(target, target)
        public = ""
        if head in self._short:  # Step.backward
            public = self._short[head]
        elif target.startswith("poise.") and target.rsplit(".", 1)[0] in self._short.values():  # poise.Step.end
            public, member = target.rsplit(".", 1)
        elif owner is not None and owner.path in RENDERED and "." not in target:  # a member of this class
            public, member = RENDERED[owner.path], target
        if not public or not member or member.startswith("_"):
            return None
        canonical = {v: k for k, v in RENDERED.items()}[public]
        try:
            found = loader.modules_collection[f"{canonical}.{member}"]
        except KeyError:
            return None
        return f"{public}.{member}" if found.docstring is not None else None
