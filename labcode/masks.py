"""Attention masks for a chunk of new queries after cached keys.

Introduced in chapter 2; used by every cache (chapters 3 to 5). Convention everywhere:
a boolean mask of shape [T, S + T] (or [T, S_total]) where True means "this query
may attend to this key".
"""

from __future__ import annotations

import torch

from labcode.checks import fail, is_int


def _check(t_new: int, s_cached: int) -> None:
    if not (is_int(t_new) and t_new > 0):
        fail("t_new", "a positive number of new queries", repr(t_new))
    if not (is_int(s_cached) and s_cached >= 0):
        fail("s_cached", "a non-negative cached length", repr(s_cached))


def causal_mask(t_new: int, s_cached: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """Offset causal mask [T, S+T]: new query i (absolute position S+i) sees keys 0..S+i."""
    _check(t_new, s_cached)
    rows = torch.arange(t_new, device=device).unsqueeze(1) + s_cached  # (T, 1) absolute query position
    cols = torch.arange(s_cached + t_new, device=device).unsqueeze(0)  # (1, S+T) key position
    return cols <= rows


def sliding_window_mask(
    t_new: int, s_cached: int, window: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Offset causal mask [T, S+T] that also hides keys more than `window - 1` positions behind each query."""
    _check(t_new, s_cached)
    if not (is_int(window) and window > 0):
        fail("window", "a positive window", repr(window))
    rows = torch.arange(t_new, device=device).unsqueeze(1) + s_cached  # (T, 1)
    cols = torch.arange(s_cached + t_new, device=device).unsqueeze(0)  # (1, S+T)
    return (cols <= rows) & (cols > rows - window)


def upper_left_mask(t_new: int, s_cached: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The classic mistake: a lower-triangular mask aligned to the top-left corner.

    Row i sees only keys 0..i, so the new queries lose most of the cached context.
    """
    _check(t_new, s_cached)
    return torch.ones(t_new, s_cached + t_new, dtype=torch.bool, device=device).tril()


def positions_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal mask from explicit positions: query at p sees stored keys at positions <= p
    (and > p - window, if a window is given).

    query_pos: [T]; key_pos: [S] (a negative key position marks an empty slot). Returns [T, S].
    """
    if query_pos.dim() != 1 or key_pos.dim() != 1:
        fail("query_pos, key_pos", "two rank-1 tensors", f"shapes {tuple(query_pos.shape)}, {tuple(key_pos.shape)}")
    if window is not None and not (is_int(window) and window > 0):
        fail("window", "a positive window or None", repr(window))
    q, k = query_pos.unsqueeze(1), key_pos.unsqueeze(0)  # (T, 1), (1, S)
    visible = (k <= q) & (k >= 0)
    return visible if window is None else visible & (k > q - window)
