"""Diagrams of the caches' data structures, drawn from the objects themselves.

Introduced in chapter 5 (`buffer_history` and `draw_buffers`: a cache's key buffer after each pass)
and used again in chapter 9 (`paged_view`, `cells_view`: the engines' block pools and cells). A view
copies what a diagram needs from live caches; a `draw_` function draws it on a matplotlib axes in
the book's style (`labcode.plotting`). Drawn from the objects, a diagram cannot drift from the code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labcode.caches.base import CacheError, KVCache
from labcode.checks import fail
from labcode.engines.cells import CellsCache
from labcode.engines.paged import PagedCache
from labcode.plotting import COLOURS, INK

NEW, COPIED = COLOURS[0], COLOURS[1]  # buffer diagrams: rows a pass wrote; old rows it copied or moved
SHARED = COLOURS[0]  # a block or cell held by several sequences
OWN = COLOURS[1:5]  # then one colour per sequence
FREE = "#9aa0a8"  # outlines of free blocks and empty cells
# Font sizes, in points: a diagram keeps its natural size on a phone (it scrolls sideways), so its
# smallest print, 9.5 points, is about 14 px there and on a desk.
SLOT_FONT = 9.5  # the character or position a slot holds
LABEL_FONT = 9.5  # block ids, reference counts, table entries, row numbers, the head marker
NAME_FONT = 11  # sequence names, "pool"
TITLE_FONT = 11
ROW_GAP = 4.0  # between the pool's slots and a sequence's, in slot widths


@dataclass(frozen=True)
class PagedView:
    """Sequences of one block pool at one moment: their block tables, lengths and text, and the pool's counts."""

    block_size: int
    refcount: tuple[int, ...]  # per physical block
    tables: dict[str, tuple[int, ...]]  # sequence name -> physical block of each logical block
    texts: dict[str, str]  # sequence name -> its tokens, one character per position


def paged_view(caches: dict[str, PagedCache], texts: dict[str, str]) -> PagedView:
    """What `draw_paged` needs from `caches` (one pool) now; `texts[name]` holds one character per position."""
    ok = isinstance(caches, dict) and 1 <= len(caches) <= 2
    if not (ok and all(isinstance(c, PagedCache) for c in caches.values())):
        fail("caches", "a dict of one or two PagedCaches (drawn above and below the pool)", caches, CacheError)
    pools = {id(c.pool) for c in caches.values()}
    if len(pools) != 1:
        fail("caches", "sequences of one BlockPool", f"{len(pools)} pools", CacheError)
    for name, cache in caches.items():
        if len(texts.get(name, "")) != cache.position:
            got = len(texts[name]) if name in texts else "none"
            fail("texts", f"{cache.position} characters for sequence {name!r}", got, CacheError)
    pool = next(iter(caches.values())).pool
    tables = {name: tuple(c.table) for name, c in caches.items()}
    return PagedView(pool.block_size, tuple(pool.refcount), tables, {n: texts[n] for n in caches})


def _box(ax, x: float, y: float, w: float, h: float, fill: str | None, edge: str = INK, alpha: float = 0.3):
    from matplotlib.patches import Rectangle

    if fill is not None:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=fill, alpha=alpha, linewidth=0))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=edge, linewidth=0.8))


def _slots(ax, x: float, y: float, chars: list[str], size: int) -> None:
    """One block's `size` slots at (x, y), each one unit wide, with the characters it holds."""
    for j in range(size):
        _box(ax, x + j, y, 1, 1, None, edge=INK if j < len(chars) else FREE)
        if j < len(chars):
            char = "␣" if chars[j] == " " else chars[j]
            ax.text(x + j + 0.5, y + 0.5, char, ha="center", va="center", fontsize=SLOT_FONT, color=INK,
                    family="monospace")


def draw_paged(ax, view: PagedView, title: str = "", n_blocks: int | None = None) -> None:
    """Each sequence's logical blocks (their characters, and the physical block its table names) above or below
    the pool's physical blocks (characters, id and reference count), with an arrow per table entry. `n_blocks`
    physical blocks are drawn (default: up to one past the highest in use)."""
    from matplotlib.patches import FancyArrowPatch

    bs, names = view.block_size, list(view.tables)
    used = {b for t in view.tables.values() for b in t}
    n_blocks = min(len(view.refcount), max(used, default=-1) + 2) if n_blocks is None else n_blocks
    step, strip = bs + 1, 0.9  # block width plus a gap; the label strip under a block's slots
    holders = {b: [n for n in names if b in view.tables[n]] for b in range(n_blocks)}
    content: dict[int, list[str]] = {}
    for name in names:
        for i, block in enumerate(view.tables[name]):
            content.setdefault(block, list(view.texts[name][i * bs : (i + 1) * bs]))
    rows = dict(zip(names, (ROW_GAP, -ROW_GAP), strict=False))  # the first sequence above the pool, the second below
    for b in range(n_blocks):  # the pool, at y = 0
        x = b * step
        who = holders[b]
        fill = None if not who else SHARED if len(who) > 1 else OWN[names.index(who[0]) % len(OWN)]
        _box(ax, x, -strip, bs, 1 + strip, fill, edge=INK if who else FREE)
        _slots(ax, x, 0, content.get(b, []) if who else [], bs)
        label = f"#{b} ref {view.refcount[b]}" if who else f"#{b} free"
        ax.text(x + bs / 2, -strip / 2, label, ha="center", va="center", fontsize=LABEL_FONT,
                color=INK if who else FREE)
    for name in names:
        y, table = rows[name], view.tables[name]
        colour = OWN[names.index(name) % len(OWN)]
        for i, block in enumerate(table):
            x = i * step
            _box(ax, x, y - strip, bs, 1 + strip, colour, alpha=0.12)
            _slots(ax, x, y, list(view.texts[name][i * bs : (i + 1) * bs]), bs)
            ax.text(x + bs / 2, y - strip / 2, f"→ #{block}", ha="center", va="center", fontsize=LABEL_FONT,
                    color=INK)
            start = (x + bs / 2, y - strip) if y > 0 else (x + bs / 2, y + 1)
            end = (block * step + bs / 2, 1 if y > 0 else -strip)
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, color=colour,
                                         linewidth=1.0, shrinkA=1, shrinkB=1))
        ax.text(-0.6, y + (1 - strip) / 2, name, ha="right", va="center", fontsize=NAME_FONT, color=INK,
                fontweight="bold")
    ax.text(-0.6, (1 - strip) / 2, "pool", ha="right", va="center", fontsize=NAME_FONT, color=INK,
            fontweight="bold")
    top, bottom = max(rows.values(), default=0) + 1.2, min(min(rows.values(), default=0) - strip, -strip) - 0.3
    ax.set(xlim=(-4.2, n_blocks * step), ylim=(bottom, top + (0.9 if title else 0.2)))
    if title:
        ax.text(-4.2, top + 0.8, title, ha="left", va="top", fontsize=TITLE_FONT, color=INK)
    ax.set_aspect("equal")
    ax.set_axis_off()


@dataclass(frozen=True)
class CellsView:
    """A cells cache at one moment: each cell's position (-1 empty) and owner names, and the head."""

    pos: tuple[int, ...]
    owners: tuple[str, ...]  # the names of the sequences owning each cell, "" for none
    head: int
    names: str  # one character per sequence id


def cells_view(cache: CellsCache, names: str = "ABCDEFGH") -> CellsView:
    """What `draw_cells` needs from `cache` now; sequence s is drawn as names[s]."""
    if not isinstance(cache, CellsCache):
        fail("cache", "a CellsCache", type(cache).__name__, CacheError)
    if len(names) < cache.n_seqs:
        fail("names", f"one character for each of the {cache.n_seqs} sequences", names, CacheError)
    owners = tuple("".join(names[s] for s in range(cache.n_seqs) if cache.owners[j, s]) for j in range(cache.n_cells))
    return CellsView(tuple(int(p) for p in cache.pos), owners, cache.head, names[: cache.n_seqs])


def draw_cells(ax, view: CellsView, title: str = "", per_row: int = 16) -> None:
    """The cells in rows of `per_row`: each shows its position, filled with one stripe per owning sequence;
    a triangle marks the head, where the next slot search starts."""
    from matplotlib.patches import Polygon

    n = len(view.pos)
    rows = -(-n // per_row)
    gap, row_h = 0.12, 1.7  # between cells; between rows (room for the head marker)
    for j in range(n):
        x, y = (j % per_row) * (1 + gap), -(j // per_row) * row_h
        who = view.owners[j]
        for k, name in enumerate(who):  # one vertical stripe per owner
            colour = OWN[view.names.index(name) % len(OWN)]
            _box(ax, x + k / len(who), y, 1 / len(who), 1, colour, edge="none", alpha=0.45)
        _box(ax, x, y, 1, 1, None, edge=INK if who else FREE)
        text = f"{view.pos[j]}" if view.pos[j] >= 0 else "·"
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=NAME_FONT, color=INK if who else FREE)
        if j % per_row == 0:
            ax.text(-0.25, y + 0.5, f"{j}", ha="right", va="center", fontsize=LABEL_FONT, color=FREE)
        if j == view.head:
            ax.add_patch(Polygon([(x + 0.5, y - 0.08), (x + 0.25, y - 0.45), (x + 0.75, y - 0.45)], closed=True,
                                 facecolor=INK, edgecolor="none"))
            ax.text(x + 0.85, y - 0.3, "head", ha="left", va="center", fontsize=LABEL_FONT, color=INK)
    width = per_row * (1 + gap)
    ax.set(xlim=(-1.2, width), ylim=(-(rows - 1) * row_h - 0.65, 1.2 + (0.6 if title else 0)))
    if title:
        ax.text(-1.2, 1.75, title, ha="left", va="top", fontsize=TITLE_FONT, color=INK)
    ax.set_aspect("equal")
    ax.set_axis_off()


def cells_legend(ax, names: str) -> None:
    """A legend of the sequences' colours for `draw_cells` and `draw_paged` figures."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=OWN[i % len(OWN)], alpha=0.45, edgecolor=INK, linewidth=0.6, label=f"sequence {n}")
               for i, n in enumerate(names)]
    ax.legend(handles=handles, loc="upper right", ncol=len(names), fontsize=LABEL_FONT, handlelength=1.2,
              bbox_to_anchor=(1.0, 1.0), borderaxespad=0.0)


# -- one layer's key buffer, pass after pass (chapter 5) ------------------------------------------

# draw_buffers' layout, in slot widths; buffers_figure sizes a figure from the same numbers.
BUFFER_ROW = 1.45  # from one pass's row to the next
BUFFER_LABEL = 2.2  # the column of pass labels, left of the slots
BUFFER_NOTES = 6.2  # the column of notes ("copied 2, dropped 2"), right of the slots


@dataclass(frozen=True)
class BufferRow:
    """One layer's key buffer after one pass: what `draw_buffers` draws as one row of slots."""

    slots: tuple[int | None, ...]  # the position each slot holds, None for a slot that holds none
    new: tuple[int, ...]  # the slots this pass wrote its own positions into
    copied: tuple[int, ...]  # the slots holding old positions that this pass copied or moved there
    rows_copied: int  # old rows the pass copied or moved, as the cache counts them (a growth copies empty slots too)
    dropped: int  # positions this pass dropped
    t_new: int  # positions this pass brought


def _held(cache: KVCache) -> list[int | None]:
    """The position held by each slot of layer 0's key buffer (the keys are their positions)."""
    keys = cache.k[0]
    if keys is None:
        return []
    values = [int(x) for x in keys[0, 0, :, 0].tolist()]
    if hasattr(cache, "slot_pos"):  # a ring: each slot says which position it holds (-1: none)
        return [v if int(p) >= 0 else None for v, p in zip(values, cache.slot_pos.tolist(), strict=True)]
    if hasattr(cache, "ptr"):  # a preallocated buffer: the first ptr slots are held
        return [v if j < cache.ptr else None for j, v in enumerate(values)]
    return values  # a concatenated tensor holds every row


def buffer_history(cache: KVCache, chunks: Sequence[int]) -> list[BufferRow]:
    """Feed a new one-layer `cache` passes of `chunks` positions, each key equal to its position
    (B = Hkv = D = 1, float64), and return its buffer after every pass.

    A slot counts as copied when it holds an old position at a new place or in new storage (a `cat`
    copies every old row, a growth copies the whole buffer, a shift moves the rows it keeps). Raises
    CacheError if the cache's own count (`rows_copied`) is smaller than the slots show.
    """
    if not (isinstance(cache, KVCache) and cache.n_layers == 1 and cache.position == 0):
        fail("cache", "a new cache of one layer", cache, CacheError)
    rows, start = [], 0
    for t in chunks:
        storage = cache.k[0].data_ptr() if cache.k[0] is not None else None
        before_slots, before_copied = _held(cache), cache.rows_copied
        keys = torch.arange(start, start + t, dtype=torch.float64).view(1, 1, t, 1)
        cache.feed(keys, -keys)
        slots = _held(cache)
        fresh = storage != cache.k[0].data_ptr()  # a new tensor: every old row was copied into it
        new = tuple(j for j, p in enumerate(slots) if p is not None and p >= start)
        copied = tuple(j for j, p in enumerate(slots) if p is not None and p < start
                       and (fresh or j >= len(before_slots) or before_slots[j] != p))
        count = (cache.rows_copied - before_copied) // 2 - t  # K and V are both counted; minus the writes
        if count < len(copied):
            fail("cache", f"rows_copied to count the {len(copied)} old rows it copied", count, CacheError)
        rows.append(BufferRow(tuple(slots), new, copied, count, getattr(cache, "last_dropped", 0), t))
        start += t
    return rows


def draw_buffers(ax, rows: Sequence[BufferRow], title: str = "", width: int | None = None) -> None:
    """One row of slots per pass, top to bottom: each slot shows the position it holds, filled when
    the pass wrote it (new) or copied it (old); the right margin says what the pass did. `width`:
    the slots drawn per row (default: the widest buffer)."""
    width = max((len(r.slots) for r in rows), default=0) if width is None else width
    for i, row in enumerate(rows):
        y = -i * BUFFER_ROW
        ax.text(-0.3, y + 0.5, f"+{row.t_new}", ha="right", va="center", fontsize=10, color=INK)
        for j in range(width):
            if j >= len(row.slots):
                continue
            pos = row.slots[j]
            fill = NEW if j in row.new else COPIED if j in row.copied else None
            _box(ax, j, y, 1, 1, fill, edge=INK if pos is not None else FREE, alpha=0.35)
            ax.text(j + 0.5, y + 0.5, "·" if pos is None else str(pos), ha="center", va="center", fontsize=10,
                    color=INK if pos is not None else FREE)
        notes = [f"copied {row.rows_copied}"] if row.rows_copied else []
        notes += [f"dropped {row.dropped}"] if row.dropped else []
        ax.text(width + 0.35, y + 0.5, ", ".join(notes), ha="left", va="center", fontsize=9.5, color=INK)
    top = 1.25 + (0.75 if title else 0)
    ax.set(xlim=(-BUFFER_LABEL, width + BUFFER_NOTES), ylim=(-(len(rows) - 1) * BUFFER_ROW - 0.25, top))
    if title:
        ax.text(-BUFFER_LABEL, top - 0.05, title, ha="left", va="top", fontsize=10.5, color=INK, fontweight="bold")
    ax.set_aspect("equal")
    ax.set_axis_off()


def buffers_legend(ax) -> None:
    """The legend of `draw_buffers`: new rows, copied or moved rows, free slots."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=NEW, alpha=0.35, edgecolor=INK, linewidth=0.6, label="written by the pass"),
               Patch(facecolor=COPIED, alpha=0.35, edgecolor=INK, linewidth=0.6, label="old, copied or moved"),
               Patch(facecolor="none", edgecolor=FREE, linewidth=0.6, label="free slot")]
    ax.legend(handles=handles, loc="lower center", ncol=3, fontsize=LABEL_FONT, handlelength=1.2,
              bbox_to_anchor=(0.5, 1.0), borderaxespad=0.2)


def buffers_figure(histories: dict[str, Sequence[BufferRow]], width: float = 5.2):
    """A figure of one `draw_buffers` panel per history (title -> rows), stacked, all drawn to the scale
    of the widest buffer, with the legend on top. Returns the figure."""
    from labcode.plotting import figure

    if not (isinstance(histories, dict) and histories):
        fail("histories", "a dict of one or more titles -> buffer_history rows", histories, CacheError)
    slots = max((len(r.slots) for rows in histories.values() for r in rows), default=1)
    units = [len(rows) * BUFFER_ROW + 1.3 for rows in histories.values()]  # each panel's height in slot widths
    per_unit = width / (slots + BUFFER_LABEL + BUFFER_NOTES)  # inches per slot width, from draw_buffers' x range
    fig, axes = figure(len(histories), 1, height=sum(units) * per_unit + 0.45, width=width,
                       gridspec_kw={"height_ratios": units})
    axes = [axes] if len(histories) == 1 else list(axes)
    for ax, (title, rows) in zip(axes, histories.items(), strict=True):
        draw_buffers(ax, rows, title, width=slots)
    buffers_legend(axes[0])
    return fig
