"""Notebook code is written for the book's column: formatted by ruff at 88 characters a line, which
fit a code cell at 1280 px without scrolling (tests/test_browser.py checks the page itself).

To fix a notebook: `.venv/bin/ruff format --line-length 88 notebooks/NN_slug.ipynb`, then shorten
by hand what the formatter cannot break (comments, strings), and re-execute the notebook.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = 88
NOTEBOOKS = sorted(str(p.relative_to(ROOT)) for d in ("notebooks", "qa") for p in (ROOT / d).glob("*.ipynb"))


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = Path(sys.executable).with_name("ruff")
    return subprocess.run([str(ruff), *args], capture_output=True, text=True, cwd=ROOT)


def test_there_are_notebooks_to_check():
    assert any(n.startswith("notebooks/") for n in NOTEBOOKS) and any(n.startswith("qa/") for n in NOTEBOOKS)


def test_notebook_code_is_formatted_for_the_column():
    out = _ruff("format", "--check", "--output-format", "concise", "--line-length", str(COLUMNS), *NOTEBOOKS)
    files = {line.split(":")[0] for line in out.stdout.splitlines() if ": unformatted:" in line}
    assert out.returncode == 0, (
        f"{len(files)} notebooks are not formatted to {COLUMNS} columns (first difference shown):\n"
        + out.stdout
        + out.stderr
        + f"\nrun: .venv/bin/ruff format --line-length {COLUMNS} <notebook>"
    )


@pytest.mark.parametrize("folder", ["notebooks", "qa"])
def test_notebook_code_lines_fit_the_column(folder):
    """What the formatter leaves long (a comment, a string) is shortened by hand; a line that is a
    single long word, such as a URL, is allowed (ruff's E501 rule)."""
    files = [n for n in NOTEBOOKS if n.startswith(f"{folder}/")]
    out = _ruff("check", "--select", "E501", "--line-length", str(COLUMNS), "--output-format", "concise",
                "--no-cache", *files)
    long_lines = [line for line in out.stdout.splitlines() if "E501" in line]
    assert out.returncode == 0 and not long_lines, (
        f"{len(long_lines)} code lines in {folder}/ are longer than {COLUMNS} characters:\n" + "\n".join(long_lines)
    )


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_a_chapter_opens_with_its_imports_folded(path):
    """The setup cell (a chapter's first code cell: its imports) is folded on the page (`hide-input`: a
    "show code" toggle) or removed, so that a chapter opens with its prose and pictures, not plumbing."""
    import json

    cells = json.loads(path.read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    tags = set(first.get("metadata", {}).get("tags", []))
    assert tags & {"hide-input", "remove-input", "remove-cell"}, f"{path.name}: the setup cell is shown in full"


def test_notebook_code_passes_the_projects_lint():
    """Notebook code is held to the project's own lint rules (pyproject.toml: pyflakes, bugbear, import
    order, upgrades), as labcode is: a loop variable a closure does not bind, a zip() that would
    silently drop a tail, an unused name, imports out of order."""
    out = _ruff("check", "--output-format", "concise", "--no-cache", *NOTEBOOKS)
    findings = [line for line in out.stdout.splitlines() if ".ipynb:" in line]
    assert out.returncode == 0 and not findings, f"{len(findings)} lint findings:\n" + "\n".join(findings)


# Printed output wraps at the column on a phone (book/_static/kvcv.css), which would break the
# columns of a table printed with padding; a cell whose output is set in columns carries this tag,
# and its output keeps its lines whole and scrolls sideways instead.
COLUMNS_TAG = "output-columns"
WIDEST_COLUMNS_LINE = 100  # a tagged output scrolls at most about twice a phone's width


def _printed(cell: dict) -> list[list[str]]:
    """The lines of each text a code cell printed (stdout, stderr)."""
    return [
        "".join(o.get("text", "")).rstrip("\n").split("\n")
        for o in cell.get("outputs", [])
        if o.get("output_type") == "stream"
    ]


def _padded_lines(lines: list[str]) -> int:
    """Lines that hold a run of two or more spaces between two words: padding that sets columns."""
    import re

    return sum(1 for line in lines if re.search(r"\S {2,}\S", line))


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_output_set_in_columns_keeps_its_lines(path):
    """An output with two or more padded lines, none longer than WIDEST_COLUMNS_LINE, is a table:
    its cell carries the output-columns tag. A tagged cell prints two or more lines, none longer
    than that (a long line, such as an error message, reads better wrapped)."""
    import json

    untagged, misused = [], []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        tagged = COLUMNS_TAG in cell.get("metadata", {}).get("tags", [])
        for lines in _printed(cell):
            widest = max(len(line) for line in lines)
            if not tagged and _padded_lines(lines) >= 2 and widest <= WIDEST_COLUMNS_LINE:
                untagged.append(f"cell {i}: {lines[0][:60]!r}")
            if tagged and (len(lines) < 2 or widest > WIDEST_COLUMNS_LINE):
                misused.append(f"cell {i}: {len(lines)} lines, the widest {widest} characters")
    assert not untagged, f"{path.name}: outputs in columns without the {COLUMNS_TAG} tag: {untagged}"
    assert not misused, f"{path.name}: the {COLUMNS_TAG} tag on output that should wrap: {misused}"
