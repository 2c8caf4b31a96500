"""The one model of the course: GPT-2's architecture, with the options of the Llama family.

Introduced in chapter 1; the cache hooks are taught in chapters 3 to 5.
Token embedding plus a learned position table (or rotary positions), pre-norm
blocks, causal multi-head (or grouped-query) attention, a 4x tanh-GELU MLP, a final
norm and an output head tied to the token embedding. The Llama-family options
(`GPTConfig.norm`, `mlp`, `d_ff`, `bias`) swap in RMSNorm, a SwiGLU feed-forward and
projections without biases: with rotary positions and grouped-query attention, that is
SmolLM2-135M (the preset `smollm2-135m`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labcode.caches.base import KVCache, NoCache, check_cache
from labcode.caches.explicit import PairsCache
from labcode.caches.styles import as_cache
from labcode.checks import fail
from labcode.config import GPTConfig
from labcode.masks import causal_mask, sliding_window_mask
from labcode.mla import LatentAttention
from labcode.rope import rotate


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
    Hkv groups of G = H/Hkv heads, and each group reads its one K/V head. `dropout_p` > 0
    drops attention weights (training only).
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.reshape(b * hkv, g * t, d)  # (B*Hkv, G*T, D): the heads of a group stacked on rows
    scores = qg @ k.reshape(b * hkv, s, d).transpose(1, 2) * (1.0 / math.sqrt(d))  # (B*Hkv, G*T, S)
    if mask is not None:  # mask [T, S], or [B, 1, 1, T, S] with one row of masks per sequence (chapter 9)
        scores = scores.view(b, hkv, g, t, s).masked_fill(~mask, float("-inf")).view(b * hkv, g * t, s)
    weights = scores.softmax(dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p, training=True)
    return (weights @ v.reshape(b * hkv, s, d)).view(b, h, t, d)  # (B, H, T, D)


class CausalSelfAttention(nn.Module):
    """Causal self-attention that reads its past keys and values from a cache object.

    With cross-layer attention (`cfg.kv_share` > 1) only one layer in kv_share owns keys and values
    (`owns_kv`); the others have no K/V projection and attend to the owner's, handed over in `shared`.
    """

    def __init__(self, cfg: GPTConfig, owns_kv: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias) if owns_kv else None
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        # State of the naive cache (chapter 3): held here only while `use_cache=True` is used.
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None
        self.ptr_current_pos = 0

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                cache: KVCache | None = None, shared: dict | None = None) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if self.cfg.rotary:
            q = rotate(q, positions, self.cfg.rope_base)
        slot = layer // self.cfg.kv_share  # the cache layer this layer reads: its own unless layers share
        if self.kv_proj is None:  # cross-layer attention: the owner's keys, values and mask, from this pass
            if shared is None or slot not in shared:
                fail("shared", f"the keys and values of layer {slot * self.cfg.kv_share}, which layer {layer} "
                     "attends to (run the whole model)", "nothing")
            k, v, mask = shared[slot]
        else:
            kv = self.kv_proj(x).view(b, t, 2, self.n_kv_heads, self.head_dim)
            k, v = kv.permute(2, 0, 3, 1, 4)  # (B, Hkv, T, D) each
            if self.cfg.rotary:
                k = rotate(k, positions, self.cfg.rope_base)
            if cache is None:  # this layer on its own (chapter 2): the T tokens see only each other
                w = self.cfg.sliding_window
                mask = None if t == 1 else causal_mask(t, device=x.device) if w is None else sliding_window_mask(
                    t, 0, w, device=x.device)
            else:
                k, v = cache.append(slot, k, v)  # (B, Hkv, S_total, D): the cached keys and values, then these
                mask = cache.mask(slot, t)
                if hasattr(cache, "observe"):  # an evicting cache sees the queries (H2O, SnapKV)
                    cache.observe(slot, q, k, mask)
            if shared is not None:  # the layers after this one that share its cache read these
                shared[slot] = (k, v, mask)
        y = attend(q, k, v, mask, self.cfg.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class SwiGLU(nn.Module):
    """Llama's gated feed-forward: down(silu(gate(x)) * up(x)), [B, T, C] -> [B, T, C]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))


def norm(cfg: GPTConfig) -> nn.Module:
    """The model's norm: LayerNorm (GPT-2) or RMSNorm (Llama), over the model width."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def feed_forward(cfg: GPTConfig) -> nn.Module:
    """GPT-2's MLP (up, tanh GELU, down) or Llama's SwiGLU."""
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg)
    return nn.Sequential(
        nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias),
        nn.GELU(approximate="tanh"),
        nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias),
        nn.Dropout(cfg.dropout),
    )


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, owns_kv: bool = True) -> None:
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, owns_kv) if cfg.kv_latent is None else LatentAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = feed_forward(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                cache: KVCache | None = None, shared: dict | None = None) -> torch.Tensor:
        h = self.ln_1(x)
        a = self.attn(h, layer, positions, cache) if shared is None else self.attn(h, layer, positions, cache, shared)
        x = x + self.resid_dropout(a)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 architecture, or a Llama-family model by its config. `forward(ids)` is the full pass every
    cache is checked against (banded when `cfg.sliding_window` is set: each query sees its last W keys).

    Three ways to hold the cache, one pass (`labcode.caches.styles.as_cache` turns each into a cache object):
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
        self.blocks = nn.ModuleList(Block(cfg, owns_kv=i % cfg.kv_share == 0) for i in range(cfg.n_layers))
        self.ln_f = norm(cfg)
        self.current_pos = 0  # naive cache (chapter 3): model-level position counter
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "mlp.2.weight", "mlp.down.weight")):
                _normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

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

    def forward(self, ids: torch.Tensor, cache=None, return_cache: bool = False, *, use_cache: bool = False):
        """Logits [B, T, V] for ids [B, T], continuing whatever `cache` holds (None: the full pass).

        With `return_cache=True`, `cache` is a list of (K, V) pairs or None and the
        call returns `(logits, new_pairs)`; the pairs passed in are not modified.
        """
        kv = as_cache(self, cache, return_cache, use_cache)  # one cache object, whatever the style
        logits, _ = self.run(ids, kv)
        made_pairs = kv is not cache and isinstance(kv, PairsCache)  # the explicit style: hand back new pairs
        return (logits, kv.pairs) if made_pairs else logits

    def run(self, ids: torch.Tensor, cache: KVCache | None = None, keep_hidden: bool = False):
        """The pass: logits [B, T, V] for ids [B, T] through one cache object (None: one that keeps nothing),
        and the hidden state [B, T, C] after each block if asked (chapter 2)."""
        b, t = self.check_ids(ids)
        n = self.cfg.kv_layers  # the layers that own keys and values: all of them unless layers share
        cache = NoCache(n, self.cfg.sliding_window) if cache is None else cache
        check_cache(cache, n, self.cfg.sliding_window)  # a cache cannot know the model: checked here
        hkv, d = self.cfg.cached_kv  # Hkv heads of D, or one latent row (latent attention)
        placed = cache.begin((b, hkv, t, d), self.dtype, self.device)
        try:  # the cache refused nothing, so it writes from here on; a pass that fails commits nothing
            positions = self.positions(placed, cache.position, b, t)  # (T,) or (B, T)
            x = self.tok_emb(ids)  # (B, T, C)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
            x = self.drop(x)
            hidden, shared = [], ({} if self.cfg.kv_share > 1 else None)  # owners' K/V for the layers sharing them
            for layer, block in enumerate(self.blocks):
                x = block(x, layer, positions, cache, shared)
                hidden.append(x)
            logits = F.linear(self.ln_f(x), self.tok_emb.weight)  # (B, T, V), tied head, no bias
        except BaseException:
            cache.cancel()
            raise
        cache.end()
        return logits, (hidden if keep_hidden else [])

    def check_ids(self, ids: torch.Tensor) -> tuple[int, int]:
        """Raise ValueError naming the problem unless ids is a [B, T] tensor of token ids; return (B, T)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            fail("ids", "an integer tensor", getattr(ids, "dtype", type(ids)))
        if ids.dim() != 2:
            fail("ids", "rank 2 [B, T]", f"shape {tuple(ids.shape)}")
        b, t = ids.shape
        if b == 0 or t == 0:
            fail("ids", "at least one token in each of at least one row", tuple(ids.shape))
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            fail("ids", f"values in [0, {self.cfg.vocab_size})", f"min {lo}, max {hi}")
        return b, t

    def positions(self, placed: torch.Tensor | None, start: int, b: int, t: int) -> torch.Tensor:
        """The positions of T new tokens: start .. start + T - 1, or those a cache `placed` ([T] or [B, T],
        chapter 9). Raise ValueError for any outside the position table."""
        n = self.cfg.context_length
        if placed is None:
            if start + t > n:
                fail("positions", f"start + T <= context_length {n}", f"start {start} + T {t} = {start + t}")
            return torch.arange(start, start + t, device=self.device)  # (T,)
        if tuple(placed.shape) not in ((t,), (b, t)):
            fail("positions", f"shape ({t},) or ({b}, {t})", tuple(placed.shape))
        lo, hi = int(placed.min()), int(placed.max())
        if lo < 0 or hi >= n:
            fail("positions", f"values in [0, {n})", f"min {lo}, max {hi}")
        return placed.to(self.device)

    def reset_kv_cache(self) -> None:
        """Clear the naive cache held inside the attention modules (chapter 3)."""
        for block in self.blocks:
            block.attn.cache_k = block.attn.cache_v = None
            block.attn.ptr_current_pos = 0
        self.current_pos = 0

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once."""
        return sum(p.numel() for p in self.parameters())
