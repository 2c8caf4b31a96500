"""The concatenating cache: every append makes new, longer tensors with `torch.cat`.

Introduced in chapter 4. Simple and fork-safe (old tensors are never written), and
what it returns is always contiguous, but step t copies all t cached rows: n
one-token steps copy about n^2/2 rows in total (`rows_copied` counts them).
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache


class ConcatCache(KVCache):
    """Per-layer (K, V) grown with `torch.cat` on the token axis; `rows_copied` counts the cost."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)
        self.k: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, S, D) each
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.rows_copied = 0  # token rows written into cache storage, summed over layers, K and V

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            k = k.clone(memory_format=torch.contiguous_format)  # own rows, not a view into the projection
            v = v.clone(memory_format=torch.contiguous_format)
        else:
            k = torch.cat((self.k[layer], k), dim=2)  # (B, Hkv, S+T, D): a new tensor, all S+T rows copied
            v = torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        self.rows_copied += 2 * k.shape[2]
        return k, v

    def length(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def fork(self) -> ConcatCache:
        """An independent copy that shares tensors safely: cat never writes into them."""
        other = ConcatCache(self.n_layers)
        other.__dict__.update({key: list(val) if isinstance(val, list) else val for key, val in vars(self).items()})
        return other

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.rows_copied = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)
