"""Drift checks for the teaching copies in notebooks/06_when_the_cache_changes_the_answer.ipynb
(see tests/test_drift.py)."""

from __future__ import annotations

import torch

import labcode.kshift


def check_shift_keys(ns: dict) -> None:
    """Equal shifted keys for several shapes, deltas, bases and dtypes."""
    ours, theirs = ns["shift_keys"], labcode.kshift.shift_keys
    gen = torch.Generator().manual_seed(0)
    for shape, dtype in [((1, 4, 6, 16), torch.float64), ((2, 2, 9, 8), torch.float32), ((1, 1, 1, 2), torch.float64)]:
        k = torch.randn(*shape, generator=gen, dtype=dtype)
        for delta in (-7, -1, 0, 3, 1000):
            for base in (10000.0, 500.0):
                a, b = ours(k, delta, base), theirs(k, delta, base)
                assert a.dtype == b.dtype and torch.equal(a, b), (shape, dtype, delta, base)
    # The teaching copy shows the rotation only; labcode's validation is tested in tests/test_kshift.py.

CHECKS = {
    "labcode/kshift.py::shift_keys": check_shift_keys,
}
