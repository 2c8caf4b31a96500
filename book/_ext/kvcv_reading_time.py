"""A reading-time line under each chapter's title: "About 24 minutes to read (5,400 words of prose)".

The words are counted in the built page, after glue and cross-references are resolved: the text of
paragraphs, lists, admonitions, captions and tables, not code, cell outputs or maths. The minutes
assume WORDS_PER_MINUTE for technical prose, rounded up. Pages
under notebooks/ (the chapters and the appendix) get the line; the other pages do not.
"""

from __future__ import annotations

import math
import re

from docutils import nodes

WORDS_PER_MINUTE = 200  # technical prose read with care: slower than the 230-250 of plain prose
_WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
_SKIP = (nodes.literal_block, nodes.math, nodes.math_block, nodes.raw, nodes.comment, nodes.title)


def _skipped(node: nodes.Node) -> bool:
    while node is not None:
        if isinstance(node, _SKIP):
            return True
        classes = node.get("classes", []) if isinstance(node, nodes.Element) else []
        if "cell_output" in classes or "cell_input" in classes:
            return True
        node = node.parent
    return False


def prose_words(doctree: nodes.Node) -> int:
    """The words of a page's prose: every text node outside code, outputs, maths and titles."""
    return sum(len(_WORD.findall(t.astext())) for t in doctree.findall(nodes.Text) if not _skipped(t.parent))


def reading_line(words: int) -> str:
    minutes = max(1, math.ceil(words / WORDS_PER_MINUTE))
    return f"About {minutes} minutes to read ({words:,} words of prose)."


def add_reading_time(app, doctree, docname):
    if not docname.startswith("notebooks/"):
        return
    section = next(iter(doctree.findall(nodes.section)), None)
    if section is None or not isinstance(section[0], nodes.title):
        return
    words = prose_words(doctree)
    line = nodes.paragraph(classes=["kvcv-reading-time"])
    line += nodes.Text(reading_line(words))
    section.insert(1, line)


def setup(app):
    app.connect("doctree-resolved", add_reading_time)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
