"""Shared machinery of the caches that preallocate [B, Hkv, N, D] buffers.

Introduced in chapter 5. Buffers are created on the first append, with the
dtype and device of the activations; writes copy only the new rows.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, PerLayerCache
from labcode.checks import fail, is_int


class PreallocatedCache(PerLayerCache):
    """Per-layer K/V buffers of `capacity` token slots, of which the first `ptr` hold the cached rows."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        super().__init__(n_layers)  # self.k, self.v: one (B, Hkv, capacity, D) buffer per layer, made on first use
        if not (is_int(capacity) and capacity > 0):
            fail("capacity", "a positive number of token slots", repr(capacity), CacheError)
        self.capacity = capacity
        self.ptr = 0  # rows held: the next free slot of every layer's buffer
        self.rows_copied = 0  # token rows written or moved inside the buffers, summed over layers, K and V

    def _check(self, chunk: Chunk) -> None:
        """Buffers made under `torch.inference_mode` (as `generate` makes them) can only be written under it."""
        k = self.k[0]
        if k is not None and k.is_inference() and not torch.is_inference_mode_enabled():
            fail("cache", "a call under torch.inference_mode(), where its buffers were made (generate runs there); "
                 "PyTorch forbids writing into them outside it", "a call outside it", CacheError)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        t = k.shape[2]
        self.k[layer].narrow(2, at, t).copy_(k)  # copies T rows, whatever the cached length
        self.v[layer].narrow(2, at, t).copy_(v)
        self.rows_copied += 2 * t

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        self.ptr = chunk.past + chunk.t_new

    def _rollback(self, n: int) -> None:
        """Move the write pointer back: the n rows stay in the buffers, past `ptr`, until overwritten."""
        self.ptr -= n

    def length(self, layer: int = 0) -> int:
        return self.ptr

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of the filled rows; they share the buffers, so a later write shows through."""
        if self.k[layer] is None:
            return None, None
        return self.k[layer][:, :, : self.ptr], self.v[layer][:, :, : self.ptr]

    def fork(self, share_storage: bool = False) -> PreallocatedCache:
        """A copy that owns its buffers. `share_storage=True` reproduces the aliasing hazard instead:
        both copies then write into the same buffers, each with its own pointer."""
        other = super().fork()
        if share_storage:
            other.k, other.v = list(self.k), list(self.v)
        return other

    def reset(self) -> None:
        super().reset()
        self.ptr = 0
        self.rows_copied = 0
