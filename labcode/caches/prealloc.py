"""Shared machinery of the caches that preallocate [B, Hkv, N, D] buffers.

Introduced in chapter 5. Buffers are created on the first append, with the
dtype and device of the activations; writes copy only the new rows.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect, is_count


class PreallocatedCache(KVCache):
    """Per-layer K/V buffers of `capacity` token slots, and a write pointer per layer."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        super().__init__(n_layers)
        expect(is_count(capacity) and capacity > 0, "capacity", "a positive number of token slots", repr(capacity))
        self.capacity = capacity
        self.k: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, capacity, D) each
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.ptr = [0] * n_layers  # next free slot per layer
        self.rows_copied = 0  # token rows written or moved inside the buffers, summed over layers, K and V

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        """The common checks, and one of this family's own: buffers made under `torch.inference_mode`
        (as `generate` makes them) can only be written under it, so a call outside is refused up front."""
        super().check(batch, t_new, dtype, device)
        k = self.k[0]
        if k is not None and k.is_inference() and not torch.is_inference_mode_enabled():
            expect(False, "cache", "a call under torch.inference_mode(), where its buffers were made "
                   "(generate runs there); PyTorch forbids writing into them outside it", "a call outside it")

    def _ensure_buffers(self, layer: int, k: torch.Tensor) -> None:
        if self.k[layer] is None:
            b, hkv, _, d = k.shape
            self.k[layer] = k.new_zeros(b, hkv, self.capacity, d)  # same dtype and device as k
            self.v[layer] = k.new_zeros(b, hkv, self.capacity, d)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        t = k.shape[2]
        self.k[layer].narrow(2, at, t).copy_(k)  # copies T rows, whatever the cached length
        self.v[layer].narrow(2, at, t).copy_(v)
        self.rows_copied += 2 * t

    def length(self, layer: int = 0) -> int:
        return self.ptr[layer]

    def read(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled rows; they share the buffers, so a later write shows through."""
        n = self.ptr[layer]
        if self.k[layer] is None:
            return None, None
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def fork(self, share_storage: bool = False) -> PreallocatedCache:
        """A copy of this cache. `share_storage=True` reproduces the aliasing hazard:
        both copies then write into the same buffers with their own pointers."""
        other = object.__new__(type(self))
        for key, val in vars(self).items():  # own copies of lists, counters and position tables
            other.__dict__[key] = list(val) if isinstance(val, list) else (
                val.clone() if isinstance(val, torch.Tensor) else val)
        if not share_storage:
            other.k = [None if t is None else t.clone() for t in self.k]
            other.v = [None if t is None else t.clone() for t in self.v]
        return other

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.ptr = [0] * self.n_layers
        self.rows_copied = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)
