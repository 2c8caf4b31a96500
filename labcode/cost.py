"""Counting formulas: cache bytes and positions computed, with and without a cache.

Introduced in chapter 1 (positions) and chapter 7 (bytes). The explorer page in the
book computes the same numbers in JavaScript; a browser test compares them.
"""

from __future__ import annotations


def kv_cache_elements(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int) -> int:
    """Elements held by a dense K/V cache: 2 (K and V) * L * B * T * Hkv * D."""
    return 2 * n_layers * batch * tokens * n_kv_heads * head_dim


def kv_cache_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int,
                   bytes_per_element: int) -> int:
    """Bytes of a dense, unquantised K/V cache."""
    return kv_cache_elements(n_layers, batch, tokens, n_kv_heads, head_dim) * bytes_per_element


def positions_computed(prompt_len: int, new_tokens: int, cached: bool) -> list[int]:
    """Positions run through the model at each forward call of a generation of `new_tokens`.

    Without a cache, call i runs the whole sequence so far (prompt_len + i positions);
    with one, the first call runs the prompt and each later call runs one position.
    """
    if new_tokens <= 0:
        return []
    if cached:
        return [prompt_len] + [1] * (new_tokens - 1)
    return [prompt_len + i for i in range(new_tokens)]
