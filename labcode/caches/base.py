"""The one interface every cache policy implements.

Introduced in chapter 3. The model asks a cache for the keys and values to read
(`append`), the mask over them (`mask`) and the absolute position of the next
token (`position`). A cache knows nothing of the model.
"""

from __future__ import annotations

import torch

from labcode.masks import causal_mask


class CacheError(ValueError):
    """A call the cache rejects; raised before any state changes."""


def expect(ok: bool, argument: str, expected: str, got: object) -> None:
    """Raise CacheError naming the argument, the expectation and the value when `ok` is false."""
    if not ok:
        raise CacheError(f"{argument}: expected {expected}, got {got}")


class KVCache:
    """Per-layer key/value storage for one batch of requests.

    Subclasses implement `_append` and, if their storage is not chronological or
    drops keys, `mask`. The model calls, in order: `check` (once), `append` and
    `mask` (per layer), `advance` (once).
    """

    def __init__(self, n_layers: int) -> None:
        expect(n_layers > 0, "n_layers", "a positive number of layers", n_layers)
        self.n_layers = n_layers
        self.position = 0  # absolute position of the next token: tokens seen so far
        self.batch: int | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None

    # -- validation: everything is checked before anything is written --------
    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise CacheError if a chunk of `t_new` tokens cannot be appended; change nothing."""
        expect(t_new > 0, "t_new", "at least one new token", t_new)
        if self.batch is not None:
            expect(batch == self.batch, "batch", f"the cache's batch size {self.batch}", batch)
            expect(dtype == self.dtype, "dtype", f"the cache's dtype {self.dtype}", dtype)
            expect(torch.device(device) == self.device, "device", f"the cache's device {self.device}", device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] for `layer`; return all keys and values to attend to."""
        expect(0 <= layer < self.n_layers, "layer", f"0 <= layer < {self.n_layers}", layer)
        expect(k.dim() == 4 and k.shape == v.shape, "k, v", "two [B, Hkv, T, D] tensors of one shape",
               (tuple(k.shape), tuple(v.shape)))
        if layer == 0:
            self.check(k.shape[0], k.shape[2], k.dtype, k.device)
        if self.batch is None:
            self.batch, self.dtype, self.device = k.shape[0], k.dtype, k.device
        return self._append(layer, k, v)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        """Boolean [T, S_total] mask over what `append` returned (None: all visible)."""
        s_total = self.length(layer)
        if t_new == 1:
            return None  # one query after its own key: every stored key is in its past
        return causal_mask(t_new, s_total - t_new, device=self.device)

    def advance(self, t_new: int) -> None:
        """Move the position counter once all layers have appended `t_new` tokens."""
        self.position += t_new

    def length(self, layer: int = 0) -> int:
        """Number of keys stored for `layer`."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything, as if new."""
        self.position = 0
        self.batch = self.dtype = self.device = None

    def state(self) -> dict:
        """A snapshot of everything observable, for "state unchanged" checks."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held."""
        raise NotImplementedError
