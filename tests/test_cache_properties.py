"""Property tests: for every prompt length and chunk schedule hypothesis finds, every cache
gives the full forward's logits (float64: max |diff| <= 1e-12; float32: <= 1e-5 on these small
models, whose float32 differences measure about 1e-6), and the cached generation loops pick the
same tokens as the no-cache reference."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PROPERTY, build, property_configs
from hypothesis import given
from hypothesis import strategies as st

from labcode import GPT, GPTConfig
from labcode.caches import ConcatCache, GrowableCache, ModuleStateCache, PairsCache, Request, RingCache, WindowCache
from labcode.generate import generate, generate_nocache

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
CONFIGS = property_configs(context_length=20)


def _build(cfg: GPTConfig, seed: int) -> dict:
    """The same weights in float64 and float32 (larger than the init, so that a wrong mask or offset shows)."""
    m = build(cfg, seed, scale=0.5)
    return {torch.float64: m, torch.float32: copy.deepcopy(m).float()}


MODELS = [_build(c, i) for i, c in enumerate(CONFIGS)]

KINDS = ["concat", "pairs", "explicit", "naive", "window", "ring", "growable-linear", "growable-double"]


pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py


@st.composite
def schedules(draw, max_len: int = 16):
    """(batch, prompt length P, chunk sizes summing to P, ids seed): at most five chunks."""
    p = draw(st.integers(1, max_len))
    cuts = sorted(draw(st.sets(st.integers(1, p - 1), max_size=min(4, p - 1)))) if p > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, p], strict=True)]
    return draw(st.integers(1, 3)), p, sizes, draw(st.integers(0, 2**31 - 1))


def make_cache(kind: str, n_layers: int, room: int, data) -> object:
    """A cache object of `kind` with room for `room` positions without dropping any."""
    if kind == "concat":
        return ConcatCache(n_layers)
    if kind == "pairs":
        return PairsCache(n_layers)
    if kind in ("window", "ring"):
        w = data.draw(st.integers(room, room + 4), label="window")
        return WindowCache(n_layers, w) if kind == "window" else RingCache(n_layers, w)
    capacity = data.draw(st.integers(1, 8), label="capacity")
    if kind == "growable-linear":
        return GrowableCache(n_layers, capacity, grow_by=data.draw(st.none() | st.integers(1, 5), label="grow_by"))
    return GrowableCache(n_layers, capacity, policy="double")


def run_schedule(model: GPT, ids: torch.Tensor, kind: str, sizes: list[int], data) -> torch.Tensor:
    """Logits [B, P, V] of ids run chunk by chunk through one request held in `kind`'s style."""
    if kind in ("naive", "explicit"):
        request = Request(model, kind)
    else:
        request = Request(model, "object", make_cache(kind, model.cfg.n_layers, ids.shape[1], data))
    return torch.cat([request(c) for c in torch.split(ids, sizes, dim=1)], dim=1)


def _equivalence(dtype: torch.dtype, case, data) -> None:
    b, p, sizes, seed = case
    models = MODELS[data.draw(st.integers(0, len(MODELS) - 1), label="model")]
    model = models[dtype]
    ids = torch.randint(0, model.cfg.vocab_size, (b, p), generator=torch.Generator().manual_seed(seed))
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=3, max_size=3, unique=True), label="kinds")
    with torch.no_grad():
        full = model(ids)
        for kind in kinds:  # three of the eight per example: each is drawn in about 75 of the 200
            out = run_schedule(model, ids, kind, sizes, data)
            diff = (out - full).abs().max().item()
            assert diff <= TOL[dtype], (kind, sizes, diff)
            assert torch.equal(out.argmax(-1), full.argmax(-1)) or dtype == torch.float32, kind


@PROPERTY
@given(case=schedules(), data=st.data())
def test_every_cache_equals_the_full_forward_float64(case, data):
    _equivalence(torch.float64, case, data)


@PROPERTY
@given(case=schedules(), data=st.data())
def test_every_cache_equals_the_full_forward_float32(case, data):
    _equivalence(torch.float32, case, data)


def _gen_cache(kind: str, model: GPT, room: int, data):
    if kind == "naive":
        model.reset_kv_cache()
        return ModuleStateCache(model)
    if kind == "explicit":
        kind = "pairs"  # the explicit API, held by the loop in a PairsCache
    return make_cache(kind, model.cfg.n_layers, room, data)


@PROPERTY
@given(b=st.integers(1, 3), p=st.integers(1, 12), n=st.integers(0, 14), seed=st.integers(0, 2**31 - 1),
       kind=st.sampled_from(KINDS), sampled=st.booleans(), data=st.data())
def test_cached_generation_picks_the_reference_tokens(b, p, n, seed, kind, sampled, data):
    model = MODELS[data.draw(st.integers(0, len(MODELS) - 1), label="model")][torch.float64]
    ids = torch.randint(0, model.cfg.vocab_size, (b, p), generator=torch.Generator().manual_seed(seed))
    opts = {}
    if sampled:
        opts = {"temperature": data.draw(st.floats(0.3, 2.0), label="temperature"),
                "top_k": data.draw(st.none() | st.integers(1, model.cfg.vocab_size), label="top_k"),
                "top_p": data.draw(st.none() | st.floats(0.05, 1.0), label="top_p")}
    room = min(model.cfg.context_length, p + n)
    cache = _gen_cache(kind, model, room, data)
    limit = getattr(cache, "max_chunk", None) or p
    chunk = data.draw(st.none() | st.integers(1, min(p, limit)), label="chunk_size")
    ref = generate_nocache(model, ids, n, generator=torch.Generator().manual_seed(seed), **opts)
    out = generate(model, ids, n, cache, chunk_size=chunk, generator=torch.Generator().manual_seed(seed), **opts)
    assert torch.equal(out.ids, ref.ids), kind
    assert torch.equal(out.ids[:, :p], ids)  # the prompt is preserved
    assert (out.new_tokens, out.stop_reason) == (ref.new_tokens, ref.stop_reason)
    for a, r in zip(out.step_logits, ref.step_logits, strict=True):
        assert (a - r).abs().max().item() <= TOL[torch.float64]


@PROPERTY
@given(pa=st.integers(1, 10), pb=st.integers(1, 10), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_naive_cache_forgotten_reset_contaminates_and_reset_isolates(pa, pb, seed, data):
    model = MODELS[data.draw(st.integers(0, len(MODELS) - 1), label="model")][torch.float64]
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(0, model.cfg.vocab_size, (1, pa), generator=gen)
    b = torch.randint(0, model.cfg.vocab_size, (1, pb), generator=gen)
    with torch.no_grad():
        reference = model(b)
        model.reset_kv_cache()
        model(a, use_cache=True)
        contaminated = model(b, use_cache=True)  # the reset before request b was forgotten
        model.reset_kv_cache()
        isolated = model(b, use_cache=True)
    assert (isolated - reference).abs().max().item() <= TOL[torch.float64]
    assert (contaminated - reference).abs().max().item() > 1e-6
    assert model.current_pos == pb


# -- storage, fed with K/V directly: D = 1 and every value names its position ----------------

def _kv(start: int, t: int, layer: int, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """K [1, heads, t, 1] = position + 100*head + 1000*layer, V = -K."""
    pos = torch.arange(start, start + t, dtype=torch.float64)
    k = torch.stack([pos + 100 * h + 1000 * layer for h in range(heads)]).view(1, heads, t, 1)
    return k, -k


def _feed(cache, sizes: list[int], n_layers: int = 2, heads: int = 2):
    """One pass per chunk of positions; yield (start, t, returned K per layer, mask per layer)."""
    start = 0
    for t in sizes:
        ks, masks = [], []
        cache.begin((1, heads, t, 1), torch.float64, "cpu")
        for layer in range(n_layers):
            k, v = _kv(start, t, layer, heads)
            ks.append(cache.append(layer, k, v)[0])
            masks.append(cache.mask(layer, t))
        cache.end()
        yield start, t, ks, masks
        start += t


def _positions(k: torch.Tensor, layer: int) -> list[int]:
    return [int(x) - 1000 * layer for x in k[0, 0, :, 0].tolist()]


@PROPERTY
@given(w=st.integers(1, 6), heads=st.integers(1, 2), data=st.data())
def test_window_shift_keeps_exactly_the_latest_positions(w, heads, data):
    sizes = data.draw(st.lists(st.integers(1, w), min_size=1, max_size=12), label="chunks")
    cache, dropped = WindowCache(2, w), 0
    for start, t, ks, masks in _feed(cache, sizes, heads=heads):
        end = start + t
        kept = list(range(max(0, end - w), end))
        expect_drop = max(0, min(start, w) + t - w)
        dropped += expect_drop
        assert cache.last_dropped == expect_drop and cache.total_dropped == dropped
        for layer in range(2):
            assert _positions(ks[layer], layer) == kept
            buf = cache.k[layer][0, :, :, 0]  # (Hkv, W): the buffer, element by element
            for h in range(heads):
                assert buf[h, : len(kept)].tolist() == [p + 100 * h + 1000 * layer for p in kept]
            assert torch.equal(cache.v[layer][:, :, : len(kept)], -cache.k[layer][:, :, : len(kept)])
            mask = torch.ones(1, len(kept), dtype=torch.bool) if masks[layer] is None else masks[layer]
            for i in range(t):  # query start+i sees exactly the kept positions <= start+i
                assert [p for p, ok in zip(kept, mask[i].tolist(), strict=True) if ok] == \
                    [p for p in kept if p <= start + i]


@PROPERTY
@given(w=st.integers(1, 6), data=st.data())
def test_ring_holds_the_window_in_order_after_wrap_around(w, data):
    sizes = data.draw(st.lists(st.integers(1, w), min_size=1, max_size=8), label="chunks")
    ring, window = RingCache(2, w), WindowCache(2, w)
    moved = 0
    for (start, t, ks, masks), (_, _, wks, wmasks) in zip(_feed(ring, sizes), _feed(window, sizes), strict=True):
        end = start + t
        kept = list(range(max(0, end - w), end))
        latest = [max([q for q in range(end) if q % w == s], default=-1) for s in range(w)]
        assert ring.slot_pos.tolist() == latest  # slot s holds the latest position p with p % W == s
        for layer in range(2):
            k, v = ring.ordered(layer)
            assert _positions(k, layer) == kept and torch.equal(v, -k)
            assert ks[layer].shape[2] == w  # every slot is returned; the mask hides the empty or future ones
            slot = [int(p) for p in ring.slot_pos.tolist()]
            for i in range(t):
                seen = sorted(p for p, ok in zip(slot, masks[layer][i].tolist(), strict=True) if ok)
                wmask = torch.ones(1, wks[layer].shape[2], dtype=torch.bool) if wmasks[layer] is None \
                    else wmasks[layer]
                wseen = [p for p, ok in zip(_positions(wks[layer], layer), wmask[i].tolist(), strict=True) if ok]
                assert seen == wseen  # the ring attends to the same positions as the shifting window
        held = min(start, w)  # rows the window held before this chunk
        drop = max(0, held + t - w)
        moved += 2 * 2 * (held - drop) if drop else 0  # rows shifted left, K and V, 2 layers
    assert ring.rows_copied == 2 * 2 * sum(sizes)  # one write per new row: nothing ever moves
    assert window.rows_copied == 2 * 2 * sum(sizes) + moved


@PROPERTY
@given(capacity=st.integers(1, 6), policy=st.sampled_from(["linear", "double"]),
       grow_by=st.none() | st.integers(1, 5), heads=st.integers(2, 3), data=st.data())
def test_growth_capacities_copies_and_contiguity(capacity, policy, grow_by, heads, data):
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=8), label="chunks")
    cache = GrowableCache(1, capacity, policy=policy, grow_by=grow_by)
    cap, n, copied, growths = capacity, 0, 0, 0
    step = capacity if grow_by is None else grow_by
    for t in sizes:
        while cap < n + t:  # the rule, restated: linear adds grow_by (default: the first capacity), double doubles
            copied += cap
            cap, growths = (cap + step if policy == "linear" else 2 * cap), growths + 1
        k = torch.randn(1, heads, t, 3, dtype=torch.float64)
        kk, vv = cache.feed(k, k + 1)
        n += t
        assert cache.capacities[0] == cap and cache.k[0].shape[2] == cap and cache.grow_count == growths
        assert kk.shape[2] == n and torch.equal(kk[:, :, n - t :], k) and torch.equal(vv, kk + 1)
        assert kk.is_contiguous() == (n == cap)  # a narrowed view is contiguous only when it is the whole buffer
        assert kk.data_ptr() == cache.k[0].data_ptr()  # a view of the buffer, not a copy
    assert cache.rows_copied == 2 * (copied + n)
