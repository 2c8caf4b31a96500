"""How many sequences fit (chapter 7): the formulas by hand, and real caches allocated until memory runs out."""

from __future__ import annotations

import math

import pytest
import torch

from labcode import get_config
from labcode.bench.memory import allocate_paged, allocate_plain, allocation_agrees, allocation_check, quantized_bytes
from labcode.capacity import (
    KVFormat,
    blocks_for,
    concurrency_table,
    contiguous_fit,
    kv_bytes_per_token,
    kv_heads_for,
    paged_fit,
    unused_slots,
)
from labcode.cost import kv_cache_bytes


def test_bytes_per_token_by_hand():
    # GPT-2 124M: L = 12, H = 12, D = 64
    assert kv_bytes_per_token(12, 12, 64, "float32") == 2 * 12 * 12 * 64 * 4 == 73_728
    assert kv_bytes_per_token(12, 12, 64, "bfloat16") == 36_864
    assert kv_bytes_per_token(12, 12, 64, "int8") == 2 * 12 * 12 * (64 * 1 + 4) == 19_584  # a float32 scale per head
    assert kv_bytes_per_token(12, 12, 64, KVFormat("int8", 1, 4, 16)) == 2 * 12 * 12 * (64 + 4 * 4)  # 4 groups
    assert kv_bytes_per_token(12, 3, 64, "float32") == 73_728 // 4  # GQA with 3 K/V heads
    assert kv_bytes_per_token(2, 2, 8, "float32") == kv_cache_bytes(2, 1, 1, 2, 8, 4)  # chapter 7's formula


def test_plain_and_paged_fit_by_hand():
    assert contiguous_fit(10_000, 32, 10) == 31  # each sequence reserves 320 bytes
    assert blocks_for(10, 4) == 3 and blocks_for(12, 4) == 3 and blocks_for(0, 4) == 0
    assert unused_slots(10, 4) == 2 and unused_slots(12, 4) == 0
    assert paged_fit(10_000, 10, 4, 10) == 83  # 250 blocks of 40 bytes, 3 per sequence
    assert paged_fit(10_000, 0, 4, 10) == math.inf


def test_layouts_and_the_table():
    assert [kv_heads_for(x, 12) for x in ("MHA", "GQA", "MQA")] == [12, 3, 1]
    rows = concurrency_table(12, 12, 64, budget_bytes=2**30, length=100, max_len=1024, block_size=16)
    assert len(rows) == 9
    mha = next(r for r in rows if r["layout"] == "MHA" and r["format"] == "float32")
    assert mha["plain"] == 2**30 // (1024 * 73_728) == 14
    assert mha["paged"] == (2**30 // (16 * 73_728)) // 7 == 130  # 100 tokens take 7 blocks of 16
    assert mha["paged_unused_fraction"] == pytest.approx(12 / 112)
    mqa = next(r for r in rows if r["layout"] == "MQA" and r["format"] == "int8")
    assert mqa["token_bytes"] == 2 * 12 * (64 + 4)


@pytest.mark.parametrize("call,message", [
    (lambda: kv_bytes_per_token(12, 0, 64), "n_kv_heads: expected a positive int, got 0"),
    (lambda: kv_bytes_per_token(12, 12, 64, "fp8"), "fmt: expected one of"),
    (lambda: kv_bytes_per_token(12, 12, 64, KVFormat("int8", 1, 4, 48)), "group_size: expected a divisor"),
    (lambda: contiguous_fit(-1, 8, 8), "budget_bytes: expected an int >= 0, got -1"),
    (lambda: paged_fit(100, 5, 0, 8), "block_size: expected a positive int, got 0"),
    (lambda: kv_heads_for("GQA", 12, 5), "group: expected a divisor of n_heads 12, got 5"),
    (lambda: kv_heads_for("MLA", 12), "layout: expected one of"),
    (lambda: concurrency_table(12, 12, 64, 2**30, 2000, 1024), "length: expected at most max_len 1024, got 2000"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_caches_admit_what_the_formulas_say(kv_heads, dtype):
    cfg = get_config("tiny", n_kv_heads=kv_heads)
    name = str(dtype).removeprefix("torch.")
    tok = kv_bytes_per_token(cfg.n_layers, kv_heads, cfg.head_dim, name)
    budget, length, block = 100_000, 21, 8
    plain = allocate_plain(cfg, dtype, budget, length)
    assert plain["bytes_per_sequence"] == cfg.context_length * tok
    assert plain["sequences"] == contiguous_fit(budget, cfg.context_length, tok)
    paged = allocate_paged(cfg, dtype, budget, length, block)
    assert paged["block_bytes"] == block * tok and paged["pool_bytes"] <= budget
    assert paged["sequences"] == paged_fit(paged["pool_bytes"], length, block, tok)
    assert paged["slots_empty"] == paged["sequences"] * unused_slots(length, block) == paged["sequences"] * 3


def test_int8_cache_holds_its_codes_and_scales():
    cfg = get_config("tiny")
    for group in (None, 8):
        fmt = KVFormat("int8", 1, 4, group)
        assert quantized_bytes(cfg, 13, group) == 13 * kv_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                                                            fmt)
    rows = allocation_check(cfg, 3 * 2**16, 21, 8)
    assert allocation_agrees(rows) and len(rows) == 12
    rows[0]["paged_allocated"] += 1  # the check can fail
    assert not allocation_agrees(rows)
