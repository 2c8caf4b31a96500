"""Windows and attention sinks on real text, in one pass: what a cache policy does to the next-token loss.

Introduced in chapter 6. A cache of W slots that keeps the first `n_keep` positions and the latest
W - n_keep (a plain window when n_keep = 0) lets each query see exactly those keys, so a whole text
can be scored in one pass under that mask, instead of one decode step per token; the QA notebook
checks the pass against the course's caches token by token. Two position rules:

- "absolute": every key keeps the position it was written at (what the course's caches do);
- "cache": positions are numbered within the cache, as StreamingLLM does: once the cache is full,
  the query sits at slot W - 1 and the kept first keys at slots 0 .. n_keep - 1, so they look
  W - 1 - s positions away instead of t - s. With rotary positions only those distances change:
  between the query and the latest keys the distance is the same under both rules.

The pass also returns the attention mass each layer's heads put on the first positions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labcode.checks import fail, is_int
from labcode.model import GPT
from labcode.rope import rotate

RULES = ("absolute", "cache")


def policy_mask(t: int, window: int | None, n_keep: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """[T, T], True = visible: causal, and with a window query i sees key j only if j > i - (W - n_keep)
    or j < n_keep (the kept first positions)."""
    i, j = torch.arange(t, device=device).view(-1, 1), torch.arange(t, device=device).view(1, -1)
    visible = j <= i
    if window is not None:
        visible &= (i - j < window - n_keep) | (j < n_keep)
    return visible


def _check(model: GPT, ids: torch.Tensor, window: int | None, n_keep: int, rule: str, first: int) -> None:
    if model.training:
        fail("model", "a model in eval mode (the pass applies no dropout)", "training mode")
    model.check_ids(ids)
    if ids.shape[0] != 1:
        fail("ids", "one sequence [1, T]", tuple(ids.shape))
    if window is not None and not (is_int(window) and window > 0):
        fail("window", "None or a positive number of cache slots", repr(window))
    if not (is_int(n_keep) and 0 <= n_keep < (1 if window is None else window)):
        fail("n_keep", "0 <= n_keep < window (first positions kept; 0 with no window)", repr(n_keep))
    if rule not in RULES:
        fail("rule", f"one of {RULES}", repr(rule))
    if rule == "cache" and n_keep and not model.cfg.rotary:
        fail("rule", "'absolute' for a model with a position table (positions within the cache need rotary)",
             repr(rule))
    if not (is_int(first) and first > 0):
        fail("first", "a positive number of first positions", repr(first))


def run_policy(model: GPT, ids: torch.Tensor, window: int | None = None, n_keep: int = 0,
               rule: str = "absolute", first: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, T, V] of ids [1, T] under a cache of `window` slots keeping the first `n_keep`
    positions (None: the full model), and the attention mass [L, H] on the first `first` positions,
    averaged over queries (each query's weights sum to 1)."""
    _check(model, ids, window, n_keep, rule, first)
    cfg, t = model.cfg, ids.shape[1]
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pos = torch.arange(t, device=model.device)
    mask = policy_mask(t, window, n_keep, model.device)  # (T, T)
    renumbered = rule == "cache" and window is not None and n_keep > 0 and t > window
    x = model.tok_emb(ids) + (0 if model.pos_emb is None else model.pos_emb(pos))  # (1, T, C)
    mass = []
    for block in model.blocks:
        attn, y = block.attn, block.ln_1(x)
        q = attn.q_proj(y).view(1, t, h, d).transpose(1, 2)  # (1, H, T, D)
        k, v = attn.kv_proj(y).view(1, t, 2, hkv, d).permute(2, 0, 3, 1, 4)  # (1, Hkv, T, D) each
        if cfg.rotary:
            q_at, k_at = rotate(q, pos, cfg.rope_base), rotate(k, pos, cfg.rope_base)
        else:
            q_at, k_at = q, k
        qg = q_at.view(1, hkv, h // hkv, t, d)  # (1, Hkv, G, T, D): query heads grouped by their K/V head
        scores = qg @ k_at.unsqueeze(2).transpose(-1, -2) / math.sqrt(d)  # (1, Hkv, G, T, T)
        if renumbered:  # full-cache queries see the kept keys at slots 0..n_keep-1 and sit at slot W - 1
            q_slot = rotate(q, torch.full((t,), window - 1, device=model.device), cfg.rope_base)
            near = q_slot.view(1, hkv, h // hkv, t, d) @ k_at[:, :, :n_keep].unsqueeze(2).transpose(-1, -2)
            rows = pos >= window
            scores[..., rows, :n_keep] = near[..., rows, :] / math.sqrt(d)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # (1, Hkv, G, T, T)
        mass.append(weights[..., :first].sum(-1).mean(-1).reshape(h))  # (H,)
        out = (weights @ v.unsqueeze(2)).reshape(1, h, t, d)  # (1, H, T, D)
        x = x + attn.out_proj(out.transpose(1, 2).reshape(1, t, cfg.d_model))
        x = x + block.mlp(block.ln_2(x))
    return F.linear(model.ln_f(x), model.tok_emb.weight), torch.stack(mass)


def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy [T - 1] in nats of logits [1, T, V] for ids [1, T]."""
    return F.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="none")
