"""No number is typed into a chapter's prose: the introduction promises that every measured or
derived number on a page is computed and inserted with glue.

The test reads every markdown cell of every chapter notebook, removes what is not prose (glue and
other roles, inline code, maths, code fences, link targets, labels, directive options, HTML
comments) and then the words that carry digits without being quantities (chapter, figure, section
and equation numbers, years, names of models, kernels and number formats). Any digit left is a
number someone typed. Glue it from the code that sets it (CONTRIBUTING, "Chapter notebooks").
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Not prose: removed before looking for digits.
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
_NOT_PROSE = [
    re.compile(r"<!--.*?-->", re.S),  # HTML comments
    re.compile(r"\$\$.*?\$\$", re.S),  # display maths
    re.compile(r"(?<![\\$\w])\$(?![\s$])[^$]+?(?<!\s)\$(?!\$)", re.S),  # inline maths
    re.compile(r"\{[\w:.-]+\}`[^`]*`"),  # roles: glue, numref, cite, ref, doc, term, eq, ...
    re.compile(r"``[^`]+``|`[^`\n]+`"),  # inline code
    re.compile(r"\]\([^)\s]*\)"),  # link targets (the link text stays prose)
    re.compile(r"^\([\w:.-]+\)=\s*$", re.M),  # labels
    re.compile(r"^:[\w-]+:.*$", re.M),  # directive options (:label:, :name:, :class:)
    re.compile(r"<[^>]+>"),  # HTML tags and their attributes
    re.compile(r"&#?\w+;"),  # HTML entities
]

# Digits that are not measurements: the book's own numbering, list markers, years, names of
# models, kernels, formats and hardware, issue numbers, the constants of a formula written in
# words (W - 1, P + i + 1), and zero and one, which count nothing (position 0, batch 1, layer 1).
_ALLOWED = re.compile(
    r"""
      \b(?:[Cc]hapters?|[Ff]ig(?:ure)?s?\.?|[Ss]ections?|[Tt]ables?|[Ee]quations?|[Ee]xercises?|
         [Aa]ppendix|[Pp]arts?|[Ii]tems?|[Ss]teps?|[Tt]heorem|[Ll]emma|[Aa]lgorithm)
        \s+\d+[a-z]?(?:\.\d+)*
        (?:(?:\s*(?:,|and|or|to|–|-)\s*)\d+[a-z]?(?:\.\d+)*)*     # chapters 5, 6 and 9
    | ^[ \t]*\d+\.[ \t]                                        # a numbered list's markers
    | ^\#{1,6}[ \t]+\d+(?:\.\d+)*\.?                          # numbered headings
    | \b(?:19|20)\d\d[a-z]?\b                                  # years, author-year citations
    | \b(?:GPT-?\d|SmolLM\d*|Llama[-\s]?\d(?:\.\d)?|LLaMA[-\s]?\d|Qwen\d(?:\.\d)?|
         Mistral|Mixtral|DeepSeek-V\d|Gemma[-\s]?\d+n?|Phi-\d|H2O)\b  # model and method names
    | \b\d+(?:\.\d+)?[MB]\b                                    # model sizes: 124M, 7B, 72B
    | \b(?:FlashAttention|Flash-Decoding|FA|PagedAttention)-?\d\b  # kernel versions
    | \bv\d+\b                                                # engine versions: vLLM's v1
    | \b(?:[HAVL]\d{2,3}|MI\d{3}X?|TPU\s?v\d[a-z]?|M\d)\b      # accelerators and chips
    | (?i:\b(?:float|bfloat|fp|bf|int|uint|e\dm)\d+(?:_\w+)?\b)  # number formats: float64, int8
    | \b[fiu](?:8|16|32|64)\b                                  # Rust's f32, u8
    | \b[qQ]\d_[0-9K](?:_[A-Z])?\b                             # GGUF formats: Q4_1, q8_0
    | \b(?:x86(?:-64)?|AVX-?\d*|ARM64|aarch64|SM\d+|NVLink\s?\d?|PCIe\s?\d(?:\.\d)?|
         HBM\d?e?|DDR\d|LPDDR\d)\b                             # hardware
    | \b(?:SHA|sha)-?\d+\b|\bUTF-\d+\b|\bbase64\b|\blog_?2\b       # algorithms
    | \b\d{1,3}(?:\.\d{1,3}){3}\b                             # an address: 127.0.0.1
    | \#\d+\b                                                 # an issue or pull request
    | \b\d+(?:st|nd|rd|th)\b                                  # ordinals
    | \b[A-Za-z](?:_\w+)?\s*[-+−·×*/]\s*\d+\b                 # W - 1, P + 1, S + T + 1
    | (?<![\w.,])[01](?![\w]|[.,]\d)                           # zero and one
    """,
    re.X | re.M,
)


def prose(cell_source: str) -> str:
    """The prose of one markdown cell: code fences removed, directive fences kept (an exercise's
    body is prose, and so is its title; a solution's argument is a label), then everything in
    _NOT_PROSE removed."""
    kept, fence = [], None
    for line in cell_source.splitlines():
        m = _FENCE.match(line.strip())
        if fence is None and m:
            marker, info = m.group(1), m.group(2).strip()
            directive = info.startswith("{") and not info.startswith(("{code", "{math"))
            fence = (marker, directive)
            titled = info.startswith(("{exercise", "{admonition", "{note", "{list-table"))
            kept.append(info.split("}", 1)[1] if directive and titled and "}" in info else "")
            continue
        if fence is not None and m and m.group(1) == fence[0] and not m.group(2).strip():
            fence = None
            kept.append("")
            continue
        kept.append(line if fence is None or fence[1] else "")
    text = "\n".join(kept)
    for pattern in _NOT_PROSE:
        text = pattern.sub(lambda mt: re.sub(r"[^\n]", " ", mt.group()), text)
    return text


def typed_numbers(cell_source: str) -> list[str]:
    """Each place in the cell's prose where a digit is left once the allowed words are gone,
    with a little of the text around it."""
    text = prose(cell_source)
    rest = _ALLOWED.sub(lambda mt: re.sub(r"[^\n]", " ", mt.group()), text)
    found, last = [], -100
    for m in re.finditer(r"\d+", rest):
        if m.start() - last < 40:  # one report per phrase
            continue
        last = m.start()
        found.append(" ".join(text[max(0, m.start() - 40) : m.end() + 40].split()))
    return found


def markdown_cells(path: Path) -> list[tuple[int, str]]:
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]


def figure_captions(path: Path) -> list[tuple[int, str]]:
    """The captions kept in code cells' metadata (`mystnb.figure.caption`): prose on the page, but
    outside any markdown cell, so a number typed there cannot be glued. Phrase it without the number
    or glue the figure and write the caption in markdown (CONTRIBUTING, "Chapter notebooks"). Alt
    text is not checked: it reads out what the image shows, labels and ticks included."""
    cells = json.loads(path.read_text())["cells"]
    return [
        (i, c["metadata"]["mystnb"]["figure"]["caption"])
        for i, c in enumerate(cells)
        if c["cell_type"] == "code" and c.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("caption")
    ]


def test_there_are_chapters_to_check():
    assert len(CHAPTERS) >= 10


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_number_is_typed_into_a_figure_caption(path):
    offenders = [
        f"cell {i}: …{phrase}…" for i, caption in figure_captions(path) for phrase in typed_numbers(caption)
    ]
    assert not offenders, f"{path.name}: numbers typed into a figure's caption:\n" + "\n".join(offenders)


def test_the_caption_check_reads_captions():
    assert any(figure_captions(p) for p in CHAPTERS), "no chapter has a caption in its cells' metadata"
    assert typed_numbers("The 16 rows."), "a caption's typed number is not caught"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_number_is_typed_into_the_prose(path):
    offenders = [
        f"cell {i}: …{phrase}…" for i, source in markdown_cells(path) for phrase in typed_numbers(source)
    ]
    assert not offenders, (
        f"{path.name}: numbers typed into the prose (glue them from the code that sets them):\n"
        + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "source",
    [
        "The window holds 16 rows.",
        "A batch of B = 4 sequences.",
        "It is 2.5x faster.",
        "```{exercise} Mask rows\n:label: ch02-x\nFive cached keys and 3 queries.\n```",
        "See [the table](x.ipynb) with 40 rows.",
        "About 1e-12 apart.",
        "Saves 1.7% of the memory.",
        "Blocks of size-16 hold a sampled temperature of 0.8.",
        "A context extended to 32k, or 1,000 tokens.",
        "Position\n10 of chapter 5 (and 7 more).",
        "```{solution} ch02-x\n:class: dropdown\nIt has 6 rows.\n```",
        "A grid of $H$ heads by\n12 sequences.",
    ],
)
def test_a_typed_number_is_caught(source):
    assert typed_numbers(source)


@pytest.mark.parametrize(
    "source",
    [
        "The window holds {glue:text}`w` rows.",
        "As chapter 5 showed, and chapters 6 and 9 measure (Fig. 7.4, {numref}`fig-x`).",
        "GPT-2 and SmolLM2-135M in float64, int8 and bf16; FlashAttention-2 (2023).",
        "The shift is $k_{t+1} = R_{12} k_t$ and `cache.append(0, k, v)`.",
        "```python\nx = 16\n```\nNo digits here.",
        "(sec-window-2)=\n## 5.2 The window\n",
        "```{glue:figure} fig_x\n:alt: a plot\n:name: fig-ch05-3\nThe caption.\n```",
        "Read from [the file](https://example.org/v2/file_3.rs).",
        "1. **First.** Then\n2. **Second**, at position 0 of layer 1, W - 1 rows, chapters 5 and\n6.",
        "Qwen2.5 7B and 72B, Llama 2 7B, vLLM v1, f32, Int8, Q4_1, SHA-256, pull request #3143.",
        "H2O and SnapKV against Gemma 3n's shared layers and DeepSeek-V3.",
        "An inline formula $2 \\cdot L \\cdot\n B$ spans a line.",
    ],
)
def test_what_is_not_a_measurement_passes(source):
    assert not typed_numbers(source), typed_numbers(source)
