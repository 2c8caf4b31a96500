"""Attention masks for a chunk of new queries after cached keys.

Introduced in chapter 2; used by every cache (chapters 3 to 5). Convention everywhere:
a boolean mask of shape [T, S + T] (or [T, S_total]) where True means "this query
may attend to this key".
"""

from __future__ import annotations

import operator

import torch


def _is_int(x: object) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _check(t_new: int, s_cached: int) -> None:
    if not _is_int(t_new) or t_new <= 0:
        raise ValueError(f"t_new: expected a positive number of new queries, got {t_new!r}")
    if not _is_int(s_cached) or s_cached < 0:
        raise ValueError(f"s_cached: expected a non-negative cached length, got {s_cached!r}")


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
    if not _is_int(window) or window <= 0:
        raise ValueError(f"window: expected a positive window, got {window!r}")
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
        raise ValueError(
            f"query_pos, key_pos: expected two rank-1 tensors, got shapes {tuple(query_pos.shape)}, "
            f"{tuple(key_pos.shape)}")
    if window is not None and (not _is_int(window) or window <= 0):
        raise ValueError(f"window: expected a positive window or None, got {window!r}")
    q, k = query_pos.unsqueeze(1), key_pos.unsqueeze(0)  # (T, 1), (1, S)
    visible = (k <= q) & (k >= 0)
    return visible if window is None else visible & (k > q - window)
