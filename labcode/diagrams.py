"""Diagrams of the caches' data structures, drawn from the objects themselves.

Introduced in chapter 5 (`buffer_history` and `draw_buffers`: a cache's key buffer after each pass)
and used again in chapter 9 (`paged_view`, `cells_view`: the engines' block pools and cells). A view
copies what a diagram needs from live caches; a `draw_` function draws it on a matplotlib axes in
the book's style (`labcode.plotting`). Drawn from the objects, a diagram cannot drift from the code.

The pictures that open chapters 1 to 4, 10 and 11 (and the introduction) are made the same way, each
from a short real run: `generation_calls` (the calls of chapter 1's two loops), `scores_view` (one
head's attention weights), `module_state_history` and `pairs_fork_view` (where the keys and values
live in chapters 3 and 4), `split_views` (chapter 10's three splits) and `serve_views` (chapter 11's
scheduler over its pool), each with a `_figure` function that draws it. Chapter 13's `row_bytes`
counts one token's cache row under each way of making it smaller, from the formulas the caches'
own byte counts are checked against, and `row_bytes_figure` draws the rows to scale.
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
    ax.legend(handles=handles, loc="lower right", ncol=len(names), fontsize=LABEL_FONT, handlelength=1.2,
              bbox_to_anchor=(1.0, 1.0), borderaxespad=0.0)  # above the axes, clear of their title


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
    """The legend of `draw_buffers`: new rows, copied or moved rows, old rows left in place, free slots."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=NEW, alpha=0.35, edgecolor=INK, linewidth=0.6, label="written by the pass"),
               Patch(facecolor=COPIED, alpha=0.35, edgecolor=INK, linewidth=0.6, label="old, copied or moved"),
               Patch(facecolor="none", edgecolor=INK, linewidth=0.6, label="old, left in place"),
               Patch(facecolor="none", edgecolor=FREE, linewidth=0.6, label="free slot")]
    ax.legend(handles=handles, loc="lower center", ncol=2, fontsize=LABEL_FONT, handlelength=1.2,
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


# -- the pictures that open chapters 1 to 4, 10 and 11 ------------------------------------------------
# Each is drawn at the column's scale (labcode.plotting.figure), so on a phone it shrinks with the page: its
# print is sized for that, PICTURE_FONT points in a figure PICTURE_WIDTH inches wide at most (about 10 px at
# 390 px, like the book's plots).

PICTURE_FONT = 12.5  # every text of these pictures
PICTURE_WIDTH = 6.2  # inches
RUN, KEPT, CHOSEN = COLOURS[0], COLOURS[5], COLOURS[1]  # run through the model; kept; the token chosen


def _text(ax, x: float, y: float, s: str, **kw) -> None:
    kw = {"ha": "center", "va": "center", "fontsize": PICTURE_FONT, "color": INK, **kw}
    ax.text(x, y, s, **kw)


def _char_cell(ax, x: float, y: float, char: str, fill: str | None, edge: str = INK, alpha: float = 0.35,
               colour: str = INK) -> None:
    """One position: a unit box at (x, y) showing its character (a space as ␣)."""
    _box(ax, x, y, 1, 1, fill, edge=edge, alpha=alpha)
    _text(ax, x + 0.5, y + 0.5, "␣" if char == " " else char, family="monospace", color=colour)


LEGEND_INCHES = 0.34  # the legend's line above a picture


def picture_figure(width_units: float, height_units: float, width: float = PICTURE_WIDTH, legend: bool = True):
    """A figure (fig, ax) for a picture `width_units` by `height_units` drawing units, `width` inches wide at most:
    equal scales, no axes, x from 0 to width_units and y from -height_units to 0, and room above for `_legend`."""
    from labcode.plotting import figure

    per_unit = min(width / width_units, 2 * width / height_units)  # inches per drawing unit
    room = LEGEND_INCHES / per_unit if legend else 0.0
    fig, ax = figure(height=(height_units + room) * per_unit, width=width_units * per_unit)
    fig.set_layout_engine("none")  # the units fill the figure: no layout to compute, which would cost a draw
    ax.set_position((0.0, 0.0, 1.0, 1.0))
    ax.set(xlim=(0, width_units), ylim=(-height_units, room))
    ax.set_aspect("equal")
    ax.set_axis_off()
    return fig, ax


def _legend(ax, entries: Sequence[tuple[str, str | None, float, str | None]], ncol: int | None = None) -> None:
    """A legend on the picture's top line: (label, fill, alpha, hatch) per entry, a free slot's outline for fill
    None."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=fill or "none", alpha=alpha if fill else None, edgecolor=INK if fill else FREE,
                     linewidth=0.6, hatch=hatch, label=label) for label, fill, alpha, hatch in entries]
    ax.legend(handles=handles, loc="upper left", ncol=ncol or len(entries), fontsize=PICTURE_FONT,
              handlelength=1.2, bbox_to_anchor=(0.0, 1.0), borderaxespad=0.0, borderpad=0.0, columnspacing=1.2)


# chapter 1: the forward calls of a generation, with and without a cache

@dataclass(frozen=True)
class CallsView:
    """The forward calls of one generation: the text each call saw, how many of its last positions it ran
    through the model, and the token it chose."""

    texts: tuple[str, ...]  # per call: the sequence so far, one character per position
    ran: tuple[int, ...]  # per call: positions run (the last ones of its text); the others came from a cache
    chosen: tuple[str, ...]  # per call: the token it chose, as text


def calls_view(generation, prompt_len: int, decode, calls: int | None = None) -> CallsView:
    """What `draw_calls` needs from a `labcode.generate.Generation` of one sequence (B = 1) whose prompt was
    `prompt_len` tokens: its first `calls` calls (default all); `decode(ids)` gives one character per id."""
    ids = generation.ids.tolist()
    if len(ids) != 1:
        fail("generation", "a generation of one sequence (B = 1)", f"B = {len(ids)}")
    ids, counts = ids[0], generation.positions_computed
    calls = len(counts) if calls is None else calls
    if not (isinstance(calls, int) and 1 <= calls <= len(counts)):
        fail("calls", f"an int in [1, {len(counts)}]", calls)
    text = decode(ids)
    if len(text) != len(ids):
        fail("decode", "one character per token", f"{len(text)} characters for {len(ids)} tokens")
    for i, ran in enumerate(counts[:calls]):
        if not 1 <= ran <= prompt_len + i:
            fail("generation", f"call {i} to run 1 to {prompt_len + i} positions", ran)
    return CallsView(tuple(text[: prompt_len + i] for i in range(calls)), tuple(counts[:calls]),
                     tuple(text[prompt_len + i] for i in range(calls)))


def generation_calls(model, prompt: torch.Tensor, calls: int, decode) -> dict[str, CallsView]:
    """The first `calls` forward calls of greedy generation from prompt [1, P], by the loop without a cache and by
    the loop with a ConcatCache (chapter 1's two loops), as views; raises ValueError if they chose different tokens."""
    from labcode.caches.concat import ConcatCache
    from labcode.generate import generate, generate_nocache

    runs = {"without a cache": generate_nocache(model, prompt, calls),
            "with a cache": generate(model, prompt, calls, ConcatCache(model.cfg.n_layers))}
    views = {name: calls_view(run, prompt.shape[1], decode) for name, run in runs.items()}
    if len({v.chosen for v in views.values()}) != 1:
        fail("model", "the same tokens with and without a cache", {k: v.chosen for k, v in views.items()})
    return views


CALL_ROW = 1.3  # from one call's row to the next, in slot widths


def draw_calls(ax, view: CallsView, top: float, left: float = 0.0, title: str = "") -> float:
    """One row per call, from `top` down: the positions it ran (filled), those it read from the cache (outlined)
    and, after an arrow, the token it chose; on the right, how many positions it ran. Returns the y below."""
    if title:
        _text(ax, left, top - 0.4, title, ha="left", fontweight="bold")
        top -= 0.9
    width = max(len(t) for t in view.texts)
    for i, (text, ran, chosen) in enumerate(zip(view.texts, view.ran, view.chosen, strict=True)):
        y = top - 1 - i * CALL_ROW
        _text(ax, left + 2.1, y + 0.5, f"call {i + 1}", ha="right")
        for j, char in enumerate(text):
            run = j >= len(text) - ran
            _char_cell(ax, left + 2.4 + j, y, char, RUN if run else None, edge=INK if run else KEPT)
        x = left + 2.4 + len(text)
        _text(ax, x + 0.45, y + 0.5, "→")
        _char_cell(ax, x + 0.9, y, chosen, CHOSEN, alpha=0.45)
        _text(ax, left + 2.4 + width + 2.5, y + 0.5, f"ran {ran}", ha="left")
    return top - 1 - (len(view.texts) - 1) * CALL_ROW - 0.4


def calls_figure(views: dict[str, CallsView], width: float = PICTURE_WIDTH):
    """The calls of each view (title -> view), stacked, with a legend on top. Returns the figure."""
    if not (isinstance(views, dict) and views):
        fail("views", "a dict of one or more titles -> calls_view results", views)
    slots = max(len(t) for v in views.values() for t in v.texts)
    rows = sum(len(v.texts) for v in views.values())
    height = 0.9 * len(views) + rows * CALL_ROW + 0.4 * len(views)
    fig, ax = picture_figure(2.4 + slots + 2.5 + 2.9, height, width)
    top = 0.0
    for title, view in views.items():
        top = draw_calls(ax, view, top, title=title)
    _legend(ax, [("run through the model", RUN, 0.35, None), ("read from the cache", None, 0, None),
                 ("chosen", CHOSEN, 0.45, None)])
    return fig


# chapter 2: one head's attention weights, and what the new row reads

@dataclass(frozen=True)
class ScoresView:
    """One attention head's weights over a sequence whose last token was just appended."""

    text: str  # one character per position
    weights: tuple[tuple[float, ...], ...]  # [T][T]: row i (a query) over keys 0..i, zero above the diagonal
    old_rows_unchanged: bool  # rows 0..T-2 equal, to the tolerance, the weights computed before the last token
    layer: int
    head: int


def _head_weights(model, ids: torch.Tensor, layer: int, head: int, tol: float) -> torch.Tensor:
    """Layer `layer`, query head `head`'s attention weights [T, T] for ids [1, T]: its queries (caught on their way
    out of q_proj) against the keys a ConcatCache keeps; checked against the attention output the model computed."""
    import math

    from labcode.caches.concat import ConcatCache
    from labcode.masks import causal_mask
    from labcode.rope import rotate

    attn, seen = model.blocks[layer].attn, {}
    hooks = [attn.q_proj.register_forward_hook(lambda m, i, out: seen.setdefault("q", out)),
             attn.out_proj.register_forward_hook(lambda m, i, out: seen.setdefault("z", i[0]))]
    cache = ConcatCache(len(model.blocks))
    try:
        with torch.no_grad():
            model(ids, cache)
    finally:
        for hook in hooks:
            hook.remove()
    t, d, group = ids.shape[1], attn.head_dim, attn.n_heads // attn.n_kv_heads
    q = seen["q"].view(1, t, attn.n_heads, d).transpose(1, 2)[:, head : head + 1]  # (1, 1, T, D)
    if model.cfg.rotary:
        q = rotate(q, torch.arange(t), model.cfg.rope_base)
    k, v = cache.k[layer][0, head // group], cache.v[layer][0, head // group]  # (T, D) each
    weights = (q[0, 0] @ k.T / math.sqrt(d)).masked_fill(~causal_mask(t), float("-inf")).softmax(-1)
    if not torch.allclose(weights @ v, seen["z"][0, :, head * d : (head + 1) * d], rtol=0, atol=tol):
        fail("model", f"head {head}'s output to be its weights times its values", "another output", CacheError)
    return weights


def scores_view(model, ids: torch.Tensor, decode, layer: int = 0, head: int = 0, tol: float = 1e-12) -> ScoresView:
    """Head `head` of layer `layer` on ids [1, T] (T >= 2), and whether its rows for the first T - 1 positions are
    those it computed on ids without the last token (largest difference <= tol). `decode(ids)`: one character per id."""
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] >= 2):
        fail("ids", "a [1, T] tensor with T >= 2", getattr(ids, "shape", ids))
    full = _head_weights(model, ids, layer, head, tol)
    before = _head_weights(model, ids[:, :-1], layer, head, tol)
    text = decode(ids[0].tolist())
    if len(text) != ids.shape[1]:
        fail("decode", "one character per token", f"{len(text)} characters for {ids.shape[1]} tokens")
    same = bool((full[:-1, :-1] - before).abs().max() <= tol)
    return ScoresView(text, tuple(tuple(float(w) for w in row) for row in full), same, layer, head)


def draw_scores(ax, view: ScoresView) -> None:
    """The weights as a lower triangle of cells (darker: more weight), queries on the left, keys and values on
    top; the old rows and the old queries in blue or grey, the new row, query, key and value in orange."""
    t = len(view.text)
    gx, gy = 1.4, -1.6  # the grid's top-left corner; the keys' row above it, the queries' column left of it
    right = gx + t + 0.4
    _text(ax, right, gy + 0.8, "K, V", ha="left")
    _text(ax, 0.5, gy + 0.8, "Q")
    for j, char in enumerate(view.text):
        new = j == t - 1
        _char_cell(ax, gx + j, gy + 0.3, char, CHOSEN if new else RUN, alpha=0.45 if new else 0.35)
    for i, row in enumerate(view.weights):
        y, new = gy - 1 - i, i == t - 1
        _char_cell(ax, 0, y, view.text[i], CHOSEN if new else None, edge=INK if new else FREE,
                   colour=INK if new else FREE, alpha=0.45)
        for j in range(i + 1):
            _box(ax, gx + j, y, 1, 1, CHOSEN if new else RUN, alpha=0.06 + 0.9 * row[j] ** 0.5)
    if view.old_rows_unchanged and t > 2:  # a bracket over the old rows
        ax.plot([right - 0.1, right, right, right - 0.1], [gy - 0.1, gy - 0.1, gy - t + 1.1, gy - t + 1.1],
                color=INK, linewidth=1.0)
        middle = gy - (t - 1) / 2
        for k, line in enumerate(("the same as", "before the", "last token")):
            _text(ax, right + 0.3, middle + 0.8 - 0.8 * k, line, ha="left")
    _text(ax, right, gy - t + 0.5, "← the new row", ha="left", fontweight="bold")
    _text(ax, gx + t / 2, gy - t - 0.6, f"layer {view.layer}, head {view.head}: attention weights")


def scores_figure(view: ScoresView, width: float = 5.2):
    """`draw_scores` of `view` in a figure `width` inches wide at most. Returns the figure."""
    t = len(view.text)
    fig, ax = picture_figure(1.4 + t + 5.4, 1.6 + t + 1.1, width, legend=False)
    draw_scores(ax, view)
    return fig


# -- one query row's walk through the keys, block by block (chapter 8) ----------------------------------------------

WALK_LABEL = 12.5  # the column of row labels, left of the first block, in key widths
WALK_GAP = 1.0  # between two blocks, in key widths
WALK_BARS = 3.6  # the height of the band of score bars, in rows of numbers


@dataclass(frozen=True)
class OnlineWalk:
    """One query row's pass over the keys in blocks, as `online_softmax_attention` makes it: every key's score
    and, after each block, the running maximum m, the factor e^(m - m') that rescaled the old sums, and the
    running sum l."""

    block_size: int
    scores: tuple[float, ...]  # s_j = q . k_j / sqrt(D), one per key
    running_max: tuple[float, ...]  # m after each block
    rescale: tuple[float, ...]  # e^(m - m') at each block; 0 at the first, where nothing had been summed
    running_sum: tuple[float, ...]  # l after each block


def online_walk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int, head: int = 0) -> OnlineWalk:
    """The walk of query head `head` of one decode step (q [1, H, 1, D], k, v [1, Hkv, S, D]) in blocks of
    `block_size` keys. The state after a block is `labcode.attention.attention_partial` over every key up to
    the block's end: what the online recurrence has summed by then."""
    import math

    from labcode.attention import attention_partial, check_qkv
    from labcode.checks import is_int

    check_qkv(q, k, v, None)
    if q.shape[0] != 1 or q.shape[2] != 1:
        fail("q", "one decode step, [1, H, 1, D]", tuple(q.shape))
    if not (is_int(block_size) and block_size > 0):
        fail("block_size", "a positive int", repr(block_size))
    if not (is_int(head) and 0 <= head < q.shape[1]):
        fail("head", f"a query head in [0, {q.shape[1]})", repr(head))
    s, kv_head = k.shape[2], head // (q.shape[1] // k.shape[1])
    scores = k[0, kv_head] @ q[0, head, 0] / math.sqrt(q.shape[3])  # (S,)
    ends = [min(j + block_size, s) for j in range(0, s, block_size)]
    states = [attention_partial(q, k[:, :, :end], v[:, :, :end]) for end in ends]  # (o, m, l) of each prefix
    maxima = [float(m[0, head, 0, 0]) for _, m, _ in states]
    rescale = [0.0] + [math.exp(old - new) for old, new in zip(maxima, maxima[1:], strict=False)]
    sums = tuple(float(ssum[0, head, 0, 0]) for _, _, ssum in states)
    return OnlineWalk(block_size, tuple(scores.tolist()), tuple(maxima), tuple(rescale), sums)


def draw_online_walk(ax, walk: OnlineWalk) -> None:
    """The keys in blocks, left to right: each block's tile of K and V (its key range), its keys' scores as bars
    with the running maximum after it as a dashed line, and under it the running state (m, the rescale
    e^(m - m'), l)."""
    n, bs = len(walk.scores), walk.block_size
    low, high = min(0.0, *walk.scores), max(0.0, *walk.scores)
    height = lambda score: WALK_BARS * (score - low) / ((high - low) or 1.0)  # score -> y in the bars' band
    base, right = height(0.0), n + (-(-n // bs) - 1) * WALK_GAP
    rows = ((r"running max $m$", walk.running_max), (r"rescale $e^{m - m'}$", walk.rescale),
            (r"running sum $\ell$", walk.running_sum))
    for text, y in (("keys of K, V", WALK_BARS + 1.05), (r"scores $s_j$", base + 0.5)):
        ax.text(-WALK_LABEL, y, text, ha="left", va="center", color=INK)
    for r, (text, _) in enumerate(rows):
        ax.text(-WALK_LABEL, -0.75 - r, text, ha="left", va="center", color=INK)
    ax.plot([-0.3, right + 0.2], [base, base], color=FREE, linewidth=0.8)
    for b, start in enumerate(range(0, n, bs)):
        end, x0, colour = min(start + bs, n), start + b * WALK_GAP, COLOURS[b % len(COLOURS)]
        _box(ax, x0, WALK_BARS + 0.5, end - start, 1.1, colour, alpha=0.3)
        ax.text(x0 + (end - start) / 2, WALK_BARS + 1.05, f"{start}–{end - 1}", ha="center", va="center", color=INK)
        for j in range(start, end):
            ax.add_patch(_bar(x0 + j - start + 0.12, base, 0.76, height(walk.scores[j]) - base, colour))
        m = height(walk.running_max[b])
        ax.plot([x0 - 0.1, x0 + end - start + 0.1], [m, m], color=INK, linestyle="--", linewidth=1.3)
        for r, (_, values) in enumerate(rows):
            ax.text(x0 + (end - start) / 2, -0.75 - r, f"{values[b]:.2f}", ha="center", va="center", color=INK)
    ax.set(xlim=(-WALK_LABEL, right + 0.2), ylim=(-3.3, WALK_BARS + 1.7))
    ax.set_axis_off()


def _bar(x: float, y: float, w: float, h: float, colour: str):
    """A bar of width w from height y to y + h (h may be negative)."""
    from matplotlib.patches import Rectangle

    return Rectangle((x, min(y, y + h)), w, abs(h), facecolor=colour, alpha=0.85, linewidth=0)


def walk_figure(walk: OnlineWalk, height: float = 3.2, width: float = 6.2):
    """A figure of `draw_online_walk`, with a legend for its dashed line; `width` in inches (under the column's
    width, it shrinks less on a phone). Returns the figure."""
    from matplotlib.lines import Line2D

    from labcode.plotting import figure

    fig, ax = figure(height=height, width=width)
    draw_online_walk(ax, walk)
    line = Line2D([], [], color=INK, linestyle="--", linewidth=1.3, label=r"running max $m$ after the block")
    ax.legend(handles=[line], loc="upper right", bbox_to_anchor=(1.0, 1.12), borderaxespad=0.0)
    return fig


# chapters 3 and 4: where a request's keys and values live, call after call

@dataclass(frozen=True)
class StateRow:
    """One tensor of keys (and its values) after a call: what it holds, and what the call did to it."""

    label: str  # where it lives: "blocks[0].attn", "layer 0"
    text: str  # one character per position it holds
    new: int  # its last `new` positions were written by the call
    copied: int  # positions before them that the call copied into a new tensor (torch.cat copies every old row)
    note: str = ""  # right of the row


@dataclass(frozen=True)
class StatePanel:
    """The state after one call: a title (the call) and one row per layer, drawn in a frame (its holder)."""

    title: str
    rows: tuple[StateRow, ...]
    note: str = ""  # right of the title


def _cat_rows(before: torch.Tensor | None, after: torch.Tensor, t: int) -> int:
    """Old rows a call copied into `after` [B, Hkv, S, D]: all of them when it is a new tensor, else none."""
    if before is None or after.data_ptr() == before.data_ptr():
        return 0
    return after.shape[2] - t


def module_state_history(model, ids: torch.Tensor, calls: Sequence[tuple[int, int]], decode) -> list[StatePanel]:
    """Run the calls (start, T) of ids [1, N] through `model` with `use_cache=True` (chapter 3's naive cache, held
    in the model), from a model holding none, and return its state after each; the model is reset at the end."""
    attns = [block.attn for block in model.blocks]
    if model.current_pos or any(a.cache_k is not None or a.ptr_current_pos for a in attns):
        fail("model", "a model holding no naive cache (call model.reset_kv_cache() first)",
             f"current_pos {model.current_pos}")
    text, panels = decode(ids[0].tolist()), []
    try:
        for start, t in calls:
            before = [a.cache_k for a in attns]
            with torch.no_grad():
                model(ids[:, start : start + t], use_cache=True)
            rows = tuple(StateRow(f"blocks[{i}].attn", text[: a.cache_k.shape[2]], t, _cat_rows(old, a.cache_k, t),
                                  f"ptr {a.ptr_current_pos}")
                         for i, (a, old) in enumerate(zip(attns, before, strict=True)))
            panels.append(StatePanel(f"model(ids[{start}:{start + t}], use_cache=True)", rows,
                                     f"current_pos {model.current_pos}"))
    finally:
        model.reset_kv_cache()
    return panels


def pairs_fork_view(model, prompt: torch.Tensor, continuations: dict[str, torch.Tensor], decode) -> list[StatePanel]:
    """Chapter 4's explicit pass: the prompt [1, P] from no cache, then each continuation [1, T] (name -> ids) from
    the prompt's list of (K, V) pairs. Returns the prompt's list, then each continuation's; raises CacheError if a
    call changed the prompt's list (so a figure of them can say that it holds what it held)."""
    from labcode.caches.base import snapshot, states_equal

    with torch.no_grad():
        _, pairs = model(prompt, None, return_cache=True)
        kept = snapshot(pairs)
        text = decode(prompt[0].tolist())

        def rows(new_pairs, t, extra=""):
            return tuple(StateRow(f"layer {i}", (text + extra)[: k.shape[2]], t, _cat_rows(old[0], k, t))
                         for i, ((k, _), old) in enumerate(zip(new_pairs, pairs if extra else [(None,)] * len(pairs),
                                                                strict=True)))

        panels = [StatePanel("caches = model(prompt, None, ...)", rows(pairs, prompt.shape[1]))]
        for name, ids in continuations.items():
            _, out = model(ids, pairs, return_cache=True)
            panels.append(StatePanel(f"{name} = model({decode(ids[0].tolist())!r}, caches, ...)",
                                     rows(out, ids.shape[1], decode(ids[0].tolist()))))
    if not states_equal(kept, pairs):
        fail("model", "calls that leave the list of pairs they are given unchanged", "a changed list", CacheError)
    return panels


STATE_ROW = 1.25  # from one row of a panel to the next, in slot widths


def states_figure(panels: Sequence[StatePanel], footer: str = "", width: float = PICTURE_WIDTH):
    """The panels stacked, each a title over a frame of rows: each row's label, its positions (filled: written by
    the call; other fill: copied by it; outlined: kept where they were) and its note; `footer` under them all.
    Returns the figure."""
    from matplotlib.patches import FancyBboxPatch

    if not panels:
        fail("panels", "one or more StatePanels", panels)
    slots = max(len(r.text) for p in panels for r in p.rows)
    notes = 2.6 if any(r.note for p in panels for r in p.rows) else 0.3
    share = max(len(r.label) for p in panels for r in p.rows) * 0.6 * PICTURE_FONT / 72 / width  # monospace
    label_units = (0.6 + share * (slots + notes + 0.2)) / (1 - share)  # the labels' inches, in slot widths
    heights = [1.0 + len(p.rows) * STATE_ROW + 0.5 for p in panels]
    right = label_units + slots + notes
    fig, ax = picture_figure(right + 0.2, sum(heights) + (0.9 if footer else 0.1), width)
    top = 0.0
    for panel, height in zip(panels, heights, strict=True):
        _text(ax, 0.1, top - 0.45, panel.title, ha="left", family="monospace")
        if panel.note:
            _text(ax, right, top - 0.45, panel.note, ha="right")
        frame_top = top - 0.95
        ax.add_patch(FancyBboxPatch((0.1, frame_top - len(panel.rows) * STATE_ROW - 0.05), right - 0.1,
                                    len(panel.rows) * STATE_ROW, linewidth=0.8, facecolor="none", edgecolor=FREE,
                                    boxstyle="round,pad=0,rounding_size=0.3"))
        for i, row in enumerate(panel.rows):
            y = frame_top - (i + 1) * STATE_ROW + 0.05
            _text(ax, label_units - 0.25, y + 0.5, row.label, ha="right", family="monospace")
            n = len(row.text)
            for j, char in enumerate(row.text):
                fill = RUN if j >= n - row.new else COPIED if j >= n - row.new - row.copied else None
                _char_cell(ax, label_units + j, y, char, fill, edge=INK if fill else KEPT)
            if row.note:
                _text(ax, label_units + slots + 0.3, y + 0.5, row.note, ha="left")
        top -= height
    if footer:
        _text(ax, 0.1, top - 0.3, footer, ha="left")
    _legend(ax, [("written by the call", RUN, 0.35, None), ("copied by the call", COPIED, 0.35, None)])
    return fig


# chapter 10: one request's cache split across processes

@dataclass(frozen=True)
class SplitView:
    """Which process holds each layer's keys and values of each key/value head, under one way of splitting."""

    title: str
    holders: tuple[tuple[str, ...], ...]  # [layer][key/value head]: the rank(s) holding it
    colours: tuple[tuple[int, ...], ...]  # [layer][key/value head]: its colour, an index into COLOURS
    notes: tuple[str, ...]  # lines under the grid: the bytes each process holds or receives


def split_views(model, cache, world: int = 2) -> list[SplitView]:
    """A filled ConcatCache of `model` split chapter 10's three ways over `world` processes: by key/value head
    (`head_shard`), by layer (`stage_layers`), and shipped whole from rank 0, which prefilled it, to rank 1
    (`pack`, then `unpack` into a new cache, checked equal). Bytes are counted from the cache's own tensors."""
    from labcode.caches.base import states_equal
    from labcode.caches.concat import ConcatCache
    from labcode.distributed.pipeline import stage_layers
    from labcode.distributed.tensor_parallel import head_shard
    from labcode.distributed.transfer import pack, unpack

    cfg = model.cfg
    if not (isinstance(cache, ConcatCache) and cache.position > 0 and cache.n_layers == cfg.n_layers):
        fail("cache", f"a filled ConcatCache of the model's {cfg.n_layers} layers", cache, CacheError)
    layers, heads = range(cfg.n_layers), range(cfg.n_kv_heads)

    def row_bytes(layer: int, kv: range) -> int:  # keys and values of some heads of one layer
        return sum(t[layer][:, kv.start : kv.stop].nbytes for t in (cache.k, cache.v))

    def note(per_rank: list[int]) -> tuple[str, ...]:
        if len(set(per_rank)) == 1:
            return (f"{per_rank[0]:,} B each",)
        return tuple(f"rank {r}: {n:,} B" for r, n in enumerate(per_rank))

    shards = [head_shard(cfg.n_heads, cfg.n_kv_heads, world, r) for r in range(world)]
    by_head = [[[r for r, s in enumerate(shards) if h in s.kv_heads] for h in heads] for _ in layers]
    head_bytes = [sum(row_bytes(layer, s.kv_heads) for layer in layers) for s in shards]
    stages = [stage_layers(cfg.n_layers, world, r) for r in range(world)]
    stage_of = [next(r for r, st in enumerate(stages) if layer in st) for layer in layers]
    stage_bytes = [sum(row_bytes(layer, heads) for layer in st) for st in stages]
    blob, into = pack(cache, model), ConcatCache(cfg.n_layers)
    unpack(blob, model, into)
    if not states_equal([*cache.k, *cache.v], [*into.k, *into.v]):
        fail("unpack", "the shipped cache equal to the one packed", "another cache", CacheError)
    return [
        SplitView("by heads", tuple(tuple(",".join(map(str, rs)) for rs in row) for row in by_head),
                  tuple(tuple(rs[0] for rs in row) for row in by_head), note(head_bytes)),
        SplitView("by layers", tuple((str(stage_of[layer]),) * len(heads) for layer in layers),
                  tuple((stage_of[layer],) * len(heads) for layer in layers), note(stage_bytes)),
        SplitView("shipped", tuple(("1",) * len(heads) for _ in layers), tuple((2,) * len(heads) for _ in layers),
                  (f"{len(blob):,} B sent",)),
    ]


def splits_figure(views: Sequence[SplitView], width: float = PICTURE_WIDTH):
    """The views side by side, each a grid of layers (rows) by key/value heads (columns), every cell labelled with
    the process that holds it; the views' notes under them. Returns the figure."""
    if not views:
        fail("views", "one or more SplitViews", views)
    n_layers, n_heads = len(views[0].holders), len(views[0].holders[0])
    left, gap, top = 3.1, 1.5, -1.0  # the layer labels' column; between grids; the grids' top
    lines = max(len(v.notes) for v in views)
    fig, ax = picture_figure(left + len(views) * (n_heads + gap) - gap + 0.1, 1.0 + n_layers + 0.4 + 0.8 * lines,
                             width)
    for layer in range(n_layers):
        _text(ax, left - 0.3, top - layer - 0.5, f"layer {layer}", ha="right")
    for k, view in enumerate(views):
        x0 = left + k * (n_heads + gap)
        _text(ax, x0 + n_heads / 2, top + 0.45, view.title, fontweight="bold")
        for layer, row in enumerate(view.holders):
            for h, label in enumerate(row):
                y = top - layer - 1
                _box(ax, x0 + h, y, 1, 1, COLOURS[view.colours[layer][h] % len(COLOURS)], alpha=0.35)
                _text(ax, x0 + h + 0.5, y + 0.5, label)
        for i, line in enumerate(view.notes):
            _text(ax, x0 + n_heads / 2, top - n_layers - 0.55 - 0.8 * i, line)
    _legend(ax, [("rank 0", COLOURS[0], 0.35, None), ("rank 1", COLOURS[1], 0.35, None),
                 ("shipped from rank 0 to 1", COLOURS[2], 0.35, None)])
    return fig


# chapter 11: several requests in one pool, one scheduler step after another

@dataclass(frozen=True)
class PoolStep:
    """One scheduler step over a block pool: the tokens of its pass, and what every block holds after it."""

    step: int
    budget: int  # tokens one pass may compute
    batch: tuple[tuple[str, int, bool], ...]  # per request in the pass: (id, tokens computed, True for a decode)
    blocks: tuple[tuple[str, int, bool], ...]  # per block: (holder ids, "" for none; slots filled; cached though free)
    block_size: int


def serve_views(sched, steps: Sequence[int]) -> list[PoolStep]:
    """Step `sched` (a `labcode.serving.Scheduler` with its requests submitted) until it is idle, checking its
    invariants after every step, and keep its pass and its pool after each step in `steps`."""
    from labcode.serving import check_invariants

    views, wanted = [], set(steps)
    bs = sched.pool.block_size
    while sched.busy():
        decoding = {s.req.rid for s in sched.running if s.n_cached == len(s.tokens) - 1}
        record = sched.step()
        check_invariants(sched)
        if record["step"] not in wanted:
            continue
        holders: dict[int, list[str]] = {}
        filled = [0] * sched.pool.n_blocks
        for seq in sched.running:
            for i, block in enumerate(seq.blocks):
                holders.setdefault(block, []).append(seq.req.rid)
                filled[block] = max(filled[block], min(bs, seq.n_cached - i * bs))
        blocks = tuple((" ".join(holders.get(b, [])), filled[b], b not in holders and b in sched.pool.hash_of)
                       for b in range(sched.pool.n_blocks))
        batch = tuple((rid, n, rid in decoding and n == 1) for rid, n in record["batch"])
        views.append(PoolStep(record["step"], sched.budget, batch, blocks, bs))
    if len(views) != len(wanted):
        fail("steps", f"steps the scheduler ran (0 to {sched.step_no - 1})", sorted(wanted), CacheError)
    return views


def pool_figure(views: Sequence[PoolStep], per_row: int = 5, width: float = PICTURE_WIDTH):
    """Each step stacked: its pass (one box per token of the budget: a request's decode filled, its prompt chunk
    hatched, unused budget outlined) over the pool, `per_row` blocks a row, each block's slots filled in the colour
    of the request holding it, named under it. Returns the figure."""
    from matplotlib.patches import Rectangle

    if not views:
        fail("views", "one or more PoolSteps", views)
    order = list(dict.fromkeys([rid for v in views for rid, _, _ in v.batch]
                               + [h for v in views for names, _, _ in v.blocks for h in names.split()]))
    colour = {rid: COLOURS[i % 5] for i, rid in enumerate(order)}
    bs, n_blocks = views[0].block_size, len(views[0].blocks)
    rows, step_w = -(-n_blocks // per_row), bs + 0.6
    height = 0.9 + 1.0 + 1.2 + rows * 1.9 + 0.4
    fig, ax = picture_figure(max(per_row * step_w - 0.6, views[0].budget) + 0.2, height * len(views), width)
    for k, view in enumerate(views):
        top = -k * height
        _text(ax, 0.1, top - 0.45, f"step {view.step}: one pass, {view.budget} tokens at most", ha="left",
              fontweight="bold")
        x, y = 0.1, top - 1.9
        for rid, n, decode in view.batch:
            _box(ax, x, y, n, 1, colour[rid], alpha=0.55 if decode else 0.3)
            if not decode:
                ax.add_patch(Rectangle((x, y), n, 1, facecolor="none", edgecolor=INK, hatch="//", linewidth=0))
            for j in range(1, n):
                ax.plot([x + j, x + j], [y, y + 1], color=INK, linewidth=0.4)
            clear = None if decode else {"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none"}
            _text(ax, x + n / 2, y + 0.5, rid, fontweight="bold", bbox=clear)  # readable over the hatching
            x += n
        for j in range(round(x - 0.1), view.budget):
            _box(ax, 0.1 + j, y, 1, 1, None, edge=FREE)
        _text(ax, 0.1, y - 0.75, "the pool after it", ha="left", fontweight="bold")
        for b, (names, n_filled, cached) in enumerate(view.blocks):
            bx, by = 0.1 + (b % per_row) * step_w, y - 2.3 - (b // per_row) * 1.9
            who = names.split()
            fill = colour[who[0]] if len(who) == 1 else SHARED if who else None
            for j in range(bs):
                _box(ax, bx + j, by, 1, 1, fill if j < n_filled else None, edge=INK if who else FREE, alpha=0.45)
            label = names or ("cached" if cached else "free")
            _text(ax, bx + bs / 2, by - 0.4, f"#{b} {label}", color=INK if who else FREE)
    unused = any(sum(n for _, n, _ in v.batch) < v.budget for v in views)
    # the kinds of box, in grey: each box takes its request's colour
    _legend(ax, [("decode", FREE, 0.55, None), ("prompt chunk", FREE, 0.3, "//")]
            + ([("unused", None, 0, None)] if unused else []))
    return fig


# -- chapter 6's opening picture: the keys each of three answers attends to -----------------------------

Box = tuple[str, int, bool]  # (character, position, attended to)


def three_answers_view(model, ids: torch.Tensor, window: int, text: str) -> dict[str, list[Box]]:
    """The keys the last of `ids` [1, T] attends to under the full model, a window cache of `window`
    slots fed one token at a time, and the truncated recompute of the last `window` tokens, read from
    the caches after the pass. `text` holds the T characters of `ids`."""
    from labcode.caches import ConcatCache, WindowCache

    t = ids.shape[1]
    if not (0 < window < t and len(text) == t):
        fail("window", f"fewer slots than the {t} tokens, and one character of text per token",
             (window, len(text)), CacheError)
    chars = ["␣" if c == " " else c for c in text]
    with torch.no_grad():
        full = ConcatCache(model.cfg.n_layers)
        model(ids, full)
        cache = WindowCache(model.cfg.n_layers, window)
        for p in range(t):
            model(ids[:, p : p + 1], cache)
        fresh = ConcatCache(model.cfg.n_layers)
        model(ids[:, -window:], fresh)  # the last W tokens, from scratch
    held = set(range(cache.position - cache.length(), cache.position))
    start = t - fresh.position  # the first token the recompute sees
    return {
        "full model": [(chars[x], x, True) for x in range(full.position)],
        "window cache": [(chars[x], x, x in held) for x in range(t)],
        "truncated recompute": [(chars[start + q], q, True) for q in range(fresh.position)],
    }


def three_answers_figure(rows: dict[str, list[Box]], notes: Sequence[str | None], width: float = 4.6):
    """One row of boxes per answer, its title above it, each box a key's character over its position,
    dashed and grey where the answer does not attend to it; `notes` beside the rows. Returns the figure."""
    from matplotlib.patches import Rectangle

    from labcode.plotting import figure

    grey, gap, mid = "#9aa0a8", 2.9, {"ha": "center", "va": "center"}
    t = max(len(boxes) for boxes in rows.values())
    fig, ax = figure(height=3.9, width=width)
    for r, ((title, boxes), note) in enumerate(zip(rows.items(), notes, strict=True)):
        y = -r * gap
        ax.text(0, y + 1.45, title, ha="left", va="center", fontsize=13, color=INK)
        for x, (char, pos, on) in enumerate(boxes):
            ink, line = (INK, "-") if on else (grey, "--")
            if on:
                ax.add_patch(Rectangle((x, y), 1, 1, color=COLOURS[0], alpha=0.35, lw=0))
            ax.add_patch(Rectangle((x, y), 1, 1, fill=False, ec=ink, lw=0.9, ls=line))
            ax.text(x + 0.5, y + 0.5, char, **mid, fontsize=13, family="monospace", color=ink)
            ax.text(x + 0.5, y - 0.35, str(pos), **mid, fontsize=12, color=ink)
        if note:
            ax.text(t + 0.3, y + 0.5, note, ha="left", va="center", fontsize=12, color=INK)
    ax.set(xlim=(0, t + 5.6), ylim=(-(len(rows) - 1) * gap - 0.8, 1.9))
    ax.set_aspect("equal")
    ax.set_axis_off()
    return fig


# -- chapter 13's opening picture: one token's cache row under each lever, to scale in bytes --------------

ROW_PARTS = {  # what a part of a row holds -> its colour
    "K and V": COLOURS[0],
    "latent c": COLOURS[3],
    "rotary key": COLOURS[4],
    "codes": COLOURS[1],
    "scales": COLOURS[2],
}


@dataclass(frozen=True)
class RowBytes:
    """One token's share of a cache under one lever: (part, bytes) pairs, in the order they are drawn."""

    label: str
    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)


def row_bytes(cfg, tokens: int, rank: int, rope_dim: int, bits: int = 2, group_size: int = 32,
              residual: int = 32, budget: int = 512, share_every: int = 2,
              element_bytes: int = 2) -> list[RowBytes]:
    """Bytes per token of a `tokens`-long sequence at the shapes of `cfg` (L, H, its Hkv, D), `element_bytes`
    an element: MHA, GQA (cfg's Hkv), MQA; MLA of rank r with a rotary key (labcode.mla); chapter 9's int8
    codes and KIVI's `bits`-bit codes (labcode.engines.kivi, scales and residual counted) on cfg's heads;
    eviction to `budget` rows (H2O, SnapKV); one K/V per `share_every` layers (cross-layer sharing)."""
    from labcode.cost import kv_cache_bytes, quantized_kv_cache_bytes
    from labcode.engines.kivi import kivi_bytes
    from labcode.mla import latent_bytes_per_token

    n, h, hkv, d, e = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, element_bytes
    if not (0 < budget <= tokens and 0 < share_every <= n and hkv not in (1, h)):
        fail("cfg, tokens, budget, share_every", "grouped heads (1 < Hkv < H), 0 < budget <= tokens and "
             f"0 < share_every <= L={n}", (hkv, tokens, budget, share_every), CacheError)
    dense = {name: kv_cache_bytes(n, 1, 1, heads, d, e) for name, heads in (("MHA", h), ("GQA", hkv), ("MQA", 1))}
    int8 = quantized_kv_cache_bytes(n, 1, 1, hkv, d)
    codes8 = kv_cache_bytes(n, 1, 1, hkv, d, 1)

    def kivi(**zeroed) -> float:  # per token, with some of KIVI's byte counts set to zero
        args = {"scale_bytes": e, "residual_bytes": e, **zeroed}
        return kivi_bytes(n, hkv, d, tokens, bits, group_size, residual, **args) / tokens

    low_codes, low_scaled = kivi(scale_bytes=0, residual_bytes=0), kivi(residual_bytes=0)
    shared = kv_cache_bytes(-(-n // share_every), 1, 1, hkv, d, e)
    return [
        RowBytes(f"MHA: {h} K/V heads", (("K and V", dense["MHA"]),)),
        RowBytes(f"GQA: {hkv} K/V heads", (("K and V", dense["GQA"]),)),
        RowBytes("MQA: one K/V head", (("K and V", dense["MQA"]),)),
        RowBytes(f"MLA: latent r = {rank}, rotary key {rope_dim}",
                 (("latent c", latent_bytes_per_token(n, rank, 0, e)),
                  ("rotary key", latent_bytes_per_token(n, 0, rope_dim, e)))),
        RowBytes("GQA in int8 codes", (("codes", codes8), ("scales", int8 - codes8))),
        RowBytes(f"GQA in KIVI {bits}-bit codes, the latest {residual} exact",
                 (("codes", low_codes), ("scales", low_scaled - low_codes),
                  ("K and V", kivi() - low_scaled))),
        RowBytes(f"GQA evicted to {budget:,} of {tokens:,} rows", (("K and V", dense["GQA"] * budget / tokens),)),
        RowBytes(f"GQA, one K/V for every {share_every} layers", (("K and V", shared),)),
    ]


def row_bytes_figure(rows: Sequence[RowBytes], unit: str = "B", width: float = PICTURE_WIDTH):
    """One bar per lever, stacked from its parts and drawn to one scale, its label above it and its total at
    its end. Returns the figure."""
    from matplotlib.patches import Rectangle

    if not rows:
        fail("rows", "one or more RowBytes", rows)
    top = max(r.total for r in rows)
    span, gap = 10.0, 1.25  # drawing units: the longest bar; from one row to the next
    fig, ax = picture_figure(span * 1.3, len(rows) * gap + 0.2, width)
    scale = span / top
    for i, row in enumerate(rows):
        y = -(i + 1) * gap
        _text(ax, 0.0, y + 0.72, row.label, ha="left")
        x = 0.0
        for part, b in row.parts:
            ax.add_patch(Rectangle((x, y), b * scale, 0.42, facecolor=ROW_PARTS[part], alpha=0.75, linewidth=0))
            x += b * scale
        ax.add_patch(Rectangle((0, y), x, 0.42, facecolor="none", edgecolor=INK, linewidth=0.6))
        _text(ax, x + 0.15, y + 0.21, f"{row.total:,.0f} {unit}", ha="left")
    used = [p for p in ROW_PARTS if any(p == q for r in rows for q, _ in r.parts)]
    _legend(ax, [(p, ROW_PARTS[p], 0.75, None) for p in used])
    return fig
