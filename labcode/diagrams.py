"""Diagrams of the engines' data structures, drawn from the objects themselves.

Introduced in chapter 9. A view (`paged_view`, `cells_view`) copies what a diagram needs from
live caches at one moment; `draw_paged` and `draw_cells` draw a view on a matplotlib axes in the
book's style (`labcode.plotting`). Drawn from the objects, a diagram cannot drift from the code.
"""

from __future__ import annotations

from dataclasses import dataclass

from labcode.caches.base import CacheError
from labcode.checks import fail
from labcode.engines.cells import CellsCache
from labcode.engines.paged import PagedCache
from labcode.plotting import COLOURS, INK

SHARED = COLOURS[0]  # a block or cell held by several sequences
OWN = COLOURS[1:5]  # then one colour per sequence
FREE = "#9aa0a8"  # outlines of free blocks and empty cells
SLOT_FONT = 8.5
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
    step, strip = bs + 1, 0.7  # block width plus a gap; the label strip under a block's slots
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
        label = f"#{b}  ref {view.refcount[b]}" if who else f"#{b} free"
        ax.text(x + bs / 2, -strip / 2, label, ha="center", va="center", fontsize=7.5, color=INK if who else FREE)
    for name in names:
        y, table = rows[name], view.tables[name]
        colour = OWN[names.index(name) % len(OWN)]
        for i, block in enumerate(table):
            x = i * step
            _box(ax, x, y - strip, bs, 1 + strip, colour, alpha=0.12)
            _slots(ax, x, y, list(view.texts[name][i * bs : (i + 1) * bs]), bs)
            ax.text(x + bs / 2, y - strip / 2, f"→ #{block}", ha="center", va="center", fontsize=7.5, color=INK)
            start = (x + bs / 2, y - strip) if y > 0 else (x + bs / 2, y + 1)
            end = (block * step + bs / 2, 1 if y > 0 else -strip)
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=8, color=colour,
                                         linewidth=1.0, shrinkA=1, shrinkB=1))
        ax.text(-0.6, y + (1 - strip) / 2, name, ha="right", va="center", fontsize=10, color=INK,
                fontweight="bold")
    ax.text(-0.6, (1 - strip) / 2, "pool", ha="right", va="center", fontsize=10, color=INK, fontweight="bold")
    top, bottom = max(rows.values(), default=0) + 1.2, min(min(rows.values(), default=0) - strip, -strip) - 0.3
    ax.set(xlim=(-4.2, n_blocks * step), ylim=(bottom, top + (0.9 if title else 0.2)))
    if title:
        ax.text(-4.2, top + 0.8, title, ha="left", va="top", fontsize=9.5, color=INK)
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
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=SLOT_FONT, color=INK if who else FREE)
        if j % per_row == 0:
            ax.text(-0.25, y + 0.5, f"{j}", ha="right", va="center", fontsize=7.5, color=FREE)
        if j == view.head:
            ax.add_patch(Polygon([(x + 0.5, y - 0.08), (x + 0.25, y - 0.45), (x + 0.75, y - 0.45)], closed=True,
                                 facecolor=INK, edgecolor="none"))
            ax.text(x + 0.85, y - 0.3, "head", ha="left", va="center", fontsize=7.5, color=INK)
    width = per_row * (1 + gap)
    ax.set(xlim=(-1.2, width), ylim=(-(rows - 1) * row_h - 0.65, 1.2 + (0.6 if title else 0)))
    if title:
        ax.text(-1.2, 1.75, title, ha="left", va="top", fontsize=9.5, color=INK)
    ax.set_aspect("equal")
    ax.set_axis_off()


def cells_legend(ax, names: str) -> None:
    """A legend of the sequences' colours for `draw_cells` and `draw_paged` figures."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=OWN[i % len(OWN)], alpha=0.45, edgecolor=INK, linewidth=0.6, label=f"sequence {n}")
               for i, n in enumerate(names)]
    ax.legend(handles=handles, loc="upper right", ncol=len(names), fontsize=8.5, handlelength=1.2,
              bbox_to_anchor=(1.0, 1.0), borderaxespad=0.0)
