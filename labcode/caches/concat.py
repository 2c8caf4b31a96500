"""The concatenating cache: every append makes new, longer tensors with `torch.cat`.

Introduced in chapter 4. Simple and fork-safe (old tensors are never written), and
what it returns is always contiguous, but step t copies all t cached rows: n
one-token steps copy about n^2/2 rows in total (`rows_copied` counts them).
"""

from __future__ import annotations

import torch

from labcode.caches.base import PerLayerCache


class ConcatCache(PerLayerCache):
    """Per-layer (K, V) grown with `torch.cat` on the token axis; `rows_copied` counts the cost."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)  # self.k, self.v: one (B, Hkv, S, D) tensor per layer, None until written
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

    def _rollback(self, n: int) -> None:
        """Narrow every layer to its first S - n rows (views: `cat` never writes into them, so forks stay safe)."""
        keep = self.length() - n
        self.k = [k[:, :, :keep] for k in self.k]
        self.v = [v[:, :, :keep] for v in self.v]

    def fork(self) -> ConcatCache:
        """A copy that shares the tensors safely: `cat` never writes into them."""
        self._between_passes("forks are made between passes")
        other = ConcatCache(self.n_layers)
        other.__dict__.update({key: list(val) if isinstance(val, list) else val for key, val in vars(self).items()})
        return other

    def reset(self) -> None:
        super().reset()
        self.rows_copied = 0
