"""A batch of sequences of different lengths, each with its own positions (candle's scattered cache).

Introduced in chapter 9. Row b of the batch writes its new tokens at its own offset
`lengths[b]`; chunks are padded on the right to one length T, and `plan` says how many
tokens of each row are real. Padding is written but never counted: the next real token
overwrites it, and no real query ever sees it. `crop` rolls a row back (speculative decoding).
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect


def scattered_mask(lengths: list[int], t_new: int) -> torch.Tensor:
    """[B, 1, 1, T, S], S = max(lengths) + T: row b's query i sees slots 0 .. lengths[b] + i."""
    s = max(lengths) + t_new
    query_slot = torch.tensor(lengths).view(-1, 1, 1) + torch.arange(t_new).view(1, -1, 1)  # (B, T, 1)
    visible = torch.arange(s).view(1, 1, -1) <= query_slot  # (B, T, S)
    return visible.view(len(lengths), 1, 1, t_new, s)  # broadcasts over (Hkv, H/Hkv) in attention


class ScatteredCache(KVCache):
    """Buffers [B, Hkv, capacity, D] per layer and a length per row; masks are [B, 1, 1, T, S]."""

    def __init__(self, n_layers: int, batch: int, capacity: int) -> None:
        super().__init__(n_layers)
        expect(isinstance(batch, int) and batch > 0, "batch", "a positive int", batch)
        expect(isinstance(capacity, int) and capacity > 0, "capacity", "a positive number of token slots", capacity)
        self.rows, self.capacity = batch, capacity
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.lengths = [0] * batch  # real tokens held per row
        self._n_new: list[int] | None = None
        self._t: int | None = None

    def plan(self, n_new: list[int], t_new: int | None = None) -> None:
        """Row b brings n_new[b] real tokens in the next pass, padded to `t_new` (default max(n_new))."""
        expect(len(n_new) == self.rows and all(isinstance(n, int) and n >= 0 for n in n_new), "n_new",
               f"{self.rows} ints >= 0, one per row", n_new)
        t_new = max(n_new) if t_new is None else t_new
        expect(isinstance(t_new, int) and t_new >= max(1, max(n_new)), "t_new", f"an int >= max(1, {max(n_new)})",
               t_new)
        self._n_new, self._t = list(n_new), t_new

    def query_positions(self) -> torch.Tensor:
        """Positions [B, T]: row b's token i sits at lengths[b] + i; padding repeats the row's last position."""
        expect(self._n_new is not None, "plan", "plan(n_new) before each forward pass", None)
        i = torch.arange(self._t).unsqueeze(0)  # (1, T)
        lengths, n_new = torch.tensor(self.lengths).unsqueeze(1), torch.tensor(self._n_new).unsqueeze(1)
        last = (lengths + n_new - 1).clamp(min=0)  # (B, 1): the row's last real position
        return torch.minimum(lengths + i, last)  # (B, T): padding never goes past a real position

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        super().check(batch, t_new, dtype, device)
        expect(batch == self.rows, "batch", f"the cache's {self.rows} rows", batch)
        expect(self._n_new is not None and self._t == t_new, "plan", f"a plan for a chunk of {t_new} tokens",
               self._t)
        room = self.capacity - max(self.lengths)
        expect(t_new <= room, "t_new", f"a chunk that fits the {room} free slots of the longest row", t_new)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, t, d = k.shape
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(b, hkv, self.capacity, d)
            self.v[layer] = k.new_zeros(b, hkv, self.capacity, d)
        slots = (torch.tensor(self.lengths).unsqueeze(1) + torch.arange(t)).to(k.device)  # (B, T)
        index = slots.view(b, 1, t, 1).expand(b, hkv, t, d)
        self.k[layer].scatter_(2, index, k)  # row b writes at its own offset
        self.v[layer].scatter_(2, index, v)
        s = max(self.lengths) + t
        return self.k[layer][:, :, :s], self.v[layer][:, :, :s]  # (B, Hkv, S, D)

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        """[B, 1, 1, T, S]: row b's query i sees slots 0..lengths[b] + i, so never its own padding."""
        return scattered_mask(self.lengths, t_new).to(self.k[layer].device)

    def advance(self, t_new: int) -> None:
        self.lengths = [n + m for n, m in zip(self.lengths, self._n_new, strict=True)]
        self._n_new = self._t = None
        self.position = max(self.lengths)

    def crop(self, row: int, n_drop: int) -> None:
        """Forget the last `n_drop` tokens of `row`; they are overwritten by whatever comes next."""
        expect(isinstance(row, int) and 0 <= row < self.rows, "row", f"an int in [0, {self.rows})", row)
        expect(isinstance(n_drop, int) and 0 <= n_drop <= self.lengths[row], "n_drop",
               f"an int in [0, {self.lengths[row]}]", n_drop)
        self.lengths[row] -= n_drop
        self.position = max(self.lengths)

    def length(self, layer: int = 0) -> int:
        return max(self.lengths)

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.lengths = [0] * self.rows
        self._n_new = self._t = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)


def run_ragged(model, cache: ScatteredCache, chunks: list[list[int]]) -> list[torch.Tensor]:
    """One pass with a chunk of token ids per row (any lengths, empty allowed); returns each row's logits [n_b, V]."""
    expect(len(chunks) == cache.rows, "chunks", f"{cache.rows} lists of token ids", len(chunks))
    n_new = [len(c) for c in chunks]
    t = max(1, max(n_new))
    ids = torch.zeros(cache.rows, t, dtype=torch.long, device=model.device)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)  # right padding with token 0
    saved = cache._n_new, cache._t
    cache.plan(n_new, t)
    try:
        logits = model(ids, cache)  # (B, T, V)
    except Exception:
        cache._n_new, cache._t = saved  # a rejected pass leaves the cache exactly as it was, plan included
        raise
    return [logits[row, :n] for row, n in enumerate(n_new)]
