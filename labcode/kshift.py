"""Moving cached rotary keys to new positions: llama.cpp's context shift ("K-shift").

Introduced in chapter 6. With rotary positions a cached key is the layer's key rotated
by its position, and rotations compose: rotating by `delta` more moves it to position
`p + delta`. So after dropping the oldest cached positions, the kept keys can be moved
down instead of recomputed. Values carry no position and are kept as they are. What the
shift cannot restore is the dropped tokens' influence on the later layers' keys and values.
"""

from __future__ import annotations

import torch

from labcode.checks import fail, is_int
from labcode.model import rotate


def shift_keys(k: torch.Tensor, delta: int, base: float) -> torch.Tensor:
    """Re-rotate cached rotary keys k [B, Hkv, S, D] from positions p to p + delta -> [B, Hkv, S, D]."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[-1] % 2:
        fail("k", "a [B, Hkv, S, D] tensor with even D", getattr(k, "shape", type(k)))
    if not is_int(delta):
        fail("delta", "an integer number of positions", repr(delta))
    shift = torch.full((k.shape[2],), delta, dtype=torch.long, device=k.device)  # (S,) the same for every key
    return rotate(k, shift, base)


def context_shift(pairs: list[tuple[torch.Tensor, torch.Tensor]], n_drop: int,
                  base: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Drop the oldest `n_drop` positions of every layer's (K, V) [B, Hkv, S, D] and move the
    kept keys to positions 0..S-n_drop-1. Returns new pairs; the pairs passed in are not modified."""
    s = pairs[0][0].shape[2]
    if not (is_int(n_drop) and 0 <= n_drop < s):
        fail("n_drop", f"an integer with 0 <= n_drop < cached length {s}", repr(n_drop))
    return [(shift_keys(k[:, :, n_drop:], -n_drop, base), v[:, :, n_drop:]) for k, v in pairs]
