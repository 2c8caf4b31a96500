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
