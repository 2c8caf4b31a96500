"""The concatenating cache: every append makes new, longer tensors with `torch.cat`.

Introduced in chapter 3. Simple and fork-safe (old tensors are never written),
but step t copies all t cached rows: n steps copy about n^2/2 rows in total.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache


class ConcatCache(KVCache):
    """Per-layer (K, V) grown with `torch.cat` on the token axis; `rows_copied` counts the cost."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.rows_copied = 0  # token rows written by cat, summed over layers, K and V

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat((self.k[layer], k), dim=2)  # (B, Hkv, S+T, D): a new tensor
            self.v[layer] = torch.cat((self.v[layer], v), dim=2)
        self.rows_copied += 2 * self.k[layer].shape[2]
        return self.k[layer], self.v[layer]

    def length(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[2]

    def fork(self) -> ConcatCache:
        """An independent copy that shares tensors safely: cat never writes into them."""
        other = ConcatCache(self.n_layers)
        other.k, other.v = list(self.k), list(self.v)
        other.position, other.batch, other.dtype, other.device = self.position, self.batch, self.dtype, self.device
        return other

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers

    def state(self) -> dict:
        return {
            "position": self.position,
            "k": [None if t is None else t.clone() for t in self.k],
            "v": [None if t is None else t.clone() for t in self.v],
        }

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)
