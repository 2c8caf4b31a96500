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
