"""A ring-buffer window: the same positions as `WindowCache`, without ever shifting.

Introduced in chapter 5. Position p is written to slot p % W; the slots are not
in time order, so the mask is built from the position stored in each slot.
"""

from __future__ import annotations

import torch

from labcode.caches.base import expect
from labcode.caches.prealloc import PreallocatedCache
from labcode.masks import positions_mask


class RingCache(PreallocatedCache):
    """Keeps the latest `window` positions in a circular buffer; `slot_pos` records each slot's position."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)
        self.slot_pos = torch.full((window,), -1, dtype=torch.long)  # -1: empty slot
        self.last_dropped = 0

    @property
    def max_chunk(self) -> int:
        return self.capacity

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        super().check(batch, t_new, dtype, device)
        expect(t_new <= self.capacity, "t_new", f"a chunk of at most window={self.capacity} tokens", t_new)

    def _slots(self, t_new: int) -> torch.Tensor:
        return (torch.arange(self.position, self.position + t_new) % self.capacity).to(self.k[0].device)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure_buffers(layer, k)
        t = k.shape[2]
        slots = self._slots(t)
        self.k[layer].index_copy_(2, slots, k)  # writes T rows; never moves the others
        self.v[layer].index_copy_(2, slots, v)
        self.rows_copied += 2 * t
        self.ptr[layer] = min(self.capacity, self.ptr[layer] + t)
        if layer == 0:
            self.last_dropped = int((self.slot_pos[slots.cpu()] >= 0).sum())
        return self.k[layer], self.v[layer]

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        query_pos = torch.arange(self.position, self.position + t_new)
        slot_pos = self.slot_pos.clone()
        slot_pos[self._slots(t_new).cpu()] = query_pos
        return positions_mask(query_pos, slot_pos).to(self.k[layer].device)  # (T, W)

    def advance(self, t_new: int) -> None:
        self.slot_pos[self._slots(t_new).cpu()] = torch.arange(self.position, self.position + t_new)
        super().advance(t_new)

    def ordered(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K, V [B, Hkv, n, D] in time order (oldest first)."""
        order = torch.argsort(self.slot_pos)[(self.slot_pos < 0).sum():].to(self.k[layer].device)
        return self.k[layer].index_select(2, order), self.v[layer].index_select(2, order)

    def reset(self) -> None:
        super().reset()
        self.slot_pos.fill_(-1)
        self.last_dropped = 0

    def state(self) -> dict:
        return {**super().state(), "slot_pos": self.slot_pos.clone()}
