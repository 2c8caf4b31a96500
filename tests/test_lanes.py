"""The unit tests, run beside the notebooks when the whole suite runs (see conftest.py).

Run on their own (`pytest tests/test_caches.py`, or any selection without this file), the unit
tests run in the session itself and this test is skipped.
"""

from __future__ import annotations

import pytest


def test_unit_tests_beside_the_notebooks_pass(unit_lane):
    if unit_lane is None:
        pytest.skip("the unit tests ran in this session itself")
    returncode = unit_lane.process.wait()
    out = unit_lane.log.read_text()
    failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert returncode == 0, (f"the unit tests ({len(unit_lane.files)} files) failed:\n" + "\n".join(failed)
                             + "\n\n" + out[-8000:])
    last = out.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last, out[-2000:]
