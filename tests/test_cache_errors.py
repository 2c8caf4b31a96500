"""Every bad input raises a clear error (which argument, what was expected, what was given)
before anything changes: each test snapshots the whole cache state, makes the bad call,
and checks the error message and that the state is exactly what it was."""

from __future__ import annotations

import pytest
import torch
from helpers import CORE, build, make_cache, rejected

from labcode import GPT, GPTConfig
from labcode.caches import CacheError, ConcatCache, GrowableCache, ModuleStateCache, RingCache, WindowCache
from labcode.caches.base import snapshot, states_equal
from labcode.caches.prealloc import PreallocatedCache
from labcode.generate import decode_step, generate, prefill
from labcode.masks import causal_mask, positions_mask, sliding_window_mask

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=24, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
MODEL = build(CFG, seed=0)
MODEL32 = build(CFG, seed=1, dtype=torch.float32)
IDS = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
W = 8  # the window of the window caches in these tests
KINDS = [*CORE, "naive"]


@pytest.fixture(autouse=True)
def _fresh_model():
    yield
    MODEL.reset_kv_cache()


def make(kind: str, n_layers: int = 2):
    """An empty cache of `kind` for `n_layers` layers; the window caches keep W positions."""
    model = MODEL if n_layers == 2 else build(CFG.with_(n_layers=n_layers))
    return make_cache(kind, model, room=W)


def filled(kind: str, n: int = 6):
    """A cache of `kind` that already holds n positions of IDS (batch 2, float64)."""
    cache = make(kind)
    prefill(MODEL, IDS[:, :n], cache)  # in chunks of at most the window for the window caches
    return cache


def opened(kind: str, t: int = 1):
    """A filled cache of `kind` with a pass of t tokens begun, as the model begins one (B=2, Hkv=2, D=4)."""
    cache = filled(kind)
    cache.begin((2, 2, t, 4), torch.float64, "cpu")
    return cache


@pytest.mark.parametrize("kind", KINDS)
def test_batch_size_change(kind):
    cache = filled(kind)
    rejected(cache, lambda: MODEL(IDS[:1, 6:7], cache), CacheError,
             r"batch: expected the cache's batch size 2 \(reset it for a new batch\), got 1")


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_mismatch(kind):
    cache = filled(kind)
    model32 = MODEL32
    if kind == "naive":  # the naive state lives in the model: make a float32 copy of the same model and state
        model32 = GPT(CFG).float().eval()
        for b32, b64 in zip(model32.blocks, MODEL.blocks, strict=True):
            b32.attn.cache_k, b32.attn.cache_v = b64.attn.cache_k, b64.attn.cache_v
            b32.attn.ptr_current_pos = b64.attn.ptr_current_pos
        model32.current_pos = MODEL.current_pos
        cache = ModuleStateCache(model32)
    rejected(cache, lambda: model32(IDS[:, 6:7], cache), CacheError,
             r"dtype: expected the cache's dtype torch.float64, got torch.float32")


@pytest.mark.parametrize("kind", CORE)
def test_device_mismatch(kind):
    """A cache filled on another device (here PyTorch's shape-only "meta" device) rejects CPU activations."""
    cache = make(kind)
    k = torch.zeros(2, 2, 3, 4, dtype=torch.float64, device="meta")
    cache.feed(k, k)
    rejected(cache, lambda: MODEL(IDS[:, 3:4], cache), CacheError,
             r"device: expected the cache's device meta, got cpu")


def test_device_mismatch_naive():
    MODEL.reset_kv_cache()
    for block in MODEL.blocks:  # state left behind by a run on another device
        block.attn.cache_k = block.attn.cache_v = torch.zeros(2, 2, 3, 4, dtype=torch.float64, device="meta")
        block.attn.ptr_current_pos = 3
    MODEL.current_pos = 3
    cache = ModuleStateCache(MODEL)
    rejected(cache, lambda: MODEL(IDS[:, 3:4], use_cache=True), CacheError,
             r"device: expected the cache's device meta, got cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_positions_past_the_table(kind):
    cache = make(kind)
    for start in (0, 7, 14):
        MODEL(IDS[:, start : start + 7], cache)
    assert cache.position == 21
    rejected(cache, lambda: MODEL(IDS[:, :4], cache), ValueError,
             r"positions: expected start \+ T <= context_length 24, got start 21 \+ T 4 = 25")


@pytest.mark.parametrize("kind", KINDS)
def test_empty_input(kind):
    cache = filled(kind)
    rejected(cache, lambda: MODEL(IDS[:, :0], cache), ValueError,
             r"ids: expected at least one token in each of at least one row, got \(2, 0\)")


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_rank_ids(kind):
    cache = filled(kind)
    rejected(cache, lambda: MODEL(IDS[0, 6:9], cache), ValueError, r"ids: expected rank 2 \[B, T\], got shape \(3,\)")


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_rank_keys_and_values(kind):
    cache = opened(kind)
    k = torch.zeros(2, 2, 4, dtype=torch.float64)
    rejected(cache, lambda: cache.append(0, k, k), CacheError,
             r"k, v: expected two \[B, Hkv, T, D\] tensors of the shape begin\(\) was given, \(2, 2, 1, 4\), "
             r"got \(\(2, 2, 4\), \(2, 2, 4\)\)")
    rejected(cache, lambda: cache.begin((2, 2, 4), torch.float64, "cpu"), CacheError,
             r"cache: expected no pass in progress")
    cache.cancel()
    rejected(cache, lambda: cache.begin((2, 2, 4), torch.float64, "cpu"), CacheError,
             r"shape: expected \(B, Hkv, T, D\), four ints, got \(2, 2, 4\)")


@pytest.mark.parametrize("kind", KINDS)
def test_heads_or_head_dim_change(kind):
    cache = filled(kind)
    rejected(cache, lambda: cache.begin((2, 4, 1, 4), torch.float64, "cpu"), CacheError,  # 4 KV heads, 2 cached
             r"k, v: expected Hkv=2 heads of D=4, as cached, got \(2, 4, 1, 4\)")
    cache = opened(kind)
    k = torch.zeros(2, 2, 1, 4, dtype=torch.float32)
    rejected(cache, lambda: cache.append(0, k, k), CacheError,
             r"k, v: expected torch.float64 on cpu, as begin\(\) was given, got \(torch.float32, device\(")


@pytest.mark.parametrize("kind", KINDS)
def test_layer_out_of_range_or_out_of_order(kind):
    cache = opened(kind)
    k = torch.zeros(2, 2, 1, 4, dtype=torch.float64)
    rejected(cache, lambda: cache.append(2, k, k), CacheError, r"layer: expected 0 <= layer < 2, got 2")
    rejected(cache, lambda: cache.append(1, k, k), CacheError,
             r"layer: expected layer 0 next \(each layer appends once per pass, in order\), got 1")
    cache.append(0, k, k)
    rejected(cache, lambda: cache.append(0, k, k), CacheError, r"layer: expected layer 1 next")
    rejected(cache, cache.end, CacheError, r"layer: expected all 2 layers appended before end\(\), got 1")


@pytest.mark.parametrize("kind", KINDS)
def test_the_pass_steps_come_in_order(kind):
    cache = filled(kind)
    k = torch.zeros(2, 2, 1, 4, dtype=torch.float64)
    steps = {"append": lambda: cache.append(0, k, k), "mask": lambda: cache.mask(0, 1), "end": cache.end}
    for step, call in steps.items():
        rejected(cache, call, CacheError, rf"cache: expected a pass in progress \(begin\(\) before {step}\(\)\)")


@pytest.mark.parametrize("kind", CORE)
def test_cache_for_another_depth(kind):
    deeper = make(kind, n_layers=3)
    rejected(deeper, lambda: MODEL(IDS[:, :4], deeper), CacheError,
             r"cache: expected a cache for 2 layers, got one for 3")


@pytest.mark.parametrize("kind", ["window", "ring"])
def test_chunk_larger_than_the_window(kind):
    cache = filled(kind, 3)
    rejected(cache, lambda: MODEL(IDS[:, 3 : 3 + W + 1], cache), CacheError,
             rf"t_new: expected a chunk of at most {W} tokens \(the window; prefill longer prompts in chunks\), "
             rf"got {W + 1}")


@pytest.mark.parametrize("make, match", [
    (lambda: WindowCache(2, 0), r"capacity: expected a positive number of token slots, got 0"),
    (lambda: RingCache(2, -3), r"capacity: expected a positive number of token slots, got -3"),
    (lambda: GrowableCache(2, 0), r"capacity: expected a positive number of token slots, got 0"),
    (lambda: PreallocatedCache(2, True), r"capacity: expected a positive number of token slots, got True"),
    (lambda: WindowCache(2, 2.5), r"capacity: expected a positive number of token slots, got 2.5"),
    (lambda: GrowableCache(2, 4, grow_by=0), r"grow_by: expected a positive number of slots, got 0"),
    (lambda: GrowableCache(2, 4, policy="triple"), r"policy: expected 'linear' or 'double', got 'triple'"),
    (lambda: ConcatCache(0), r"n_layers: expected a positive number of layers, got 0"),
    (lambda: ConcatCache(True), r"n_layers: expected a positive number of layers, got True"),
])
def test_bad_construction(make, match):
    with pytest.raises(CacheError, match=match):
        make()


# -- the naive cache: the model's own state must stay consistent ---------------------------------

def test_naive_pointer_drift_is_rejected_before_anything_changes():
    cache = filled("naive")
    MODEL.blocks[1].attn.ptr_current_pos -= 1  # the per-layer pointer and the model counter drift apart
    rejected(cache, lambda: MODEL(IDS[:, 6:7], use_cache=True), CacheError,
             r"ptr_current_pos: expected every layer's pointer equal to the model's current_pos 6, got \[6, 5\]")


def test_naive_counter_drift_is_rejected_before_anything_changes():
    cache = filled("naive")
    MODEL.current_pos += 1
    for block in MODEL.blocks:
        block.attn.ptr_current_pos += 1  # pointers and counter agree, but the stored keys do not
    rejected(cache, lambda: MODEL(IDS[:, 6:7], use_cache=True), CacheError,
             r"cache_k: expected every layer holding current_pos=7 keys, got \[6, 6\]")


def test_naive_switch_rejects_an_explicit_cache_too():
    cache = filled("naive")
    rejected(cache, lambda: MODEL(IDS[:, 6:7], ConcatCache(2), use_cache=True), ValueError,
             r"cache, return_cache: expected None and False when use_cache=True")
    rejected(cache, lambda: MODEL(IDS[:, 6:7], None, return_cache=True, use_cache=True), ValueError,
             r"cache, return_cache: expected None and False when use_cache=True")


# -- the explicit-pass cache: the caller's list and tensors are never touched ---------------------

def _pairs(n: int = 5):
    return MODEL(IDS[:, :n], None, return_cache=True)[1]


@pytest.mark.parametrize("mangle, match", [
    (lambda p: p[:1], r"caches: expected a list of 2 \(K, V\) pairs, one per layer, got 1"),
    (lambda p: [p[0], None], r"caches\[1\]: expected a \(K, V\) pair of tensors, got NoneType"),
    (lambda p: [p[0], (p[1][0][0], p[1][1][0])], r"caches\[1\]: expected tensors of rank 4 \[B, Hkv, S, D\]"),
    (lambda p: [p[0], (p[1][0], p[1][1][:, :, :4])], r"caches\[1\]: expected K and V of shape \(2, 2, 5, 4\)"),
    (lambda p: [p[0], (p[1][0][:, :, :4], p[1][1][:, :, :4])], r"caches\[1\]: expected K and V of shape"),
    (lambda p: {"k": p}, r"caches: expected None or a list of 2 \(K, V\) pairs, got dict"),
])
def test_explicit_pass_rejects_malformed_caches(mangle, match):
    caches = _pairs()
    bad = mangle(caches)
    kept = snapshot(caches)
    with pytest.raises(CacheError, match=match):
        MODEL(IDS[:, 5:6], bad, return_cache=True)
    assert states_equal(kept, caches)


def test_explicit_pass_rejects_another_batch_and_keeps_the_callers_pairs():
    caches = _pairs()
    kept = snapshot(caches)
    with pytest.raises(CacheError, match=r"batch: expected the cache's batch size 2 .*got 3"):
        MODEL(IDS[:1, 5:6].repeat(3, 1), caches, return_cache=True)
    with pytest.raises(ValueError, match=r"positions: expected start \+ T <= context_length 24, got start 5"):
        MODEL(IDS[:, :20], caches, return_cache=True)
    assert states_equal(kept, caches)


def test_ring_ordered_needs_a_filled_layer():
    ring = RingCache(2, 4)
    with pytest.raises(CacheError, match=r"layer: expected a layer below 2 that holds keys, got 0"):
        ring.ordered(0)


# -- generation: everything is checked before the first chunk runs ---------------------------------

@pytest.mark.parametrize("kind", ["window", "ring", "growable-linear", "growable-double"])
def test_buffers_made_in_inference_mode_are_refused_outside_it(kind):
    cache = make(kind)
    out = generate(MODEL, IDS[:, :3], 3, cache)  # generate runs under torch.inference_mode
    nxt = out.ids[:, -1]
    rejected(cache, lambda: decode_step(MODEL, nxt, cache), CacheError, "cache: expected a call under "
             r"torch.inference_mode\(\)")
    with torch.enable_grad():
        rejected(cache, lambda: decode_step(MODEL, nxt, cache), CacheError, "inference_mode")
    with torch.inference_mode():  # where it was filled, the cache continues
        assert decode_step(MODEL, nxt, cache).shape == (2, CFG.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_rejects_a_prompt_that_would_cross_the_table_midway(kind):
    cache = filled(kind, 18)
    rejected(cache, lambda: prefill(MODEL, IDS[:, :8], cache, chunk_size=2), ValueError,
             r"positions: expected start \+ T <= context_length 24, got start 18 \+ T 8 = 26")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size, match", [
    (0, r"chunk_size: expected a positive integer or None, got 0"),
    (2.0, r"chunk_size: expected a positive integer or None, got 2.0"),
])
def test_prefill_rejects_a_bad_chunk_size(kind, size, match):
    cache = filled(kind)
    rejected(cache, lambda: prefill(MODEL, IDS[:, 6:12], cache, chunk_size=size), ValueError, match)


@pytest.mark.parametrize("kind", ["window", "ring"])
def test_prefill_rejects_a_chunk_size_over_the_window(kind):
    cache = filled(kind, 2)
    rejected(cache, lambda: prefill(MODEL, IDS[:, 2:20], cache, chunk_size=W + 1), ValueError,
             rf"chunk_size: expected at most the cache's max_chunk {W} \(the window\), got {W + 1}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("opts, match", [
    ({"max_new_tokens": -1}, r"max_new_tokens: expected an integer >= 0, got -1"),
    ({"temperature": -0.5}, r"temperature: expected >= 0, got -0.5"),
    ({"temperature": float("nan")}, r"temperature: expected >= 0, got nan"),
    ({"temperature": 1.0, "top_k": 0, "generator": torch.Generator()}, r"top_k: expected a positive integer"),
    ({"temperature": 1.0, "top_p": 0.0, "generator": torch.Generator()}, r"top_p: expected 0 < top_p <= 1"),
    ({"temperature": 1.0}, r"generator: expected a torch.Generator for sampling \(no global seeding\), got None"),
])
def test_generate_rejects_bad_arguments_before_the_prefill(kind, opts, match):
    cache = filled(kind)
    opts = {"max_new_tokens": 3, **opts}
    n = opts.pop("max_new_tokens")
    rejected(cache, lambda: generate(MODEL, IDS[:, 6:9], n, cache, **opts), ValueError, match)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_needs_one_token_per_row(kind):
    cache = filled(kind)
    rejected(cache, lambda: decode_step(MODEL, IDS[:, 6:7], cache), ValueError,
             r"token: expected a rank-1 tensor \[B\] of ids, got torch.Size\(\[2, 1\]\)")


def test_mask_arguments():
    with pytest.raises(ValueError, match=r"t_new: expected a positive number of new queries, got 0"):
        causal_mask(0, 3)
    with pytest.raises(ValueError, match=r"s_cached: expected a non-negative cached length, got -1"):
        sliding_window_mask(2, -1, 4)
    with pytest.raises(ValueError, match=r"window: expected a positive window, got 0"):
        sliding_window_mask(2, 1, 0)
    with pytest.raises(ValueError, match=r"query_pos, key_pos: expected two rank-1 tensors"):
        positions_mask(torch.zeros(2, 1), torch.zeros(3))
