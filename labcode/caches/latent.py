"""The latent cache: one row per token for latent attention, stored once although it is key and value.

Introduced in the chapter on smaller caches. A latent-attention layer (labcode/mla.py) appends
the same tensor, its rows [c, k_rope] of shape [B, 1, T, r + dR], as k and as v. Any cache of
the course can hold it, but stores it twice; this one keeps it once, grown by concatenation as
`ConcatCache` is, and hands the same tensor back as keys and values. A pass writes into the
cache only when it is committed, so a pass that fails commits nothing at all.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, KVCache
from labcode.checks import fail, is_int


class LatentCache(KVCache):
    """Per-layer latent rows [B, 1, S, W] (W = r + dR), stored once; refuses a v that is not the k appended."""

    def __init__(self, n_layers: int, width: int | None = None) -> None:
        super().__init__(n_layers)
        if not (width is None or (is_int(width) and width > 0)):
            fail("width", "None or a positive row width r + dR", repr(width), CacheError)
        self.width = width  # the row width every pass must have (None: whatever the first pass has)
        self.rows: list[torch.Tensor | None] = [None] * n_layers  # (B, 1, S, W) each

    def _check(self, chunk: Chunk) -> None:
        """A latent is one "head" per token, of the width asked for."""
        _, heads, _, w = chunk.shape
        if heads != 1 or (self.width is not None and w != self.width):
            want = "W" if self.width is None else f"W={self.width}"
            fail("k, v", f"latent rows [B, 1, T, {want}] (one row per token, no heads)", chunk.shape, CacheError)

    def _open(self, chunk: Chunk) -> None:
        super()._open(chunk)
        chunk.plan = [None] * self.n_layers  # each layer's rows after this pass, kept at the commit

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if v is not k:
            fail("v", "the tensor given as k (a latent row is key and value at once)", "another tensor", CacheError)
        old = self.rows[layer]
        rows = k.clone(memory_format=torch.contiguous_format) if old is None else torch.cat((old, k), dim=2)
        self.chunk.plan[layer] = rows  # (B, 1, S + T, W): a new tensor, so earlier ones are never written
        return rows, rows

    def _commit(self, chunk: Chunk) -> None:
        self.rows = list(chunk.plan)
        super()._commit(chunk)

    def length(self, layer: int = 0) -> int:
        return 0 if self.rows[layer] is None else self.rows[layer].shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stored rows [B, 1, S, W] of `layer`, as keys and as values (one tensor)."""
        return self.rows[layer], self.rows[layer]

    def _rollback(self, n: int) -> None:
        keep = self.length() - n
        self.rows = [rows[:, :, :keep] for rows in self.rows]

    def _reorder(self, index: torch.Tensor) -> int:
        self.rows = [rows.index_select(0, index.to(rows.device)) for rows in self.rows]
        return sum(rows.nbytes for rows in self.rows)

    def reset(self) -> None:
        super().reset()
        self.rows = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in self.rows if rows is not None)
