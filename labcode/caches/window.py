"""The preallocated window cache: fixed buffers, a write pointer, shift left when full.

Introduced in chapter 5. Once full, each append drops the oldest rows; from then
on the model no longer computes what the full forward computes (chapter 6).
"""

from __future__ import annotations

import torch

from labcode.caches.base import expect
from labcode.caches.prealloc import PreallocatedCache


class WindowCache(PreallocatedCache):
    """Keeps at most `window` positions per layer; `last_dropped` says how many the last call dropped."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)
        self.last_dropped = 0  # positions dropped by the latest forward call
        self.total_dropped = 0

    @property
    def window(self) -> int:
        return self.capacity

    @property
    def max_chunk(self) -> int:
        """The largest chunk one call accepts; longer prompts are prefilled in chunks."""
        return self.capacity

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        super().check(batch, t_new, dtype, device)
        expect(t_new <= self.capacity, "t_new", f"a chunk of at most window={self.capacity} tokens", t_new)

    def will_drop(self, t_new: int) -> int:
        """How many cached positions a chunk of `t_new` tokens would drop."""
        return max(0, self.ptr[0] + t_new - self.capacity)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure_buffers(layer, k)
        t, n = k.shape[2], self.ptr[layer]
        drop = max(0, n + t - self.capacity)
        if drop:
            keep = n - drop
            # Source and destination overlap: copy the source first (clone) before assigning.
            self.k[layer][:, :, :keep] = self.k[layer][:, :, drop:n].clone()
            self.v[layer][:, :, :keep] = self.v[layer][:, :, drop:n].clone()
            self.rows_copied += 2 * keep
            n = keep
        if layer == 0:
            self.last_dropped = drop
            self.total_dropped += drop
        self._write(layer, k, v, n)
        self.ptr[layer] = n + t
        return self.k[layer][:, :, : n + t], self.v[layer][:, :, : n + t]  # views, no copy

    def reset(self) -> None:
        super().reset()
        self.last_dropped = self.total_dropped = 0
