"""How many sequences fit: `labcode.capacity`'s formulas, and a check that allocates the caches for real.

Introduced in chapter 7. The formulas are exact arithmetic; the check builds the
caches the course has (a preallocated `WindowCache` per sequence, chapter 9's paged
`BlockPool`, the int8 `QuantizedCache`) at a small scale, admits sequences until the
memory is used up, and compares the count, the bytes and the empty slots with the formulas.
"""

from __future__ import annotations

import torch

from labcode.bench.common import TIMED, Sizes
from labcode.bench.roofline import fill_cache
from labcode.caches import WindowCache
from labcode.capacity import (
    FORMATS,
    KVFormat,
    concurrency_table,
    contiguous_fit,
    kv_bytes_per_token,
    kv_heads_for,
    paged_fit,
    unused_slots,
)
from labcode.config import GPTConfig, get_config
from labcode.engines import BlockPool, PagedCache, QuantizedCache
from labcode.model import GPT
from labcode.results import QAResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def concurrency(cfg: GPTConfig, budget_bytes: int, lengths: tuple[int, ...], block_size: int = 16,
                gqa_group: int = 4) -> dict:
    """`concurrency_table` for `cfg`'s shapes at each sequence length, plain caches reserving the whole table."""
    return {"budget_bytes": budget_bytes, "max_len": cfg.context_length, "block_size": block_size,
            "gqa_group": gqa_group,
            "tables": {str(n): concurrency_table(cfg.n_layers, cfg.n_heads, cfg.head_dim, budget_bytes, n,
                                                 cfg.context_length, block_size, gqa_group) for n in lengths}}


def _stub(cfg: GPTConfig, dtype: torch.dtype) -> GPT:
    """Something `fill_cache` can fill a cache for: the config, a device and a dtype (no weights are used)."""
    return GPT(cfg.with_(vocab_size=8)).to(dtype)


@torch.inference_mode()
def allocate_plain(cfg: GPTConfig, dtype: torch.dtype, budget_bytes: int, length: int) -> dict:
    """Admit sequences, each a `WindowCache` reserving `context_length` slots, while their bytes fit the budget."""
    stub, held, total = _stub(cfg, dtype), 0, 0
    while True:
        cache = WindowCache(cfg.n_layers, cfg.context_length)
        fill_cache(cache, stub, 1, length)
        per_sequence = cache.nbytes
        if total + per_sequence > budget_bytes:
            break
        held, total = held + 1, total + per_sequence
    return {"sequences": held, "bytes_per_sequence": per_sequence, "bytes_used": total}


@torch.inference_mode()
def allocate_paged(cfg: GPTConfig, dtype: torch.dtype, budget_bytes: int, length: int, block_size: int) -> dict:
    """Fill a `BlockPool` as large as the budget allows with sequences of `length` tokens until it refuses one.

    Returns the sequences admitted, the pool's bytes, and the slots allocated but empty.
    """
    stub = _stub(cfg, dtype)
    block_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * block_size * cfg.head_dim * torch.finfo(dtype).bits // 8
    pool = BlockPool(cfg.n_layers, max(1, budget_bytes // block_bytes), block_size)
    sequences: list[PagedCache] = []
    while True:
        cache = PagedCache(pool)
        if cache.room() < length:  # the pool has no blocks left for another sequence
            break
        fill_cache(cache, stub, 1, length)
        sequences.append(cache)
    slots = sum(len(c.table) for c in sequences) * block_size
    return {"sequences": len(sequences), "pool_bytes": pool.nbytes, "block_bytes": pool.block_nbytes(),
            "slots_allocated": slots, "slots_empty": slots - sum(c.position for c in sequences)}


@torch.inference_mode()
def quantized_bytes(cfg: GPTConfig, length: int, group_size: int | None = None) -> int:
    """Bytes an int8 `QuantizedCache` holds for one sequence of `length` tokens (codes and float32 scales)."""
    cache = QuantizedCache(cfg.n_layers, bits=8, group_size=group_size)
    fill_cache(cache, _stub(cfg, torch.float32), 1, length)
    return cache.nbytes


def allocation_check(cfg: GPTConfig, budget_bytes: int, length: int, block_size: int, gqa_group: int = 2) -> list[dict]:
    """For each layout and format, the sequences and bytes the formulas predict and those real caches hold."""
    rows = []
    for layout in ("MHA", "GQA", "MQA"):
        c = cfg.with_(n_kv_heads=kv_heads_for(layout, cfg.n_heads, gqa_group))
        for name, dtype in DTYPES.items():
            tok = kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, name)
            plain, paged = allocate_plain(c, dtype, budget_bytes, length), allocate_paged(
                c, dtype, budget_bytes, length, block_size)
            n = paged["sequences"]
            rows.append({
                "layout": layout, "n_kv_heads": c.n_kv_heads, "format": name, "token_bytes": tok,
                "plain_formula": contiguous_fit(budget_bytes, c.context_length, tok), "plain_allocated": plain[
                    "sequences"], "plain_bytes_per_sequence": plain["bytes_per_sequence"],
                "paged_formula": paged_fit(paged["pool_bytes"], length, block_size, tok),
                "paged_allocated": n, "pool_bytes": paged["pool_bytes"],
                "empty_slots_formula": n * unused_slots(length, block_size), "empty_slots_measured": paged[
                    "slots_empty"]})
        for group in (None, c.head_dim // 2):
            fmt = KVFormat("int8", 1, FORMATS["int8"].scale_bytes, group)
            rows.append({"layout": layout, "n_kv_heads": c.n_kv_heads, "format": f"int8, group {group or c.head_dim}",
                         "token_bytes": kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, fmt),
                         "bytes_formula": length * kv_bytes_per_token(c.n_layers, c.n_kv_heads, c.head_dim, fmt),
                         "bytes_allocated": quantized_bytes(c, length, group)})
    return rows


def allocation_agrees(rows: list[dict]) -> bool:
    """True when every count and byte total of `allocation_check` equals its formula."""
    return all(r["bytes_formula"] == r["bytes_allocated"] if "bytes_formula" in r else
               (r["plain_formula"], r["paged_formula"], r["empty_slots_formula"])
               == (r["plain_allocated"], r["paged_allocated"], r["empty_slots_measured"]) for r in rows)


def concurrency_sweep(cfg: GPTConfig, budget_bytes: int, block_size: int = 16, gqa_group: int = 4,
                      lengths: tuple[int, ...] | None = None) -> dict:
    """Sequences that fit at every length (paged) and with plain allocation at `cfg`'s shapes, per layout and format."""
    lengths = lengths or tuple(range(8, cfg.context_length + 1, 8))
    out = {"lengths": list(lengths), "budget_bytes": budget_bytes, "block_size": block_size, "paged": {},
           "plain": {}}
    for layout in ("MHA", "GQA", "MQA"):
        hkv = kv_heads_for(layout, cfg.n_heads, gqa_group)
        for name in FORMATS:
            tok = kv_bytes_per_token(cfg.n_layers, hkv, cfg.head_dim, name)
            out["paged"][f"{layout}/{name}"] = [paged_fit(budget_bytes, n, block_size, tok) for n in lengths]
            out["plain"][f"{layout}/{name}"] = contiguous_fit(budget_bytes, cfg.context_length, tok)
    return out


def record(res: QAResult, sizes: Sizes) -> None:
    """How many sequences fit at GPT-2 124M shapes, and the formulas checked against allocated caches (tiny)."""
    budget = int(sizes.memory_budget_gib * 2**30)
    gpt2 = get_config("gpt2-124m")
    table = concurrency(gpt2, budget, sizes.memory_lengths, sizes.memory_block_size)
    rows = allocation_check(get_config("tiny"), 3 * 2**16, 21, 8)
    res.value("memory", {
        "concurrency": table, "sweep": concurrency_sweep(gpt2, budget, sizes.memory_block_size),
        "allocation": {"preset": "tiny", "budget_bytes": 3 * 2**16, "length": 21, "block_size": 8, "rows": rows,
                       "agrees": allocation_agrees(rows)}}, TIMED)
