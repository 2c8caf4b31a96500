"""Windows, said exactly (chapters 5 and 6).

A model with `sliding_window = W` lets each query see its last W keys, itself included: that
banded full forward is the reference. `SlidingWindowCache` keeps W - 1 past rows plus the chunk
and equals it under every chunk schedule, chunks longer than W included. The W-row `WindowCache`
(and `RingCache`) drop before the chunk attends: exact one token at a time after a prefill of at
most W, schedule-dependent once a chunk of several tokens makes them drop. `SinkCache` keeps the
first `n_keep` positions and the latest W.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import PROPERTY, TOL64, build, max_diff, property_configs, rejected, run_chunks
from hypothesis import given
from hypothesis import strategies as st

from labcode import GPT, GPTConfig, get_config
from labcode.caches import (
    CacheError,
    ConcatCache,
    GrowableCache,
    RingCache,
    SinkCache,
    SlidingWindowCache,
    WindowCache,
)
from labcode.caches.base import NoCache
from labcode.config import PRESETS
from labcode.generate import generate, generate_nocache, prefill

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CONFIGS = property_configs(context_length=28)


@functools.cache
def sliding_model(config: int, w: int) -> GPT:
    """Config `config` with sliding window W, float64, weights large enough that a wrong mask shows."""
    return build(CONFIGS[config].with_(sliding_window=w), seed=10 * config + w, scale=0.5)


def _ids(model: GPT, b: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.cfg.vocab_size, (b, n), generator=torch.Generator().manual_seed(seed))


def _schedule(draw, n: int, most: int) -> list[int]:
    """Chunk sizes covering n tokens, none larger than `most`."""
    sizes = []
    while sum(sizes) < n:
        sizes.append(draw(st.integers(1, min(most, n - sum(sizes)))))
    return sizes


def stays_banded(sizes: list[int], w: int) -> bool:
    """The W-row window's rule: exact unless a chunk of T > 1 arrives when the cache must drop to take it."""
    held = 0
    for t in sizes:
        if t > 1 and held + t > w:
            return False
        held = min(w, held + t)
    return True


# -- the config option and the banded full forward ------------------------------------------------

@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8"])
def test_sliding_window_is_validated(bad):
    with pytest.raises(ValueError, match=rf"^GPTConfig\.sliding_window: expected None or a positive int .*, "
                                         rf"got {repr(bad)}$"):
        GPTConfig(sliding_window=bad)


def test_presets_keep_full_attention():
    assert all(cfg.sliding_window is None for cfg in PRESETS.values())
    assert get_config("tiny", sliding_window=8).sliding_window == 8


@pytest.mark.parametrize("n_layers", [1, 2, 3])
@pytest.mark.parametrize("w", [1, 3, 5])
def test_a_token_reaches_exactly_the_positions_its_band_allows(n_layers, w):
    """Each layer lets a query see its last W keys, itself included, so a token at j reaches positions
    j .. j + L(W - 1) and no further."""
    cfg = GPTConfig(vocab_size=11, context_length=24, n_layers=n_layers, n_heads=2, d_model=8, sliding_window=w)
    model = build(cfg, seed=w, scale=0.5)
    ids = _ids(model, 1, 24, 0)
    j = 4
    changed = ids.clone()
    changed[0, j] = (ids[0, j] + 1) % cfg.vocab_size
    per_position = (model(ids) - model(changed)).abs().amax(-1)[0]  # (T,)
    reach = j + n_layers * (w - 1)
    assert torch.all(per_position[:j] == 0) and torch.all(per_position[reach + 1 :] == 0)
    assert torch.all(per_position[j : reach + 1] > 1e-9)


def test_a_window_of_the_whole_context_is_full_attention():
    full = build(CONFIGS[1], seed=1, scale=0.5)
    banded = GPT(CONFIGS[1].with_(sliding_window=CONFIGS[1].context_length)).double().eval()
    banded.load_state_dict(full.state_dict())
    ids = _ids(full, 2, 28, 1)
    assert torch.equal(banded(ids), full(ids))
    narrower = GPT(CONFIGS[1].with_(sliding_window=6)).double().eval()
    narrower.load_state_dict(full.state_dict())
    assert max_diff(narrower(ids), full(ids)) > 1e-3


def test_a_layer_on_its_own_is_banded_too():
    model = sliding_model(1, 4)
    attn, t = model.blocks[0].attn, 10
    x = torch.randn(2, t, model.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(t)
    cache = NoCache(1, 4)
    cache.begin((2, model.cfg.n_kv_heads, t, model.cfg.head_dim), torch.float64, "cpu")
    through_the_cache = attn(x, 0, positions, cache)
    cache.end()
    assert torch.equal(attn(x, 0, positions, None), through_the_cache)


# -- the sliding-window cache: exact under every schedule -----------------------------------------

@PROPERTY
@given(data=st.data())
def test_sliding_window_cache_equals_the_banded_forward_for_every_schedule(data):
    config = data.draw(st.integers(0, len(CONFIGS) - 1), label="config")
    w = data.draw(st.integers(1, 6), label="W")
    most = data.draw(st.integers(1, 12), label="max_chunk")  # up to twice the largest W: chunks longer than W
    model = sliding_model(config, w)
    b, n = data.draw(st.integers(1, 2), label="batch"), data.draw(st.integers(1, 28), label="tokens")
    sizes = _schedule(data.draw, n, most)
    ids = _ids(model, b, n, data.draw(st.integers(0, 2**16), label="seed"))
    cache = SlidingWindowCache(model.cfg.n_layers, w, max_chunk=most)
    out, start = [], 0
    for t in sizes:
        out.append(model(ids[:, start : start + t], cache))
        start += t
        assert cache.ptr == cache.length() == min(w - 1, start)  # what the next chunk's first query needs
    assert max_diff(torch.cat(out, 1), model(ids)) <= TOL64, (w, sizes)
    assert cache.total_dropped == max(0, n - (w - 1)) and cache.position == n


def test_chunks_longer_than_the_window_are_exact():
    model = sliding_model(0, 3)
    ids = _ids(model, 2, 28, 5)
    for sizes in ([7, 1, 9, 2, 9], [28], [3] * 9 + [1], [1] * 28):
        cache = SlidingWindowCache(model.cfg.n_layers, 3, max_chunk=max(sizes))
        assert max_diff(run_chunks(model, ids, cache, sizes), model(ids)) <= TOL64, sizes


def _kv(start: int, t: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K [1, 2, t, 1] = position + 100*head + 1000*layer (every value names its position), V = -K."""
    pos = torch.arange(start, start + t, dtype=torch.float64)
    k = torch.stack([pos + 100 * h + 1000 * layer for h in range(2)]).view(1, 2, t, 1)
    return k, -k


def _feed(cache, sizes: list[int], n_layers: int = 2):
    """One pass per chunk; yield (start, t, positions returned to layer 0, layer 0's mask, positions kept after)."""
    start = 0
    for t in sizes:
        cache.begin((1, 2, t, 1), torch.float64, "cpu")
        for layer in range(n_layers):
            k, v = _kv(start, t, layer)
            out_k, out_v = cache.append(layer, k, v)
            assert torch.equal(out_v, -out_k)
            if layer == 0:
                returned, mask = [int(x) for x in out_k[0, 0, :, 0].tolist()], cache.mask(layer, t)
        cache.end()
        kept = [int(x) for x in cache.read(0)[0][0, 0, :, 0].tolist()]
        yield start, t, returned, mask, kept
        start += t


def _seen(returned: list[int], mask: torch.Tensor | None, i: int) -> list[int]:
    """The positions query i of a chunk may attend to."""
    row = [True] * len(returned) if mask is None else mask[i].tolist()
    return [p for p, ok in zip(returned, row, strict=True) if ok]


@PROPERTY
@given(w=st.integers(1, 6), most=st.integers(1, 9), data=st.data())
def test_sliding_window_rows_and_mask(w, most, data):
    sizes = data.draw(st.lists(st.integers(1, most), min_size=1, max_size=10), label="chunks")
    cache = SlidingWindowCache(2, w, max_chunk=most)
    for start, t, returned, mask, kept in _feed(cache, sizes):
        end = start + t
        assert returned == list(range(max(0, start - (w - 1)), end))  # the W - 1 kept rows, then the chunk
        for i in range(t):  # query start + i sees exactly its last W positions, itself included
            assert _seen(returned, mask, i) == list(range(max(0, start + i - w + 1), start + i + 1))
        assert kept == list(range(max(0, end - (w - 1)), end))
        assert cache.k[0].shape[2] == w - 1 + most  # preallocated once: W - 1 + max_chunk slots


def test_a_failed_pass_leaves_the_sliding_window_cache_holding_what_it_held(monkeypatch):
    """It writes behind the kept rows and trims only when the pass ends, so a failure needs no reset
    (the W-row window shifts before it writes, and needs one)."""
    model = sliding_model(0, 4)
    ids = _ids(model, 1, 20, 3)
    cache, twin = SlidingWindowCache(2, 4, max_chunk=6), SlidingWindowCache(2, 4, max_chunk=6)
    for c in (cache, twin):
        run_chunks(model, ids, c, [5, 6])
    rows = [t.clone() for layer in range(2) for t in cache.read(layer)]
    before = (cache.position, cache.ptr, cache.total_dropped, rows)

    def broken(*args):
        raise RuntimeError("a failure inside the model, between two layers")

    monkeypatch.setattr(model.blocks[1], "forward", broken)
    with pytest.raises(RuntimeError, match="between two layers"):
        model(ids[:, 11:17], cache)
    monkeypatch.undo()
    after = (cache.position, cache.ptr, cache.total_dropped, [t for layer in range(2) for t in cache.read(layer)])
    assert before[:3] == after[:3] and all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))
    assert torch.equal(model(ids[:, 11:17], cache), model(ids[:, 11:17], twin))


def test_sliding_window_cache_refuses_bad_construction_and_long_chunks():
    for make, match in [(lambda: SlidingWindowCache(2, 0), r"window: expected a positive number of keys"),
                        (lambda: SlidingWindowCache(2, True), r"window: expected a positive number of keys"),
                        (lambda: SlidingWindowCache(2, 4, max_chunk=0), r"max_chunk: expected a positive number"),
                        (lambda: SlidingWindowCache(2, 4, max_chunk=2.0), r"max_chunk: expected a positive number")]:
        with pytest.raises(CacheError, match=match):
            make()
    model = sliding_model(0, 4)
    cache = SlidingWindowCache(2, 4, max_chunk=5)
    run_chunks(model, _ids(model, 1, 7, 0), cache, [5, 2])
    rejected(cache, lambda: model(_ids(model, 1, 6, 1), cache), CacheError,
             r"t_new: expected a chunk of at most 5 tokens \(the slots left after the W - 1 kept rows; prefill "
             r"longer prompts in chunks\), got 6")


def test_generate_through_the_sliding_window_cache_picks_the_reference_tokens():
    model = sliding_model(2, 3)
    ids = _ids(model, 2, 9, 4)
    ref = generate_nocache(model, ids, 25)
    out = generate(model, ids, 25, SlidingWindowCache(model.cfg.n_layers, 3))  # prefill in chunks of W
    assert torch.equal(out.ids, ref.ids) and out.stop_reason == ref.stop_reason == "context_length"
    assert max(max_diff(a, b) for a, b in zip(out.step_logits, ref.step_logits, strict=True)) <= TOL64


# -- the W-row window on a sliding-window model: one token at a time, or a schedule ---------------

@PROPERTY
@given(data=st.data())
def test_w_row_window_is_exact_one_token_at_a_time_after_a_prefill_of_at_most_w(data):
    config, w = data.draw(st.integers(0, len(CONFIGS) - 1), label="config"), data.draw(st.integers(1, 6), label="W")
    model = sliding_model(config, w)
    n = data.draw(st.integers(1, 28), label="tokens")
    p = data.draw(st.integers(1, min(w, n)), label="prefill")
    ids = _ids(model, data.draw(st.integers(1, 2), label="batch"), n, data.draw(st.integers(0, 2**16), label="seed"))
    ref = model(ids)
    for cache in (WindowCache(model.cfg.n_layers, w), RingCache(model.cfg.n_layers, w)):
        out = run_chunks(model, ids, cache, [p] + [1] * (n - p))
        assert max_diff(out, ref) <= TOL64, (type(cache).__name__, w, p)


@PROPERTY
@given(data=st.data())
def test_w_row_window_is_exact_exactly_when_no_chunk_makes_it_drop(data):
    config, w = data.draw(st.integers(0, len(CONFIGS) - 1), label="config"), data.draw(st.integers(2, 6), label="W")
    model = sliding_model(config, w)
    n = data.draw(st.integers(w + 1, 28), label="tokens")
    sizes = _schedule(data.draw, n, w)
    ids = _ids(model, 1, n, data.draw(st.integers(0, 2**16), label="seed"))
    diff = max_diff(run_chunks(model, ids, WindowCache(model.cfg.n_layers, w), sizes), model(ids))
    if stays_banded(sizes, w):
        assert diff <= TOL64, (w, sizes, diff)
    else:  # a chunk's first query saw fewer than W keys
        assert diff > 1e-6, (w, sizes, diff)


def test_default_prefill_in_chunks_of_w_is_the_worst_case():
    """prefill's chunk is the window's max_chunk, W: each chunk after the first drops the whole window,
    so its first query sees only itself."""
    model = sliding_model(1, 4)
    ids = _ids(model, 1, 20, 2)
    ref = model(ids)[:, -1]
    window, exact = WindowCache(2, 4), SlidingWindowCache(2, 4)
    by_prefill = prefill(model, ids, window)
    assert window.last_dropped == 4 and max_diff(by_prefill, ref) > 1e-3
    assert max_diff(prefill(model, ids, exact), ref) <= TOL64  # chunks of W too: exact


# -- a sliding-window model runs only through caches that apply its band -----------------------------

@pytest.mark.parametrize("make", [
    lambda m: ConcatCache(m.cfg.n_layers),
    lambda m: GrowableCache(m.cfg.n_layers, 4),
    lambda m: NoCache(m.cfg.n_layers),
    lambda m: WindowCache(m.cfg.n_layers, 3),
    lambda m: SlidingWindowCache(m.cfg.n_layers, 5),
    lambda m: SinkCache(m.cfg.n_layers, 4, 2),
], ids=["concat", "growable", "nocache", "window-3", "sliding-5", "sinks"])
def test_a_cache_that_ignores_the_band_is_refused(make):
    model = sliding_model(0, 4)
    cache = make(model)
    for call in (lambda: model(_ids(model, 1, 3, 0), cache), lambda: generate(model, _ids(model, 1, 3, 0), 2, cache),
                 lambda: prefill(model, _ids(model, 1, 3, 0), cache)):
        rejected(cache, call, CacheError, r"cache: expected a cache whose masks apply the model's sliding window "
                                          r"of 4 \(SlidingWindowCache, or a WindowCache or RingCache of 4\)")


def test_the_other_styles_are_refused_too():
    model = sliding_model(0, 4)
    with pytest.raises(CacheError, match=r"got PairsCache with attention_window None"):
        model(_ids(model, 1, 3, 0), None, return_cache=True)
    with pytest.raises(CacheError, match=r"got ModuleStateCache with attention_window None"):
        model(_ids(model, 1, 3, 0), use_cache=True)


# -- the sink cache ---------------------------------------------------------------------------------

@PROPERTY
@given(w=st.integers(1, 6), n_keep=st.integers(0, 4), data=st.data())
def test_sink_cache_keeps_the_first_n_keep_and_the_latest_w(w, n_keep, data):
    sizes = data.draw(st.lists(st.integers(1, w), min_size=1, max_size=12), label="chunks")
    cache, dropped = SinkCache(2, w, n_keep), 0
    for start, t, returned, mask, kept in _feed(cache, sizes):
        end = start + t
        sinks = list(range(min(n_keep, end)))
        expect = sinks + [p for p in range(max(n_keep, end - w), end)]
        assert kept == returned == expect
        held = min(start, n_keep + w)
        dropped += max(0, held + t - (n_keep + w))
        assert cache.total_dropped == dropped
        for i in range(t):  # every query sees the sinks and every kept position up to itself
            assert _seen(returned, mask, i) == [p for p in expect if p <= start + i]


def test_sink_cache_without_sinks_is_the_window_cache():
    model = build(CONFIGS[1], seed=2, scale=0.5)
    ids = _ids(model, 2, 28, 3)
    sinks, window = SinkCache(2, 5, 0), WindowCache(2, 5)
    assert torch.equal(run_chunks(model, ids, sinks, [3, 2, 5, 1, 4, 5, 5, 3]),
                       run_chunks(model, ids, window, [3, 2, 5, 1, 4, 5, 5, 3]))
    assert all(torch.equal(a, b) for a, b in zip(sinks.k + sinks.v, window.k + window.v, strict=True))
    assert sinks.rows_copied == window.rows_copied and sinks.total_dropped == window.total_dropped


def test_sink_cache_is_exact_until_it_drops_and_then_differs_from_the_plain_window():
    model = build(CONFIGS[0], seed=3, scale=0.5)
    ids = _ids(model, 1, 28, 4)
    full = model(ids)
    cache = SinkCache(2, 6, 3)
    out = run_chunks(model, ids, cache, [5, 4])  # 9 = n_keep + W positions: nothing dropped yet
    assert cache.total_dropped == 0 and max_diff(out, full[:, :9]) <= TOL64
    rest = torch.cat([model(ids[:, p : p + 1], cache) for p in range(9, 28)], 1)
    plain = WindowCache(2, 9)  # the same number of rows, all of them recent
    plain_rest = run_chunks(model, ids, plain, [5, 4] + [1] * 19)[:, 9:]
    assert cache.total_dropped == plain.total_dropped == 19
    assert max_diff(rest, full[:, 9:]) > 1e-3 and max_diff(rest, plain_rest) > 1e-3


def test_sink_cache_refuses_bad_construction_and_long_chunks():
    for make, match in [(lambda: SinkCache(2, 4, -1), r"n_keep: expected a number of first positions to keep, "
                                                      r"at least 0, got -1"),
                        (lambda: SinkCache(2, 4, True), r"n_keep: expected .*, got True"),
                        (lambda: SinkCache(2, 0, 2), r"window: expected a positive number of latest positions")]:
        with pytest.raises(CacheError, match=match):
            make()
    model = build(CONFIGS[0], seed=3, scale=0.5)
    cache = SinkCache(2, 4, 2)
    run_chunks(model, _ids(model, 1, 6, 0), cache, [4, 2])
    assert cache.window == cache.max_chunk == 4 and cache.capacity == 6
    rejected(cache, lambda: model(_ids(model, 1, 5, 1), cache), CacheError,
             r"t_new: expected a chunk of at most 4 tokens \(the window; prefill longer prompts in chunks\), got 5")
