"""Drift checks for the teaching copies in notebooks/02_why_caching_is_exact.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import pytest
import torch

import labcode.masks

SHAPES = [(t, s) for t in range(1, 9) for s in range(0, 12)]
BAD = [(0, 0), (0, 4), (-2, 3), (3, -1)]


def _check_mask(ours, theirs) -> None:
    for t, s in SHAPES:
        a, b = ours(t, s), theirs(t, s)
        assert a.dtype == b.dtype == torch.bool, (t, s)
        assert torch.equal(a, b), (t, s)
    for t, s in BAD:
        with pytest.raises(ValueError) as ours_err:
            ours(t, s)
        with pytest.raises(ValueError) as theirs_err:
            theirs(t, s)
        argument = str(theirs_err.value).split(":")[0]  # the message starts with the argument's name
        assert str(ours_err.value).startswith(argument + ":"), (t, s, str(ours_err.value), argument)


def check_causal_mask(ns: dict) -> None:
    """Equal masks for every small (T, S), the default S = 0, and the same errors."""
    _check_mask(ns["causal_mask"], labcode.masks.causal_mask)
    assert torch.equal(ns["causal_mask"](5), labcode.masks.causal_mask(5))


def check_upper_left_mask(ns: dict) -> None:
    """Equal (wrong) masks for every small (T, S), and the same errors."""
    _check_mask(ns["upper_left_mask"], labcode.masks.upper_left_mask)


CHECKS = {
    "labcode/masks.py::causal_mask": check_causal_mask,
    "labcode/masks.py::upper_left_mask": check_upper_left_mask,
}
