"""Multi-head latent attention (MLA): the cache holds one small latent per token instead of K and V.

Introduced in the chapter on smaller caches; the design is DeepSeek-V2's and V3's. Each layer
projects the token down to a latent c of width r (normed), which the cache keeps, and up again
per head at attention time: head h's key is W_uk[h] c and its value W_uv[h] c. Rotary
positions cannot pass through that up-projection (a rotation between the two would tie the
up-projection to the position), so a small rotary key of width dR, one for all heads, is kept
beside the latent; the query carries a matching rotary part per head. The cached row is
[c, k_rope], of width r + dR, and it serves as key and as value.

Two ways to compute the same attention:
  * naive: up-project every cached latent to per-head K, V [B, H, S, D], then attend;
  * absorbed: move W_uk onto the query (q W_uk, width r) and W_uv after the weighted sum, so that
    attention reads the cached rows as they are: multi-query attention with one key/value "head"
    of width r + dR. Nothing of length S is up-projected.
A random-weight model is enough here: the two ways are equal whatever the weights, and the cache
bytes depend only on the shapes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from labcode.caches.base import KVCache
from labcode.checks import fail
from labcode.config import GPTConfig
from labcode.cost import kv_cache_bytes
from labcode.masks import causal_mask, sliding_window_mask
from labcode.rope import rotate

MODES = ("naive", "absorbed")


def _softmax(scores: torch.Tensor, mask: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """Attention weights of scores [B, H, T, S] under mask [T, S] (or chapter 9's [B, 1, 1, T, S])."""
    if mask is not None:
        scores = scores.masked_fill(~(mask[:, 0] if mask.dim() == 5 else mask), float("-inf"))
    weights = scores.softmax(dim=-1)
    return torch.nn.functional.dropout(weights, dropout_p, training=True) if dropout_p > 0 else weights


class LatentAttention(nn.Module):
    """Causal self-attention whose cache row per token is the latent [c, k_rope] of width r + dR.

    `mode` is "naive" or "absorbed" (`set_mode`): the same weights, the same attention, computed
    two ways. The up-projection has no bias, so that it can be moved onto the query.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg, self.mode = cfg, "naive"
        h, d, r, dr = cfg.n_heads, cfg.head_dim, cfg.kv_latent, cfg.latent_rope_dim
        self.n_heads, self.head_dim, self.rank, self.rope_dim = h, d, r, dr
        self.q_proj = nn.Linear(cfg.d_model, h * (d + dr), bias=cfg.bias)  # per head: D channels, then dR rotary
        self.kv_down = nn.Linear(cfg.d_model, r + dr, bias=cfg.bias)  # the latent, then the shared rotary key
        self.kv_norm = nn.RMSNorm(r, eps=cfg.norm_eps)
        self.kv_up = nn.Linear(r, h * 2 * d, bias=False)  # per head: D key rows, then D value rows
        self.out_proj = nn.Linear(h * d, cfg.d_model, bias=cfg.bias)
        self.scale = 1.0 / math.sqrt(d + dr)  # a head's query-key width, whichever way it is computed
        # State of the naive cache (chapter 3), so that use_cache=True works here too.
        self.cache_k: torch.Tensor | None = None
        self.cache_v: torch.Tensor | None = None
        self.ptr_current_pos = 0

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache rows of x [B, T, C]: [norm(c), rotated k_rope] -> [B, 1, T, r + dR]."""
        c, k_rope = self.kv_down(x).split((self.rank, self.rope_dim), dim=-1)  # (B, T, r), (B, T, dR)
        k_rope = k_rope.unsqueeze(1)  # (B, 1, T, dR): one rotary key for every head
        if self.cfg.rotary:
            k_rope = rotate(k_rope, positions, self.cfg.rope_base)
        return torch.cat((self.kv_norm(c).unsqueeze(1), k_rope), dim=-1)  # (B, 1, T, r + dR)

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C)
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim + self.rope_dim).transpose(1, 2)
        q_c, q_rope = q.split((self.head_dim, self.rope_dim), dim=-1)  # (B, H, T, D), (B, H, T, dR)
        if self.cfg.rotary:
            q_rope = rotate(q_rope, positions, self.cfg.rope_base)
        rows = self.latent(x, positions)  # (B, 1, T, r + dR)
        if cache is None:  # this layer on its own: the T tokens see only each other
            w = self.cfg.sliding_window
            mask = None if t == 1 else causal_mask(t, device=x.device) if w is None else sliding_window_mask(
                t, 0, w, device=x.device)
        else:
            rows, _ = cache.append(layer, rows, rows)  # (B, 1, S_total, r + dR): one row is key and value
            mask = cache.mask(layer, t)
        p = self.cfg.dropout if self.training else 0.0
        attend = self.absorbed if self.mode == "absorbed" else self.naive
        y = attend(q_c, q_rope, rows, mask, p)  # (B, H, T, D)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T, C)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk and W_uv, [H, D, r] each: head h's key is W_uk[h] c and its value W_uv[h] c."""
        w = self.kv_up.weight.view(self.n_heads, 2 * self.head_dim, self.rank)  # (H, 2D, r)
        return w[:, : self.head_dim], w[:, self.head_dim :]

    def naive(self, q_c: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float = 0.0) -> torch.Tensor:
        """Up-project the S cached rows [B, 1, S, r + dR] to per-head K, V, then attend -> [B, H, T, D]."""
        b, h, d, s = q_c.shape[0], self.n_heads, self.head_dim, rows.shape[2]
        c, k_rope = rows[:, 0].split((self.rank, self.rope_dim), dim=-1)  # (B, S, r), (B, S, dR)
        k_c, v = self.kv_up(c).view(b, s, h, 2 * d).transpose(1, 2).split(d, dim=-1)  # (B, H, S, D) each
        k = torch.cat((k_c, k_rope.unsqueeze(1).expand(b, h, s, self.rope_dim)), dim=-1)  # (B, H, S, D + dR)
        q = torch.cat((q_c, q_rope), dim=-1)  # (B, H, T, D + dR)
        weights = _softmax(q @ k.transpose(-2, -1) * self.scale, mask, dropout_p)  # (B, H, T, S)
        return weights @ v  # (B, H, T, D)

    def absorbed(self, q_c: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
                 dropout_p: float = 0.0) -> torch.Tensor:
        """Attend to the cached rows [B, 1, S, r + dR] as they are, W_uk moved onto the query and W_uv after
        the weighted sum -> [B, H, T, D]. Multi-query attention with one head of width r + dR."""
        w_uk, w_uv = self.up_weights()  # (H, D, r) each
        q_lat = torch.einsum("bhtd,hdr->bhtr", q_c, w_uk)  # (B, H, T, r): q . (W_uk c) = (q W_uk) . c
        q = torch.cat((q_lat, q_rope), dim=-1)  # (B, H, T, r + dR)
        weights = _softmax(q @ rows.transpose(-2, -1) * self.scale, mask, dropout_p)  # (B, H, T, S)
        o = weights @ rows[..., : self.rank]  # (B, H, T, r): the weighted sum of the latents
        return torch.einsum("bhtr,hdr->bhtd", o, w_uv)  # (B, H, T, D): sum_s w_s W_uv c_s = W_uv sum_s w_s c_s


def set_mode(model: nn.Module, mode: str) -> nn.Module:
    """Compute every latent-attention layer of `model` the `mode` way ("naive" or "absorbed"); returns model."""
    if mode not in MODES:
        fail("mode", f"one of {MODES}", repr(mode))
    layers = [block.attn for block in model.blocks if isinstance(block.attn, LatentAttention)]
    if not layers:
        fail("model", "a model with latent attention (GPTConfig.kv_latent set)", "none")
    for attn in layers:
        attn.mode = mode
    return model


def folded_weights(attn: LatentAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """The up-projections folded into the query and output projections, once (not per step):
    W_q'[h] = W_q[h]^T W_uk[h] [H, C, r] maps x to head h's latent query, and W_o'[h] = W_uv[h]^T W_o[h]^T
    [H, r, C] maps head h's weighted latent to its share of the output."""
    w_uk, w_uv = attn.up_weights()  # (H, D, r)
    h, d, dr = attn.n_heads, attn.head_dim, attn.rope_dim
    w_q = attn.q_proj.weight.view(h, d + dr, -1)[:, :d]  # (H, D, C): the non-rotary query rows
    w_o = attn.out_proj.weight.view(-1, h, d).permute(1, 2, 0)  # (H, D, C)
    return torch.einsum("hdc,hdr->hcr", w_q, w_uk), torch.einsum("hdr,hdc->hrc", w_uv, w_o)


# -- counting: cache bytes and the FLOPs of one step ---------------------------------------------------------

def latent_bytes_per_token(n_layers: int, rank: int, rope_dim: int, bytes_per_element: int) -> int:
    """Bytes one token takes in a latent cache: L * (r + dR) elements (the row is key and value at once)."""
    return n_layers * (rank + rope_dim) * bytes_per_element


def bytes_per_token_table(cfg: GPTConfig, ranks: list[int], rope_dim: int,
                          bytes_per_element: int) -> list[dict]:
    """Cache bytes per token at the width of `cfg` (L, H, D): MHA (H K/V heads), GQA (cfg's Hkv, or H/4 when
    cfg is MHA), MQA (one head), and MLA at each rank r with a rotary key of `rope_dim`."""
    h, d, n = cfg.n_heads, cfg.head_dim, cfg.n_layers
    gqa = cfg.n_kv_heads if cfg.n_kv_heads not in (h, 1) else max(1, h // 4)
    rows = [{"layout": name, "kv_heads": hkv, "rank": None,
             "bytes_per_token": kv_cache_bytes(n, 1, 1, hkv, d, bytes_per_element)}
            for name, hkv in (("MHA", h), ("GQA", gqa), ("MQA", 1))]
    rows += [{"layout": "MLA", "kv_heads": None, "rank": r,
              "bytes_per_token": latent_bytes_per_token(n, r, rope_dim, bytes_per_element)} for r in ranks]
    return rows


def latent_step_flops(cfg: GPTConfig, mode: str, t_new: int, s_total: int, batch: int = 1) -> int:
    """FLOPs of the part of attention that differs between the modes, for T new queries against S_total rows,
    in all layers (a multiply and an add are two FLOPs; the projections both modes share are left out).

    naive: up-project S rows (2 S r 2HD), then QK^T (2 H T S (D + dR)) and weights @ V (2 H T S D);
    absorbed: q W_uk (2 H T D r), QK^T against the rows (2 H T S (r + dR)), weights @ c (2 H T S r),
    then W_uv (2 H T r D).
    """
    if mode not in MODES:
        fail("mode", f"one of {MODES}", repr(mode))
    h, d, r, dr = cfg.n_heads, cfg.head_dim, cfg.kv_latent, cfg.latent_rope_dim
    t, s = t_new, s_total
    if mode == "naive":
        per_row = 2 * s * r * 2 * h * d + 2 * h * t * s * (d + dr) + 2 * h * t * s * d
    else:
        per_row = 2 * h * t * d * r + 2 * h * t * s * (r + dr) + 2 * h * t * s * r + 2 * h * t * r * d
    return cfg.n_layers * batch * per_row


def shared_step_flops(cfg: GPTConfig, t_new: int, batch: int = 1) -> int:
    """FLOPs of the latent-attention projections both modes run, for T new tokens in all layers:
    the query (C -> H (D + dR)), the way down (C -> r + dR) and the output (H D -> C)."""
    c, h, d, r, dr = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.kv_latent, cfg.latent_rope_dim
    return cfg.n_layers * 2 * batch * t_new * (c * h * (d + dr) + c * (r + dr) + h * d * c)
