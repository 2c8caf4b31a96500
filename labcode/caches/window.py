"""The preallocated window cache: fixed buffers, a write pointer, shift left when full.

Introduced in chapter 5. It drops the oldest rows *before* a chunk attends, so it computes
banded (sliding-window) attention one token at a time, and an answer that depends on the
chunk schedule once a chunk of several tokens makes it drop (chapter 5). For a full-attention
model every drop changes the answer (chapter 6); `SlidingWindowCache` is the exact one.
"""

from __future__ import annotations

import torch

from labcode.caches.base import Chunk
from labcode.caches.prealloc import PreallocatedCache
from labcode.masks import sliding_window_mask


def shift_left(buf: torch.Tensor, drop: int, n: int) -> None:
    """Move rows drop..n of buf [B, Hkv, W, D] to rows 0..n-drop, in place.

    Source and destination overlap, so the source is cloned first: PyTorch either
    refuses an overlapping copy or, when it cannot tell, gives no guarantee (chapter 5).
    """
    buf[:, :, : n - drop] = buf[:, :, drop:n].clone()


class WindowCache(PreallocatedCache):
    """Keeps the latest `window` positions per layer; `last_dropped` says how many the last pass dropped."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)
        self.max_chunk = window  # the largest chunk one pass accepts; longer prompts are prefilled in chunks
        self.last_dropped = 0  # positions dropped by the latest pass
        self.total_dropped = 0  # positions dropped since the cache was new

    @property
    def window(self) -> int:
        """W, the number of positions kept."""
        return self.capacity

    @property
    def attention_window(self) -> int:
        """The band its masks apply: W (a sliding-window model of this W may use it)."""
        return self.capacity

    @property
    def keeps(self) -> int:
        """Positions held before the first drop: W (after a drop, no rollback can bring them back)."""
        return self.capacity

    def will_drop(self, t_new: int) -> int:
        """How many cached positions a chunk of `t_new` tokens would drop."""
        return max(0, self.ptr + t_new - self.capacity)

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: how many rows to drop, and the mask over the rows kept (the window rule never
        hides a kept row, since each is at most W - 1 positions behind every query: it documents the rule)."""
        t = chunk.t_new
        chunk.dropped = self.will_drop(t)
        chunk.past = self.ptr - chunk.dropped
        chunk.mask = None if t == 1 else sliding_window_mask(t, chunk.past, self.capacity, device=chunk.device)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.chunk
        self._buffers(layer, k, self.capacity)
        if chunk.dropped:
            self._shift(layer, chunk.dropped)
        self._write(layer, k, v, chunk.past)
        n = chunk.past + chunk.t_new
        return self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n)  # views, no copy

    def _shift(self, layer: int, drop: int) -> None:
        """Drop `layer`'s `drop` oldest rows: move the ones kept to the front of K and V."""
        for buf in (self.k[layer], self.v[layer]):
            shift_left(buf, drop, self.ptr)
            self.rows_copied += self.ptr - drop

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        self.last_dropped = chunk.dropped
        self.total_dropped += chunk.dropped

    def reset(self) -> None:
        super().reset()
        self.last_dropped = self.total_dropped = 0
