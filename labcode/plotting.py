"""Figures made for the book's page: one column wide, fonts readable at that width, at most six
colours, and a transparent background that works in the light and the dark theme.

Introduced in chapter 1 and used by every chapter that plots. The book's text column is about
770 px wide; a figure of COLUMN_INCHES at DPI fills it at its natural size, so 10-point text is
about 15 px high on the page. Ink is dark on a transparent background; in dark mode the book
inverts each figure's lightness (book/_static/kvcv.css), so the palette holds colours of middle
lightness that stay distinct either way. Captions and alt text belong to the notebook cell that
shows the figure (see `caption_metadata`).
"""

from __future__ import annotations

from typing import Any

COLUMN_INCHES = 7.0  # the text column at 1280 px, at DPI
DPI = 110

# Six colours, distinct for the common colour-vision deficiencies (after Okabe and Ito), darkened
# or lightened to middle lightness so that they read on white and, inverted, on near-black.
COLOURS = ("#0f6fb0", "#d0591a", "#0d8f6a", "#b85c99", "#8a6d00", "#5f6b7a")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (1, 1)))
INK = "#262626"  # text, axes and ticks
GRID = "#c9ccd1"

_STYLE: dict[str, Any] = {
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "figure.facecolor": "none",
    "savefig.facecolor": "none",
    "savefig.transparent": True,
    "axes.facecolor": "none",
    "figure.figsize": (COLUMN_INCHES, 3.2),
    "figure.constrained_layout.use": True,
    "font.size": 10.5,
    "axes.titlesize": 11.5,
    "axes.labelsize": 10.5,
    "xtick.labelsize": 9.5,
    "ytick.labelsize": 9.5,
    "legend.fontsize": 9.5,
    "legend.frameon": False,
    "text.color": INK,
    "axes.labelcolor": INK,
    "axes.edgecolor": INK,
    "xtick.color": INK,
    "ytick.color": INK,
    "axes.titlecolor": INK,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": GRID,
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "lines.linewidth": 1.8,
    "lines.markersize": 5,
    "image.cmap": "Blues",  # more is darker on white and, inverted, lighter on black
}


def use_book_style() -> None:
    """Set matplotlib's defaults to the book's style for the rest of the session (the notebook)."""
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(_STYLE)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=list(COLOURS))


def figure(nrows: int = 1, ncols: int = 1, height: float = 3.2, width: float = COLUMN_INCHES, **subplots: Any):
    """A figure sized for the column, in the book's style: (fig, axes) as from plt.subplots.

    `height` in inches; several panels share the column's width (ncols > 2 makes small panels:
    prefer nrows). Sets the book's style first (`use_book_style`). Grids are on: turn them off
    on a heatmap (`ax.grid(False)`).
    """
    import matplotlib.pyplot as plt

    if not (isinstance(nrows, int) and isinstance(ncols, int) and nrows >= 1 and ncols >= 1):
        raise ValueError(f"nrows, ncols: expected positive ints, got {nrows!r}, {ncols!r}")
    if not 0 < width <= COLUMN_INCHES:
        raise ValueError(f"width: expected inches in (0, {COLUMN_INCHES}], got {width!r}")
    if not 0 < height <= 2 * COLUMN_INCHES:
        raise ValueError(f"height: expected inches in (0, {2 * COLUMN_INCHES}], got {height!r}")
    use_book_style()
    return plt.subplots(nrows, ncols, figsize=(width, height), **subplots)


def check_series(ax, most: int = len(COLOURS)) -> int:
    """Raise ValueError if the axes `ax` draws more than `most` labelled series; return how many it draws.

    More lines than colours cannot be told apart: split the panel, or summarise (a median with a band).
    """
    labelled = [h for h in ax.get_legend_handles_labels()[1] if not h.startswith("_")]
    if len(labelled) > most:
        raise ValueError(f"ax: expected at most {most} labelled series, got {len(labelled)}: {labelled}")
    return len(labelled)


def caption_metadata(caption: str, alt: str, name: str) -> dict[str, dict[str, Any]]:
    """The cell metadata that gives a figure a numbered caption and alt text in the book (myst-nb).

    Put the result under the key "mystnb" of the metadata of the cell that shows the figure;
    `name` is the label that {numref}`name` refers to. Raises ValueError on an empty or path-like
    alt text, which screen readers would read out instead of a description.
    """
    for argument, value in (("caption", caption), ("alt", alt), ("name", name)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{argument}: expected a non-empty string, got {value!r}")
    if alt.rstrip().lower().endswith((".png", ".svg", ".jpg", ".jpeg")) or "/" in alt.split(" ")[0]:
        raise ValueError(f"alt: expected a description of the figure, got a file name {alt!r}")
    return {"figure": {"caption": caption, "name": name}, "image": {"alt": alt}}
