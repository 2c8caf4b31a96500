"""Attention masks for a chunk of new queries after cached keys.

Introduced in chapter 2. Convention everywhere: a boolean mask of shape
[T, S + T] where True means "this query may attend to this key".
"""

from __future__ import annotations

import torch


def _check(t_new: int, s_cached: int) -> None:
    if t_new <= 0:
        raise ValueError(f"t_new: expected a positive number of new queries, got {t_new}")
    if s_cached < 0:
        raise ValueError(f"s_cached: expected a non-negative cached length, got {s_cached}")


def causal_mask(t_new: int, s_cached: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """Offset causal mask [T, S+T]: new query i (absolute position S+i) sees keys 0..S+i."""
    _check(t_new, s_cached)
    rows = torch.arange(t_new, device=device).unsqueeze(1) + s_cached  # (T, 1) absolute query position
    cols = torch.arange(s_cached + t_new, device=device).unsqueeze(0)  # (1, S+T) key position
    return cols <= rows


def sliding_window_mask(
    t_new: int, s_cached: int, window: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Causal mask that also hides keys more than `window - 1` positions behind each query."""
    if window <= 0:
        raise ValueError(f"window: expected a positive window, got {window}")
    rows = torch.arange(t_new, device=device).unsqueeze(1) + s_cached
    cols = torch.arange(s_cached + t_new, device=device).unsqueeze(0)
    return causal_mask(t_new, s_cached, device) & (cols > rows - window)


def upper_left_mask(t_new: int, s_cached: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The classic mistake: a lower-triangular mask aligned to the top-left corner.

    Row i sees only keys 0..i, so the new queries lose most of the cached context.
    """
    _check(t_new, s_cached)
    return torch.ones(t_new, s_cached + t_new, dtype=torch.bool, device=device).tril()


def positions_mask(query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Causal mask from explicit positions: query at p sees keys at positions <= p.

    query_pos: [T]; key_pos: [S] (a negative key position marks an empty slot). Returns [T, S].
    """
    return (key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)) & (key_pos.unsqueeze(0) >= 0)
