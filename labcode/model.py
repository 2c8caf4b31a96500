"""The one GPT-2-architecture model of the course.

Introduced in chapter 1; the cache hooks are taught in chapters 3 to 5.
Token embedding plus a learned position table (or rotary positions), pre-LayerNorm
blocks, causal multi-head (or grouped-query) attention, a 4x tanh-GELU MLP, a final
LayerNorm and an output head tied to the token embedding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labcode.config import GPTConfig


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, D] at absolute `positions` [T] (pairs (i, i + D/2))."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)  # (D/2,)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # (T, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention; q [B, H, T, D], k and v [B, Hkv, S, D], mask [T, S] or None -> [B, H, T, D].

    Grouped-query attention without copying K/V: the H query heads are viewed as
    Hkv groups of H/Hkv heads, and each group reads its one K/V head.
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, (h // hkv) * t, d)  # (B, Hkv, G*T, D): heads of a group stacked on rows
    scores = (qg @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (B, Hkv, G*T, S)
    if mask is not None:
        scores = scores.view(b, hkv, h // hkv, t, s).masked_fill(~mask, float("-inf")).view(b, hkv, -1, s)
    return (scores.softmax(dim=-1) @ v).reshape(b, h, t, d)  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    """Causal self-attention that reads its past keys and values from a cache object."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        # State of the naive cache (chapter 3): held here only while `use_cache=True` is used.
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None
        self.ptr_current_pos = 0

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor, cache=None) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k, v = self.kv_proj(x).view(b, t, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.cfg.rotary:
            q, k = rotate(q, positions, self.cfg.rope_base), rotate(k, positions, self.cfg.rope_base)
        if cache is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() if t > 1 else None
        else:
            k, v = cache.append(layer, k, v)  # (B, Hkv, S_total, D)
            mask = cache.mask(layer, t)
        y = attend(q, k, v, mask)
        if self.training and self.cfg.dropout > 0:
            y = self.dropout(y)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_1(x), layer, positions, cache))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 architecture. `forward(ids)` is the full pass every cache is checked against.

    Three ways to hold the cache, one model:
      * `forward(ids, cache)` with a `labcode.caches` object (chapters 3 and 5);
      * `forward(ids, caches, return_cache=True)` with a list of (K, V) pairs (chapter 4);
      * `forward(ids, use_cache=True)` with state kept inside the attention modules (chapter 3).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = None if cfg.rotary else nn.Embedding(cfg.context_length, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.current_pos = 0  # naive cache (chapter 3): model-level position counter
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def check_ids(self, ids: torch.Tensor, start: int) -> None:
        """Raise ValueError naming the problem if `ids` cannot be run at position `start`."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"ids: expected an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
        if ids.dim() != 2:
            raise ValueError(f"ids: expected rank 2 [B, T], got shape {tuple(ids.shape)}")
        b, t = ids.shape
        if b == 0 or t == 0:
            raise ValueError(f"ids: expected at least one token in each of at least one row, got {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"ids: expected values in [0, {self.cfg.vocab_size}), got min {lo}, max {hi}")
        if start + t > self.cfg.context_length:
            raise ValueError(
                f"positions: expected start + T <= context_length {self.cfg.context_length}, "
                f"got start {start} + T {t} = {start + t}"
            )

    def forward(self, ids: torch.Tensor, cache=None, return_cache: bool = False, *, use_cache: bool = False):
        """Logits [B, T, V] for ids [B, T], continuing whatever `cache` holds.

        With `return_cache=True`, `cache` is a list of (K, V) pairs or None and the
        call returns `(logits, new_pairs)`; the pairs passed in are not modified.
        """
        from labcode.caches.explicit import PairsCache  # local import: caches import nothing of the model
        from labcode.caches.naive import ModuleStateCache

        if return_cache or isinstance(cache, (list, tuple)):
            cache = PairsCache(self.cfg.n_layers, cache)
        elif use_cache:
            if cache is not None:
                raise ValueError("cache: expected None when use_cache=True (the state lives in the model)")
            cache = ModuleStateCache(self)
        logits = self.run(ids, cache)[0]
        return (logits, cache.pairs) if isinstance(cache, PairsCache) else logits

    def run(self, ids: torch.Tensor, cache=None, keep_hidden: bool = False):
        """Core pass: returns (logits [B, T, V], hidden states after each block if asked)."""
        start = 0 if cache is None else cache.position
        self.check_ids(ids, start)
        b, t = ids.shape
        if cache is not None:
            cache.check(b, t, self.dtype, self.device)  # every rejection happens before any write
        positions = torch.arange(start, start + t, device=ids.device)  # (T,)
        x = self.tok_emb(ids)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        x = self.drop(x)
        hidden = []
        for layer, block in enumerate(self.blocks):
            x = block(x, layer, positions, cache)
            if keep_hidden:
                hidden.append(x)
        if cache is not None:
            cache.advance(t)
        logits = F.linear(self.ln_f(x), self.tok_emb.weight)  # (B, T, V), tied head, no bias
        return logits, hidden

    def reset_kv_cache(self) -> None:
        """Clear the naive cache held inside the attention modules (chapter 3)."""
        for block in self.blocks:
            block.attn.cache_k = block.attn.cache_v = None
            block.attn.ptr_current_pos = 0
        self.current_pos = 0

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once."""
        return sum(p.numel() for p in self.parameters())
