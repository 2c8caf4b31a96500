"""Rotary position embedding (RoPE): the one rotation every rotary key and query goes through.

Introduced in chapter 1 with the model's rotary option (SmolLM2-135M's positions); chapter 6's
K-shift and attention sinks and chapter 13's latent attention rotate with it too. Pairs (i, i + D/2)
of a head vector are rotated by angles position * base^(-2i/D), computed in float64 and rounded once
to the tensor's dtype.
"""

from __future__ import annotations

import torch


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
