"""The explicit-pass cache: `forward(ids, caches, return_cache=True)`.

Introduced in chapter 4. The caller owns the request state: a list of per-layer
(K, V) pairs shaped [B, Hkv, S, D] goes in, a new list comes out. The pairs
passed in are never modified, so one prefix can be continued twice.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect


class PairsCache(KVCache):
    """Adapter that lets the model read a list of (K, V) pairs and build the next list."""

    def __init__(self, n_layers: int, pairs=None) -> None:
        super().__init__(n_layers)
        pairs = [None] * n_layers if pairs is None else list(pairs)
        expect(len(pairs) == n_layers, "caches", f"a list of {n_layers} (K, V) pairs or None", len(pairs))
        lengths = {None if p is None else p[0].shape[2] for p in pairs}
        expect(len(lengths) == 1, "caches", "pairs of one cached length for every layer", sorted(map(str, lengths)))
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = pairs
        if pairs[0] is not None:
            k0 = pairs[0][0]
            expect(k0.dim() == 4, "caches", "(K, V) tensors of rank 4 [B, Hkv, S, D]", tuple(k0.shape))
            self.position = k0.shape[2]  # the position offset is the cached length
            self.batch, self.dtype, self.device = k0.shape[0], k0.dtype, k0.device

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old = self.pairs[layer]
        if old is not None:
            k, v = torch.cat((old[0], k), dim=2), torch.cat((old[1], v), dim=2)  # (B, Hkv, S+T, D)
        self.pairs[layer] = (k, v)
        return k, v

    def length(self, layer: int = 0) -> int:
        pair = self.pairs[layer]
        return 0 if pair is None else pair[0].shape[2]
