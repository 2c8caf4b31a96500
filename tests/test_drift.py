"""Teaching copies in the notebooks must keep matching their labcode originals.

A teaching copy is a code cell whose first line is
`# teaching copy of labcode/<module>.py::<Name>`. A from-scratch version, code written the way
the from-scratch books write it that must compute what a labcode object computes in one mode,
is a code cell whose first line is
`# from-scratch version of labcode/<module>.py::<Name> (<mode>)`, e.g. `(use_cache=True)`.
For each one, this test executes the notebook's setup cell and its marked cells (in notebook
order, up to and including that one) in a fresh namespace, then runs the checker registered
for `labcode/<module>.py::<Name>` (with ` (<mode>)` for a from-scratch version) in one of the
`tests/drift_checks_*.py` modules (a dict `CHECKS`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(
    r"^# (?:teaching copy of (labcode/[\w/]+\.py::\w+)"
    r"|from-scratch version of (labcode/[\w/]+\.py::\w+ \([\w=, ]+\)))\s*$"
)


def _code_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def teaching_copies() -> list[tuple[Path, str, int]]:
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, src in enumerate(_code_cells(path)):
            m = MARK.match(src.splitlines()[0]) if src.strip() else None
            if m:
                found.append((path, m.group(1) or m.group(2), i))
    return found


def registered_checks() -> dict:
    checks = {}
    for file in sorted(Path(__file__).parent.glob("drift_checks_*.py")):
        spec = importlib.util.spec_from_file_location(file.stem, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        overlap = set(checks) & set(module.CHECKS)
        assert not overlap, f"{file.name} registers checks twice: {overlap}"
        checks.update(module.CHECKS)
    return checks


COPIES = teaching_copies()
CHECKS = registered_checks()


def test_every_copy_has_a_check_and_every_check_a_copy():
    names = {name for _, name, _ in COPIES}
    assert names, "no teaching copies found in notebooks/"
    assert names - set(CHECKS) == set(), f"teaching copies without a drift check: {names - set(CHECKS)}"
    assert set(CHECKS) - names == set(), f"drift checks without a teaching copy: {set(CHECKS) - names}"


@pytest.mark.parametrize("path,name,index", COPIES, ids=[f"{p.stem}::{n}" for p, n, _ in COPIES])
def test_teaching_copy_matches_labcode(path, name, index):
    cells = _code_cells(path)
    namespace: dict = {"__name__": f"drift_{path.stem}"}
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()  # setup cells may change both
    try:
        exec(compile(cells[0], f"{path.name}[setup]", "exec"), namespace)
        for i in range(1, index + 1):
            if MARK.match((cells[i].splitlines() or [""])[0]):
                exec(compile(cells[i], f"{path.name}[cell {i}]", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
    CHECKS[name](namespace)
