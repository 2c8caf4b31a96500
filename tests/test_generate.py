"""The generation loops: prefill, decode step and generate agree with the no-cache reference,
stop at the position table, keep the prompt, and prefill prompts longer than a window in chunks."""

from __future__ import annotations

import pytest
import torch
from helpers import CORE, ONE_ROW, TOL64, build, make_cache, rejected

from labcode import GPTConfig
from labcode.caches import CacheError, ConcatCache, PairsCache, RingCache, WindowCache
from labcode.caches.base import snapshot, states_equal
from labcode.engines import BlockPool, CellsCache, PagedCache, ScatteredCache
from labcode.generate import chunk_length, decode_step, generate, generate_nocache, new_token_budget, prefill
from labcode.tokenizer import CharTokenizer
from labcode.weights.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py
TOL32_TRAINED = 1e-4  # float32 on the trained model, whose logits reach ~10: measured up to ~1.5e-5 at 64 positions
CFG = GPTConfig(vocab_size=13, context_length=10, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
MODEL = build(CFG, scale=0.5)
PROMPT = torch.randint(0, CFG.vocab_size, (3, 6), generator=torch.Generator().manual_seed(2))
KINDS = [*CORE, "naive", "scattered"]  # every kind that holds a batch of rows, through generate unchanged


def fresh(kind: str, model):
    """An empty cache of `kind` with room for the whole position table (rows for a batch of 3 where it matters)."""
    return make_cache(kind, model, batch=3)


def test_budget_is_the_room_left_in_the_position_table():
    assert new_token_budget(6, 20, 10) == (4, "context_length")
    assert new_token_budget(6, 4, 10) == (4, "max_new_tokens")
    assert new_token_budget(10, 1, 10) == (0, "context_length")
    assert new_token_budget(3, 0, 10) == (0, "max_new_tokens")


@pytest.mark.parametrize("kind", [*KINDS, "nocache"])
def test_prompt_6_capacity_10_asked_20_generates_4_and_keeps_the_prompt(kind):
    if kind == "nocache":
        out = generate_nocache(MODEL, PROMPT, 20)
    else:
        out = generate(MODEL, PROMPT, 20, fresh(kind, MODEL))
    assert out.new_tokens == 4 and out.stop_reason == "context_length"
    assert out.ids.shape == (3, 10) and torch.equal(out.ids[:, :6], PROMPT)
    assert len(out.step_logits) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_of_three_matches_the_reference(kind):
    ref = generate_nocache(MODEL, PROMPT[:, :3], 7)
    out = generate(MODEL, PROMPT[:, :3], 7, fresh(kind, MODEL), chunk_size=2)
    assert torch.equal(out.ids, ref.ids) and out.stop_reason == ref.stop_reason == "max_new_tokens"
    assert max((a - r).abs().max().item() for a, r in zip(out.step_logits, ref.step_logits, strict=True)) <= TOL64
    assert out.positions_computed == [3] + [1] * 6  # prefill, then one position per step
    assert ref.positions_computed == [3, 4, 5, 6, 7, 8, 9]  # the reference recomputes everything


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_matches_the_reference(kind):
    opts = {"temperature": 1.3, "top_k": 9, "top_p": 0.9}
    ref = generate_nocache(MODEL, PROMPT, 4, generator=torch.Generator().manual_seed(7), **opts)
    out = generate(MODEL, PROMPT, 4, fresh(kind, MODEL), generator=torch.Generator().manual_seed(7), **opts)
    other = generate(MODEL, PROMPT, 4, fresh(kind, MODEL), generator=torch.Generator().manual_seed(8), **opts)
    assert torch.equal(out.ids, ref.ids)
    assert not torch.equal(other.ids, ref.ids)  # the generator, and only it, decides the samples


def test_generation_continues_a_filled_cache_within_the_table():
    cache = ConcatCache(2)
    prefill(MODEL, PROMPT[:, :4], cache)
    out = generate(MODEL, PROMPT[:, 4:6], 20, cache)  # 4 cached + 2 new prompt positions: room for 4
    assert out.new_tokens == 4 and out.stop_reason == "context_length"
    ref = generate_nocache(MODEL, PROMPT, 4)
    assert torch.equal(out.ids[:, 2:], ref.ids[:, 6:])


def test_zero_new_tokens_runs_nothing():
    cache = ConcatCache(2)
    out = generate(MODEL, PROMPT, 0, cache)
    assert out.new_tokens == 0 and out.ids is PROMPT and cache.position == 0 and out.positions_computed == []
    full = generate(MODEL, torch.zeros(1, 10, dtype=torch.long), 5, ConcatCache(2))
    assert (full.new_tokens, full.stop_reason) == (0, "context_length")


def test_prefill_chunks_default_to_the_window_and_never_exceed_it():
    assert chunk_length(ConcatCache(2), 9, None) == 9
    assert chunk_length(WindowCache(2, 4), 9, None) == 4
    assert chunk_length(WindowCache(2, 4), 3, None) == 3
    assert chunk_length(ConcatCache(2), 9, 5) == 5


def test_prefill_of_a_prompt_longer_than_the_window():
    window, ring = WindowCache(2, 3), RingCache(2, 3)
    a = prefill(MODEL, PROMPT, window)  # 6 positions through a window of 3: chunks of 3, 3
    b = prefill(MODEL, PROMPT, ring)
    assert window.position == ring.position == 6 and window.total_dropped == ring.total_dropped == 3
    assert (a - b).abs().max().item() <= TOL64  # two storage layouts, one meaning
    first = MODEL(PROMPT[:, :3])[:, -1]
    assert (prefill(MODEL, PROMPT[:, :3], WindowCache(2, 3)) - first).abs().max().item() <= TOL64  # exact, no drop


@pytest.mark.parametrize("chunk", [None, 1, 2, 4, 5])
def test_prefill_in_chunks_equals_the_full_forward(chunk):
    for kind in KINDS:
        last = prefill(MODEL, PROMPT, fresh(kind, MODEL), chunk_size=chunk)
        assert (last - MODEL(PROMPT)[:, -1]).abs().max().item() <= TOL64, kind


def test_decode_step_returns_next_logits():
    cache = ConcatCache(2)
    prefill(MODEL, PROMPT, cache)
    nxt = decode_step(MODEL, PROMPT[:, 0], cache)
    assert nxt.shape == (3, CFG.vocab_size)
    ref = MODEL(torch.cat((PROMPT, PROMPT[:, :1]), 1))[:, -1]
    assert (nxt - ref).abs().max().item() <= TOL64


def test_trained_model_prints_the_same_text_with_and_without_cache():
    model = load_checkpoint(device="cpu")
    tok = CharTokenizer()
    prompt = tok.encode_tensor("The little fox")
    ref = generate_nocache(model, prompt, 30)
    for kind in KINDS + sorted(ONE_ROW):  # every cache kind, the engines' included, one sequence
        out = generate(model, prompt, 30, make_cache(kind, model))
        assert tok.decode(out.ids[0]) == tok.decode(ref.ids[0]), kind
        diff = max((a - r).abs().max().item() for a, r in zip(out.step_logits, ref.step_logits, strict=True))
        assert diff <= TOL32_TRAINED, (kind, diff)


# -- a prompt is checked whole, and a cache's own room is a stop reason ------------------------------

def _pool_cache(n_blocks: int, block_size: int = 2) -> PagedCache:
    return PagedCache(BlockPool(CFG.n_layers, n_blocks, block_size))


def test_a_pool_that_cannot_hold_the_whole_prompt_refuses_it_before_writing():
    one_row = PROMPT[:1]
    cache = _pool_cache(2)  # 4 slots: the first chunk of 2 fits, the prompt of 6 does not
    rejected(cache, lambda: prefill(MODEL, one_row, cache, chunk_size=2), CacheError,
             r"ids: expected a prompt of at most 4 tokens \(the room left in the cache\), got 6")
    assert cache.position == 0 and cache.pool.n_free == 2
    rejected(cache, lambda: generate(MODEL, one_row, 3, cache, chunk_size=2), CacheError, r"ids: expected a prompt")


@pytest.mark.parametrize("blocks, expected", [(3, 1), (4, 3), (5, 4)])
def test_generation_stops_when_the_pool_is_full_and_keeps_what_it_made(blocks, expected):
    one_row = PROMPT[:1]
    cache = _pool_cache(blocks)  # 2 slots a block: the prompt of 6 takes 3 blocks, each new token but the last one slot
    out = generate(MODEL, one_row, 20, cache)
    ref = generate_nocache(MODEL, one_row, expected)
    reason = "context_length" if expected == CFG.context_length - 6 else "cache_full"
    assert (out.new_tokens, out.stop_reason) == (expected, reason)
    assert torch.equal(out.ids, ref.ids) and torch.equal(out.ids[:, :6], one_row)
    assert max((a - r).abs().max().item() for a, r in zip(out.step_logits, ref.step_logits, strict=True)) <= TOL64
    assert cache.position == 6 + expected - 1 and cache.room() == 2 * blocks - cache.position


def test_budget_names_the_cache_when_its_room_is_the_tightest_limit():
    assert new_token_budget(6, 20, 10, cache_room=1) == (2, "cache_full")
    assert new_token_budget(6, 20, 10, cache_room=3) == (4, "context_length")  # a tie: the table is named
    assert new_token_budget(6, 2, 10, cache_room=0) == (1, "cache_full")
    assert new_token_budget(6, 1, 10, cache_room=0) == (1, "max_new_tokens")


@pytest.mark.parametrize("call", [
    lambda bad: generate(MODEL, PROMPT, 3, bad),
    lambda bad: prefill(MODEL, PROMPT, bad),
    lambda bad: decode_step(MODEL, PROMPT[:, 0], bad),
])
def test_a_cache_argument_that_is_not_a_cache_is_refused_clearly(call):
    with torch.no_grad():
        _, pairs = MODEL(PROMPT[:, :3], None, return_cache=True)
    kept = snapshot(pairs)
    for bad, got in ((pairs, "list"), (None, "None"), ("window", "str")):
        with pytest.raises(CacheError, match=rf"cache: expected a KVCache object \(labcode.caches; wrap \(K, V\) pairs "
                                             rf"in PairsCache\), got {got}"):
            call(bad)
    assert states_equal(kept, pairs)
    with pytest.raises(CacheError, match=r"cache: expected a cache for 2 layers, got one for 3"):
        call(ConcatCache(3))


def test_explicit_pairs_generate_once_wrapped_in_a_pairs_cache():
    with torch.no_grad():
        _, pairs = MODEL(PROMPT[:, :4], None, return_cache=True)
    cache = PairsCache(CFG.n_layers, pairs)
    out = generate(MODEL, PROMPT[:, 4:], 3, cache)
    assert torch.equal(out.ids[:, 2:], generate_nocache(MODEL, PROMPT, 3).ids[:, 6:])
    assert cache.length() == 8 and pairs[0][0].shape[2] == 4  # the pairs handed in are untouched


def test_cells_and_ragged_caches_generate_one_sequence_and_a_batch():
    one_row = PROMPT[:1]
    ref = generate_nocache(MODEL, one_row, 4)
    cells = CellsCache(CFG.n_layers, 12, n_seqs=2, default_seq=1)
    out = generate(MODEL, one_row, 4, cells, chunk_size=4)
    assert torch.equal(out.ids, ref.ids) and cells.seq_pos_max(1) == 8 and cells.seq_pos_max(0) == -1
    batch = ScatteredCache(CFG.n_layers, 3, 10)
    out = generate(MODEL, PROMPT, 4, batch, chunk_size=2)
    assert torch.equal(out.ids, generate_nocache(MODEL, PROMPT, 4).ids) and batch.lengths == [9, 9, 9]


def test_caches_that_need_a_plan_are_refused_before_anything_runs():
    one_row = PROMPT[:1]
    cells = CellsCache(CFG.n_layers, 12)  # no default sequence: every pass needs a plan
    rejected(cells, lambda: generate(MODEL, one_row, 3, cells), CacheError,
             r"plan: expected plan\(seq_ids\) before each forward pass, got None")
    cells.plan([0] * 6)
    rejected(cells, lambda: generate(MODEL, one_row, 3, cells), CacheError,
             r"cache: expected no pending plan \(a plan covers one pass, and generate runs many\), got a plan")
    rejected(cells, lambda: prefill(MODEL, one_row, cells, chunk_size=3), CacheError,
             r"plan: expected a plan for the 3 tokens of this pass, got 6")
    last = prefill(MODEL, one_row, cells)  # the plan covers the whole prompt: one pass
    assert (last - MODEL(one_row)[:, -1]).abs().max().item() <= TOL64 and cells.planned is None
