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


def codes_per_byte(bits: int) -> int:
    """How many codes of `bits` bits a quantised cache stores in one byte: 8 / bits for 2 and 4 bits,
    one otherwise (3, 5, 6 or 7 bits do not divide a byte, and 8 fill it)."""
    return 8 // bits if bits in (2, 4) else 1


def quantized_kv_cache_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int,
                             group_size: int | None = None, bits: int = 8) -> int:
    """Bytes of a quantised K/V cache (labcode.engines.quant): codes plus a float32 scale per group.

    A group is a token's whole head vector by default (group_size None): D + 4 bytes per token and
    head in int8, for keys and for values, instead of D * 4 in float32. Codes of 2 or 4 bits pack
    8 / bits to a byte (D / 2 + 4 bytes in int4); codes of any other width take a byte each.
    """
    group = head_dim if group_size is None else group_size
    if not (isinstance(group, int) and group > 0 and head_dim % group == 0):
        raise ValueError(f"group_size: expected None or a positive divisor of head_dim={head_dim}, got {group_size!r}")
    if not (isinstance(bits, int) and 2 <= bits <= 8):
        raise ValueError(f"bits: expected an int in [2, 8], got {bits!r}")
    per = codes_per_byte(bits)
    if head_dim % per:
        raise ValueError(f"head_dim: expected a multiple of {per} for {bits}-bit codes, got {head_dim}")
    per_head = head_dim // per + 4 * (head_dim // group)  # codes + float32 scales
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
