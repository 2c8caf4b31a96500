"""A preallocated cache that grows when full, as candle's `KvCache` does.

Introduced in chapter 5. `policy="linear"` grows by a fixed `grow_by` slots
(candle: the initial capacity), `policy="double"` doubles. Each growth copies the
whole buffer; `grow_count` and `rows_copied` count it.
"""

from __future__ import annotations

import torch

from labcode.caches.base import expect
from labcode.caches.prealloc import PreallocatedCache


class GrowableCache(PreallocatedCache):
    """Never drops a position; grows its buffers with a copy when an append does not fit."""

    def __init__(self, n_layers: int, capacity: int, policy: str = "linear", grow_by: int | None = None) -> None:
        super().__init__(n_layers, capacity)
        expect(policy in ("linear", "double"), "policy", "'linear' or 'double'", repr(policy))
        grow_by = capacity if grow_by is None else grow_by
        expect(isinstance(grow_by, int) and grow_by > 0, "grow_by", "a positive number of slots", grow_by)
        self.policy, self.grow_by = policy, grow_by
        self.grow_count = 0  # growths, counted once per layer
        self.capacities = [capacity] * n_layers

    def _grow(self, layer: int, needed: int) -> None:
        cap = self.capacities[layer]
        while cap < needed:  # a while, not an if: one big chunk may need several growths
            cap = cap + self.grow_by if self.policy == "linear" else 2 * cap
        extra = cap - self.capacities[layer]
        for buffers in (self.k, self.v):
            old = buffers[layer]
            pad = old.new_zeros(old.shape[0], old.shape[1], extra, old.shape[3])
            buffers[layer] = torch.cat((old, pad), dim=2)  # copies every slot of the old buffer
            self.rows_copied += old.shape[2]
        self.capacities[layer] = cap
        self.grow_count += 1

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure_buffers(layer, k)
        n, t = self.ptr[layer], k.shape[2]
        if n + t > self.capacities[layer]:
            self._grow(layer, n + t)
        self._write(layer, k, v, n)
        self.ptr[layer] = n + t
        return self.k[layer][:, :, : n + t], self.v[layer][:, :, : n + t]  # narrow views

    def reset(self) -> None:
        super().reset()
        self.capacities = [self.capacity] * self.n_layers
        self.grow_count = 0

    def state(self) -> dict:
        return {**super().state(), "capacities": list(self.capacities), "grow_count": self.grow_count}
