"""How notebooks write numbers on the page (labcode.display): no exponents where a reader expects digits."""

from __future__ import annotations

import pytest

from labcode.display import num, sig


@pytest.mark.parametrize("value,digits,text", [
    (1098.01, 2, "1,100"), (316.4, 2, "320"), (4640.2, 3, "4,640"), (112_345.0, 3, "112,000"),
    (0.5, 2, "0.5"), (0.4977, 3, "0.498"), (9.996, 3, "10"), (19.25, 3, "19.2"), (-2.5e6, 2, "-2,500,000"),
    (3.0, 3, "3"), (0.000123, 2, "0.00012"),
])
def test_num_writes_significant_digits_in_full(value, digits, text):
    assert num(value, digits) == text


def test_num_leaves_what_needs_an_exponent_to_sig():
    assert num(2.5e-7, 2) == sig(2.5e-7, 2) == "2.5e-07"
    assert num(0.0) == "0.0" and num(float("inf")) == "inf"
