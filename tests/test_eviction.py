"""Eviction by score (H2O, SnapKV) and by position (StreamingCache): the kept set, the budget, exactness.

The kept set is checked on hand-made scores; with a budget of the whole sequence nothing drops.

Dropping keys changes the answers by design; what these tests hold the caches to is choosing the
right keys, never holding more than they promise, and being the full cache when the budget is enough.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build, max_diff, run_chunks

from labcode import GPTConfig
from labcode.caches import H2OCache, SinkCache, SnapKVCache, StreamingCache
from labcode.caches.scored import attention_weights, heavy_hitters, pool_votes, snap_select
from labcode.masks import causal_mask
from labcode.model import attend
from labcode.rope import rotate

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=48, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, rotary=True)
MODEL = build(CFG, seed=7, scale=0.5)
IDS = torch.randint(0, 13, (2, 40), generator=torch.Generator().manual_seed(4))


def _pass(cache, k: torch.Tensor, q: torch.Tensor) -> None:
    """One pass of one layer without a model: append k (as k and v), show the cache the queries q."""
    cache.begin(tuple(k.shape), k.dtype, k.device)
    k_all, _ = cache.append(0, k, k)
    cache.observe(0, q, k_all, cache.mask(0, k.shape[2]))
    cache.end()


# -- the choice, on hand-made scores -------------------------------------------------------------------

def test_heavy_hitters_keep_the_latest_and_the_largest_older_scores_per_head():
    scores = torch.tensor([[[5.0, 1, 9, 3, 7, 2, 8, 4], [1.0, 2, 3, 4, 5, 6, 7, 8]]])  # (B=1, Hkv=2, S=8)
    index = heavy_hitters(scores, budget=5, recent=2)
    assert index.tolist() == [[[0, 2, 4, 6, 7], [3, 4, 5, 6, 7]]]  # each head its own keys, in position order
    assert heavy_hitters(scores, budget=8, recent=2) is None  # everything fits
    assert heavy_hitters(scores, budget=3, recent=0).tolist() == [[[2, 4, 6], [5, 6, 7]]]


def test_snapkv_pools_the_votes_so_that_neighbours_are_kept():
    votes = torch.tensor([[[0.0, 0, 2, 9, 1, 0, 0, 0]]])
    assert snap_select(votes, 2, kernel=1, pool="max").tolist() == [[[2, 3]]]  # no pooling: the two best
    assert snap_select(votes, 3, kernel=3, pool="max").tolist() == [[[2, 3, 4]]]  # the peak and its neighbours
    assert pool_votes(votes, 3, "avg")[0, 0, :5].tolist() == pytest.approx([0, 2 / 3, 11 / 3, 4, 10 / 3])
    assert snap_select(votes, 2, kernel=3, pool="avg").tolist() == [[[2, 3]]]


def test_h2o_under_uniform_attention_keeps_the_oldest_keys_with_the_sums_it_observed():
    """Queries of zeros attend uniformly: each step gives each visible key 1/(keys visible), summed over the
    G = 2 query heads; older keys have had more steps, so H2O keeps the oldest and the latest."""
    cache = H2OCache(1, budget=4, recent=1)
    k = torch.randn(1, 1, 6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(1, 2, 1, 2, dtype=torch.float64)
    for i in range(6):
        _pass(cache, k[:, :, i : i + 1], q)
        assert cache.length() == min(i + 1, 4)
    assert cache.kept[0].tolist() == [[[0, 1, 2, 5]]]
    visible = [1, 2, 3, 4, 5, 5]  # keys each step attends to: one more each step, up to budget + 1
    want = [2 * sum(1 / n for n in visible[j:]) for j in range(3)] + [2 / 5]
    assert cache.scores[0][0, 0].tolist() == pytest.approx(want, abs=1e-12)
    assert torch.equal(cache.read(0)[0][0, 0], k[0, 0, [0, 1, 2, 5]])
    assert cache.last_dropped == 1 and cache.total_dropped == 2


@pytest.mark.parametrize("sizes", [[3, 1, 1, 1], [6]], ids=str)
def test_h2o_sums_the_attention_of_every_query_of_a_longer_pass(sizes):
    """Uniform attention again, with a first pass of several queries: query i of it sees keys 0..i, giving
    each 1/(i + 1), so key j collects G * sum over the queries i >= j of the pass of 1/(i + 1), a sum over
    the queries, not their mean; the later one-token passes see 4, 5 and 5 keys, as above."""
    cache = H2OCache(1, budget=4, recent=1)
    k = torch.randn(1, 1, 6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    start = 0
    for t in sizes:
        _pass(cache, k[:, :, start : start + t], torch.zeros(1, 2, t, 2, dtype=torch.float64))
        start += t
    assert cache.kept[0].tolist() == [[[0, 1, 2, 5]]] and cache.total_dropped == 2
    if sizes == [6]:  # one pass of 6 queries, then the budget: the oldest three and the latest stay
        want = [2 * sum(1 / (i + 1) for i in range(j, 6)) for j in (0, 1, 2, 5)]
    else:  # keys 0..2 from the first pass (queries 0..2), then 1/4 + 1/5 + 1/5; key 5 from its own step
        want = [2 * sum(1 / (i + 1) for i in range(j, 3)) + 2 * (1 / 4 + 1 / 5 + 1 / 5) for j in range(3)]
        want.append(2 / 5)
    assert cache.scores[0][0, 0].tolist() == pytest.approx(want, abs=1e-12)


def test_h2o_keeps_a_key_that_every_query_looks_at():
    k = torch.zeros(1, 1, 8, 2, dtype=torch.float64)
    k[0, 0, 3] = torch.tensor([4.0, 0.0])  # the one key the queries align with
    q = torch.tensor([4.0, 0.0], dtype=torch.float64).expand(1, 2, 1, 2)
    cache = H2OCache(1, budget=3, recent=1)
    for i in range(8):
        _pass(cache, k[:, :, i : i + 1], q)
    assert cache.kept[0].tolist() == [[[0, 3, 7]]]  # the key looked at, the oldest zero key, the latest


def test_snapkv_keeps_what_the_window_looks_at_and_the_window():
    t, w = 12, 2
    k = torch.zeros(1, 1, t, 2, dtype=torch.float64)
    k[0, 0, 5] = torch.tensor([3.0, 0.0])
    q = torch.zeros(1, 2, t, 2, dtype=torch.float64)
    q[:, :, -w:] = torch.tensor([3.0, 0.0], dtype=torch.float64)  # the window's queries look at position 5
    cache = SnapKVCache(1, budget=5, window=w, kernel=3)
    _pass(cache, k, q)
    assert cache.kept[0].tolist() == [[[4, 5, 6, 10, 11]]] and cache.last_dropped == t - 5
    _pass(cache, k[:, :, :1], q[:, :, :1])  # decoding appends as usual: nothing more is dropped
    assert cache.kept[0].tolist() == [[[4, 5, 6, 10, 11, 12]]] and cache.last_dropped == 0


def _window_votes(q: torch.Tensor, k: torch.Tensor, w: int, mask: torch.Tensor | None) -> torch.Tensor:
    """By hand: softmax weights of the last w queries q [B, H, T, D] over keys k [B, Hkv, T, D] (under mask
    [T, T], or none), summed over those queries and over the query heads of each K/V head -> [B, Hkv, T]."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    votes = torch.zeros(b, hkv, t, dtype=q.dtype)
    for head in range(h):
        scores = q[:, head] @ k[:, head // (h // hkv)].transpose(-1, -2) / d**0.5  # (B, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        votes[:, head // (h // hkv)] += scores.softmax(dim=-1)[:, t - w :].sum(dim=1)
    return votes


def _snap_choice(votes: torch.Tensor, keep: int, kernel: int, pool: str) -> tuple[torch.Tensor, float]:
    """By hand: votes [B, Hkv, S'] pooled over the keys within kernel // 2 of each (those that exist), the
    `keep` best in position order, and the smallest gap between the last kept and the first dropped."""
    r, n = kernel // 2, votes.shape[-1]
    near = [votes[..., max(0, j - r) : j + r + 1] for j in range(n)]
    pooled = torch.stack([x.amax(dim=-1) if pool == "max" else x.mean(dim=-1) for x in near], dim=-1)
    best = pooled.sort(dim=-1, descending=True)
    gap = (best.values[..., keep - 1] - best.values[..., keep]).min().item()
    return best.indices[..., :keep].sort(dim=-1).values, gap


@pytest.mark.parametrize("pool, kernel", [("avg", 3), ("avg", 5), ("max", 1)])
def test_snapkv_votes_are_the_window_queries_causal_attention(pool, kernel):
    """On a model's prompt, each layer keeps the keys that the last `window` queries attend to under the
    causal mask: those queries do not see the keys after them. The votes are computed here from the
    model's weights and a plain softmax, layer by layer."""
    t, budget, w = 20, 12, 6
    ids, pos = IDS[:, :t], torch.arange(t)
    cache = SnapKVCache(2, budget=budget, window=w, kernel=kernel, pool=pool)
    MODEL(ids, cache)
    x = MODEL.tok_emb(ids)
    hd, hkv = CFG.head_dim, CFG.n_kv_heads
    for layer, block in enumerate(MODEL.blocks):
        y = block.ln_1(x)
        q = rotate(block.attn.q_proj(y).view(2, t, -1, hd).transpose(1, 2), pos, CFG.rope_base)
        k = rotate(block.attn.kv_proj(y).view(2, t, 2, hkv, hd)[:, :, 0].transpose(1, 2), pos, CFG.rope_base)
        masked, gap = _snap_choice(_window_votes(q, k, w, causal_mask(t))[..., : t - w], budget - w, kernel, pool)
        unmasked, _ = _snap_choice(_window_votes(q, k, w, None)[..., : t - w], budget - w, kernel, pool)
        assert gap > 1e-6  # no tie at the cut: the choice is the same whatever the tie-breaking
        assert not torch.equal(masked, unmasked)  # the mask changes the choice: this case can tell them apart
        want = torch.cat((masked, torch.arange(t - w, t).expand(2, hkv, w)), dim=-1)
        assert torch.equal(cache.kept[layer], want), layer
        x = block(x, layer, pos)  # the full forward's next layer input
    assert cache.last_dropped == t - budget


# -- the hook: the weights the cache computes are the model's -----------------------------------------

def test_the_observed_weights_are_the_ones_attention_uses():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, t, 4, dtype=torch.float64, generator=g) for h, t in ((4, 5), (2, 9), (2, 9)))
    mask = causal_mask(5, 4)
    w = attention_weights(q, k, mask)  # (B, Hkv, G, T, S)
    by_hand = (w @ v.unsqueeze(2)).reshape(2, 4, 5, 4)  # each group's heads read their one K/V head
    assert max_diff(by_hand, attend(q, k, v, mask)) <= TOL64


@pytest.mark.parametrize("make", [lambda: H2OCache(2, 8, 2), lambda: SnapKVCache(2, 8, 2)])
def test_the_model_shows_each_layer_its_queries_once_per_pass(make, monkeypatch):
    cache, calls = make(), []
    original = type(cache).observe
    monkeypatch.setattr(type(cache), "observe",
                        lambda self, layer, *a: calls.append(layer) or original(self, layer, *a))
    run_chunks(MODEL, IDS, cache, [10, 1, 1])
    assert calls == [0, 1] * 3


# -- the budget, and exactness when it is enough --------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: H2OCache(2, 40, 4), lambda: SnapKVCache(2, 40, 8, 5, "avg"),
                                  lambda: H2OCache(2, 40, 0)])
@pytest.mark.parametrize("sizes", [[40], [16] + [1] * 24, [5, 1, 9, 25]], ids=str)
def test_a_budget_of_the_whole_sequence_is_the_full_cache(make, sizes):
    cache = make()
    out = run_chunks(MODEL, IDS, cache, sizes)
    assert max_diff(out, MODEL(IDS)) <= TOL64 and cache.total_dropped == 0 and cache.length() == 40


@pytest.mark.parametrize("budget, recent", [(6, 2), (10, 0), (12, 12)])
def test_h2o_never_holds_more_than_its_budget_and_always_the_latest(budget, recent):
    cache = H2OCache(2, budget, recent)
    start = 0
    for t in [9, 1, 1, 3, 1, 7, 1, 1]:
        out = MODEL(IDS[:, start : start + t], cache)
        start += t
        assert torch.isfinite(out).all()
        for layer in range(2):
            kept = cache.kept[layer]
            assert cache.length(layer) == min(start, budget) == kept.shape[2]
            latest = min(recent, start)
            assert (kept[..., kept.shape[2] - latest :] == torch.arange(start - latest, start)).all()
            assert (kept.diff(dim=-1) > 0).all()  # distinct, in position order, each head on its own
    assert max_diff(MODEL(IDS[:, start : start + 1], cache), MODEL(IDS[:, : start + 1])[:, -1:]) > 1e-3  # dropped


def test_snapkv_compresses_the_prompt_once_then_grows():
    cache = SnapKVCache(2, budget=10, window=3, kernel=3)
    MODEL(IDS[:, :25], cache)
    assert cache.length() == 10 and cache.last_dropped == 15
    kept = cache.kept[0]
    assert (kept[..., -3:] == torch.arange(22, 25)).all() and (kept.diff(dim=-1) > 0).all()
    assert not torch.equal(kept[0, 0], kept[0, 1])  # the heads chose differently
    for i in range(25, 30):
        MODEL(IDS[:, i : i + 1], cache)
    assert cache.length() == 15 and cache.total_dropped == 15


# -- eviction by position: StreamingLLM after each pass ----------------------------------------------------

@pytest.mark.parametrize("budget, n_keep", [(8, 0), (8, 3), (5, 1)])
def test_streaming_keeps_the_first_and_the_latest_after_a_long_pass(budget, n_keep):
    cache = StreamingCache(2, budget, n_keep)
    out = MODEL(IDS[:, :25], cache)  # one pass longer than the budget: its queries saw every key
    assert max_diff(out, MODEL(IDS[:, :25])) <= TOL64
    want = torch.cat((torch.arange(n_keep), torch.arange(25 - (budget - n_keep), 25)))
    assert all((cache.kept[layer] == want).all() for layer in range(2)) and cache.last_dropped == 25 - budget


@pytest.mark.parametrize("budget, n_keep", [(8, 0), (8, 3)])
def test_streaming_fed_token_by_token_is_the_sink_cache(budget, n_keep):
    """Each query sees the n_keep first keys and the latest budget - n_keep + 1 (its own included): the sink
    cache with that window, which shifts before it writes."""
    streaming, sinks = StreamingCache(2, budget, n_keep), SinkCache(2, budget - n_keep + 1, n_keep)
    a = run_chunks(MODEL, IDS, streaming, [1] * 40)
    b = run_chunks(MODEL, IDS, sinks, [1] * 40)
    assert max_diff(a, b) <= TOL64 and max_diff(a, MODEL(IDS)) > 1e-3
