"""The naive cache: state inside the model (the design the sources call "upstream naive").

Introduced in chapter 3. Each attention module holds `cache_k`, `cache_v` and a
pointer `ptr_current_pos` into a precomputed triangular mask; the model holds
`current_pos`, the row of the position table. Both must advance together, and
`model.reset_kv_cache()` must be called before every new request.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect


class ModuleStateCache(KVCache):
    """A view of the K/V state kept in `model.blocks[l].attn`; used by `forward(ids, use_cache=True)`."""

    def __init__(self, model) -> None:
        super().__init__(len(model.blocks))
        self.model = model
        self.attns = [block.attn for block in model.blocks]
        self.position = model.current_pos
        k0 = self.attns[0].cache_k
        if k0 is not None:
            self.batch, self.dtype, self.device = k0.shape[0], k0.dtype, k0.device
        n = model.cfg.context_length  # the upstream design precomputes one full triangular mask
        self.full_mask = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.attns[layer]
        if attn.cache_k is None:
            attn.cache_k, attn.cache_v = k, v
        else:
            attn.cache_k = torch.cat((attn.cache_k, k), dim=2)  # (B, Hkv, S+T, D)
            attn.cache_v = torch.cat((attn.cache_v, v), dim=2)
        return attn.cache_k, attn.cache_v

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        """Rows ptr..ptr+T of the full triangular mask, then advance this layer's pointer."""
        attn = self.attns[layer]
        ptr = attn.ptr_current_pos
        expect(ptr == self.model.current_pos, "ptr_current_pos", f"the model's current_pos {self.model.current_pos}",
               ptr)
        rows = self.full_mask[ptr : ptr + t_new, : ptr + t_new]  # (T, S+T)
        attn.ptr_current_pos = ptr + t_new
        return rows

    def advance(self, t_new: int) -> None:
        super().advance(t_new)
        self.model.current_pos += t_new

    def length(self, layer: int = 0) -> int:
        k = self.attns[layer].cache_k
        return 0 if k is None else k.shape[2]
