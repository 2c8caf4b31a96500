"""A preallocated cache that grows when full, as candle's `KvCache` does.

Introduced in chapter 5. `policy="linear"` grows by a fixed `grow_by` slots
(candle: the initial capacity), `policy="double"` doubles. Each growth copies the
whole buffer; `grow_count` and `rows_copied` count it.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError
from labcode.caches.prealloc import PreallocatedCache
from labcode.checks import fail, is_int


class GrowableCache(PreallocatedCache):
    """Never drops a position; grows its buffers with a copy when an append does not fit."""

    def __init__(self, n_layers: int, capacity: int, policy: str = "linear", grow_by: int | None = None) -> None:
        super().__init__(n_layers, capacity)
        if policy not in ("linear", "double"):
            fail("policy", "'linear' or 'double'", repr(policy), CacheError)
        grow_by = capacity if grow_by is None else grow_by  # candle: grow_by is the initial capacity
        if not (is_int(grow_by) and grow_by > 0):
            fail("grow_by", "a positive number of slots", repr(grow_by), CacheError)
        self.policy, self.grow_by = policy, grow_by
        self.grow_count = 0  # buffer growths, summed over layers
        self.capacities = [capacity] * n_layers  # current slots per layer

    def _grow(self, layer: int, needed: int) -> None:
        # A loop, not an if: one large chunk may need several growths (candle's fix #3035).
        while self.capacities[layer] < needed:
            cap = self.capacities[layer]
            extra = self.grow_by if self.policy == "linear" else cap
            for buffers in (self.k, self.v):
                old = buffers[layer]
                pad = old.new_zeros(old.shape[0], old.shape[1], extra, old.shape[3])
                buffers[layer] = torch.cat((old, pad), dim=2)  # a new buffer: every old slot is copied
                self.rows_copied += cap
            self.capacities[layer] = cap + extra
            self.grow_count += 1

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._buffers(layer, k, self.capacity)
        n, t = self.ptr, k.shape[2]
        if n + t > self.capacities[layer]:
            self._grow(layer, n + t)
        self._write(layer, k, v, n)
        return self.k[layer][:, :, : n + t], self.v[layer][:, :, : n + t]  # narrow views of the buffers

    def reset(self) -> None:
        super().reset()
        self.capacities = [self.capacity] * self.n_layers
        self.grow_count = 0
