"""The diagrams of chapters 5 and 9 (`labcode.diagrams`) show the caches' real state: views copy it, drawings
show it."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # draw off screen, whatever MPLBACKEND says

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.patches import FancyArrowPatch, Polygon

from labcode.caches import CacheError, ConcatCache, GrowableCache, RingCache, WindowCache
from labcode.diagrams import (
    buffer_history,
    buffers_figure,
    cells_view,
    draw_buffers,
    draw_cells,
    draw_paged,
    paged_view,
)
from labcode.engines import BlockPool, CellsCache, PagedCache


def feed(cache, n: int) -> None:
    kv = torch.zeros(1, 1, n, 2, dtype=torch.float64)
    cache.feed(kv, kv)


@pytest.fixture
def forked():
    """Sequence a of 6 positions in blocks of 4, forked into b, and each one position longer."""
    pool = BlockPool(1, n_blocks=8, block_size=4)
    a = PagedCache(pool)
    feed(a, 6)
    b = a.fork()
    feed(a, 1)  # a writes into the shared partial block first: it gets a copy
    feed(b, 1)
    return a, b


def texts_of(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_paged_view_copies_tables_counts_and_text(forked):
    a, b = forked
    view = paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"})
    assert view.tables == {"a": (0, 2), "b": (0, 1)} and view.refcount[:3] == (2, 1, 1)
    feed(a, 1)
    assert view.tables["a"] == (0, 2)  # a copy of that moment, not a live reference


def test_draw_paged_shows_every_table_entry_block_and_character(forked):
    a, b = forked
    fig, ax = plt.subplots()
    draw_paged(ax, paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"}), title="t")
    texts = texts_of(ax)
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(arrows) == 4  # one per block-table entry
    assert "#0 ref 2" in texts and "#2 ref 1" in texts and "#3 free" in texts  # up to one past the last used
    assert texts.count("→ #0") == 2 and "→ #2" in texts and "→ #1" in texts
    assert texts.count("!") == 2 and texts.count("l") == 2 and texts.count("␣") == 3  # b's block; a's; block 0 thrice
    plt.close(fig)


def test_paged_view_rejects_what_it_cannot_draw(forked):
    a, b = forked
    stranger = PagedCache(BlockPool(1, 4, 4))
    with pytest.raises(CacheError, match=r"caches: expected sequences of one BlockPool, got 2 pools"):
        paged_view({"a": a, "x": stranger}, {"a": "The owl", "x": ""})
    with pytest.raises(CacheError, match=r"texts: expected 7 characters for sequence 'b', got 3"):
        paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The"})
    with pytest.raises(CacheError, match=r"caches: expected a dict of one or two PagedCaches"):
        paged_view({"a": a, "b": b, "c": a}, {"a": "The owl", "b": "The ow!", "c": "The owl"})


def test_cells_view_and_drawing_show_owners_positions_and_head():
    cache = CellsCache(1, 8, n_seqs=3)
    cache.plan([0, 0, 1, 1, 1])
    feed(cache, 5)
    cache.seq_rm(1, 0, 1)  # frees cell 2 (sequence 1's position 0): the head moves back to it
    cache.seq_cp(0, 2, 0, 1)  # cell 0 now has two owners
    view = cells_view(cache, names="ABC")
    assert view.pos == (0, 1, -1, 1, 2, -1, -1, -1) and view.owners[:5] == ("AC", "A", "", "B", "B")
    assert view.head == 2
    fig, ax = plt.subplots()
    draw_cells(ax, view, title="t", per_row=4)
    texts = texts_of(ax)
    assert [t for t in texts if t.isdigit() and len(t) == 1][:3] == ["0", "0", "1"]  # row label 0, cells 0 and 1
    assert texts.count("·") == 4 and "head" in texts and "4" in texts  # empty cells; head; the second row's label
    assert len([p for p in ax.patches if isinstance(p, Polygon)]) == 1
    stripes = [p for p in ax.patches if p.get_alpha() == 0.45]
    assert len(stripes) == 5  # one per owner: two in cell 0, one each in cells 1, 3 and 4
    plt.close(fig)
    with pytest.raises(CacheError, match=r"names: expected one character for each of the 3 sequences, got AB"):
        cells_view(cache, names="AB")
    with pytest.raises(CacheError, match=r"cache: expected a CellsCache, got PagedCache"):
        cells_view(PagedCache(BlockPool(1, 2, 2)))


# -- chapter 5: one layer's key buffer after each pass ------------------------------------------------

CHUNKS = (3, 1, 2, 1, 4)


def test_buffer_history_of_the_window_shows_the_shift_and_the_drops():
    rows = buffer_history(WindowCache(1, 4), CHUNKS)
    assert [r.slots for r in rows] == [(0, 1, 2, None), (0, 1, 2, 3), (2, 3, 4, 5), (3, 4, 5, 6), (7, 8, 9, 10)]
    assert [r.new for r in rows] == [(0, 1, 2), (3,), (2, 3), (3,), (0, 1, 2, 3)]
    assert [r.copied for r in rows] == [(), (), (0, 1), (0, 1, 2), ()]  # the kept rows moved to the front
    assert [r.rows_copied for r in rows] == [0, 0, 2, 3, 0]
    assert [r.dropped for r in rows] == [0, 0, 2, 1, 4]


def test_buffer_history_of_concat_and_growable_shows_every_copy():
    concat = buffer_history(ConcatCache(1), CHUNKS)
    assert concat[-1].slots == tuple(range(11))
    assert [len(r.copied) for r in concat] == [r.rows_copied for r in concat] == [0, 3, 4, 6, 7]  # all old rows
    grow = buffer_history(GrowableCache(1, 4), CHUNKS)
    assert [len(r.slots) for r in grow] == [4, 4, 8, 8, 12]  # linear growth by the first capacity
    assert [len(r.copied) for r in grow] == [0, 0, 4, 0, 7]
    assert [r.rows_copied for r in grow] == [0, 0, 4, 0, 8]  # a growth copies the empty slot too
    assert grow[-1].slots[-1] is None


def test_buffer_history_of_a_ring_moves_nothing():
    rows = buffer_history(RingCache(1, 4), CHUNKS)
    assert all(r.copied == () and r.rows_copied == 0 for r in rows)
    assert sorted(p for p in rows[-1].slots if p is not None) == [7, 8, 9, 10]


def test_buffer_history_refuses_a_used_cache_and_a_miscounted_copy():
    used = WindowCache(1, 4)
    used.feed(torch.zeros(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64))
    with pytest.raises(CacheError, match="cache: expected a new cache of one layer"):
        buffer_history(used, CHUNKS)
    with pytest.raises(CacheError, match="cache: expected a new cache of one layer"):
        buffer_history(WindowCache(2, 4), CHUNKS)

    class Uncounted(WindowCache):  # a shift that forgets to count what it moves
        def _shift(self, layer, drop):
            before = self.rows_copied
            super()._shift(layer, drop)
            self.rows_copied = before

    with pytest.raises(CacheError, match="rows_copied to count the 2 old rows it copied"):
        buffer_history(Uncounted(1, 4), CHUNKS)


def test_draw_buffers_shows_every_position_and_what_each_pass_did():
    rows = buffer_history(WindowCache(1, 4), CHUNKS)
    fig, ax = plt.subplots()
    draw_buffers(ax, rows, "W = 4")
    texts = texts_of(ax)
    assert "W = 4" in texts and [f"+{t}" for t in CHUNKS] == [t for t in texts if t.startswith("+")]
    assert {str(p) for p in range(11)} <= set(texts)
    assert "copied 2, dropped 2" in texts and "dropped 4" in texts
    plt.close(fig)
    fig = buffers_figure({"a": rows, "b": buffer_history(ConcatCache(1), CHUNKS)})
    assert len(fig.axes) == 2 and fig.axes[0].get_legend() is not None
    plt.close(fig)
    with pytest.raises(CacheError, match="histories: expected a dict"):
        buffers_figure({})


def test_diagrams_small_print_is_legible_at_natural_size(forked):
    """A diagram keeps its natural size on a phone, so its smallest print is LABEL_FONT (about 12 px on the
    page at labcode.plotting.PAGE_DPI), block ids and reference counts included."""
    from labcode.diagrams import LABEL_FONT, cells_legend
    from labcode.plotting import PAGE_DPI, drawn_texts

    a, b = forked
    cells = CellsCache(1, 8, n_seqs=2)
    cells.plan([0, 0, 1])
    feed(cells, 3)
    histories = {"ConcatCache": buffer_history(ConcatCache(1), [3, 1])}
    fig, (paged, cell) = plt.subplots(2, 1)
    draw_paged(paged, paged_view({"a": a, "b": b}, {"a": "The owl", "b": "The ow!"}), title="t")
    draw_cells(cell, cells_view(cells), title="t")
    cells_legend(cell, "AB")
    for drawn in (fig, buffers_figure(histories)):
        drawn.canvas.draw()
        sizes = [t.get_fontsize() for t in drawn_texts(drawn)]
        assert sizes and min(sizes) >= LABEL_FONT, sorted(sizes)[:3]
        plt.close(drawn)
    assert LABEL_FONT * PAGE_DPI / 72 >= 12
