"""The bibliography's labels in the form its citations take: "Vaswani et al. 2017", not "[1]".

The chapters cite author-year (`bibtex_reference_style` in _config.yml), so the
references page labels each entry the same way, and keeps pybtex's plain style for the entries
themselves, sorted by the label's names, year and title. Two entries with the same label get a, b, ... after
the year. Registered as the pybtex style `kvcv_author_year` (`bibtex_default_style`).

The citations in the text take the same letter ("Hugging Face, 2026a"): sphinxcontrib-bibtex's author-year
reference style writes the year field alone, so two entries with one name and year would read alike. Registered
as the reference style `kvcv_author_year` (`bibtex_reference_style`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.template import node
from sphinxcontrib.bibtex.plugin import register_plugin as register_bibtex_plugin
from sphinxcontrib.bibtex.style.referencing.author_year import AuthorYearReferenceStyle
from sphinxcontrib.bibtex.style.referencing.basic_author_year import (
    BasicAuthorYearParentheticalReferenceStyle,
    BasicAuthorYearTextualReferenceStyle,
)
from sphinxcontrib.bibtex.style.template import join, join2, post_text, pre_text, reference, year

LETTERS = "abcdefghijklmnopqrstuvwxyz"


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
                yield label + LETTERS[seen[label] - 1]
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


def label_letter(label: str) -> str:
    """The letter AuthorYearLabels put after a label's year ("Hugging Face 2026a": "a"), or ""."""
    return label[-1] if len(label) > 1 and label[-1] in LETTERS and label[-2].isdigit() else ""


@node
def labelled_year(children, data) -> Text:
    """The cited entry's year with its label's letter, as the bibliography labels it."""
    assert not children
    return Text(year.format_data(data), label_letter(data["formatted_entry"].label))


@dataclass
class LabelledParenthetical(BasicAuthorYearParentheticalReferenceStyle):
    """(Name, 2026a): sphinxcontrib-bibtex's parenthetical citation with the labelled year."""

    def inner(self, role_name):
        return join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[
            pre_text,
            reference[join(sep=self.author_year_sep)[
                self.person.author_or_editor_or_title(full="s" in role_name), labelled_year]],
            post_text,
        ]


@dataclass
class LabelledTextual(BasicAuthorYearTextualReferenceStyle):
    """Name (2026a): sphinxcontrib-bibtex's textual citation with the labelled year."""

    def inner(self, role_name):
        return join(sep=self.text_reference_sep)[
            self.person.author_or_editor_or_title(full="s" in role_name),
            join[self.bracket.left,
                 join2(sep1=self.pre_text_sep, sep2=self.post_text_sep)[pre_text, reference[labelled_year], post_text],
                 self.bracket.right],
        ]


@dataclass
class LabelledAuthorYearReferenceStyle(AuthorYearReferenceStyle):
    """sphinxcontrib-bibtex's author-year citations, the year written as the bibliography's label writes it."""

    def __post_init__(self):
        super().__post_init__()
        swap = {BasicAuthorYearParentheticalReferenceStyle: LabelledParenthetical,
                BasicAuthorYearTextualReferenceStyle: LabelledTextual}
        self.styles = [swap[type(s)](**vars(s)) if type(s) in swap else s for s in self.styles]
        self.role_style.update((name, s) for s in self.styles for name in s.role_names())


def setup(app):
    register_plugin("pybtex.style.labels", "kvcv_author_year", AuthorYearLabels)
    register_plugin("pybtex.style.formatting", "kvcv_author_year", AuthorYearStyle)
    register_bibtex_plugin("sphinxcontrib.bibtex.style.referencing", "kvcv_author_year",
                           LabelledAuthorYearReferenceStyle)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
