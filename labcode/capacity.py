"""How many sequences fit in memory: K/V bytes per token, and plain versus paged allocation.

Introduced in chapter 7 (the paged pool is chapter 9's). Every sequence in a batch
keeps its own keys and values, so the memory left after the weights caps how many
sequences a server can run at once. A plain cache reserves room for the longest
sequence it may ever hold; a paged cache takes fixed-size blocks as the sequence
grows, and wastes only the unused slots of its last block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labcode.checks import is_int
from labcode.cost import kv_cache_bytes


@dataclass(frozen=True)
class KVFormat:
    """How one K or V element is stored: its bytes, and for quantised formats a scale per group of elements."""

    name: str
    element_bytes: int
    scale_bytes: int = 0  # bytes of one scale (float32: 4)
    group_size: int | None = None  # elements per scale; None: one per head vector (D elements)


FORMATS = {
    "float32": KVFormat("float32", 4),
    "bfloat16": KVFormat("bfloat16", 2),
    # chapter 9's QuantizedCache: int8 codes and one float32 scale per token and head (or per group)
    "int8": KVFormat("int8", 1, scale_bytes=4),
}

LAYOUTS = ("MHA", "GQA", "MQA")


def _positive(name: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def kv_format(fmt: str | KVFormat) -> KVFormat:
    """A `KVFormat`, given one or the name of one in `FORMATS`."""
    if isinstance(fmt, KVFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {sorted(FORMATS)} or a KVFormat, got {fmt!r}")
    return FORMATS[fmt]


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, fmt: str | KVFormat = "float32") -> int:
    """Bytes one token's keys and values take in all layers of one sequence.

    2 (K and V) * L * Hkv * (D * element bytes + D / group * scale bytes).
    """
    f = kv_format(fmt)
    d = _positive("head_dim", head_dim)
    group = d if f.group_size is None else _positive("group_size", f.group_size)
    if d % group:
        raise ValueError(f"group_size: expected a divisor of head_dim {d}, got {group}")
    n_layers, n_kv_heads = _positive("n_layers", n_layers), _positive("n_kv_heads", n_kv_heads)
    scales = 2 * n_layers * n_kv_heads * (d // group) * f.scale_bytes
    return kv_cache_bytes(n_layers, 1, 1, n_kv_heads, d, f.element_bytes) + scales


def kv_heads_for(layout: str, n_heads: int, group: int = 4) -> int:
    """Hkv of a layout: MHA keeps H, GQA H / `group` (at least 1), MQA a single head."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    _positive("n_heads", n_heads)
    if layout == "GQA" and (n_heads % _positive("group", group)):
        raise ValueError(f"group: expected a divisor of n_heads {n_heads}, got {group}")
    return {"MHA": n_heads, "GQA": max(1, n_heads // group), "MQA": 1}[layout]


def blocks_for(length: int, block_size: int) -> int:
    """Blocks a sequence of `length` tokens takes: ceil(length / block size)."""
    if not is_int(length) or length < 0:
        raise ValueError(f"length: expected an int >= 0, got {length!r}")
    return -(-length // _positive("block_size", block_size))


def unused_slots(length: int, block_size: int) -> int:
    """Token slots allocated but empty: the rest of the last block."""
    return blocks_for(length, block_size) * block_size - length


def contiguous_fit(budget_bytes: int, max_len: int, token_bytes: int) -> int:
    """Sequences that fit when each reserves `max_len` tokens up front (a preallocated cache per sequence)."""
    if not is_int(budget_bytes) or budget_bytes < 0:
        raise ValueError(f"budget_bytes: expected an int >= 0, got {budget_bytes!r}")
    return budget_bytes // (_positive("max_len", max_len) * _positive("token_bytes", token_bytes))


def paged_fit(budget_bytes: int, length: int, block_size: int, token_bytes: int) -> int:
    """Sequences of `length` tokens that fit in a pool of blocks of `block_size` tokens filling the budget."""
    if not is_int(budget_bytes) or budget_bytes < 0:
        raise ValueError(f"budget_bytes: expected an int >= 0, got {budget_bytes!r}")
    blocks = budget_bytes // (_positive("block_size", block_size) * _positive("token_bytes", token_bytes))
    per_sequence = blocks_for(length, block_size)
    return blocks // per_sequence if per_sequence else math.inf


def concurrency_table(n_layers: int, n_heads: int, head_dim: int, budget_bytes: int, length: int, max_len: int,
                      block_size: int = 16, gqa_group: int = 4,
                      formats: tuple[str, ...] = tuple(FORMATS)) -> list[dict]:
    """Sequences of `length` tokens that fit in `budget_bytes`, for each layout and format, plain and paged.

    Plain allocation reserves `max_len` tokens per sequence; paged allocation takes
    ceil(length / block size) blocks. Each row also gives the fraction of the paged
    slots left empty (the last block's) and how many more sequences paging admits.
    """
    if length > max_len:
        raise ValueError(f"length: expected at most max_len {max_len}, got {length}")
    rows = []
    for layout in LAYOUTS:
        hkv = kv_heads_for(layout, n_heads, gqa_group)
        for name in formats:
            tok = kv_bytes_per_token(n_layers, hkv, head_dim, name)
            plain = contiguous_fit(budget_bytes, max_len, tok)
            paged = paged_fit(budget_bytes, length, block_size, tok)
            rows.append({"layout": layout, "n_kv_heads": hkv, "format": name, "token_bytes": tok,
                         "plain": plain, "paged": paged,
                         "paged_unused_fraction": unused_slots(length, block_size) / (
                             blocks_for(length, block_size) * block_size) if length else 0.0,
                         "paged_over_plain": paged / plain if plain else math.inf})
    return rows
