"""The bibliography's labels in the form its citations take: "Vaswani et al. 2017", not "[1]".

The chapters cite author-year (`bibtex_reference_style: author_year` in _config.yml), so the
references page labels each entry the same way, and keeps pybtex's plain style for the entries
themselves, sorted by the label's names, year and title. Two entries with the same label get a, b, ... after
the year. Registered as the pybtex style `kvcv_author_year` (`bibtex_default_style`).
"""

from __future__ import annotations

from collections import Counter

from pybtex.plugin import register_plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle


def _names(entry) -> str:
    people = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [" ".join(p.last_names).replace("{", "").replace("}", "") for p in people]
    if not last:
        return entry.key
    if len(last) == 1:
        return last[0]
    if len(last) == 2:
        return f"{last[0]} and {last[1]}"
    return f"{last[0]} et al."


class AuthorYearLabels(BaseLabelStyle):
    """Labels "Name 2020", "Name and Other 2020" or "Name et al. 2020"."""

    def format_labels(self, sorted_entries):
        plain = [f"{_names(e)} {e.fields.get('year', '')}".strip() for e in sorted_entries]
        seen, counts = Counter(), Counter(plain)
        for label in plain:
            if counts[label] > 1:
                seen[label] += 1
                yield label + "abcdefghijklmnopqrstuvwxyz"[seen[label] - 1]
            else:
                yield label


class AuthorYearStyle(PlainStyle):
    """pybtex's plain entries, sorted as their labels read: by name, then year, then title."""

    default_label_style = "kvcv_author_year"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sort = self.by_label  # BaseStyle sets self.sort from its sorting style

    @staticmethod
    def by_label(entries):
        def key(entry):
            return (_names(entry).lower(), entry.fields.get("year", ""), entry.fields.get("title", "").lower())

        return sorted(entries, key=key)


def setup(app):
    register_plugin("pybtex.style.labels", "kvcv_author_year", AuthorYearLabels)
    register_plugin("pybtex.style.formatting", "kvcv_author_year", AuthorYearStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
