"""A ring-buffer window: the same positions as `WindowCache`, without ever shifting.

Introduced in chapter 5. Position p is written to slot p % W; the slots are not
in time order, so the mask is built from the position stored in each slot.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk
from labcode.caches.window import WindowCache
from labcode.checks import fail, is_int
from labcode.masks import positions_mask


class RingCache(WindowCache):
    """Keeps the latest `window` positions in a circular buffer; `slot_pos` records each slot's position."""

    def __init__(self, n_layers: int, window: int) -> None:
        super().__init__(n_layers, window)  # ptr counts the slots filled
        self.slot_pos = torch.full((window,), -1, dtype=torch.long)  # (W,): -1 marks an empty slot

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: the slots p % W of the new positions, the slot table after the pass, the mask."""
        chunk.dropped = self.will_drop(chunk.t_new)  # the slots overwritten: as many as the window drops
        chunk.past = self.ptr - chunk.dropped
        query = torch.arange(chunk.start, chunk.start + chunk.t_new)  # (T,) positions of the new tokens
        chunk.slots = query % self.capacity
        chunk.plan = self.slot_pos.clone()
        chunk.plan[chunk.slots] = query  # (W,): the position each slot holds once the pass is committed
        chunk.mask = positions_mask(query, chunk.plan, self.capacity).to(chunk.device)  # (T, W)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._buffers(layer, k, self.capacity)
        slots = self.chunk.slots.to(k.device)
        self.k[layer].index_copy_(2, slots, k)  # writes T rows; never moves the others
        self.v[layer].index_copy_(2, slots, v)
        self.rows_copied += 2 * k.shape[2]
        return self.k[layer], self.v[layer]  # (B, Hkv, W, D): every slot, masked by position

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        self.slot_pos = chunk.plan

    def _rollback(self, n: int) -> None:
        """Mark the slots of the last n positions empty in the slot table; their keys stay in the buffers
        (stale) until a later position is written there, and the mask, built from the table, never reads them."""
        super()._rollback(n)
        self.slot_pos = torch.where(self.slot_pos >= self.position - n, -1, self.slot_pos)

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if self.k[layer] is None else self.ordered(layer)

    def ordered(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K, V [B, Hkv, n, D] in time order (oldest first): copies, gathered by position."""
        if not (is_int(layer) and 0 <= layer < self.n_layers and self.k[layer] is not None):
            fail("layer", f"a layer below {self.n_layers} that holds keys", layer, CacheError)
        order = torch.argsort(self.slot_pos)[int((self.slot_pos < 0).sum()):]  # empty slots sort first
        order = order.to(self.k[layer].device)
        return self.k[layer].index_select(2, order), self.v[layer].index_select(2, order)

    def reset(self) -> None:
        super().reset()
        self.slot_pos = torch.full((self.capacity,), -1, dtype=torch.long)
