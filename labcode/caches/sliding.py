"""The sliding-window cache: exact sliding-window attention under any chunk schedule.

Introduced in chapter 5. A model trained with a sliding window W (`GPTConfig.sliding_window`)
lets each query see its last W keys, itself included. A query at the start of a chunk needs the
W - 1 positions before it, so this cache keeps those W - 1 rows between passes, appends the
chunk behind them, attends under the banded mask, and only then trims back to W - 1 rows. That
is what Hugging Face's `DynamicSlidingWindowLayer` does; the W-row `WindowCache` drops before the
chunk attends instead, and is exact only one token at a time.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk
from labcode.caches.prealloc import PreallocatedCache
from labcode.caches.window import shift_left
from labcode.checks import fail, is_int
from labcode.masks import sliding_window_mask


class SlidingWindowCache(PreallocatedCache):
    """W - 1 past rows plus a chunk of at most `max_chunk` (default W), in W - 1 + max_chunk preallocated slots.

    With a `reserve` of r it keeps W - 1 + r rows between passes (the band hides the r oldest), so that r
    positions can always be rolled back (chapter 12, rollback).
    """

    max_chunk_reason = "the slots left after the W - 1 kept rows"

    def __init__(self, n_layers: int, window: int, max_chunk: int | None = None, reserve: int = 0) -> None:
        if not (is_int(window) and window > 0):
            fail("window", "a positive number of keys per query", repr(window), CacheError)
        max_chunk = window if max_chunk is None else max_chunk
        if not (is_int(max_chunk) and max_chunk > 0):
            fail("max_chunk", "a positive number of tokens per pass, or None (the window)", repr(max_chunk),
                 CacheError)
        if not (is_int(reserve) and reserve >= 0):
            fail("reserve", "a number of extra rows to keep for rollbacks, at least 0", repr(reserve), CacheError)
        super().__init__(n_layers, window - 1 + reserve + max_chunk)
        self.attention_window = window  # W: the band every mask applies
        self.rollback_reserve = reserve  # rows kept beyond the W - 1 the band needs
        self.max_chunk = max_chunk
        self.last_dropped = 0  # positions trimmed after the latest pass
        self.total_dropped = 0  # positions trimmed since the cache was new

    @property
    def window(self) -> int:
        """W, the keys each query sees, itself included."""
        return self.attention_window

    @property
    def keeps(self) -> int:
        """Positions held between passes before the first trim: W - 1, plus the reserve."""
        return self.attention_window - 1 + self.rollback_reserve

    def rollback_limit(self) -> int:
        """Every position until the first trim; after it, the rows held beyond the W - 1 the next query needs."""
        return self.position if self.total_dropped == 0 else self.ptr - (self.attention_window - 1)

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: the chunk goes after the (at most W - 1) kept rows, under the band."""
        t, w = chunk.t_new, self.attention_window
        chunk.past = self.ptr
        band = t > 1 or chunk.past > w - 1  # one query sees every row, unless reserved rows lie past its band
        chunk.mask = sliding_window_mask(t, chunk.past, w, device=chunk.device) if band else None  # (T, S + T)
        chunk.dropped = max(0, chunk.past + t - self.keeps)  # trimmed when the pass ends: no later query sees them

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._buffers(layer, k, self.capacity)
        self._write(layer, k, v, self.ptr)  # behind the kept rows; nothing is moved before attention
        n = self.ptr + k.shape[2]
        return self.k[layer].narrow(2, 0, n), self.v[layer].narrow(2, 0, n)  # views, no copy

    def _commit(self, chunk: Chunk) -> None:
        """After every layer has attended: keep the last W - 1 rows (a failed pass, never committed, moved nothing)."""
        super()._commit(chunk)  # ptr = rows held now: past + T
        if chunk.dropped:
            for layer in range(self.n_layers):
                for buf in (self.k[layer], self.v[layer]):
                    shift_left(buf, chunk.dropped, self.ptr)
                    self.rows_copied += self.ptr - chunk.dropped
            self.ptr -= chunk.dropped
        self.last_dropped = chunk.dropped
        self.total_dropped += chunk.dropped

    def reset(self) -> None:
        super().reset()
        self.last_dropped = self.total_dropped = 0
