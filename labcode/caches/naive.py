"""The naive cache: state inside the model (the design the sources call "upstream naive").

Introduced in chapter 3. Each attention module holds `cache_k`, `cache_v` and a
pointer `ptr_current_pos` into a precomputed triangular mask; the model holds
`current_pos`, the row of the position table. Both must advance together, and
`model.reset_kv_cache()` must be called before every new request.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect, snapshot


def append_to_module(attn, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive write: grow `attn.cache_k`, `attn.cache_v` [B, Hkv, S, D] by k, v [B, Hkv, T, D] on the token axis."""
    if attn.cache_k is None:
        attn.cache_k, attn.cache_v = k, v
    else:
        attn.cache_k = torch.cat((attn.cache_k, k), dim=2)  # (B, Hkv, S+T, D): a new tensor
        attn.cache_v = torch.cat((attn.cache_v, v), dim=2)
    return attn.cache_k, attn.cache_v


def mask_rows(attn, t_new: int, context_length: int) -> torch.Tensor:
    """Rows ptr..ptr+T, columns 0..ptr+T of one full [N, N] triangular mask; moves the pointer on by T."""
    ptr = attn.ptr_current_pos
    full = torch.ones(context_length, context_length, dtype=torch.bool, device=attn.cache_k.device).tril()
    attn.ptr_current_pos = ptr + t_new
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
    """A stateless view of the K/V state kept in `model.blocks[l].attn`; `forward(ids, use_cache=True)` uses it.

    Everything it reports (position, batch, dtype, device) is read from the model, so a
    view made at any time agrees with every other view of the same model.
    """

    def __init__(self, model) -> None:  # no super().__init__: this view holds no state of its own
        self.n_layers = len(model.blocks)
        self.model = model
        self.attns = [block.attn for block in model.blocks]

    @property
    def position(self) -> int:
        return self.model.current_pos

    def _first(self, i: int) -> object:
        k0 = self.attns[0].cache_k
        return None if k0 is None else (*k0.shape, k0.dtype, k0.device)[i]

    def _remember(self, k: torch.Tensor) -> None:
        pass  # B, Hkv, D, dtype and device are read from the stored tensors

    batch = property(lambda self: self._first(0))
    kv_heads = property(lambda self: self._first(1))
    head_dim = property(lambda self: self._first(3))
    dtype = property(lambda self: self._first(4))
    device = property(lambda self: self._first(5))

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        """Also reject a model whose pointers, cached lengths and `current_pos` have drifted apart."""
        super().check(batch, t_new, dtype, device)
        pos = self.model.current_pos
        ptrs = [a.ptr_current_pos for a in self.attns]
        expect(all(p == pos for p in ptrs), "ptr_current_pos",
               f"every layer's pointer equal to the model's current_pos {pos}", ptrs)
        lengths = [self.length(layer) for layer in range(self.n_layers)]
        expect(all(n == pos for n in lengths), "cache_k", f"every layer holding current_pos={pos} keys", lengths)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return append_to_module(self.attns[layer], k, v)

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        """Rows of the full triangular mask at this layer's pointer (the upstream design), which moves on."""
        return mask_rows(self.attns[layer], t_new, self.model.cfg.context_length)

    def advance(self, t_new: int) -> None:
        self.model.current_pos += t_new

    def length(self, layer: int = 0) -> int:
        k = self.attns[layer].cache_k
        return 0 if k is None else k.shape[2]

    def read(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attns[layer].cache_k, self.attns[layer].cache_v

    def reset(self) -> None:
        self.model.reset_kv_cache()

    def state(self) -> dict:
        return naive_state(self.model)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for a in self.attns for t in (a.cache_k, a.cache_v) if t is not None)
