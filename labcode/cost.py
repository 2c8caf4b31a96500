"""Counting formulas: cache bytes and positions computed, with and without a cache.

Introduced in chapter 1 (positions), chapter 7 (bytes) and chapter 9 (quantised bytes). The
explorer page in the book computes the same numbers in JavaScript; a browser test compares them.
"""

from __future__ import annotations


def kv_cache_elements(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int) -> int:
    """Elements held by a dense K/V cache: 2 (K and V) * L * B * T * Hkv * D."""
    return 2 * n_layers * batch * tokens * n_kv_heads * head_dim


def kv_cache_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int,
                   bytes_per_element: int) -> int:
    """Bytes of a dense, unquantised K/V cache."""
    return kv_cache_elements(n_layers, batch, tokens, n_kv_heads, head_dim) * bytes_per_element


def quantized_kv_cache_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int,
                             group_size: int | None = None) -> int:
    """Bytes of an int8 K/V cache (labcode.engines.quant): one-byte codes plus a float32 scale per group.

    A group is a token's whole head vector by default (group_size None): D + 4 bytes per token and
    head, for keys and for values, instead of D * 4 in float32.
    """
    group = head_dim if group_size is None else group_size
    if not (isinstance(group, int) and group > 0 and head_dim % group == 0):
        raise ValueError(f"group_size: expected None or a positive divisor of head_dim={head_dim}, got {group_size!r}")
    per_head = head_dim + 4 * (head_dim // group)  # int8 codes + float32 scales
    return 2 * n_layers * batch * tokens * n_kv_heads * per_head


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
