"""The `chapter` role: a link to a chapter notebook once it is part of the book, plain text before.

    {chapter}`chapter 3, The naive cache <03_naive_cache>`

links to notebooks/03_naive_cache when that page is built (it is listed in _toc.yml), and renders
the text in italics otherwise, so that pages can name every chapter while the course is being
written without breaking the build, and gain the links as chapters are added.
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.addnodes import pending_xref

_EXPLICIT = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


def chapter_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    match = _EXPLICIT.match(text)
    if not match:
        msg = inliner.reporter.error(f"chapter role: expected 'title <NN_slug>', got {text!r}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    title = re.sub(r"\s+", " ", match["title"])
    docname = "notebooks/" + match["target"].strip()
    env = inliner.document.settings.env
    if docname not in env.found_docs:
        return [nodes.emphasis(rawtext, title, classes=["kvcv-chapter-pending"])], []
    ref = pending_xref(
        rawtext,
        refdomain="std",
        reftype="doc",
        reftarget="/" + docname,
        refexplicit=True,
        refwarn=True,
        refdoc=env.docname,
    )
    ref += nodes.inline(rawtext, title, classes=["xref", "std", "std-doc"])
    return [ref], []


def setup(app):
    app.add_role("chapter", chapter_role)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
