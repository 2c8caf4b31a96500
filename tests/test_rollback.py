"""Rollback, one contract for every cache kind: `cache.rollback(n)` leaves the cache as if its last n positions
had never been written. Property tests drive random writes, rollbacks and forks and compare, after every step,
with a reference that never rolls back (the kept tokens recomputed without a cache); the other tests pin the
refusals and what each kind does with the storage it gives up."""

from __future__ import annotations

import pytest
import torch
from helpers import FACTORIES, ONE_ROW, TOL64, build, make_cache, property_configs, rejected
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode.caches import CacheError, ConcatCache, NoCache, RingCache, SinkCache, SlidingWindowCache, WindowCache
from labcode.caches.base import states_equal
from labcode.engines import BlockPool, CellsCache, PagedCache, QuantizedCache

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # defined in conftest.py

ROOM = 10  # positions each sequence holds at most: the window kinds never drop, so every rollback is allowed
MODELS = [build(cfg, i, scale=0.5) for i, cfg in enumerate(property_configs(context_length=24))]
KINDS = list(FACTORIES)
FORKLESS = {"naive"}  # its state lives in the one model: it cannot fork
FEW = settings(max_examples=25, deadline=None, derandomize=True)


def new_cache(kind: str, model, block_size: int = 3, batch: int = 1):
    """An empty cache of `kind` with room for ROOM positions; a paged pool with room for three sequences."""
    if kind == "paged":
        return PagedCache(BlockPool(model.cfg.n_layers, n_blocks=3 * -(-ROOM // block_size), block_size=block_size))
    return make_cache(kind, model, ROOM, batch)


def reference(kind: str, model, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Logits [B, N, V] of tokens [B, N] computed in one pass by a cache that was never rolled back, and that
    cache: the full forward for every exact kind, a fresh quantised cache for the quantised one (it rounds)."""
    cache = QuantizedCache(model.cfg.n_layers, bits=8) if kind == "quantized" else ConcatCache(model.cfg.n_layers)
    return model(tokens, cache), cache


def check_holds(kind: str, model, cache, tokens: torch.Tensor) -> None:
    """`cache` holds exactly the keys and values of tokens [B, N]: position, length and every layer's K, V."""
    n = tokens.shape[1]
    assert cache.position == n and cache.length() == n
    if not n:
        return
    _, ref = reference(kind, model, tokens)
    for layer in range(model.cfg.n_layers):
        for got, want in zip(cache.read(layer), ref.read(layer), strict=True):
            assert got.shape == want.shape, (kind, layer, got.shape, want.shape)
            assert (got - want).abs().max().item() <= TOL64


def check_pool(handles: list) -> None:
    """The paged pool's books balance: each block's count is the number of tables that list it, and the free
    list holds exactly the blocks nobody references."""
    pool = handles[0][0].pool
    counts = [0] * pool.n_blocks
    for cache, _ in handles:
        for block in cache.table:
            counts[block] += 1
    assert pool.refcount == counts
    assert sorted(pool.free_blocks) == [b for b in range(pool.n_blocks) if counts[b] == 0]


@st.composite
def programs(draw, forks: bool):
    """A model, a block size, a batch size, a seed for the token ids, and up to 7 steps: ("write", handle, T),
    ("back", handle, n) or ("fork", handle); handle indices are taken modulo the handles alive then."""
    steps = [("write", 0, draw(st.integers(1, 5)))]
    op = st.sampled_from(["write", "back", "fork"] if forks else ["write", "back"])
    for _ in range(draw(st.integers(1, 6))):
        steps.append((draw(op), draw(st.integers(0, 2)), draw(st.integers(1, 5))))
    batch = draw(st.integers(1, 2))
    return draw(st.integers(0, len(MODELS) - 1)), draw(st.integers(1, 4)), batch, draw(st.integers(0, 2**31 - 1)), steps


def run_program(kind: str, program) -> None:
    """Play `program` on caches of `kind`, checking every step against the never-rolled-back reference."""
    model_index, block_size, batch, seed, steps = program
    batch = 1 if kind in ONE_ROW else batch
    model, gen = MODELS[model_index], torch.Generator().manual_seed(seed)
    empty = torch.zeros(batch, 0, dtype=torch.long)
    handles = [(new_cache(kind, model, block_size, batch), empty)]  # (cache, the tokens [B, N] it should hold)
    for op, which, size in steps:
        i = which % len(handles)
        cache, tokens = handles[i]
        if op == "write":
            t = min(size, ROOM - tokens.shape[1])
            if t == 0:
                continue
            new = torch.randint(0, model.cfg.vocab_size, (batch, t), generator=gen)
            got = model(new, cache)
            tokens = torch.cat((tokens, new), dim=1)
            want = reference(kind, model, tokens)[0][:, -t:]
            assert (got - want).abs().max().item() <= TOL64, (kind, op, tokens)
        elif op == "back":
            n = min(size, tokens.shape[1])
            cache.rollback(n)
            tokens = tokens[:, : tokens.shape[1] - n]
            check_holds(kind, model, cache, tokens)
        elif len(handles) < 3:
            handles.append((cache.fork(), tokens.clone()))
        handles[i] = (cache, tokens)
        if kind == "paged":
            check_pool(handles)
    for cache, tokens in handles:  # every sequence, forks included, still holds its own tokens
        check_holds(kind, model, cache, tokens)
    if kind == "paged":
        for cache, _ in handles:
            cache.free()
        assert handles[0][0].pool.n_free == handles[0][0].pool.n_blocks  # no block leaked


@pytest.mark.parametrize("kind", KINDS)
@FEW
@given(data=st.data())
def test_writes_rollbacks_and_forks_equal_never_rolling_back(kind, data):
    run_program(kind, data.draw(programs(forks=kind not in FORKLESS), label="program"))


# -- refusals: checked first, nothing changed --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_bad_rollbacks_are_refused_and_change_nothing(kind):
    model = MODELS[1]
    cache = new_cache(kind, model)
    model(torch.tensor([[1, 2, 3, 4]]), cache)
    for bad in (5, -1, True, 1.0, "1", None):
        rejected(cache, lambda bad=bad: cache.rollback(bad), CacheError, r"n: expected an int in \[0, 4\], got")
    cache.begin((1, model.cfg.n_kv_heads, 1, model.cfg.head_dim), model.dtype, model.device)
    rejected(cache, lambda: cache.rollback(1), CacheError, r"cache: expected no pass in progress \(roll back")
    cache.cancel()
    before = cache.state()
    cache.rollback(0)  # nothing to remove: nothing changes
    assert states_equal(before, cache.state())


@pytest.mark.parametrize("make", [
    lambda L: WindowCache(L, 4), lambda L: RingCache(L, 4), lambda L: SinkCache(L, 2, n_keep=2),
    lambda L: SlidingWindowCache(L, 5)])
def test_a_window_that_dropped_cannot_roll_back(make):
    """Once a window dropped a position, rolling back would need it again: refused, however small n is."""
    model = MODELS[0]
    cache = make(model.cfg.n_layers)
    for token in range(4):
        model(torch.tensor([[token]]), cache)
    assert cache.rollback_limit() == 4 and cache.keeps == 4
    model(torch.tensor([[5]]), cache)
    assert cache.rollback_limit() == 0
    rejected(cache, lambda: cache.rollback(1), CacheError,
             r"n: expected an int in \[0, 0\] \(it keeps 4 positions and dropped older ones")
    cache.rollback(0)


def test_nocache_holds_nothing_to_roll_back():
    cache = NoCache(2)
    rejected(cache, lambda: cache.rollback(1), CacheError, r"n: expected an int in \[0, 0\], got 1")


# -- what each kind does with what it gives up -------------------------------------------------------


def test_ring_rollback_leaves_stale_keys_that_the_mask_never_reads():
    """The freed slots still hold the rolled-back keys; the slot table marks them empty, so the next pass's
    mask hides them, and even keys overwritten with huge values there change no logit."""
    model = MODELS[2]
    ids = torch.randint(0, 11, (1, 9), generator=torch.Generator().manual_seed(3))
    ring = RingCache(model.cfg.n_layers, 8)
    model(ids[:, :6], ring)
    rolled_back = [ring.k[layer][:, :, 3:6].clone() for layer in range(model.cfg.n_layers)]
    ring.rollback(3)
    assert ring.slot_pos.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    for layer in range(model.cfg.n_layers):  # stale: the keys of positions 3..5 are still in slots 3..5
        assert torch.equal(ring.k[layer][:, :, 3:6], rolled_back[layer])
        ring.k[layer][:, :, 4:].fill_(1e6)  # and whatever a stale slot holds, nothing reads it
        ring.v[layer][:, :, 4:].fill_(-1e6)
    ring.begin((1, model.cfg.n_kv_heads, 1, model.cfg.head_dim), model.dtype, model.device)
    assert ring.chunk.mask.tolist() == [[True] * 4 + [False] * 4]  # position 3 sees slots 0..3 only
    ring.cancel()
    got = model(ids[:, 6:7], ring)
    want = model(torch.cat((ids[:, :3], ids[:, 6:7]), dim=1))[:, -1:]
    assert (got - want).abs().max().item() <= TOL64


def test_paged_rollback_frees_blocks_and_keeps_forks_intact():
    model = MODELS[0]
    pool = BlockPool(model.cfg.n_layers, n_blocks=8, block_size=2)
    a = PagedCache(pool)
    model(torch.tensor([[1, 2, 3, 4, 5]]), a)  # blocks 0, 1, 2 (the last one half full)
    b = a.fork()
    assert pool.refcount[:3] == [2, 2, 2]
    b.rollback(3)  # b keeps positions 0, 1: block 0; blocks 1 and 2 lose b's reference
    assert b.table == [0] and pool.refcount[:3] == [2, 1, 1] and pool.n_free == 5
    a.rollback(4)  # a keeps position 0 of the shared block 0: the next write copies it first
    assert a.table == [0] and pool.refcount[:3] == [2, 0, 0] and pool.n_free == 7
    got = model(torch.tensor([[9]]), a)
    assert pool.copies == 1 and a.table != b.table
    assert (got - model(torch.tensor([[1, 9]]))[:, -1:]).abs().max().item() <= TOL64
    check_holds("paged", model, b, torch.tensor([[1, 2]]))
    a.free()
    b.free()
    assert pool.n_free == 8 and pool.refcount == [0] * 8


def test_paged_rollback_into_a_cached_block_forgets_its_hash():
    """A full block found by its tokens' hash, cut by a rollback and rewritten, must not be found again."""
    model = MODELS[0]
    pool = BlockPool(model.cfg.n_layers, n_blocks=6, block_size=2)
    a = PagedCache(pool)
    model(torch.tensor([[1, 2, 3, 4]]), a)
    assert a.cache_full_blocks([1, 2, 3, 4]) == 2
    a.rollback(1)  # block 1 now holds only token 3, and token 4's slot is written again next
    model(torch.tensor([[7]]), a)
    assert a.table[1] not in pool.hash_of and len(pool.cached) == 1
    fresh = PagedCache(pool)
    assert fresh.reuse_prefix([1, 2, 3, 4, 0]) == 2  # only block 0 (tokens 1, 2) is found again


def test_paged_crop_is_rollback_under_its_chapter_9_name():
    model = MODELS[0]
    a, b = (PagedCache(BlockPool(model.cfg.n_layers, n_blocks=4, block_size=2)) for _ in range(2))
    for cache in (a, b):
        model(torch.tensor([[1, 2, 3]]), cache)
    a.crop(2)
    b.rollback(2)
    assert states_equal(a.state(), b.state())
    rejected(a, lambda: a.crop(2), CacheError, r"n_drop: expected an int in \[0, 1\], got 2")


def test_cells_rollback_removes_one_sequence_and_keeps_shared_cells():
    model = MODELS[0]
    cells = CellsCache(model.cfg.n_layers, 8, n_seqs=2, default_seq=0)
    model(torch.tensor([[1, 2, 3, 4]]), cells)
    cells.seq_cp(0, 1)  # sequence 1 shares all four cells
    cells.rollback(2)  # sequence 0 gives up positions 2, 3; sequence 1 still owns them
    assert cells.rollback_limit() == 2 and cells.rollback_limit(1) == 4 and cells.room() == 4
    cells.rollback(3, seq=1)  # positions 2, 3 have no owner left; sequence 0 still owns position 1
    assert cells.pos.tolist()[:4] == [0, 1, -1, -1] and cells.owners[:, 1].tolist()[:4] == [True, False, False, False]
    got = model(torch.tensor([[8]]), cells)
    assert (got - model(torch.tensor([[1, 2, 8]]))[:, -1:]).abs().max().item() <= TOL64
    rejected(cells, lambda: cells.rollback(4), CacheError, r"n: expected an int in \[0, 3\], got 4")
    rejected(cells, lambda: cells.rollback(1, seq=2), CacheError, r"seq: expected an int in \[0, 2\)")


def test_scattered_rollback_shortens_every_row():
    from labcode.engines import ScatteredCache, run_ragged

    model = MODELS[0]
    cache = ScatteredCache(model.cfg.n_layers, 2, 8)
    run_ragged(model, cache, [[1, 2, 3, 4], [5, 6]])
    rejected(cache, lambda: cache.rollback(3), CacheError, r"n: expected an int in \[0, 2\], got 3")
    cache.rollback(2)
    assert cache.lengths == [2, 0]
    rows = run_ragged(model, cache, [[9], [9]])
    for row, seq in zip(rows, ([1, 2, 9], [9]), strict=True):
        assert (row - model(torch.tensor([seq]))[0, -1:]).abs().max().item() <= TOL64


# -- a sliding window that keeps a reserve can roll back after it trims --------------------------------

SLIDING = build(property_configs(context_length=40)[1].with_(sliding_window=4), 5, scale=0.5)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=8),
       reserve=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_a_sliding_window_with_a_reserve_rolls_back_after_trimming(steps, reserve, seed):
    """A sliding-window model (W = 4) on a cache that keeps `reserve` rows more than W - 1: after any writes it
    rolls back up to the reserve, and every later chunk equals the banded full forward of the kept tokens."""
    model, gen = SLIDING, torch.Generator().manual_seed(seed)
    cache = SlidingWindowCache(model.cfg.n_layers, 4, reserve=reserve)
    tokens = torch.zeros(1, 0, dtype=torch.long)
    for t, back in steps:
        t = min(t, 40 - tokens.shape[1])
        if t:  # after a write of t tokens, at least min(t, reserve) can be rolled back: what a verify pass needs
            new = torch.randint(0, 11, (1, t), generator=gen)
            got = model(new, cache)
            tokens = torch.cat((tokens, new), dim=1)
            assert (got - model(tokens)[:, -t:]).abs().max().item() <= TOL64
        limit = cache.rollback_limit()
        assert limit == (tokens.shape[1] if cache.total_dropped == 0 else cache.length() - 3)
        assert limit >= min(reserve, t)
        n = min(back, limit)
        if back > limit:
            rejected(cache, lambda back=back: cache.rollback(back), CacheError, r"n: expected an int in \[0, ")
        cache.rollback(n)
        tokens = tokens[:, : tokens.shape[1] - n]
        assert cache.position == tokens.shape[1]
