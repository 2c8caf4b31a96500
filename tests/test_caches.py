"""Behaviour of each cache policy that chapters 3 to 5 teach: storage, pointers, growth,
forks and aliasing, contiguity, copies counted, and equality with the full forward."""

from __future__ import annotations

import pytest
import torch
from helpers import CORE, TOL64, build, make_cache
from helpers import run_chunks as _run

from labcode import GPTConfig
from labcode.caches import ConcatCache, GrowableCache, ModuleStateCache, RingCache, WindowCache
from labcode.caches.base import snapshot, states_equal
from labcode.caches.naive import naive_state
from labcode.caches.window import shift_left
from labcode.masks import causal_mask, positions_mask, sliding_window_mask, upper_left_mask

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)


def _model(cfg: GPTConfig = CFG, seed: int = 0, dtype=torch.float64):
    return build(cfg, seed, dtype)


MODEL = _model()
IDS = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    FULL = MODEL(IDS)


@pytest.mark.parametrize("kind", CORE)
def test_every_cache_matches_the_full_forward_for_one_schedule(kind):
    cache = make_cache(kind, MODEL)
    out = _run(MODEL, IDS, cache, [3, 1, 5, 1, 1, 4, 5])
    assert (out - FULL).abs().max().item() <= TOL64
    assert cache.position == 20 and cache.length(0) == cache.length(1) == 20
    k, v = cache.read(1)
    assert k.shape == v.shape == (2, CFG.n_kv_heads, 20, CFG.head_dim)  # only the Hkv heads are stored


@pytest.mark.parametrize("kind", CORE)
def test_cache_storage_takes_the_activations_dtype_and_device(kind):
    for dtype in (torch.float32, torch.float64):
        model = _model(dtype=dtype)
        cache = make_cache(kind, model)
        assert cache.read(0) == (None, None) and cache.layout is None  # nothing allocated before the first use
        model(IDS[:, :4], cache)
        k, v = cache.read(0)
        assert k.dtype == v.dtype == dtype and k.device == v.device == model.device
        assert (cache.layout.dtype, cache.layout.batch, cache.layout.kv_heads) == (dtype, 2, CFG.n_kv_heads)


# -- chapter 3: the naive cache ---------------------------------------------------------------

def test_naive_pointer_and_counter_advance_together_and_reset_clears():
    model = _model()
    model.reset_kv_cache()
    for t in (4, 1, 3):
        before = model.current_pos
        model(IDS[:, before : before + t], use_cache=True)
        ptrs = [b.attn.ptr_current_pos for b in model.blocks]
        assert ptrs == [before + t] * CFG.n_layers and model.current_pos == before + t
        assert [b.attn.cache_k.shape[2] for b in model.blocks] == [before + t] * CFG.n_layers
    assert model.blocks[0].attn.cache_k.shape == (2, CFG.n_kv_heads, 8, CFG.head_dim)
    model.reset_kv_cache()
    assert naive_state(model) == {"current_pos": 0, "ptr_current_pos": [0, 0], "cache_k": [None, None],
                                  "cache_v": [None, None]}


def test_naive_use_cache_false_leaves_the_state_alone():
    model = _model()
    model.reset_kv_cache()
    model(IDS[:, :5], use_cache=True)
    before = naive_state(model)
    plain = model(IDS)
    assert states_equal(before, naive_state(model))
    assert (plain - FULL).abs().max().item() == 0.0


def test_naive_view_reads_everything_from_the_model():
    model = _model()
    model.reset_kv_cache()
    view = ModuleStateCache(model)
    model(IDS[:, :5], use_cache=True)  # another view advanced the model
    assert view.position == 5 and view.layout.batch == 2 and view.layout.dtype == torch.float64
    out = model(IDS[:, 5:9], view)  # so this stale-looking view continues correctly
    assert (out - FULL[:, 5:9]).abs().max().item() <= TOL64
    view.reset()
    assert model.current_pos == 0 and model.blocks[1].attn.cache_k is None


def test_naive_forgotten_reset_contaminates_and_reset_isolates():
    model = _model()
    a, b = IDS[:1, :7], IDS[1:, :6]
    model.reset_kv_cache()
    model(a, use_cache=True)
    contaminated = model(b, use_cache=True)  # no reset: request b continues request a
    model.reset_kv_cache()
    isolated = model(b, use_cache=True)
    reference = model(b)
    assert (isolated - reference).abs().max().item() <= TOL64
    assert (contaminated - reference).abs().max().item() > 1e-3


# -- chapter 4: the explicit-pass cache ------------------------------------------------------

def test_explicit_pass_returns_new_pairs_and_never_modifies_the_old_ones():
    logits, caches = MODEL(IDS[:, :6], None, return_cache=True)
    assert len(caches) == CFG.n_layers
    assert all(k.shape == v.shape == (2, CFG.n_kv_heads, 6, CFG.head_dim) for k, v in caches)
    kept = snapshot(caches)
    ids_before = [id(t) for pair in caches for t in pair]
    logits2, caches2 = MODEL(IDS[:, 6:9], caches, return_cache=True)  # offset 6 read from the cache length
    assert states_equal(kept, caches) and [id(t) for pair in caches for t in pair] == ids_before
    assert caches2[0][0].shape[2] == 9
    assert (torch.cat((logits, logits2), 1) - FULL[:, :9]).abs().max().item() <= TOL64


def test_explicit_pass_two_requests_interleaved():
    r1, r2 = IDS[:1], IDS[1:]
    c1 = c2 = None
    out1, out2 = [], []
    for start, t in ((0, 3), (3, 1), (4, 4), (8, 2)):
        logits, c1 = MODEL(r1[:, start : start + t], c1, return_cache=True)
        out1.append(logits)
        logits, c2 = MODEL(r2[:, start : start + t], c2, return_cache=True)
        out2.append(logits)
    assert (torch.cat(out1, 1) - MODEL(r1[:, :10])).abs().max().item() <= TOL64
    assert (torch.cat(out2, 1) - MODEL(r2[:, :10])).abs().max().item() <= TOL64


def test_concat_cache_returns_contiguous_tensors_and_counts_quadratic_copies():
    cache = ConcatCache(2)
    MODEL(IDS[:, :4], cache)
    for t in range(4, 12):
        MODEL(IDS[:, t : t + 1], cache)
        k, v = cache.read(0)
        assert k.is_contiguous() and v.is_contiguous()
    # the prefill writes 4 rows; decode step s (cache of length s before it) copies s + 1 rows; x2 for K, V; x L
    assert cache.rows_copied == 2 * CFG.n_layers * (4 + sum(s + 1 for s in range(4, 12)))


def test_concat_fork_gives_independent_continuations():
    base = ConcatCache(2)
    MODEL(IDS[:, :6], base)
    fork = base.fork()
    tail_a, tail_b = IDS[:, 6:8], IDS[:, 10:12]  # two different continuations at positions 6 and 7
    a = MODEL(tail_a, base)
    b = MODEL(tail_b, fork)
    seq_a, seq_b = torch.cat((IDS[:, :6], tail_a), 1), torch.cat((IDS[:, :6], tail_b), 1)
    assert (a - MODEL(seq_a)[:, 6:]).abs().max().item() <= TOL64
    assert (b - MODEL(seq_b)[:, 6:]).abs().max().item() <= TOL64
    for cache, seq in ((base, seq_a), (fork, seq_b)):  # each holds exactly its own sequence's keys
        fresh = ConcatCache(2)
        MODEL(seq, fresh)
        assert torch.equal(cache.read(0)[0], fresh.read(0)[0])  # layer 0: the same projection of the same rows
        assert (cache.read(1)[0] - fresh.read(1)[0]).abs().max().item() <= TOL64


@pytest.mark.parametrize("make", [lambda: WindowCache(2, 24), lambda: GrowableCache(2, 4), lambda: RingCache(2, 24)])
def test_preallocated_fork_copies_the_buffers(make):
    base = make()
    MODEL(IDS[:, :6], base)
    fork = base.fork()
    a = MODEL(IDS[:, 6:9], base)
    b = MODEL(IDS[:, 9:12], fork)  # other tokens at the same positions 6..8
    ref_b = MODEL(torch.cat((IDS[:, :6], IDS[:, 9:12]), 1))[:, 6:]
    assert (a - FULL[:, 6:9]).abs().max().item() <= TOL64
    assert (b - ref_b).abs().max().item() <= TOL64


def _one(value: float) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), value, dtype=torch.float64)  # [B, Hkv, T, D] = [1, 1, 1, 1]


def _push(cache, value: float) -> list[float]:
    k, _ = cache.feed(_one(value), _one(-value))  # one pass: begin, append to the one layer, end
    return k.flatten().tolist()


def test_shared_storage_fork_reproduces_the_overwrite_hazard():
    c1 = GrowableCache(1, 8)  # candle's KvCache: a preallocated buffer of 8 slots
    _push(c1, 1.0)
    c2 = c1.fork(share_storage=True)  # both copies now point at one buffer, each with its own pointer
    assert _push(c2, 2.0) == [1.0, 2.0]
    assert _push(c1, 3.0) == [1.0, 3.0]
    assert c2.read(0)[0].flatten().tolist() == [1.0, 3.0]  # c2's 2 was overwritten by c1's 3
    safe1 = GrowableCache(1, 8)
    _push(safe1, 1.0)
    safe2 = safe1.fork()
    _push(safe2, 2.0)
    _push(safe1, 3.0)
    assert safe2.read(0)[0].flatten().tolist() == [1.0, 2.0]
    d1 = ConcatCache(1)
    _push(d1, 1.0)
    d2 = d1.fork()
    _push(d2, 2.0)
    _push(d1, 3.0)
    assert d1.read(0)[0].flatten().tolist() == [1.0, 3.0] and d2.read(0)[0].flatten().tolist() == [1.0, 2.0]


def test_inference_mode_keeps_no_graph_and_plain_mode_does():
    model = _model(dtype=torch.float32)
    plain = ConcatCache(2)
    with torch.enable_grad():
        model(IDS[:, :3], plain)
        model(IDS[:, 3:4], plain)
    assert plain.read(0)[0].grad_fn is not None  # the cache holds the autograd graph of every step
    with torch.inference_mode():
        inf = ConcatCache(2)
        model(IDS[:, :3], inf)
        model(IDS[:, 3:4], inf)
    k = inf.read(0)[0]
    assert k.grad_fn is None and not k.requires_grad and k.is_inference()


# -- chapter 5: the preallocated caches --------------------------------------------------------

def test_window_slice_writes_copy_only_new_rows_until_full():
    cache = WindowCache(2, 10)
    MODEL(IDS[:, :4], cache)
    assert cache.rows_copied == 2 * CFG.n_layers * 4
    for t in range(4, 10):
        before = cache.rows_copied
        MODEL(IDS[:, t : t + 1], cache)
        assert cache.rows_copied - before == 2 * CFG.n_layers  # one row per K and V per layer
    assert cache.total_dropped == 0 and cache.read(0)[0].shape[2] == 10
    MODEL(IDS[:, 10:13], cache)  # full: 3 dropped, 7 rows moved left, 3 written
    assert cache.last_dropped == 3 and cache.total_dropped == 3
    assert cache.rows_copied == 2 * CFG.n_layers * (10 + 7 + 3)


def test_window_is_exact_until_it_drops():
    cache = WindowCache(2, 12)
    out = _run(MODEL, IDS, cache, [5, 4, 3])
    assert cache.total_dropped == 0 and (out - FULL[:, :12]).abs().max().item() <= TOL64
    after = MODEL(IDS[:, 12:13], cache)
    assert cache.last_dropped == 1
    assert (after - FULL[:, 12:13]).abs().max().item() > 1e-6  # from here on, chapter 6


def test_window_mask_rule_never_hides_a_kept_row():
    for window in range(1, 7):
        for s_cached in range(0, window):
            for t in range(1, window - s_cached + 1):
                assert torch.equal(sliding_window_mask(t, s_cached, window), causal_mask(t, s_cached))


def test_ring_and_window_agree_after_drops():
    ring, window = RingCache(2, 5), WindowCache(2, 5)
    a = _run(MODEL, IDS, ring, [3, 2, 2, 1, 4, 5, 3])
    b = _run(MODEL, IDS, window, [3, 2, 2, 1, 4, 5, 3])
    assert ring.total_dropped == window.total_dropped == 15
    assert (a - b).abs().max().item() <= TOL64
    assert torch.equal(ring.read(0)[0], window.read(0)[0])
    assert (ring.read(1)[0] - window.read(1)[0]).abs().max().item() <= TOL64  # summed in another order
    assert ring.rows_copied < window.rows_copied  # the ring never moves a row


def test_growth_puzzle_3_1_1_10_with_capacity_4():
    """candle's KvCache::new(2, 4): appends of 3, 1, 1 and 10 positions, K of [1, 3, n, 64]."""
    expected = [(3, False, 4), (4, True, 4), (5, False, 8), (15, False, 16)]
    for policy in ("linear", "double"):
        cache = GrowableCache(1, 4, policy=policy)
        seen = []
        for n in (3, 1, 1, 10):
            k = torch.ones(1, 3, n, 64)
            kk, _ = cache.feed(k, k)
            seen.append((kk.shape[2], kk.is_contiguous(), cache.capacities[0]))
        assert seen == expected, policy
        assert cache.grow_count == (3 if policy == "linear" else 2)  # 4->8->12->16, or 4->8->16
        copied = (4 + 8 + 12) if policy == "linear" else (4 + 8)
        assert cache.rows_copied == 2 * (copied + 15)


def test_shift_left_without_clone_on_this_pytorch():
    """What the clone protects against: PyTorch refuses the overlapping copy when it can see it,
    and a right shift through the same path silently corrupts when it cannot."""
    single = torch.arange(8.0).view(1, 1, 8, 1)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        single[:, :, :5] = single[:, :, 3:8]
    two_heads = torch.arange(16.0).view(1, 2, 8, 1)
    expected = two_heads.clone()
    expected[:, :, 3:] = expected[:, :, :5].clone()
    two_heads[:, :, 3:] = two_heads[:, :, :5]  # no error: the overlap check gives up on this layout
    assert not torch.equal(two_heads, expected)
    for heads in (1, 2, 3):  # one head is the layout PyTorch refuses without the clone
        buf = torch.arange(8.0 * heads).view(1, heads, 8, 1)
        shift_left(buf, 3, 8)
        assert buf[0, :, :5, 0].tolist() == [[8.0 * h + i for i in range(3, 8)] for h in range(heads)]


# -- masks -----------------------------------------------------------------------------------

def test_offset_mask_rows_and_the_upper_left_mistake():
    m = causal_mask(3, 5)
    assert m.shape == (3, 8) and m.sum(1).tolist() == [6, 7, 8]
    assert upper_left_mask(3, 5).sum(1).tolist() == [1, 2, 3]


def test_sliding_window_and_positions_masks_match_their_definitions():
    for t, s, w in ((3, 5, 4), (1, 0, 1), (4, 2, 2), (2, 7, 10)):
        m = sliding_window_mask(t, s, w)
        for i in range(t):
            for j in range(s + t):
                assert bool(m[i, j]) == (s + i - w < j <= s + i)
    q, k = torch.tensor([7, 8]), torch.tensor([5, -1, 8, 3, 6])
    assert positions_mask(q, k).tolist() == [[True, False, False, True, True], [True, False, True, True, True]]
    assert positions_mask(q, k, window=3).tolist() == [[True, False, False, False, True],
                                                      [False, False, True, False, True]]


def test_states_equal_sees_any_change():
    cache = WindowCache(2, 8)
    MODEL(IDS[:, :3], cache)
    s = cache.state()
    assert states_equal(s, cache.state())
    value = cache.k[1][1, 0, 2, 3].item()
    cache.k[1][1, 0, 2, 3] = torch.nextafter(torch.tensor(value, dtype=torch.float64), torch.tensor(1.0))
    assert not states_equal(s, cache.state())
    cache.k[1][1, 0, 2, 3] = value
    assert states_equal(s, cache.state())
    cache.rows_copied += 1
    assert not states_equal(s, cache.state())
