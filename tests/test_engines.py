"""Engine cache policies (chapter 9): each equals the full forward, and rejects bad input untouched."""

from __future__ import annotations

import pytest
import torch
from helpers import build, rejected
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode import GPT, GPTConfig
from labcode.caches import CacheError, ConcatCache
from labcode.caches.base import states_equal
from labcode.cost import quantized_kv_cache_bytes
from labcode.engines import (
    BlockPool,
    CellsCache,
    PagedCache,
    QuantizedCache,
    ScatteredCache,
    block_hashes,
    block_slots,
    cells_mask,
    dequantize,
    fake_quantize,
    find_slots,
    hadamard,
    key_outlier_ratio,
    quantize,
    run_ragged,
    scattered_mask,
    with_key_outliers,
)

TOL = 1e-12  # float64 equivalence


pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py
CFG = GPTConfig(vocab_size=32, context_length=48, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)


def make_model(rotary: bool = False, seed: int = 0) -> GPT:
    return build(CFG.with_(rotary=rotary), seed)


MODELS = {False: make_model(False), True: make_model(True)}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model: GPT, seq: list[int]) -> torch.Tensor:
    """The reference: the full forward without any cache, [len(seq), V]."""
    return model(torch.tensor([seq]))[0]


def run_chunks(model: GPT, cache, seq: list[int], sizes: list[int]) -> torch.Tensor:
    """Feed `seq` into `cache` in chunks of the given sizes; logits [len(seq), V]."""
    out, start = [], 0
    for size in sizes:
        out.append(model(torch.tensor([seq[start : start + size]]), cache)[0])
        start += size
    return torch.cat(out)


def split(n: int, cuts: list[int]) -> list[int]:
    """Chunk sizes that cover n tokens, cut at the given (sorted, de-duplicated) points."""
    points = [0] + sorted({c for c in cuts if 0 < c < n}) + [n]
    return [b - a for a, b in zip(points, points[1:], strict=False)]


# -- the model hook: explicit positions -----------------------------------------------------------

def test_explicit_positions_are_checked_by_the_model():
    model = MODELS[False]

    class Placed(ConcatCache):
        """A cache that places its tokens itself: `begin` returns their positions."""

        def __init__(self, positions):
            super().__init__(CFG.n_layers)
            self.positions = positions

        def _open(self, chunk):
            super()._open(chunk)
            chunk.placed = self.positions

    for placed, match in ((torch.tensor([0, 1]), r"positions: expected shape \(3,\) or \(1, 3\), got \(2,\)"),
                          (torch.tensor([46, 47, 48]), r"positions: expected values in \[0, 48\), got min 46, max 48")):
        cache = Placed(placed)
        rejected(cache, lambda cache=cache: model(torch.tensor([[1, 2, 3]]), cache), ValueError, match)
        assert cache.chunk is None and cache.length() == 0  # the pass was cancelled: nothing committed


# -- paged ----------------------------------------------------------------------------------------

def test_block_slots_follow_the_table():
    blocks, offsets = block_slots([7, 2, 5], start=3, t_new=4, block_size=3)
    assert blocks.tolist() == [2, 2, 2, 5] and offsets.tolist() == [0, 1, 2, 0]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(prompt=st.integers(1, 20), block=st.integers(1, 6), cuts=st.lists(st.integers(1, 19), max_size=4),
       more_a=st.integers(1, 10), more_b=st.integers(1, 10), seed=st.integers(0, 1000))
def test_paged_equals_full_forward_and_forks_share_then_copy(prompt, block, cuts, more_a, more_b, seed):
    model = MODELS[False]
    pool = BlockPool(CFG.n_layers, n_blocks=40, block_size=block)
    base, a_tail, b_tail = tokens(prompt, seed), tokens(more_a, seed + 1), tokens(more_b, seed + 2)
    a = PagedCache(pool)
    got = run_chunks(model, a, base, split(prompt, cuts))
    assert (got - full_logits(model, base)).abs().max().item() <= TOL
    b = a.fork()
    shared = len(a.table)
    assert all(pool.refcount[x] == 2 for x in a.table)
    got_a = run_chunks(model, a, a_tail, [more_a])
    got_b = run_chunks(model, b, b_tail, split(more_b, [1]))
    assert (got_a - full_logits(model, base + a_tail)[prompt:]).abs().max().item() <= TOL
    assert (got_b - full_logits(model, base + b_tail)[prompt:]).abs().max().item() <= TOL
    assert pool.copies == (1 if prompt % block else 0)  # only a half-filled shared block is copied, once
    assert len(set(a.table[: prompt // block]) ^ set(b.table[: prompt // block])) == 0  # full blocks still shared
    assert pool.n_free == 40 - len(set(a.table) | set(b.table))
    assert shared == -(-prompt // block)
    a.free()
    b.free()
    assert pool.n_free == 40 and all(r == 0 for r in pool.refcount)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(n=st.integers(2, 25), drop=st.integers(1, 10), block=st.integers(1, 5), more=st.integers(1, 8),
       seed=st.integers(0, 1000))
def test_paged_crop_equals_never_having_generated(n, drop, block, more, seed):
    model, drop = MODELS[False], min(drop, n - 1)
    seq, tail = tokens(n, seed), tokens(more, seed + 7)
    pool = BlockPool(CFG.n_layers, n_blocks=40, block_size=block)  # room for 25 + 8 one-slot blocks
    cache = PagedCache(pool)
    run_chunks(model, cache, seq, [n])
    cache.crop(drop)
    assert cache.position == n - drop and len(cache.table) == -(-(n - drop) // block)
    got = run_chunks(model, cache, tail, [more])
    assert (got - full_logits(model, seq[: n - drop] + tail)[n - drop :]).abs().max().item() <= TOL


def test_block_hashes_chain_full_blocks_only():
    a, b = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9, 9]
    ha, hb = block_hashes(a, 2), block_hashes(b, 2)
    assert len(ha) == 3 and len(hb) == 4  # a partly filled last block has no hash
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # equal exactly as far as the full blocks agree
    assert block_hashes([9, 9, 3, 4], 2)[1] != ha[1]  # block 1's hash covers the blocks before it
    assert block_hashes(a, 2) == ha  # the same tokens give the same hashes every time
    with pytest.raises(CacheError, match=r"block_size: expected a positive int, got 0"):
        block_hashes(a, 0)


def test_prefix_cache_finds_freed_full_blocks_and_computes_only_the_rest():
    model = MODELS[False]
    pool = BlockPool(CFG.n_layers, n_blocks=12, block_size=4)
    first = PagedCache(pool)
    seq = tokens(14, 3)
    run_chunks(model, first, seq, [14])
    assert first.cache_full_blocks(seq) == 3  # blocks of positions 0-3, 4-7, 8-11
    first.free()  # preempted or finished: the blocks are free but keep their hashes
    assert pool.n_free == 12 and len(pool.cached) == 3
    again = PagedCache(pool)
    other = seq[:10] + tokens(5, 4)  # shares the first 10 tokens: two full blocks
    assert again.reuse_prefix(other) == 8 and again.table == first_blocks(pool, seq, 2)
    got = run_chunks(model, again, other[8:], [7])  # only positions 8.. are computed
    assert (got - full_logits(model, other)[8:]).abs().max().item() <= TOL
    exact = PagedCache(pool)  # a prompt of exactly 8 tokens reuses 4: its last token must be computed
    assert exact.reuse_prefix(seq[:8]) == 4


def first_blocks(pool: BlockPool, seq: list[int], n: int) -> list[int]:
    return [pool.cached[h] for h in block_hashes(seq, pool.block_size)[:n]]


def test_free_queue_evicts_cached_blocks_last_and_least_recently_freed_first():
    pool = BlockPool(1, n_blocks=6, block_size=1)
    kv = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    old, plain = PagedCache(pool), PagedCache(pool)
    old.feed(kv.expand(1, 1, 3, 2), kv.expand(1, 1, 3, 2))  # blocks 0, 1, 2
    plain.feed(kv, kv)  # block 3
    old.cache_full_blocks([7, 8, 9])
    old.free()  # cached: evicted last, the prefix's end first
    plain.free()  # no hash: reused first
    assert pool.peek(6) == [3, 4, 5, 2, 1, 0]
    new = PagedCache(pool)
    new.feed(kv.expand(1, 1, 4, 2), kv.expand(1, 1, 4, 2))  # takes 3, 4, 5 and evicts block 2
    assert new.table == [3, 4, 5, 2] and len(pool.cached) == 2 and 2 not in pool.hash_of
    hit = PagedCache(pool)
    assert hit.reuse_prefix([7, 8, 9, 1]) == 2  # blocks 0 and 1 are still found; block 2 was evicted
    assert hit.table == [0, 1] and pool.refcount[:2] == [1, 1] and pool.n_free == 0


def test_prefix_cache_rejects_bad_input_before_any_change():
    model = MODELS[False]
    pool = BlockPool(CFG.n_layers, n_blocks=6, block_size=4)
    cache = PagedCache(pool)
    run_chunks(model, cache, tokens(6, 0), [6])
    rejected(cache, lambda: cache.cache_full_blocks(tokens(5, 0)), CacheError,
             r"ids: expected the sequence's 6 token ids, got 5 ids")
    rejected(cache, lambda: cache.reuse_prefix(tokens(6, 0)), CacheError,
             r"cache: expected an empty sequence \(reuse_prefix starts one\), got 6 positions")
    empty = PagedCache(pool)
    rejected(empty, lambda: empty.reuse_prefix([]), CacheError, r"ids: expected a non-empty list of token ids")


def test_paged_rejects_bad_input_before_any_change():
    model = MODELS[False]
    pool = BlockPool(CFG.n_layers, n_blocks=3, block_size=4)
    cache = PagedCache(pool)
    run_chunks(model, cache, tokens(6, 0), [6])
    before = cache.state()
    with pytest.raises(CacheError, match=r"t_new: expected a chunk that fits the 1 free blocks, got 7 tokens"):
        model(torch.tensor([tokens(7, 1)]), cache)
    with pytest.raises(CacheError, match=r"batch: expected the cache's batch size 1.*got 2"):
        model(torch.tensor([tokens(2, 1)] * 2), cache)
    with pytest.raises(CacheError, match=r"dtype: expected the cache's dtype torch.float64, got torch.float32"):
        make_model().float()(torch.tensor([tokens(1, 1)]), cache)
    with pytest.raises(CacheError, match=r"n_drop: expected an int in \[0, 6\], got 7"):
        cache.crop(7)
    with pytest.raises(CacheError, match=r"block_size: expected a positive int, got 0"):
        BlockPool(2, 3, 0)
    assert states_equal(before, cache.state())
    other = PagedCache(BlockPool(CFG.n_layers, 4, 4))
    with pytest.raises(CacheError, match=r"batch: expected 1 \(one sequence per PagedCache"):
        model(torch.tensor([tokens(2, 1)] * 2), other)
    stranger = PagedCache(pool)  # the same pool, read by a model with other head shapes
    wide = GPT(CFG.with_(n_kv_heads=4)).double().eval()
    with pytest.raises(CacheError, match=r"k: expected \(Hkv, D, dtype, device\) = \(2, 8, torch.float64"):
        wide(torch.tensor([tokens(2, 1)]), stranger)
    assert states_equal(before, cache.state())


# -- cells ----------------------------------------------------------------------------------------

def test_slot_search_starts_after_the_last_written_cell_and_wraps():
    pos = torch.tensor([-1, -1, 2, 3, 4, 5, -1, -1])
    assert find_slots(pos, head=6, t_new=3).tolist() == [6, 7, 0]
    assert find_slots(pos, head=0, t_new=3).tolist() == [0, 1, 6]
    assert find_slots(pos, head=6, t_new=5) is None


def test_slot_search_restarts_at_zero_far_ahead_of_the_cells_in_use():
    pos = torch.full((16,), -1)
    pos[10:12] = torch.tensor([0, 1])  # 2 cells in use, so a search of T restarts when head > 2 + 2 T
    assert find_slots(pos, head=8, t_new=3).tolist() == [8, 9, 12]  # 8 <= 8: from the head
    assert find_slots(pos, head=9, t_new=3).tolist() == [0, 1, 2]  # 9 > 8: from cell 0
    assert find_slots(pos, head=12, t_new=5).tolist() == [12, 13, 14, 15, 0]  # 12 <= 12: from the head


def test_cells_mask_reads_only_metadata():
    pos = torch.tensor([0, 1, 0, 2, -1])
    owners = torch.tensor([[1, 0], [1, 0], [0, 1], [1, 1], [0, 0]], dtype=torch.bool)
    mask = cells_mask(pos, owners, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert mask.tolist() == [[True, True, False, False, False], [False, False, True, True, False]]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 14), min_size=1, max_size=3), n_cells=st.integers(42, 48),
       steps=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4)), min_size=1, max_size=30),
       seed=st.integers(0, 1000))
def test_cells_hold_several_sequences_like_separate_caches(lengths, n_cells, steps, seed):
    model = MODELS[False]
    seqs = [tokens(n, seed + i) for i, n in enumerate(lengths)]
    cache, done, got = CellsCache(CFG.n_layers, n_cells, n_seqs=3), [0] * len(seqs), [[] for _ in seqs]
    schedule = list(steps) + [(s, 99) for s in range(len(seqs)) for _ in range(2)]  # then finish each one
    for i in range(0, len(schedule), 2):  # two (sequence, count) requests share one ubatch
        batch_seq, batch_ids = [], []
        for s, n in schedule[i : i + 2]:
            s %= len(seqs)
            if s in batch_seq:
                continue
            take = seqs[s][done[s] : done[s] + n]
            batch_seq += [s] * len(take)
            batch_ids += take
        if not batch_ids:
            continue
        cache.plan(batch_seq)
        logits = model(torch.tensor([batch_ids]), cache)[0]
        for s in set(batch_seq):
            rows = [j for j, x in enumerate(batch_seq) if x == s]
            got[s].append(logits[rows])
            done[s] += len(rows)
    for s, seq in enumerate(seqs):
        assert (torch.cat(got[s]) - full_logits(model, seq)).abs().max().item() <= TOL
    assert cache.length() == sum(lengths)


def test_cells_remove_fork_and_reuse():
    model = MODELS[False]
    cache = CellsCache(CFG.n_layers, 24, n_seqs=3)
    a, b, c = tokens(10, 1), tokens(6, 2), tokens(9, 3)
    cache.plan([0] * 10 + [1] * 6)
    model(torch.tensor([a + b]), cache)
    cache.seq_rm(1)  # sequence 1 is done: its 6 cells become empty, and the head moves back to the first
    assert cache.length() == 10 and cache.head == 10
    cache.seq_cp(0, 2, 0, 7)  # sequence 2 shares the first 7 positions of sequence 0, no copy
    assert int(cache.owners[:, 2].sum()) == 7
    cache.plan([2] * 9, list(range(7, 16)))  # and continues with its own tokens from position 7
    assert cache.find_slots(9).tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 18]  # from the head
    logits = model(torch.tensor([c]), cache)[0]
    assert (logits - full_logits(model, a[:7] + c)[7:]).abs().max().item() <= TOL
    assert sorted(cache.pos[cache.owners[:, 2]].tolist()) == list(range(16))
    cache.seq_rm(0, 5)  # crop sequence 0 back to 5 positions and continue differently
    cache.plan([0, 0])
    logits = model(torch.tensor([[3, 4]]), cache)[0]
    assert (logits - full_logits(model, a[:5] + [3, 4])[5:]).abs().max().item() <= TOL





def test_cells_head_follows_llama_cpp_after_removal_and_shift():
    cache = CellsCache(1, 12, n_seqs=2)
    kv = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    cache.plan([0] * 4 + [1] * 4)
    cache.feed(kv.expand(1, 1, 8, 2), kv.expand(1, 1, 8, 2))  # cells 0-3: sequence 0, cells 4-7: sequence 1
    assert cache.head == 8
    cache.seq_rm(0, 1, 3)  # frees cells 1 and 2, behind the head: the next search starts at cell 1
    assert cache.head == 1 and cache.pos.tolist()[:4] == [0, -1, -1, 3]
    cache.seq_rm(1, 3)  # frees cell 7, ahead of the head: the head stays
    assert cache.head == 1
    cache.seq_add(0, 3, None, -2)  # position 3 becomes 1; nothing is freed, so the head goes to cell 0
    assert cache.head == 0 and cache.pos.tolist()[:4] == [0, -1, -1, 1]
    cache.seq_add(1, 0, 2, -1)  # position 0 of sequence 1 (cell 4) falls below 0 and is freed
    assert cache.pos.tolist()[4:8] == [-1, 0, 2, -1] and cache.head == 4 and not cache.owners[4].any()


def test_cells_context_shift_keeps_n_keep_and_renumbers_the_rest():
    """llama.cpp's context shift on a learned-position model: seq_rm a block after n_keep, then seq_add
    the rest down; the kept cells hold their old keys, and new tokens continue at the shifted positions."""
    model = MODELS[False]
    cache = CellsCache(CFG.n_layers, 16, default_seq=0)
    seq = tokens(12, 5)
    run_chunks(model, cache, seq, [12])
    n_keep, n_discard = 3, 4
    cache.seq_rm(0, n_keep, n_keep + n_discard)
    cache.seq_add(0, n_keep + n_discard, None, -n_discard)
    assert sorted(cache.pos[cache.pos >= 0].tolist()) == list(range(12 - n_discard))
    assert cache.position == 12 - n_discard
    new = tokens(2, 6)
    got = run_chunks(model, cache, new, [2])  # continues at positions 8 and 9
    assert cache.position == 12 - n_discard + 2
    kept = seq[:n_keep] + seq[n_keep + n_discard :]
    assert (got - full_logits(model, kept + new)[-2:]).abs().max().item() > 1e-6  # not the shorter text's answer


def test_cells_reject_bad_input_before_any_change():
    model = MODELS[False]
    cache = CellsCache(CFG.n_layers, 8, n_seqs=2)
    cache.plan([0] * 6)
    model(torch.tensor([tokens(6, 0)]), cache)
    rejected(cache, lambda: cache.plan([0, 2]), CacheError,
            r"seq_ids: expected a non-empty list of ints in \[0, 2\), got \[0, 2\]")
    rejected(cache, lambda: cache.plan([0], [5]), CacheError,
            r"positions: expected for sequence 0, increasing positions after its last one \(5\), got \[5\]")
    rejected(cache, lambda: model(torch.tensor([[1]]), cache), CacheError,
            r"plan: expected plan\(seq_ids\) before each forward pass")
    cache.plan([1, 1, 1])
    rejected(cache, lambda: model(torch.tensor([[1, 2, 3]]), cache), CacheError,
            r"t_new: expected at most 2 tokens \(free cells\), got 3")
    cache.plan([1, 1])
    rejected(cache, lambda: model(torch.tensor([[1, 2, 3]]), cache), CacheError,
            r"plan: expected a plan for the 3 tokens of this pass, got 2")  # begin compares plan and chunk
    rejected(cache, lambda: cache.check((1, 2, 3, 8), torch.float64, torch.device("cpu")), CacheError,
            r"plan: expected a plan for the 3 tokens of this pass, got 2")
    rejected(cache, lambda: cache.seq_cp(1, 0), CacheError, r"dst: expected a sequence that holds no cells, got 0")
    rejected(cache, lambda: cache.seq_rm(5), CacheError, r"seq: expected an int in \[0, 2\), got 5")
    rejected(cache, lambda: cache.seq_rm(0, 4, 2), CacheError, r"p1: expected an int >= p0 = 4, got 2")
    rejected(cache, lambda: cache.seq_add(0, 2, None, 1.5), CacheError, r"delta: expected an int, got 1.5")
    rejected(cache, lambda: cache.seq_add(3, 2, None, -1), CacheError, r"seq: expected an int in \[0, 2\), got 3")
    cache.plan([0], [60])
    rejected(cache, lambda: model(torch.tensor([[1]]), cache), ValueError,
            r"positions: expected values in \[0, 48\), got min 60, max 60")


# -- unequal lengths in one batch ------------------------------------------------------------------

def test_scattered_mask_hides_other_rows_padding():
    mask = scattered_mask([2, 0], 2)[:, 0, 0]  # (B, T, S)
    assert mask.tolist() == [[[True, True, True, False], [True, True, True, True]],
                             [[True, False, False, False], [True, True, False, False]]]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rotary=st.booleans(), rows=st.integers(1, 3), seed=st.integers(0, 1000),
       schedule=st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=8),
       crops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3)), max_size=3))
def test_scattered_batch_equals_each_sequence_alone(rotary, rows, seed, schedule, crops):
    model = MODELS[rotary]
    cache = ScatteredCache(CFG.n_layers, rows, capacity=CFG.context_length)
    seqs, got = [[] for _ in range(rows)], [[] for _ in range(rows)]
    for step, counts in enumerate(schedule):
        chunks = [tokens(counts[r], seed + 10 * step + r) for r in range(rows)]
        if max(cache.lengths) + max(1, max(len(c) for c in chunks)) > CFG.context_length:
            break
        out = run_ragged(model, cache, chunks)
        for r in range(rows):
            seqs[r] += chunks[r]
            got[r].append(out[r])
        if step < len(crops):  # a rejected draft: roll one row back and forget its logits
            r, n = crops[step][0] % rows, min(crops[step][1], len(seqs[crops[step][0] % rows]))
            cache.crop(r, n)
            if n:
                seqs[r] = seqs[r][:-n]
                kept = torch.cat(got[r])[: len(seqs[r])]
                got[r] = [kept]
    for r in range(rows):
        assert cache.lengths[r] == len(seqs[r])
        if seqs[r]:
            assert (torch.cat(got[r]) - full_logits(model, seqs[r])).abs().max().item() <= TOL


def test_a_full_row_can_idle_while_others_continue():
    # Row 0 holds every position of the table; its padding must not ask for position 48.
    model = MODELS[False]
    cache = ScatteredCache(CFG.n_layers, 2, capacity=CFG.context_length + 8)
    full_row, other = tokens(CFG.context_length, 0), tokens(3, 1)
    run_ragged(model, cache, [full_row, other])
    assert cache.lengths == [CFG.context_length, 3]
    out = run_ragged(model, cache, [[], [5, 6]])
    assert out[0].shape[0] == 0
    assert (out[1] - full_logits(model, other + [5, 6])[3:]).abs().max().item() <= TOL


def test_scattered_rejects_bad_input_before_any_change():
    model = MODELS[False]
    cache = ScatteredCache(CFG.n_layers, 2, capacity=10)
    run_ragged(model, cache, [tokens(4, 0), tokens(2, 1)])
    rejected(cache, lambda: cache.plan([1]), CacheError, r"n_new: expected 2 ints >= 0, one per row, got \[1\]")
    rejected(cache, lambda: cache.plan([3, 1], 2), CacheError, r"t_new: expected an int >= max\(1, 3\), got 2")
    rejected(cache, lambda: run_ragged(model, cache, [tokens(7, 2), []]), CacheError,
            r"t_new: expected a chunk that fits the 6 free slots of the longest row, got 7")
    rejected(cache, lambda: run_ragged(model, cache, [[CFG.vocab_size], []]), ValueError,
            r"ids: expected values in \[0, 32\)")
    rejected(cache, lambda: run_ragged(model, cache, [[1], [2], [3]]), CacheError,
            r"chunks: expected 2 lists of token ids, got 3")
    rejected(cache, lambda: cache.crop(1, 3), CacheError, r"n_drop: expected an int in \[0, 2\], got 3")
    rejected(cache, lambda: model(torch.tensor([[1], [2], [3]]), cache), CacheError,
            r"batch: expected the cache's batch size 2 \(reset it for a new batch\), got 3")
    cache.plan([1, 1])
    rejected(cache, lambda: model(torch.tensor([[1, 2], [2, 3]]), cache), CacheError,
            r"plan: expected a plan for a chunk of 2 tokens, got 1")
    rejected(cache, lambda: run_ragged(model, cache, [[1], [2]]), CacheError,
            r"plan: expected no plan pending before planned_pass")


# -- quantised K/V ---------------------------------------------------------------------------------

def test_hadamard_is_orthonormal_and_symmetric():
    for n in (1, 2, 16, 64):
        h = hadamard(n)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-14)
        assert torch.equal(h, h.T)
    with pytest.raises(CacheError, match="n: expected a power of two, got 12"):
        hadamard(12)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(bits=st.integers(2, 8), group=st.sampled_from([None, 2, 4, 8]), seed=st.integers(0, 1000),
       scale=st.floats(1e-3, 1e3))
def test_quantize_rounds_to_within_half_a_step(bits, group, seed, scale):
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    codes, scales = quantize(x, bits, group)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 2 ** (bits - 1) - 1
    assert scales.shape == (3, 5, 8 // (group or 8))
    err = (dequantize(codes, scales, torch.float64) - x).abs()
    step = scales.repeat_interleave(group or 8, dim=-1).double()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()
    # ... and the step is the finest one that fits: each group's largest |x| is the top code 2^(bits-1) - 1
    g, qmax = group or 8, 2 ** (bits - 1) - 1
    xg, cg = x.reshape(3, 5, 8 // g, g), codes.reshape(3, 5, 8 // g, g)
    assert scales.dtype == torch.float32 and torch.equal(scales, xg.abs().amax(-1).float() / qmax)
    top = xg.abs().argmax(-1, keepdim=True)  # where each group's largest magnitude sits
    assert torch.equal(cg.gather(-1, top), (xg.gather(-1, top).sign() * qmax).to(torch.int8))


def test_rotation_shrinks_the_error_of_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 16, generator=g, dtype=torch.float64)
    k[:, 3] *= 30.0  # one outlier channel sets every token's scale
    plain = (fake_quantize(k, 8) - k).abs().max().item()
    rotated = (fake_quantize(k, 8, rotate=True) - k).abs().max().item()
    assert rotated < plain / 2


def test_quantized_cache_keeps_logits_close_and_stores_fewer_bytes():
    model = MODELS[False]
    seq = tokens(30, 4)
    ref = full_logits(model, seq)
    plain, concat = QuantizedCache(CFG.n_layers, bits=8), ConcatCache(CFG.n_layers)
    got = run_chunks(model, plain, seq, [10] + [1] * 20)
    run_chunks(model, concat, seq, [30])
    err = (got - ref).abs().max().item()
    assert 0 < err <= 0.02 * ref.abs().max().item()  # not exact, but close
    d = CFG.head_dim  # per token and head: D one-byte codes and one 4-byte scale, for K and V
    assert plain.nbytes == CFG.n_layers * 2 * CFG.n_kv_heads * 30 * (d + 4)
    assert plain.nbytes < concat.nbytes / 4


class FakeQuantizedCache(ConcatCache):
    """The reference for the quantised cache: a concatenating cache that stores fake-quantised K and V."""

    def __init__(self, n_layers: int, bits: int, group: int | None, rotate: bool) -> None:
        super().__init__(n_layers)
        self.bits, self.group, self.rotate = bits, group, rotate

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super()._append(layer, *(fake_quantize(x, self.bits, self.group, self.rotate) for x in (k, v)))


@pytest.mark.parametrize(("bits", "group", "rotate"), [(8, None, False), (4, 4, False), (3, None, True)])
def test_quantized_cache_gives_the_logits_of_a_cache_of_fake_quantized_values(bits, group, rotate):
    """Each token is quantised alone, so the cache's logits are those of the full-precision K and V replaced by
    what quantising and dequantising them gives (the bound above is loose: a cache of 3 bits meets it too)."""
    model, seq, sizes = MODELS[True], tokens(30, 5), [10] + [1] * 20
    got = run_chunks(model, QuantizedCache(CFG.n_layers, bits=bits, group_size=group, rotate=rotate), seq, sizes)
    ref = run_chunks(model, FakeQuantizedCache(CFG.n_layers, bits, group, rotate), seq, sizes)
    assert (got - ref).abs().max().item() <= TOL
    assert (got - full_logits(model, seq)).abs().max().item() > 0  # the reference is not the plain forward


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize(("group", "rotate"), [(None, False), (4, False), (None, True)])
def test_quantized_cache_packs_narrow_codes_without_losing_any(bits, group, rotate):
    """Codes of 2 and 4 bits are stored 8 / bits to a byte: the cache gives exactly the logits, the
    reads and, after a rollback and a reorder, the state of the same cache keeping one code a byte,
    and holds the bytes `quantized_kv_cache_bytes` counts (D / 2 + 4 per token and head in int4)."""
    model, seq = MODELS[False], tokens(30, 6)
    packed = QuantizedCache(CFG.n_layers, bits=bits, group_size=group, rotate=rotate)
    one_a_byte = QuantizedCache(CFG.n_layers, bits=bits, group_size=group, rotate=rotate)
    one_a_byte.packed = False  # the reference: every code in its own byte
    assert packed.packed == (bits in (2, 4))
    sizes = [10] + [1] * 20
    assert torch.equal(run_chunks(model, packed, seq, sizes), run_chunks(model, one_a_byte, seq, sizes))
    d, hkv, n = CFG.head_dim, CFG.n_kv_heads, CFG.n_layers
    assert packed.nbytes == quantized_kv_cache_bytes(n, 1, 30, hkv, d, group, bits)
    per_head = (d * bits // 8 if bits in (2, 4) else d) + 4 * (d // (group or d))  # codes, float32 scales
    assert packed.nbytes == 2 * n * 30 * hkv * per_head
    for cache in (packed, one_a_byte):
        cache.rollback(7)
        cache.reorder(torch.tensor([0, 0]))  # two copies of the one sequence, as a beam search makes
    more = torch.tensor([tokens(4, 7), tokens(4, 8)])
    assert torch.equal(model(more, packed), model(more, one_a_byte))
    for layer in range(n):
        assert all(torch.equal(a, b) for a, b in zip(packed.read(layer), one_a_byte.read(layer), strict=True))


def test_packed_codes_need_a_head_dim_they_fill():
    odd = GPT(CFG.with_(d_model=24, n_heads=4, n_kv_heads=2)).double().eval()  # D = 6
    fine = QuantizedCache(CFG.n_layers, bits=4)
    odd(torch.tensor([[1, 2]]), fine)  # int4: two codes to a byte, and 6 is even
    cache = QuantizedCache(CFG.n_layers, bits=2)
    rejected(cache, lambda: odd(torch.tensor([[1, 2]]), cache), CacheError,
             r"k, v: expected a head dim that is a multiple of 4 \(codes of 2 bits pack into bytes\), got 6")
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 4 for 2-bit codes, got 6"):
        quantized_kv_cache_bytes(1, 1, 1, 1, 6, bits=2)
    with pytest.raises(ValueError, match=r"bits: expected an int in \[2, 8\], got 1"):
        quantized_kv_cache_bytes(1, 1, 1, 1, 8, bits=1)


def test_key_outliers_leave_logits_unchanged_and_rotation_helps():
    model = MODELS[False]
    seq = tokens(30, 5)
    ref = full_logits(model, seq)
    skewed = with_key_outliers(model, 50.0, channel=2)
    assert (full_logits(skewed, seq) - ref).abs().max().item() <= 1e-10
    exact = ConcatCache(CFG.n_layers)
    run_chunks(skewed, exact, seq, [30])
    k, v = exact.k[1], exact.v[1]  # (1, Hkv, 30, D): the second layer's keys, with the outlier channel
    assert k[..., 2].abs().mean() > 10 * k[..., 3].abs().mean()
    errs = {}
    for rotate in (False, True):
        cache = QuantizedCache(CFG.n_layers, bits=8, rotate=rotate)
        k_back, _ = cache.feed(k, v)  # what attention reads from the cache
        errs[rotate] = (k_back - k).abs().max().item()
    assert errs[True] < errs[False] / 2


def test_key_outlier_ratio_by_hand():
    # head 0: every channel +-1 (RMS 1); head 1: channel 5 is 3, -3, 1, -1 over the positions (RMS sqrt(5),
    # mean |x| 2), the others +-1; a second sequence with a far larger outlier that must be ignored
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    keys = signs.view(1, 1, 4, 1).expand(2, 2, 4, 8).clone()
    keys[0, 1, :, 5] = torch.tensor([3.0, -3.0, 1.0, -1.0], dtype=torch.float64)
    keys[1, 0, :, 0] = 100.0
    assert key_outlier_ratio(keys) == pytest.approx(5**0.5, rel=1e-15)  # the largest head, over the median
    assert key_outlier_ratio(keys[:, :1]) == 1.0  # no channel stands out
    lower = keys[:1, 1:].clone()
    lower[0, 0, :, [4, 6, 7]] *= 2  # RMS 1, 1, 1, 1, 2, 2, 2, sqrt(5): the lower middle value is 1
    assert key_outlier_ratio(lower) == pytest.approx(5**0.5, rel=1e-15)
    for bad in (keys[0], keys[:, :, :0], keys.long(), [keys]):
        with pytest.raises(CacheError, match=r"keys: expected a float tensor \[B, Hkv, S, D\] with S >= 1"):
            key_outlier_ratio(bad)


def test_quantized_cache_rejects_bad_input_before_any_change():
    model = MODELS[False]
    with pytest.raises(CacheError, match=r"bits: expected an int in \[2, 8\], got 9"):
        QuantizedCache(2, bits=9)
    with pytest.raises(CacheError, match=r"group_size: expected None or a positive int, got 0"):
        QuantizedCache(2, group_size=0)
    cache = QuantizedCache(CFG.n_layers, group_size=3)
    before = cache.state()
    with pytest.raises(CacheError, match=r"group_size: expected None or a positive divisor of D=8, got 3"):
        model(torch.tensor([[1, 2]]), cache)
    assert states_equal(before, cache.state())
    odd = GPT(CFG.with_(d_model=24, n_heads=4, n_kv_heads=2)).double().eval()  # D = 6
    fresh = QuantizedCache(CFG.n_layers, rotate=True)
    rejected(fresh, lambda: odd(torch.tensor([[1, 2]]), fresh), CacheError,
            r"k: expected a head dim that is a power of two \(for the rotation\), got 6")
    cache = QuantizedCache(CFG.n_layers, rotate=True)
    run_chunks(model, cache, tokens(3, 0), [3])  # D = 8 first, then a model with D = 6
    rejected(cache, lambda: odd(torch.tensor([[1, 2]]), cache), CacheError,
            r"k, v: expected Hkv=2 heads of D=8, as cached, got \(1, 2, 2, 6\)")
    rejected(cache, lambda: make_model().float()(torch.tensor([[1]]), cache), CacheError,
            r"dtype: expected the cache's dtype torch.float64, got torch.float32")
    with pytest.raises(CacheError, match=r"factor: expected a non-zero number, got 0"):
        with_key_outliers(model, 0)
