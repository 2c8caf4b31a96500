"""The preallocated window cache: fixed buffers, a write pointer, shift left when full.

Introduced in chapter 5. While nothing has been dropped it computes exactly what the
full forward computes; once full, each append drops the oldest rows and from then
on it no longer does (chapter 6).
"""

from __future__ import annotations

import torch

from labcode.caches.prealloc import PreallocatedCache
from labcode.masks import sliding_window_mask


def shift_left(buf: torch.Tensor, drop: int, n: int) -> None:
    """Move rows drop..n of buf [B, Hkv, W, D] to rows 0..n-drop, in place.

    Source and destination overlap, so the source is cloned first: PyTorch either
    refuses an overlapping copy or, when it cannot tell, gives no guarantee (chapter 5).
    """
    buf[:, :, : n - drop] = buf[:, :, drop:n].clone()


class WindowCache(PreallocatedCache):
    """Keeps the latest `window` positions per layer; `last_dropped` says how many the last call dropped."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)
        self.last_dropped = 0  # positions dropped by the latest forward call
        self.total_dropped = 0  # positions dropped since the cache was new

    @property
    def window(self) -> int:
        """W, the number of positions kept."""
        return self.capacity

    @property
    def max_chunk(self) -> int:
        """The largest chunk one call accepts; longer prompts are prefilled in chunks."""
        return self.capacity

    def will_drop(self, t_new: int) -> int:
        """How many cached positions a chunk of `t_new` tokens would drop."""
        return max(0, self.ptr[0] + t_new - self.capacity)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure_buffers(layer, k)
        t, n = k.shape[2], self.ptr[layer]
        drop = max(0, n + t - self.capacity)
        if drop:
            shift_left(self.k[layer], drop, n)
            shift_left(self.v[layer], drop, n)
            self.rows_copied += 2 * (n - drop)
            n -= drop
        if layer == 0:
            self.last_dropped = drop
            self.total_dropped += drop
        self._write(layer, k, v, n)
        self.ptr[layer] = n + t
        return self.k[layer].narrow(2, 0, n + t), self.v[layer].narrow(2, 0, n + t)  # views, no copy

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        """The offset causal mask over the kept rows; the window rule never hides a kept row
        (every kept key is at most W-1 positions behind each query), so it only documents the rule."""
        s_total = self.length(layer)
        if t_new == 1:
            return None
        return sliding_window_mask(t_new, s_total - t_new, self.capacity, device=self.device)

    def reset(self) -> None:
        super().reset()
        self.last_dropped = self.total_dropped = 0
