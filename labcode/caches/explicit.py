"""The explicit-pass cache: `forward(ids, caches, return_cache=True)`.

Introduced in chapter 4. The caller owns the request state: a list of per-layer
(K, V) pairs shaped [B, Hkv, S, D] goes in, a new list comes out. The pairs
passed in are never modified, so one prefix can be continued twice.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, KVCache, Layout
from labcode.checks import fail


def check_pairs(pairs, n_layers: int) -> list:
    """Validate `caches` (None, or n_layers pairs of K, V [B, Hkv, S, D], all alike); return a new list."""
    if pairs is None:
        return [None] * n_layers
    if not isinstance(pairs, (list, tuple)):
        fail("caches", f"None or a list of {n_layers} (K, V) pairs", type(pairs).__name__, CacheError)
    pairs = list(pairs)
    if len(pairs) != n_layers:
        fail("caches", f"a list of {n_layers} (K, V) pairs, one per layer", len(pairs), CacheError)
    if all(p is None for p in pairs):
        return pairs
    for layer, p in enumerate(pairs):
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(t, torch.Tensor) for t in p)):
            fail(f"caches[{layer}]", "a (K, V) pair of tensors", type(p).__name__, CacheError)
        if p[0].dim() != 4:
            fail(f"caches[{layer}]", "tensors of rank 4 [B, Hkv, S, D]", tuple(p[0].shape), CacheError)
        k0, k, v = pairs[0][0], p[0], p[1]
        alike = k.shape == v.shape == k0.shape and k.dtype == v.dtype == k0.dtype and k.device == v.device == k0.device
        if not alike:
            fail(f"caches[{layer}]", f"K and V of shape {tuple(k0.shape)}, {k0.dtype} on {k0.device}, as in layer 0",
                 (tuple(k.shape), tuple(v.shape), k.dtype, v.dtype), CacheError)
    return pairs


class PairsCache(KVCache):
    """Adapter that lets the model read a list of (K, V) pairs and build the next list."""

    def __init__(self, n_layers: int, pairs=None) -> None:
        super().__init__(n_layers)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = check_pairs(pairs, n_layers)  # a new list
        if self.pairs[0] is not None:
            k0 = self.pairs[0][0]
            self.position = k0.shape[2]  # the position offset is the cached length
            self.layout = Layout.of(k0)  # B, Hkv, D, dtype and device, as cached

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old = self.pairs[layer]
        if old is not None:
            k, v = torch.cat((old[0], k), dim=2), torch.cat((old[1], v), dim=2)  # (B, Hkv, S+T, D), new tensors
        self.pairs[layer] = (k, v)
        return k, v

    def _rollback(self, n: int) -> None:
        """A new list of narrower pairs; the tensors handed in or out are never written."""
        keep = self.length() - n
        self.pairs = [(k[:, :, :keep], v[:, :, :keep]) for k, v in self.pairs]

    def _reorder(self, index: torch.Tensor) -> int:
        self.pairs = [tuple(t.index_select(0, index.to(t.device)) for t in pair) for pair in self.pairs]
        return sum(t.nbytes for pair in self.pairs for t in pair)

    def length(self, layer: int = 0) -> int:
        pair = self.pairs[layer]
        return 0 if pair is None else pair[0].shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        pair = self.pairs[layer]
        return (None, None) if pair is None else pair

    def reset(self) -> None:
        super().reset()
        self.pairs = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for p in self.pairs if p is not None for t in p)
