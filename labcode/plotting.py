"""Figures made for the book's page: one column wide, fonts readable on a desk and on a phone, at
most six colours, and a transparent background that works in the light and the dark theme.

Introduced in chapter 1 and used by every chapter that plots. A figure is at most COLUMN_INCHES
wide. The page shows it at PAGE_DPI CSS px per inch (a full-width figure is about 650 px wide on a
desk) and, on a 390 px phone, shrunk to the column's 358 px, so its text is sized for the phone: the
style's smallest text, MIN_TEXT_PT, is about 17 px on a desk and 9 px or more on a phone
(tests/test_browser.py measures every figure of the book there).

In a notebook, `use_book_style` also makes the figures' PNGs sharp on high-density screens: each is
drawn at RETINA times PAGE_DPI, shown at PAGE_DPI, and records the size of its smallest text
(`page_png`). DPI is matplotlib's own figure resolution (the notebook's "Figure size 770x330").

Ink is dark on a transparent background; in dark mode the book inverts each figure's lightness
(book/_static/kvcv.css), so the palette holds colours of middle lightness that stay distinct either
way. Captions and alt text belong to the notebook cell that shows the figure (see
`caption_metadata`).
"""

from __future__ import annotations

from typing import Any

COLUMN_INCHES = 7.0  # the widest figure: it fits the text column at 1280 px, at PAGE_DPI
DPI = 110  # matplotlib's figure.dpi (and savefig.dpi outside a notebook)
PAGE_DPI = 92  # CSS px per inch of a figure on the page
RETINA = 2  # PNG pixels per CSS pixel: sharp on a phone's or a laptop's high-density screen
MIN_TEXT_PT = 13  # the style's smallest text (ticks, legends): 9 px or more on a 390 px phone

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
    "font.size": 13.5,
    "axes.titlesize": 14,
    "axes.titlepad": 8,
    "axes.labelsize": 13.5,
    "xtick.labelsize": MIN_TEXT_PT,
    "ytick.labelsize": MIN_TEXT_PT,
    "legend.fontsize": MIN_TEXT_PT,
    "figure.titlesize": 14,
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
    """Set matplotlib's defaults to the book's style for the rest of the session (the notebook),
    and, in IPython, show figures as `page_png` draws them."""
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(_STYLE)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=list(COLOURS))
    _show_as_page_png()


def _show_as_page_png() -> None:
    """In IPython, display every figure as `page_png` draws it. Called again once a figure exists:
    the inline backend, loaded with the first figure, registers its own PNG formatter then."""
    import sys

    if "IPython" not in sys.modules:  # plain Python: nothing displays figures
        return
    from IPython import get_ipython
    from matplotlib.figure import Figure

    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, page_png)


def drawn_texts(fig) -> list:
    """The texts a draw of `fig` shows: visible, not empty, not on a switched-off axis."""
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.spines import Spine
    from matplotlib.text import Text

    found, todo = [], [fig]
    while todo:
        artist = todo.pop()
        if not artist.get_visible():
            continue
        if isinstance(artist, Text):
            if artist.get_text().strip():
                found.append(artist)
            continue
        children = artist.get_children()
        if isinstance(artist, Axes) and not artist.axison:
            children = [c for c in children if not isinstance(c, (Axis, Spine))]
        todo.extend(children)
    return found


PNG_TEXT_KEY = "kvcv-smallest-text-px"  # the PNG's own record of its smallest text, read by the browser test
PNG_SCALE_KEY = "kvcv-pixels-per-css-px"


def page_png(fig) -> tuple[str, dict[str, int]]:
    """`fig` as the book shows it: a PNG (base64) drawn at RETINA x PAGE_DPI, and its display width
    in CSS px (at PAGE_DPI) for the notebook's output metadata.

    The PNG records its smallest drawn text, in CSS px at the natural size (PNG_TEXT_KEY), so that a
    reader of the file (tests/test_browser.py) can tell how large that text is on a page.
    """
    import base64
    import io
    import struct

    fig.canvas.draw()  # lays the figure out, so every text it shows is placed and sized
    sizes = [t.get_fontsize() for t in drawn_texts(fig)]
    metadata = {PNG_SCALE_KEY: str(RETINA)}
    if sizes:
        metadata[PNG_TEXT_KEY] = f"{min(sizes) * PAGE_DPI / 72:.2f}"
    buf = io.BytesIO()
    fig.canvas.print_figure(
        buf, format="png", dpi=PAGE_DPI * RETINA, bbox_inches="tight", pad_inches=0.04, metadata=metadata
    )
    data = buf.getvalue()
    width = struct.unpack(">I", data[16:20])[0]  # the IHDR chunk's width
    return base64.b64encode(data).decode("ascii"), {"width": round(width / RETINA)}


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
    made = plt.subplots(nrows, ncols, figsize=(width, height), **subplots)
    _show_as_page_png()
    return made


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
