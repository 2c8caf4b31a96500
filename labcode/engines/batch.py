"""A batch of sequences of different lengths, each with its own positions (candle's scattered cache).

Introduced in chapter 9. Row b of the batch writes its new tokens at its own offset
`lengths[b]`; chunks are padded on the right to one length T, and `plan` says how many
tokens of each row are real. Padding is written but never counted: the next real token
overwrites it, and no real query ever sees it. `crop` rolls a row back (speculative decoding).
A pass without a plan gives every row all T of its tokens, as any batch does.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from labcode.caches.base import CacheError, Chunk, PerLayerCache
from labcode.checks import fail, is_int


def scattered_mask(lengths: list[int], t_new: int) -> torch.Tensor:
    """[B, 1, 1, T, S], S = max(lengths) + T: row b's query i sees slots 0 .. lengths[b] + i."""
    s = max(lengths) + t_new
    query_slot = torch.tensor(lengths).view(-1, 1, 1) + torch.arange(t_new).view(1, -1, 1)  # (B, T, 1)
    visible = torch.arange(s).view(1, 1, -1) <= query_slot  # (B, T, S)
    return visible.view(len(lengths), 1, 1, t_new, s)  # broadcasts over (Hkv, H/Hkv) in attention


class ScatteredCache(PerLayerCache):
    """Buffers [B, Hkv, capacity, D] per layer and a length per row; masks are [B, 1, 1, T, S]."""

    def __init__(self, n_layers: int, batch: int, capacity: int) -> None:
        super().__init__(n_layers)  # self.k, self.v: one (B, Hkv, capacity, D) buffer per layer, made on first use
        if not (is_int(batch) and batch > 0):
            fail("batch", "a positive int", batch, CacheError)
        if not (is_int(capacity) and capacity > 0):
            fail("capacity", "a positive number of token slots", capacity, CacheError)
        self.rows, self.capacity = batch, capacity
        self.lengths = [0] * batch  # real tokens held per row
        self.planned: tuple[list[int], int] | None = None  # the next pass's (real tokens per row, T)

    def plan(self, n_new: list[int], t_new: int | None = None) -> None:
        """Row b brings n_new[b] real tokens in the next pass, padded to `t_new` (default max(n_new))."""
        if not (len(n_new) == self.rows and all(is_int(n) and n >= 0 for n in n_new)):
            fail("n_new", f"{self.rows} ints >= 0, one per row", n_new, CacheError)
        t_new = max(n_new) if t_new is None else t_new
        if not (is_int(t_new) and t_new >= max(1, max(n_new))):
            fail("t_new", f"an int >= max(1, {max(n_new)})", t_new, CacheError)
        self.planned = (list(n_new), t_new)

    @contextmanager
    def planned_pass(self, n_new: list[int], t_new: int | None = None):
        """`plan` for the one pass run inside the `with` block; a refused pass leaves no plan behind."""
        if self.planned is not None:
            fail("plan", "no plan pending before planned_pass", self.planned, CacheError)
        self.plan(n_new, t_new)
        try:
            yield self
        finally:
            self.planned = None  # used by the pass, or withdrawn because the pass was refused

    def query_positions(self, n_new: list[int], t_new: int) -> torch.Tensor:
        """Positions [B, T]: row b's token i sits at lengths[b] + i; padding repeats the row's last position."""
        i = torch.arange(t_new).unsqueeze(0)  # (1, T)
        lengths, n = torch.tensor(self.lengths).unsqueeze(1), torch.tensor(n_new).unsqueeze(1)
        last = (lengths + n - 1).clamp(min=0)  # (B, 1): the row's last real position
        return torch.minimum(lengths + i, last)  # (B, T): padding never goes past a real position

    def room(self) -> int:
        """Positions every row can still take."""
        return self.capacity - max(self.lengths)

    def _check(self, chunk: Chunk) -> None:
        b, t = chunk.shape[0], chunk.t_new
        if b != self.rows:
            fail("batch", f"the cache's {self.rows} rows", b, CacheError)
        if self.planned is not None and self.planned[1] != t:
            fail("plan", f"a plan for a chunk of {t} tokens", self.planned[1], CacheError)
        if t > self.room():
            fail("t_new", f"a chunk that fits the {self.room()} free slots of the longest row", t, CacheError)

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: each row's real tokens, their positions, the slots they are written to, the masks."""
        n_new = [chunk.t_new] * self.rows if self.planned is None else self.planned[0]
        t = chunk.t_new
        chunk.placed = self.query_positions(n_new, t)  # (B, T)
        chunk.slots = torch.tensor(self.lengths).unsqueeze(1) + torch.arange(t)  # (B, T): row b writes at lengths[b]
        chunk.mask = scattered_mask(self.lengths, t).to(chunk.device)  # (B, 1, 1, T, S): never a row's padding
        chunk.plan = n_new

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, t, d = k.shape
        self._buffers(layer, k, self.capacity)
        index = self.chunk.slots.to(k.device).view(b, 1, t, 1).expand(b, hkv, t, d)
        self.k[layer].scatter_(2, index, k)  # row b writes at its own offset
        self.v[layer].scatter_(2, index, v)
        s = max(self.lengths) + t
        return self.k[layer][:, :, :s], self.v[layer][:, :, :s]  # (B, Hkv, S, D)

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        self.lengths = [n + m for n, m in zip(self.lengths, chunk.plan, strict=True)]
        self.planned = None
        self.position = max(self.lengths)

    def crop(self, row: int, n_drop: int) -> None:
        """Forget the last `n_drop` tokens of `row`; they are overwritten by whatever comes next."""
        if not (is_int(row) and 0 <= row < self.rows):
            fail("row", f"an int in [0, {self.rows})", row, CacheError)
        if not (is_int(n_drop) and 0 <= n_drop <= self.lengths[row]):
            fail("n_drop", f"an int in [0, {self.lengths[row]}]", n_drop, CacheError)
        self.lengths[row] -= n_drop
        self.position = max(self.lengths)

    def _reorder(self, index: torch.Tensor) -> int:
        """Rows gathered with their lengths (no plan may be pending: it was made for the old rows)."""
        if self.planned is not None:
            fail("plan", "no pending plan (it was made for the rows before the reorder)", self.planned, CacheError)
        moved = super()._reorder(index)
        self.lengths = [self.lengths[i] for i in index.tolist()]
        self.rows = index.shape[0]
        return moved

    def rollback_limit(self) -> int:
        """The most positions `rollback` can remove from every row: the shortest row's length."""
        return min(self.lengths)

    def rollback(self, n: int) -> None:
        """Remove the last n tokens of every row (`crop` does it for one row). Introduced in chapter 12
        (rollback)."""
        self._between_passes("roll back between passes")
        if self.planned is not None:
            fail("plan", "no pending plan (it was made for the lengths before the rollback)", self.planned,
                 CacheError)
        self._check_rollback(n, "n")
        for row in range(self.rows):
            self.crop(row, n)

    def length(self, layer: int = 0) -> int:
        return max(self.lengths)

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The first max(lengths) slots of every row (a row shorter than that ends in stale slots)."""
        if self.k[layer] is None:
            return None, None
        n = max(self.lengths)
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def reset(self) -> None:
        super().reset()
        self.lengths = [0] * self.rows
        self.planned = None


def run_ragged(model, cache: ScatteredCache, chunks: list[list[int]]) -> list[torch.Tensor]:
    """One pass with a chunk of token ids per row (any lengths, empty allowed); returns each row's logits [n_b, V]."""
    if len(chunks) != cache.rows:
        fail("chunks", f"{cache.rows} lists of token ids", len(chunks), CacheError)
    n_new = [len(c) for c in chunks]
    t = max(1, max(n_new))
    ids = torch.zeros(cache.rows, t, dtype=torch.long, device=model.device)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)  # right padding with token 0
    with cache.planned_pass(n_new, t):  # a refused pass leaves the cache exactly as it was
        logits = model(ids, cache)  # (B, T, V)
    return [logits[row, :n] for row, n in enumerate(n_new)]
