"""The cache contract itself: one check per pass, a refused pass changes nothing, forks own what they write.

Every cache kind is driven through the same contract (begin, append and mask per layer, end),
so these tests run over every kind. The fork properties follow what a reader relies on: fork a
cache after it has dropped or wrapped, continue the two copies differently, and each must be
exactly an unforked cache fed the same tokens in the same chunks.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, FACTORIES, ONE_ROW, TOL64, build, make_cache, max_diff, rejected, run_chunks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labcode import GPTConfig
from labcode.caches import CacheError, KVCache, RingCache, WindowCache
from labcode.caches.base import states_equal

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=40, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
MODELS = {"learned": build(CFG, seed=3, scale=0.5), "rotary": build(CFG.with_(rotary=True), seed=4, scale=0.5)}
FORKABLE = [k for k in FACTORIES if k != "naive"]  # the naive state lives in the one model: it cannot be forked
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _room(kind: str) -> int:
    """Small windows, so that forks happen after drops and wrap-arounds; room for everything otherwise."""
    return 5 if kind in ("window", "ring", "sliding", "sinks") else CFG.context_length


def _chunks(draw, n: int, most: int) -> list[int]:
    """A chunk schedule covering n tokens, no chunk larger than `most`."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(draw(st.integers(1, min(most, n - sum(sizes)))))
    return sizes


def _reads(cache: KVCache) -> list[torch.Tensor]:
    return [t for layer in range(cache.n_layers) for t in cache.read(layer)]


def _counters(cache: KVCache) -> tuple:
    return (cache.position, getattr(cache, "last_dropped", None), getattr(cache, "total_dropped", None))


# -- the contract --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", FACTORIES)
def test_validation_runs_once_per_pass(kind, monkeypatch):
    model = MODELS["learned"]
    cache = make_cache(kind, model)
    run_chunks(model, _ids(6, 0), cache, [4])
    calls = []
    original = type(cache)._check
    monkeypatch.setattr(type(cache), "_check", lambda self, chunk: calls.append(chunk.t_new) or original(self, chunk))
    run_chunks(model, _ids(6, 1), cache, [1, 1])  # two decode steps through L = 2 layers
    assert calls == [1, 1]  # once per pass, never per layer


@pytest.mark.parametrize("kind", FACTORIES)
def test_begin_writes_nothing_and_cancel_closes_the_pass(kind):
    model = MODELS["learned"]
    twin = None if kind == "naive" else make_cache(kind, model)  # the naive state lives in the model: one only
    cache = make_cache(kind, model)
    for c in (cache, twin) if twin else (cache,):
        run_chunks(model, _ids(7, 0), c, [3, 4])
    before = cache.state()
    placed = cache.begin((1, CFG.n_kv_heads, 2, CFG.head_dim), model.dtype, model.device)
    assert placed is None or tuple(placed.shape) in ((2,), (1, 2))
    assert cache.chunk is not None and cache.chunk.start == cache.position == 7
    cache.cancel()
    assert states_equal(before, cache.state())
    out = model(_ids(9, 0)[:, 7:], cache)  # the cache goes on as if the pass had never begun
    ref = model(_ids(9, 0))[:, 7:] if twin is None else model(_ids(9, 0)[:, 7:], twin)
    assert max_diff(out, ref) <= TOL64 if twin is None else torch.equal(out, ref)


@pytest.mark.parametrize("kind", FACTORIES)
def test_a_pass_refused_by_the_model_after_begin_changes_nothing(kind):
    model = MODELS["learned"]
    cache = make_cache(kind, model, 60)  # room to spare: the position table is what refuses
    run_chunks(model, _ids(36, 0), cache, [4] * 9)
    rejected(cache, lambda: model(_ids(5, 1), cache), ValueError,  # positions 36..40: past the table of 40
             r"positions: expected (start \+ T <= context_length 40|values in \[0, 40\))")
    assert cache.chunk is None


@pytest.mark.parametrize("kind", ["concat", "window", "ring", "paged", "cells"])
def test_a_pass_that_fails_between_layers_commits_nothing(kind, monkeypatch):
    model = MODELS["learned"]
    cache = make_cache(kind, model)
    run_chunks(model, _ids(6, 0), cache, [6])
    committed = _counters(cache), cache.layout

    def broken(*args):
        raise RuntimeError("a failure inside the model, between two layers")

    monkeypatch.setattr(model.blocks[1], "forward", broken)
    with pytest.raises(RuntimeError, match="between two layers"):
        model(_ids(8, 0)[:, 6:], cache)
    assert cache.chunk is None and (_counters(cache), cache.layout) == committed
    monkeypatch.undo()
    cache.reset()  # the contract's advice after such a failure: a fresh cache computes the full forward again
    assert max_diff(run_chunks(model, _ids(8, 0), cache, [5, 3]), model(_ids(8, 0))) <= TOL64


def test_feed_is_one_pass_through_every_layer():
    cache = WindowCache(3, 4)
    k = torch.arange(6.0, dtype=torch.float64).view(1, 1, 6, 1)
    with pytest.raises(CacheError, match=r"t_new: expected a chunk of at most 4 tokens"):
        cache.feed(k, k)
    assert cache.chunk is None and cache.position == 0
    out, _ = cache.feed(k[:, :, :3], k[:, :, :3])
    assert out.flatten().tolist() == [0.0, 1.0, 2.0] and cache.position == 3 and cache.ptr == 3


def test_the_naive_cache_cannot_be_forked():
    cache = make_cache("naive", MODELS["learned"])
    with pytest.raises(CacheError, match=r"fork: expected a cache object"):
        cache.fork()


def test_a_fork_is_refused_during_a_pass():
    cache = make_cache("concat", MODELS["learned"])
    cache.begin((1, CFG.n_kv_heads, 1, CFG.head_dim), torch.float64, "cpu")
    rejected(cache, cache.fork, CacheError,
             r"cache: expected no pass in progress \(forks are made between passes\), got a pass begun at position 0")


# -- forks own everything they write ---------------------------------------------------------------

@pytest.mark.parametrize("kind", FORKABLE)
@SETTINGS
@given(data=st.data())
def test_a_fork_after_drops_and_wraps_equals_a_cache_that_never_forked(kind, data):
    model = MODELS[data.draw(st.sampled_from(sorted(MODELS)), label="model")]
    room, most = _room(kind), min(_room(kind), 6)
    prefix = data.draw(st.integers(1, 14), label="prefix")  # past the window of 5: forks after drops and wraps
    extra_a, extra_b = data.draw(st.integers(1, 10), label="a"), data.draw(st.integers(1, 10), label="b")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    base, tail_a, tail_b = _ids(prefix, seed), _ids(extra_a, seed + 1), _ids(extra_b, seed + 2)
    sched = [_chunks(data.draw, n, most) for n in (prefix, extra_a, extra_b)]
    a = make_cache(kind, model, room)
    run_chunks(model, base, a, sched[0])
    b = a.fork()
    # interleaved: part of a, all of b, the rest of a, so that the original is read again after the fork wrote
    half = len(sched[1]) // 2
    out_a1 = run_chunks(model, tail_a, a, sched[1][:half]) if half else None
    out_b = run_chunks(model, tail_b, b, sched[2])
    out_a2 = run_chunks(model, tail_a[:, sum(sched[1][:half]):], a, sched[1][half:])
    out_a = out_a2 if out_a1 is None else torch.cat((out_a1, out_a2), 1)
    for cache, tail, sizes, out in ((a, tail_a, sched[1], out_a), (b, tail_b, sched[2], out_b)):
        alone = make_cache(kind, model, room)  # the same tokens in the same chunks, never forked
        ref = run_chunks(model, torch.cat((base, tail), 1), alone, sched[0] + sizes)[:, prefix:]
        assert max_diff(out, ref) <= TOL64, kind
        assert _counters(cache) == _counters(alone)
        assert all(torch.equal(x, y) for x, y in zip(_reads(cache), _reads(alone), strict=True)), kind


# -- the ring and the window hold the same positions -----------------------------------------------

@SETTINGS
@given(w=st.integers(2, 7), data=st.data())
def test_ring_and_window_agree_at_every_step_whatever_the_window(w, data):
    model = MODELS[data.draw(st.sampled_from(sorted(MODELS)), label="model")]
    n = data.draw(st.integers(1, 30).filter(lambda n: n % w), label="tokens")  # never a multiple of the window
    sizes = _chunks(data.draw, n, w)
    ids = _ids(n, data.draw(st.integers(0, 2**16), label="seed"))
    ring, window, start = RingCache(CFG.n_layers, w), WindowCache(CFG.n_layers, w), 0
    for t in sizes:
        a, b = model(ids[:, start : start + t], ring), model(ids[:, start : start + t], window)
        start += t
        assert max_diff(a, b) <= TOL64, (w, sizes, start)
        assert (ring.position, ring.ptr, ring.total_dropped) == (window.position, window.ptr, window.total_dropped)
        assert torch.equal(ring.read(0)[0], window.read(0)[0])  # layer 0: the same projections of the same tokens
        assert max_diff(ring.read(1)[0], window.read(1)[0]) <= TOL64  # deeper: attention summed in another order
    assert start % w and ring.total_dropped == max(0, n - w)


# -- room: how many more positions a cache can take -------------------------------------------------

@pytest.mark.parametrize("kind", sorted(ONE_ROW | {"scattered"}))
@settings(max_examples=15, deadline=None, derandomize=True)
@given(filled=st.integers(0, 20), forked=st.booleans())
def test_room_is_exact(kind, filled, forked):
    model = MODELS["learned"]
    cache = make_cache(kind, model, 24)
    if filled:
        run_chunks(model, _ids(filled, 0), cache, [filled])
    if forked and kind == "paged":
        cache.fork()  # the blocks are now shared: writing into the last one needs a copy first
    room = cache.room()
    assert room is not None and room >= 0
    k = torch.zeros(1, CFG.n_kv_heads, room + 1, CFG.head_dim, dtype=torch.float64)
    rejected(cache, lambda: cache.feed(k, k), CacheError, r"t_new: expected")
    if room:
        cache.feed(k[:, :, :room], k[:, :, :room])
        assert cache.room() == 0


@pytest.mark.parametrize("kind", [k for k in EXACT if k not in ONE_ROW | {"scattered"}])
def test_caches_with_no_limit_of_their_own_say_so(kind):
    assert make_cache(kind, MODELS["learned"], 5).room() is None
