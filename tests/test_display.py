"""How notebooks write numbers on the page (labcode.display): no exponents where a reader expects digits."""

from __future__ import annotations

import math
import random

import pytest

from labcode.display import listed, num, num_beside, num_down, num_up, sig


@pytest.mark.parametrize("value,digits,text", [
    (1098.01, 2, "1,100"), (316.4, 2, "320"), (4640.2, 3, "4,640"), (112_345.0, 3, "112,000"),
    (0.5, 2, "0.5"), (0.4977, 3, "0.498"), (9.996, 3, "10"), (19.25, 3, "19.2"), (-2.5e6, 2, "-2,500,000"),
    (3.0, 3, "3"), (0.000123, 2, "0.00012"),
])
def test_num_writes_significant_digits_in_full(value, digits, text):
    assert num(value, digits) == text


@pytest.mark.parametrize(
    "value, target, text",
    [(1.3016, 1.3, "1.302"), (1.2443, 1.3, "1.24"), (1.3, 1.3, "1.3"), (0.99996, 1.0, "0.99996")],
)
def test_num_beside_never_reads_as_its_target_unless_equal(value, target, text):
    assert num_beside(value, target) == text


@pytest.mark.parametrize("value, digits, down, up", [
    (0.0506, 2, "0.05", "0.051"), (1.3864, 3, "1.38", "1.39"), (4.524, 3, "4.52", "4.53"), (0.05, 2, "0.05", "0.05"),
    (9.996, 3, "9.99", "10"), (-1.234, 2, "-1.3", "-1.2"), (1234.5, 2, "1,200", "1,300"), (3.0, 2, "3", "3"),
])
def test_num_down_and_up_round_towards_the_side_a_bound_needs(value, digits, down, up):
    assert (num_down(value, digits), num_up(value, digits)) == (down, up)


def test_a_bound_said_at_least_or_up_to_is_never_on_the_wrong_side():
    """"at least num_down(x)" and "up to num_up(x)" stay true, and each is within one step of x."""
    rng = random.Random(0)
    for _ in range(2000):
        x, digits = rng.uniform(-1, 1) * 10 ** rng.randint(-4, 6), rng.randint(1, 4)
        down, up = (float(f(x, digits).replace(",", "")) for f in (num_down, num_up))
        step = 10 ** (math.floor(math.log10(abs(x))) - digits + 1)
        assert down <= x <= up and up - down <= step * (1 + 1e-9) and x - down < step and up - x < step


def test_num_leaves_what_needs_an_exponent_to_sig():
    assert num(2.5e-7, 2) == sig(2.5e-7, 2) == "2.5e-07"
    assert num(0.0) == "0.0" and num(float("inf")) == "inf"


@pytest.mark.parametrize("value", [3, "a claim", 1.5e-13, {"a": 1}])
@pytest.mark.parametrize("display", [False, True])
def test_glue_displays_what_myst_nb_s_glue_displays(monkeypatch, value, display):
    """labcode.display.glue avoids importing myst_nb.ext.glue (seconds per kernel) but must display
    exactly what it displays: the same bundle, prefix and scrapbook metadata, which the book reads."""
    import myst_nb.ext.glue as myst_glue

    import labcode.display

    shown = []
    record = lambda bundle, raw, metadata: shown.append((bundle, raw, metadata))  # noqa: E731
    monkeypatch.setattr("IPython.display.display", record)
    monkeypatch.setattr(myst_glue, "ipy_display", record)
    labcode.display.glue("name", value, display=display)
    myst_glue.glue("name", value, display=display)
    assert labcode.display.GLUE_PREFIX == myst_glue.GLUE_PREFIX
    assert len(shown) == 2 and shown[0] == shown[1]
    assert shown[0][2]["scrapbook"]["name"] == "name"


@pytest.mark.parametrize(("items", "text"), [([3], "3"), ([3, 1], "3 and 1"), (["a", "b", "c"], "a, b and c")])
def test_listed_lists_items_as_prose_does(items, text):
    assert listed(items) == text


def test_listed_refuses_an_empty_list():
    with pytest.raises(ValueError, match="at least one"):
        listed([])
