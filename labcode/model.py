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
    """Rotary position embedding of x [B, H, T, D] at absolute `positions` [T] or [B, T] (pairs (i, i + D/2))."""
    d = x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)  # (D/2,)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # (T, D/2) or (B, T, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if positions.dim() == 2:  # one row of positions per sequence (chapter 9): broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _normal_(p: torch.Tensor, std: float) -> None:
    """Fill p with N(0, std^2) samples drawn in float64 from the global generator.

    PyTorch samples float32 normals with vector kernels chosen by the CPU, whose last bits differ from
    one CPU to the next; its float64 sampling does not. Drawing in float64 gives a seeded model the
    same weights on every machine.
    """
    with torch.no_grad():
        p.copy_(torch.empty(p.shape, dtype=torch.float64).normal_(0.0, std))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention; q [B, H, T, D], k and v [B, Hkv, S, D], mask [T, S] or None -> [B, H, T, D].

    Grouped-query attention without copying K/V: the H query heads are viewed as
    Hkv groups of H/Hkv heads, and each group reads its one K/V head. `dropout_p` > 0
    drops attention weights (training only).
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    # Batched products on 3-D views (what `@` on 4-D tensors does inside, minus its bookkeeping,
    # which a one-token decode step pays in every layer); for cache buffers these are views, not copies.
    qg = q.reshape(b * hkv, g * t, d)  # (B*Hkv, G*T, D): heads of a group stacked on rows
    scores = torch.bmm(qg, k.reshape(b * hkv, s, d).transpose(1, 2)).mul_(1.0 / math.sqrt(d))  # (B*Hkv, G*T, S)
    if mask is not None:
        scores.view(b, hkv, g, t, s).masked_fill_(~mask, float("-inf"))  # in place; mask [T, S] or [B, 1, 1, T, S]
    weights = scores.softmax(dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p, training=True)
    return torch.bmm(weights, v.reshape(b * hkv, s, d)).view(b, h, t, d)  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    """Causal self-attention that reads its past keys and values from a cache object."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)
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
        y = attend(q, k, v, mask, self.cfg.dropout if self.training else 0.0)
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
                _normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        self._store_wide_weights_by_column()

    def _store_wide_weights_by_column(self, min_elements: int = 1 << 20) -> None:
        """Store large weights [out, in] with out > in column by column (chapter 7); values are unchanged.

        A decode step multiplies one row by each weight matrix, so it runs at the speed the
        weights stream from memory. For wide matrices (the tied head above all) the BLAS
        product reads W^T stored contiguously markedly faster than W stored row by row.
        Shapes, values and the state_dict stay the same; square and tall matrices, and those under
        `min_elements`, keep PyTorch's default layout (so the tiny model is untouched).
        """
        with torch.no_grad():
            for p in [self.tok_emb.weight] + [m.weight for m in self.modules() if isinstance(m, nn.Linear)]:
                if p.shape[0] > p.shape[1] and p.numel() >= min_elements:
                    p.data = p.data.t().contiguous().t()  # (out, in) with strides (1, out)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def check_ids(self, ids: torch.Tensor, start: int, positions: torch.Tensor | None = None) -> None:
        """Raise ValueError naming the problem if `ids` cannot be run at position `start`
        (or at explicit `positions` [T] or [B, T], when a cache places each token itself)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"ids: expected an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
        if ids.dim() != 2:
            raise ValueError(f"ids: expected rank 2 [B, T], got shape {tuple(ids.shape)}")
        b, t = ids.shape
        if b == 0 or t == 0:
            raise ValueError(f"ids: expected at least one token in each of at least one row, got {tuple(ids.shape)}")
        if ids.numel() <= 4096:  # a decode step's few ids: one copy to Python beats two reductions
            values = ids.flatten().tolist()
            lo, hi = min(values), max(values)
        else:
            lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"ids: expected values in [0, {self.cfg.vocab_size}), got min {lo}, max {hi}")
        if positions is not None:
            if tuple(positions.shape) not in ((t,), (b, t)):
                raise ValueError(f"positions: expected shape ({t},) or ({b}, {t}), got {tuple(positions.shape)}")
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= self.cfg.context_length:
                raise ValueError(
                    f"positions: expected values in [0, {self.cfg.context_length}), got min {lo}, max {hi}")
        elif start + t > self.cfg.context_length:
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

        explicit = return_cache or isinstance(cache, (list, tuple))
        if use_cache and (explicit or cache is not None):
            raise ValueError("cache, return_cache: expected None and False when use_cache=True "
                             f"(the state lives in the model), got {type(cache).__name__} and {return_cache}")
        if explicit:
            cache = PairsCache(self.cfg.n_layers, cache)
        elif use_cache:
            cache = ModuleStateCache(self)
        logits = self.run(ids, cache)[0]
        return (logits, cache.pairs) if explicit else logits

    def run(self, ids: torch.Tensor, cache=None, keep_hidden: bool = False):
        """Core pass: returns (logits [B, T, V], hidden states after each block if asked)."""
        start = 0 if cache is None else cache.position
        # Engines that place each token themselves (chapter 9) give its position: (T,) or (B, T).
        positions = cache.query_positions() if hasattr(cache, "query_positions") else None
        self.check_ids(ids, start, positions)
        b, t = ids.shape
        if cache is not None:
            from labcode.caches.base import expect  # local import, as in forward

            expect(cache.n_layers == len(self.blocks), "cache", f"a cache for {len(self.blocks)} layers",
                   f"one for {cache.n_layers}")  # a cache cannot know the model's depth: checked here
            cache.check(b, t, self.dtype, self.device)  # every rejection happens before any write
        if positions is None:
            positions = torch.arange(start, start + t, device=ids.device)  # (T,)
        positions = positions.to(ids.device)
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
