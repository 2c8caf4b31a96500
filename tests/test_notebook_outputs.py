"""What nbval compares is the same on every machine, by construction.

Committed notebook outputs are compared with fresh executions on CPUs whose vector kernels round
differently (`tests/test_portability.py` runs them under another kernel set). So: counts, ids and
verdicts are shown exactly; rounding-level differences as the claim they support
(`labcode.display.claim`), never as digits; a cell that must show a machine-dependent number
carries nbval's `nbval-ignore-output` tag and asserts its claim itself; and nothing is hidden from
nbval by comments in the code the reader sees, or by a sanitizer that blurs numbers.
"""

from __future__ import annotations

import ast
import configparser
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "qa").glob("*.ipynb"))
# A float printed with its rounding-level digits: 1.2e-14, 6.7e-06, 2.4e-16 (not 1e-12, which is a bound).
ROUNDING_DIGITS = re.compile(r"(?<![\w.])\d\.\d+e-(0[5-9]|[1-9]\d)\b")


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def ignored(cell: dict) -> bool:
    return "nbval-ignore-output" in cell.get("metadata", {}).get("tags", [])


def output_texts(cell: dict) -> list[str]:
    """Every text nbval compares: streams, and each text-like entry of displayed data (glued values too)."""
    texts = []
    for out in cell.get("outputs", []):
        texts.append("".join(out.get("text", "")))
        for mime, value in out.get("data", {}).items():
            if "text" in mime:
                texts.append("".join(value) if isinstance(value, list) else str(value))
    return texts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_compared_outputs_show_no_rounding_digits(path):
    found = [(i, m.group(0)) for i, cell in enumerate(code_cells(path)) if not ignored(cell)
             for text in output_texts(cell) for m in ROUNDING_DIGITS.finditer(text)]
    assert not found, (f"{path.name}: outputs nbval compares show rounding-level digits, which differ between "
                       f"CPUs (code cell, digits): {found[:8]}; show the claim instead (labcode.display.claim)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_excluded_output_belongs_to_a_cell_that_asserts_its_claim(path):
    weak = []
    for i, cell in enumerate(code_cells(path)):
        if not ignored(cell):
            continue
        source = "".join(cell["source"])
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        if not any(isinstance(node, ast.Assert) for node in ast.walk(tree)):
            weak.append(i)
    assert not weak, f"{path.name}: code cells {weak} are excluded from nbval but assert nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_nbval_is_steered_by_tags_and_threads_are_left_alone(path):
    for i, cell in enumerate(code_cells(path)):
        source = "".join(cell["source"])
        assert "NBVAL_" not in source, f"{path.name} code cell {i}: use nbval's cell tags, not comments the reader sees"
        assert "set_num_threads" not in source, (
            f"{path.name} code cell {i}: outputs must not depend on the thread count, so notebooks do not pin it")


def test_the_sanitizer_blurs_no_numbers():
    config = configparser.ConfigParser()
    config.read(ROOT / "sanitize.cfg")
    for section in config.sections():
        regex = re.compile(config[section]["regex"])
        for number in ("1.2e-14", "6.7e-06", "0.517", "2.9", "17", "1e-12"):
            assert not regex.search(number), f"sanitize.cfg [{section}] would hide the number {number}"
