"""The naive cache: state inside the model, as in Raschka's LLMs-from-scratch (ch04/03_kv-cache).

Introduced in chapter 3. Each attention module holds `cache_k`, `cache_v` and a
pointer `ptr_current_pos` into a triangular mask (the from-scratch code builds it
once as a buffer; `mask_rows` here builds it on every call); the model holds
`current_pos`, the row of the position table. Both must advance together, and
`model.reset_kv_cache()` must be called before every new request.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, KVCache, Layout, snapshot
from labcode.checks import fail


def append_to_module(attn, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive write: grow `attn.cache_k`, `attn.cache_v` [B, Hkv, S, D] by k, v [B, Hkv, T, D] on the token axis."""
    if attn.cache_k is None:
        attn.cache_k, attn.cache_v = k, v
    else:
        attn.cache_k = torch.cat((attn.cache_k, k), dim=2)  # (B, Hkv, S+T, D): a new tensor
        attn.cache_v = torch.cat((attn.cache_v, v), dim=2)
    return attn.cache_k, attn.cache_v


def mask_rows(attn, t_new: int, context_length: int) -> torch.Tensor:
    """Rows ptr..ptr+T, columns 0..ptr+T of one full [N, N] triangular mask, at this module's pointer."""
    ptr = attn.ptr_current_pos
    full = torch.ones(context_length, context_length, dtype=torch.bool, device=attn.cache_k.device).tril()
    return full[ptr : ptr + t_new, : ptr + t_new]  # (T, S+T)


def naive_state(model) -> dict:
    """A snapshot of the naive cache state kept in `model`: per-layer K, V, pointer, and `current_pos`."""
    attns = [block.attn for block in model.blocks]
    return {
        "current_pos": model.current_pos,
        "ptr_current_pos": [a.ptr_current_pos for a in attns],
        "cache_k": [snapshot(a.cache_k) for a in attns],
        "cache_v": [snapshot(a.cache_v) for a in attns],
    }


class ModuleStateCache(KVCache):
    """The K/V state kept in `model.blocks[l].attn`, seen through the contract; `forward(ids, use_cache=True)` uses it.

    The view keeps nothing of its own: position and layout are read from the model, so a
    view made at any time agrees with every other view of the same model.
    """

    def __init__(self, model) -> None:
        attns = [block.attn for block in model.blocks[:: model.cfg.kv_share]]  # the layers that own K/V
        super().__init__(len(attns))
        self.model = model
        self.attns = attns

    @property
    def position(self) -> int:
        return self.model.current_pos

    @property
    def layout(self) -> Layout | None:
        k = self.attns[0].cache_k
        return None if k is None else Layout.of(k)

    def _check(self, chunk: Chunk) -> None:
        """Also refuse a model whose pointers, cached lengths and `current_pos` have drifted apart."""
        pos = self.model.current_pos
        ptrs = [a.ptr_current_pos for a in self.attns]
        if any(p != pos for p in ptrs):
            fail("ptr_current_pos", f"every layer's pointer equal to the model's current_pos {pos}", ptrs, CacheError)
        lengths = [self.length(layer) for layer in range(self.n_layers)]
        if any(n != pos for n in lengths):
            fail("cache_k", f"every layer holding current_pos={pos} keys", lengths, CacheError)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return append_to_module(self.attns[layer], k, v)

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        """Rows of the full triangular mask at this layer's pointer (the from-scratch design)."""
        self._in_pass("mask")
        return mask_rows(self.attns[layer], t_new, self.model.cfg.context_length)

    def _commit(self, chunk: Chunk) -> None:
        """The pointers and the counter move on together, by T."""
        for attn in self.attns:
            attn.ptr_current_pos += chunk.t_new
        self.model.current_pos += chunk.t_new

    def length(self, layer: int = 0) -> int:
        k = self.attns[layer].cache_k
        return 0 if k is None else k.shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.attns[layer].cache_k, self.attns[layer].cache_v

    def rollback(self, n: int) -> None:
        """Remove the last n positions from every module's buffers; the pointers and `current_pos` move back
        together. Introduced in chapter 12 (rollback)."""
        self._check_rollback(n, "n")
        self._check(None)  # a model whose counters drifted apart has no "last n" to remove
        if n:
            keep = self.position - n
            for attn in self.attns:
                attn.cache_k, attn.cache_v = attn.cache_k[:, :, :keep], attn.cache_v[:, :, :keep]
                attn.ptr_current_pos -= n
            self.model.current_pos -= n

    def reorder(self, index: torch.Tensor) -> int:
        """Every module's buffers gathered row by row (the layout is read from them). Returns the bytes written."""
        self._check_reorder(index)
        for attn in self.attns:
            attn.cache_k = attn.cache_k.index_select(0, index.to(attn.cache_k.device))
            attn.cache_v = attn.cache_v.index_select(0, index.to(attn.cache_v.device))
        return sum(t.nbytes for a in self.attns for t in (a.cache_k, a.cache_v))

    def fork(self) -> KVCache:
        fail("fork", "a cache object (this state lives in the one model: a second copy cannot exist)",
             "the naive cache", CacheError)

    def reset(self) -> None:
        self.model.reset_kv_cache()

    def state(self) -> dict:
        return {**naive_state(self.model), "chunk": snapshot(self.chunk)}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for a in self.attns for t in (a.cache_k, a.cache_v) if t is not None)
