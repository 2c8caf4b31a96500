"""How the notebooks show results: tables, differences, claims and glued numbers.

Used by every chapter. Committed notebook outputs are compared on every CI run, on machines
whose CPUs round float32 (and even float64 at 1e-14) differently, so what a notebook prints must
be the same everywhere: counts and ids exactly, a rounding-level difference as the claim it
supports (`claim`), other floats only to the digits their sentence needs.
"""

from __future__ import annotations

import decimal
import html
import math

import torch


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute elementwise difference of two tensors, computed in float64."""
    return (a.double() - b.double()).abs().max().item()


def claim(value: float, bound: float, what: str = "rounding") -> str:
    """The claim a rounding-level `value` supports, "≤ 1e-12 (rounding)"; raises AssertionError if it
    fails, and for a NaN or an infinity, which measured nothing.

    Its digits depend on the CPU, so a page shows the bound it is held to; the exact value
    belongs in a result file or in a hidden cell.
    """
    # NaN fails "<=" on its own; -inf would pass it, and an infinity measured nothing either.
    assert math.isfinite(value) and value <= bound, f"{what}: expected at most {bound:g}, got {value!r}"
    return f"≤ {bound_text(bound)} ({what})"


def bound_text(bound: float) -> str:
    """A tolerance as a page writes it: 1e-12, 1e-4 (not 1e-04)."""
    return f"{bound:.0e}".replace("e-0", "e-").replace("e+0", "e")


def within(value: float, bound: float, digits: int = 2) -> str:
    """'≤1e-12' when `value` is at most `bound` (its digits are rounding and move between CPUs), else the value."""
    return f"≤{bound_text(bound)}" if math.isfinite(value) and value <= bound else sig(value, digits)


def sig(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, without a trailing '.0' for whole numbers."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    text = f"{value:.{digits}g}"
    return text[:-2] if text.endswith(".0") else text


def listed(items) -> str:
    """Items as prose lists them: 'a', 'a and b', 'a, b and c' (each written with str)."""
    words = [str(x) for x in items]
    if not words:
        raise ValueError("items: expected at least one, got none")
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def num(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, written out with thousands separators: 1,100 and 0.5,
    never 1.1e+03 (`sig` for values below 1e-4, which need the exponent)."""
    if value == 0 or not math.isfinite(value) or abs(value) < 1e-4:
        return sig(value, digits)
    rounded = float(f"{value:.{digits}g}")
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    text = f"{rounded:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def num_down(value: float, digits: int = 3) -> str:
    """`value` as `num` writes it, rounded down instead of to the nearest: a bound said "at least"
    must not exceed what was measured (0.0506 at 2 digits is 0.05, not 0.051)."""
    return num(_rounded(value, digits, decimal.ROUND_FLOOR), digits)


def num_up(value: float, digits: int = 3) -> str:
    """`value` as `num` writes it, rounded up instead of to the nearest: a bound said "up to" or
    "at most" must not fall below what was measured (4.524 at 3 digits is 4.53, not 4.52)."""
    return num(_rounded(value, digits, decimal.ROUND_CEILING), digits)


def _rounded(value: float, digits: int, rounding: str) -> float:
    """`value` to `digits` significant digits in the direction `rounding`, in decimal arithmetic on the
    shortest decimal that reads back as `value` (0.05 stays 0.05 both ways)."""
    if value == 0 or not math.isfinite(value):
        return value
    exact = decimal.Decimal(repr(float(value)))
    step = decimal.Decimal(1).scaleb(exact.adjusted() - digits + 1)
    return float(exact.quantize(step, rounding=rounding))


def num_beside(value: float, target: float, digits: int = 3) -> str:
    """`value` as `num` writes it, with more digits (up to 6) while it would read the same as
    `target` without being equal to it: 1.302 against a target of 1.3, not 1.3."""
    while digits < 6 and value != target and num(value, digits) == num(target, 6):
        digits += 1
    return num(value, digits)


GLUE_PREFIX = "application/papermill.record/"  # myst-nb's mime prefix of a glued, hidden output


def glue(name: str, value, display: bool = False) -> None:
    """myst-nb's `glue`, hidden by default: the page inserts `value` where the text says {glue:text}`name`.

    Glued values are compared by nbval like any output, so glue counts, ids and claims as they are,
    and a measured float rounded to the digits the sentence needs (`sig`).
    """
    # What myst-nb's own `glue` (myst_nb.ext.glue) displays, without importing it: that module imports
    # nbformat and jsonschema, seconds of start-up in every notebook's kernel for one display call.
    import IPython
    from IPython.display import display as ipy_display

    bundle, metadata = IPython.core.formatters.format_display_data(value)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


def show_table(header: list[str], rows: list[list], align: str | None = None) -> None:
    """Show a table: HTML in the book, aligned plain text in the notebook's saved output.

    `align` has one letter per column, "l" or "r" (default: numbers right, text left).
    """
    from IPython.display import display

    columns = list(zip(header, *rows, strict=True))
    if align is None:
        align = "".join("r" if all(isinstance(x, (int, float)) for x in col[1:]) else "l" for col in columns)
    widths = [max(len(str(x)) for x in col) for col in columns]
    pad = lambda x, w, a: str(x).rjust(w) if a == "r" else str(x).ljust(w)  # noqa: E731
    text = "\n".join("  ".join(pad(x, w, a) for x, w, a in zip(r, widths, align, strict=True)).rstrip()
                     for r in [header, *rows])
    cell = lambda x, tag, a: f'<{tag} class="kvcv-{a}">{html.escape(str(x))}</{tag}>'  # noqa: E731
    head = "".join(cell(h, "th", a) for h, a in zip(header, align, strict=True))
    body = "".join("<tr>" + "".join(cell(x, "td", a) for x, a in zip(r, align, strict=True)) + "</tr>" for r in rows)
    table = f'<table class="table kvcv-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    display({"text/html": f'<div class="kvcv-table-wrap">{table}</div>', "text/plain": text}, raw=True)
