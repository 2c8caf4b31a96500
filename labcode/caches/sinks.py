"""The sink cache: the first `n_keep` positions (attention sinks) and the latest W.

Introduced in chapter 6. A `WindowCache` whose shift leaves its first `n_keep` rows where they
are, as llama.cpp's context shift keeps its first `n_keep` tokens and StreamingLLM keeps four
"attention sinks" beside a rolling window. Positions stay absolute here: the course model's
learned position table gives each key its position once, when it is computed.
"""

from __future__ import annotations

from labcode.caches.base import CacheError
from labcode.caches.window import WindowCache, shift_left
from labcode.checks import fail, is_int


class SinkCache(WindowCache):
    """Keeps positions 0..n_keep-1 and the latest `window` positions; drops the ones in between."""

    attention_window = None  # not a band: every query also sees the sinks

    def __init__(self, n_layers: int, window: int, n_keep: int) -> None:
        if not (is_int(n_keep) and n_keep >= 0):
            fail("n_keep", "a number of first positions to keep, at least 0", repr(n_keep), CacheError)
        if not (is_int(window) and window > 0):
            fail("window", "a positive number of latest positions to keep", repr(window), CacheError)
        super().__init__(n_layers, n_keep + window)  # n_keep + W slots: the sinks, then the window
        self.n_keep = n_keep
        self.max_chunk = window  # a chunk must fit beside the sinks

    @property
    def window(self) -> int:
        """W, the number of latest positions kept beside the sinks."""
        return self.capacity - self.n_keep

    def _shift(self, layer: int, drop: int) -> None:
        """Drop the `drop` oldest rows after the sinks: rows n_keep + drop.. move to n_keep.."""
        for buf in (self.k[layer], self.v[layer]):
            shift_left(buf[:, :, self.n_keep :], drop, self.ptr - self.n_keep)  # a view: writes into buf
            self.rows_copied += self.ptr - self.n_keep - drop
