"""labcode.plotting makes figures for the book's column, and labcode.cost counts an int8 cache's
bytes as QuantizedCache stores them (the explorer shows the same count)."""

from __future__ import annotations

import io
import subprocess
import sys

import matplotlib
import pytest
import torch
from matplotlib.colors import to_rgb

from labcode.cost import quantized_kv_cache_bytes
from labcode.engines import QuantizedCache

matplotlib.use("Agg")

from labcode import plotting  # noqa: E402


@pytest.fixture(autouse=True)
def default_style():
    """Each test starts from matplotlib's defaults, and leaves them as it found them."""
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_importing_plotting_changes_no_matplotlib_setting():
    code = (
        "import matplotlib as mpl; before = dict(mpl.rcParams); import labcode.plotting;"
        "assert dict(mpl.rcParams) == before"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_figure_fills_the_column_on_a_transparent_background():
    fig, ax = plotting.figure(height=3)
    ax.plot([0, 1], [1, 2], label="a")
    assert tuple(fig.get_size_inches()) == (plotting.COLUMN_INCHES, 3)
    assert fig.dpi == plotting.DPI
    assert fig.patch.get_alpha() == 0 or fig.get_facecolor()[3] == 0
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    from PIL import Image

    image = Image.open(io.BytesIO(buf.getvalue()))
    assert image.mode == "RGBA" and image.getpixel((1, 1))[3] == 0, "the corner is not transparent"
    assert image.size[0] == round(plotting.COLUMN_INCHES * plotting.DPI)
    # 10-point text or larger: at DPI, at least 14 px high on the page.
    sizes = [ax.xaxis.label.get_fontsize(), ax.get_xticklabels()[0].get_fontsize()]
    assert min(sizes) * plotting.DPI / 72 >= 14, sizes


def _png_of(fig) -> tuple[object, dict, dict]:
    """page_png's image (PIL), its text records and its output metadata."""
    import base64

    from PIL import Image

    data, metadata = plotting.page_png(fig)
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    return image, image.text, metadata


def test_page_png_is_drawn_twice_as_fine_and_records_its_smallest_text():
    fig, ax = plotting.figure(height=3)
    ax.plot([0, 1], [1, 2], label="a")
    ax.legend()
    ax.set(xlabel="step", title="a title")
    image, text, metadata = _png_of(fig)
    # Shown at PAGE_DPI: the output's width is the PNG's over RETINA, about the column's inches.
    assert metadata == {"width": round(image.size[0] / plotting.RETINA)}
    assert abs(metadata["width"] - plotting.COLUMN_INCHES * plotting.PAGE_DPI) < 0.05 * metadata["width"]
    assert float(text[plotting.PNG_SCALE_KEY]) == plotting.RETINA
    assert float(text[plotting.PNG_TEXT_KEY]) == round(plotting.MIN_TEXT_PT * plotting.PAGE_DPI / 72, 2)
    ax.annotate("small print", (0.5, 1.5), fontsize=7)
    _, text, _ = _png_of(fig)
    assert float(text[plotting.PNG_TEXT_KEY]) == round(7 * plotting.PAGE_DPI / 72, 2)


def test_the_style_is_sized_for_a_phone():
    """The style's smallest text, on a full-width figure shrunk to a 390 px phone's 358 px column,
    is at least 9 px (the threshold tests/test_browser.py measures every figure against)."""
    plotting.use_book_style()
    sizes = [matplotlib.rcParams[k] for k in ("font.size", "axes.titlesize", "axes.labelsize", "xtick.labelsize",
                                             "ytick.labelsize", "legend.fontsize")]
    assert min(sizes) == plotting.MIN_TEXT_PT
    on_phone = plotting.MIN_TEXT_PT * plotting.PAGE_DPI / 72 * 358 / (plotting.COLUMN_INCHES * plotting.PAGE_DPI)
    assert on_phone >= 9, on_phone


def test_drawn_texts_skip_what_a_draw_does_not_show():
    fig, (ax, hidden) = plotting.figure(1, 2, height=2)
    ax.text(0.5, 0.5, "shown", fontsize=15)
    ax.text(0.5, 0.2, "   ")
    ax.text(0.5, 0.7, "invisible").set_visible(False)
    hidden.set_axis_off()  # its tick labels are not drawn
    hidden.text(0.5, 0.5, "diagram", fontsize=11)
    fig.canvas.draw()
    texts = {t.get_text() for t in plotting.drawn_texts(fig)}
    assert {"shown", "diagram"} <= texts
    assert not texts & {"   ", "invisible"}
    assert not [t for t in plotting.drawn_texts(fig) if t.axes is hidden and t.get_text() != "diagram"]


def test_a_notebook_shows_figures_as_page_png_draws_them():
    """In IPython, figure() makes the PNG formatter of every matplotlib figure page_png."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        fig, ax = plotting.figure(height=2)
        ax.plot([0, 1])
        data, metadata = shell.display_formatter.format(fig)
        assert metadata["image/png"]["width"] * plotting.RETINA >= 1000
        assert data["image/png"] == plotting.page_png(fig)[0]
    finally:
        InteractiveShell.clear_instance()


def test_six_distinct_colours_of_middle_lightness():
    colours = [to_rgb(c) for c in plotting.COLOURS]
    assert len(set(plotting.COLOURS)) == len(colours) <= 6
    fig, ax = plotting.figure()
    lines = [ax.plot([0, 1])[0] for _ in plotting.COLOURS]
    assert [line.get_color() for line in lines] == list(plotting.COLOURS)
    for rgb in colours:  # relative luminance: dark enough on white, light enough once inverted on black
        lum = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
        assert 0.12 < lum < 0.5, (rgb, lum)


def test_check_series_refuses_more_lines_than_colours():
    fig, ax = plotting.figure()
    for i in range(7):
        ax.plot([0, 1], [i, i], label=f"s{i}")
    with pytest.raises(ValueError, match="ax: expected at most 6 labelled series, got 7"):
        plotting.check_series(ax)
    assert plotting.check_series(ax, most=7) == 7


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 9}, "width: expected inches"),
        ({"height": 0}, "height: expected inches"),
        ({"nrows": 0}, "nrows, ncols: expected positive ints"),
    ],
)
def test_figure_rejects_sizes_that_do_not_fit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plotting.figure(**kwargs)


def test_caption_metadata_is_what_myst_nb_reads():
    meta = plotting.caption_metadata("Cache bytes per token.", "Bars for MHA, GQA and MQA, tallest first.", "fig-bytes")
    assert meta == {
        "figure": {"caption": "Cache bytes per token.", "name": "fig-bytes"},
        "image": {"alt": "Bars for MHA, GQA and MQA, tallest first."},
    }
    with pytest.raises(ValueError, match="alt: expected a description"):
        plotting.caption_metadata("c", "../_images/abc.png", "n")
    with pytest.raises(ValueError, match="caption: expected a non-empty string"):
        plotting.caption_metadata(" ", "A description of the figure.", "n")


@pytest.mark.parametrize(
    ("n_layers", "batch", "tokens", "heads", "head_dim", "group"),
    [(12, 1, 9, 4, 64, None), (2, 3, 5, 2, 16, None), (2, 3, 5, 2, 16, 4), (1, 1, 1, 1, 8, 8)],
)
def test_quantized_bytes_are_what_the_quantized_cache_holds(n_layers, batch, tokens, heads, head_dim, group):
    cache = QuantizedCache(n_layers, group_size=group)
    g = torch.Generator().manual_seed(0)
    cache.begin((batch, heads, tokens, head_dim), torch.float32, "cpu")  # one pass, as the model makes it
    for layer in range(n_layers):
        cache.append(layer, torch.randn(batch, heads, tokens, head_dim, generator=g),
                     torch.randn(batch, heads, tokens, head_dim, generator=g))
    cache.end()
    assert cache.nbytes == quantized_kv_cache_bytes(n_layers, batch, tokens, heads, head_dim, group)
    if group is None:
        float32 = 2 * n_layers * batch * tokens * heads * head_dim * 4
        assert cache.nbytes / float32 == (head_dim + 4) / (4 * head_dim)


def test_quantized_bytes_reject_a_group_that_does_not_divide_the_head():
    with pytest.raises(ValueError, match="group_size: expected None or a positive divisor of head_dim=64, got 10"):
        quantized_kv_cache_bytes(1, 1, 1, 1, 64, 10)


def test_a_figure_reads_its_target_by_name_not_by_the_start_of_a_longer_one():
    from labcode.bench.plots import _goal

    record = {"targets": [{"name": "decode_near_floor_lean", "target": 9.0},
                          {"name": "decode_near_floor", "target": 1.3},
                          {"name": "compiled_near_floor_gpt2-124m", "target": 1.25}]}
    assert _goal(record, "decode_near_floor") == 1.3  # the exact name, though a longer one comes first
    assert _goal(record, "compiled_near_floor") == 1.25  # a family of per-preset targets: its first
