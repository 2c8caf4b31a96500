"""Moving cached rotary keys to new positions: llama.cpp's context shift ("K-shift").

Introduced in chapter 6. With rotary positions a cached key is the layer's key rotated
by its position, and rotations compose: rotating by `delta` more moves it to position
`p + delta`. So after dropping the oldest cached positions, the kept keys can be moved
down instead of recomputed. Values carry no position and are kept as they are. What the
shift cannot restore is the dropped tokens' influence on the later layers' keys and values.
"""

from __future__ import annotations

import torch

from labcode.caches.concat import ConcatCache
from labcode.checks import fail, is_int
from labcode.rope import rotate


def shift_keys(k: torch.Tensor, delta: int, base: float) -> torch.Tensor:
    """Re-rotate cached rotary keys k [B, Hkv, S, D] from positions p to p + delta -> [B, Hkv, S, D]."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or k.shape[-1] % 2:
        fail("k", "a [B, Hkv, S, D] tensor with even D", getattr(k, "shape", type(k)))
    if not is_int(delta):
        fail("delta", "an integer number of positions", repr(delta))
    shift = torch.full((k.shape[2],), delta, dtype=torch.long, device=k.device)  # (S,) the same for every key
    return rotate(k, shift, base)


def context_shift(pairs: list[tuple[torch.Tensor, torch.Tensor]], n_drop: int,
                  base: float, n_keep: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keep the first `n_keep` positions of every layer's (K, V) [B, Hkv, S, D], drop the next `n_drop`,
    and move the later keys down by `n_drop` (llama.cpp's `seq_rm` then `seq_add`). Returns new pairs;
    the pairs passed in are not modified."""
    s = pairs[0][0].shape[2]
    if not (is_int(n_keep) and 0 <= n_keep < s):
        fail("n_keep", f"an integer with 0 <= n_keep < cached length {s}", repr(n_keep))
    if not (is_int(n_drop) and 0 <= n_drop < s - n_keep):
        kept = f" - n_keep {n_keep}" if n_keep else ""
        fail("n_drop", f"an integer with 0 <= n_drop < cached length {s}{kept}", repr(n_drop))
    rest = n_keep + n_drop
    return [(torch.cat((k[:, :, :n_keep], shift_keys(k[:, :, rest:], -n_drop, base)), dim=2),
             torch.cat((v[:, :, :n_keep], v[:, :, rest:]), dim=2)) for k, v in pairs]


class DropInPlace(ConcatCache):
    """A full cache that, once `hide` is set, hides positions n_keep .. n_keep + n_drop - 1 from every later
    query: the drop of a context shift without renumbering anything (the keys keep their positions)."""

    def __init__(self, n_layers: int, n_drop: int, n_keep: int = 0) -> None:
        super().__init__(n_layers)
        self.n_drop, self.n_keep, self.hide = n_drop, n_keep, False

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        m = super().mask(layer, t_new)
        if not self.hide:
            return m
        m = torch.ones(t_new, self.length(layer), dtype=torch.bool) if m is None else m.clone()  # (T, S)
        m[:, self.n_keep : self.n_keep + self.n_drop] = False
        return m
