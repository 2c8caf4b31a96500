"""A ring-buffer window: the same positions as `WindowCache`, without ever shifting.

Introduced in chapter 5. Position p is written to slot p % W; the slots are not
in time order, so the mask is built from the position stored in each slot.
"""

from __future__ import annotations

import torch

from labcode.caches.base import expect, is_count
from labcode.caches.prealloc import PreallocatedCache
from labcode.masks import positions_mask


class RingCache(PreallocatedCache):
    """Keeps the latest `window` positions in a circular buffer; `slot_pos` records each slot's position."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)
        self.slot_pos = torch.full((window,), -1, dtype=torch.long)  # (W,): -1 marks an empty slot
        self.last_dropped = 0  # positions overwritten by the latest forward call
        self.total_dropped = 0

    @property
    def window(self) -> int:
        """W, the number of positions kept."""
        return self.capacity

    @property
    def max_chunk(self) -> int:
        return self.capacity

    def _slots(self, t_new: int) -> torch.Tensor:
        """Slots [T] of the next `t_new` positions: p % W."""
        return torch.arange(self.position, self.position + t_new) % self.capacity

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure_buffers(layer, k)
        t = k.shape[2]
        slots = self._slots(t)
        self.k[layer].index_copy_(2, slots.to(k.device), k)  # writes T rows; never moves the others
        self.v[layer].index_copy_(2, slots.to(k.device), v)
        self.rows_copied += 2 * t
        self.ptr[layer] = min(self.capacity, self.ptr[layer] + t)  # slots filled
        if layer == 0:
            self.last_dropped = int((self.slot_pos[slots] >= 0).sum())
            self.total_dropped += self.last_dropped
        return self.k[layer], self.v[layer]  # (B, Hkv, W, D): every slot, masked by position

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        query_pos = torch.arange(self.position, self.position + t_new)  # (T,)
        slot_pos = self.slot_pos.clone()
        slot_pos[self._slots(t_new)] = query_pos  # the positions the slots hold after this chunk's writes
        return positions_mask(query_pos, slot_pos, self.capacity).to(self.k[layer].device)  # (T, W)

    def advance(self, t_new: int) -> None:
        self.slot_pos[self._slots(t_new)] = torch.arange(self.position, self.position + t_new)
        super().advance(t_new)

    def read(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return (None, None) if self.k[layer] is None else self.ordered(layer)

    def ordered(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K, V [B, Hkv, n, D] in time order (oldest first): copies, gathered by position."""
        expect(is_count(layer) and 0 <= layer < self.n_layers and self.k[layer] is not None, "layer",
               f"a layer below {self.n_layers} that holds keys", layer)
        order = torch.argsort(self.slot_pos)[int((self.slot_pos < 0).sum()):]  # empty slots sort first
        order = order.to(self.k[layer].device)
        return self.k[layer].index_select(2, order), self.v[layer].index_select(2, order)

    def reset(self) -> None:
        super().reset()
        self.slot_pos = torch.full((self.capacity,), -1, dtype=torch.long)
        self.last_dropped = self.total_dropped = 0
