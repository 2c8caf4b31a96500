"""The smaller caches (latent, KIVI, H2O, SnapKV, streaming) under the course's contract, refusals and rollback.

They are kept out of `helpers.FACTORIES`: the tests that enumerate it compare every kind with the
full forward (or, for rollback, with a cache that rounds the same way), which a cache that drops or
rounds keys by design does not match. These tests ask of them what test_protocol.py,
test_cache_errors.py and test_rollback.py ask of every other kind: one check per pass, nothing
changed by a refused or failed pass, forks that own what they write, and exact rollbacks (or a
clear refusal) within the limit each kind states.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build, rejected, run_chunks

from labcode import GPTConfig
from labcode.caches import CacheError, H2OCache, LatentCache, SnapKVCache, StreamingCache
from labcode.caches.base import states_equal
from labcode.engines import KIVICache

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=40, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, rotary=True)
MLA_CFG = GPTConfig(vocab_size=13, context_length=40, n_layers=2, n_heads=4, d_model=16, rotary=True, kv_latent=6)
PLAIN, LATENT = build(CFG, seed=5, scale=0.5), build(MLA_CFG, seed=6, scale=0.5)
# kind -> (model, an empty cache); budgets small enough that 12 tokens make the scored caches drop
KINDS = {
    "latent": (LATENT, lambda: LatentCache(2, MLA_CFG.cached_kv[1])),
    "kivi2": (PLAIN, lambda: KIVICache(2, bits=2, group_size=2, residual=3)),
    "kivi4": (PLAIN, lambda: KIVICache(2, bits=4, group_size=3, residual=2, value_group=2)),
    "h2o": (PLAIN, lambda: H2OCache(2, budget=6, recent=2)),
    "snapkv": (PLAIN, lambda: SnapKVCache(2, budget=6, window=2, kernel=3)),
    "streaming": (PLAIN, lambda: StreamingCache(2, budget=6, n_keep=2)),
}


def _ids(n: int, seed: int, b: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, n), generator=torch.Generator().manual_seed(seed))


def _filled(kind: str, n: int = 10, b: int = 2, sizes: list[int] | None = None):
    model, make = KINDS[kind]
    cache = make()
    run_chunks(model, _ids(40, 0, b)[:, :n], cache, sizes or [n])  # the first n of one sequence
    return model, cache


def _shape(model, b: int = 2, t: int = 1) -> tuple[int, int, int, int]:
    hkv, d = model.cfg.cached_kv
    return (b, hkv, t, d)


def _reads(cache) -> list[torch.Tensor]:
    return [t for layer in range(cache.n_layers) for t in cache.read(layer)]


# -- the contract ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_validation_runs_once_per_pass(kind, monkeypatch):
    model, cache = _filled(kind)
    calls = []
    original = type(cache)._check
    monkeypatch.setattr(type(cache), "_check", lambda self, chunk: calls.append(chunk.t_new) or original(self, chunk))
    run_chunks(model, _ids(2, 1, 2), cache, [1, 1])
    assert calls == [1, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_begin_writes_nothing_and_cancel_closes_the_pass(kind):
    (model, cache), (_, twin) = _filled(kind), _filled(kind)
    before = cache.state()
    assert cache.begin(_shape(model, t=2), model.dtype, model.device) is None
    cache.cancel()
    assert states_equal(before, cache.state())
    assert torch.equal(model(_ids(3, 1, 2), cache), model(_ids(3, 1, 2), twin))


@pytest.mark.parametrize("kind", KINDS)
def test_a_pass_refused_by_the_model_after_begin_changes_nothing(kind):
    model, cache = _filled(kind, 36)
    rejected(cache, lambda: model(_ids(5, 1, 2), cache), ValueError,
             r"positions: expected start \+ T <= context_length 40")


@pytest.mark.parametrize("kind", KINDS)
def test_a_pass_that_fails_between_layers_commits_nothing_at_all(kind, monkeypatch):
    model, cache = _filled(kind)
    before = cache.state()

    def broken(*args):
        raise RuntimeError("a failure inside the model, between two layers")

    monkeypatch.setattr(model.blocks[1], "forward", broken)
    with pytest.raises(RuntimeError, match="between two layers"):
        model(_ids(2, 1, 2), cache)
    assert states_equal(before, cache.state())  # these kinds write only when a pass is committed


# -- bad input: a clear CacheError, nothing changed --------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_bad_passes_are_refused_and_change_nothing(kind):
    model, cache = _filled(kind)
    b, hkv, t, d = _shape(model)
    rejected(cache, lambda: model(_ids(1, 1, 1), cache), CacheError, r"batch: expected the cache's batch size 2")
    rejected(cache, lambda: cache.begin((b, hkv, t, d), torch.float32, "cpu"), CacheError,
             r"dtype: expected the cache's dtype torch.float64, got torch.float32")
    rejected(cache, lambda: cache.begin((b, hkv + 1, t, d), torch.float64, "cpu"), CacheError, r"k, v: expected")
    rejected(cache, lambda: cache.begin((b, hkv, 2), torch.float64, "cpu"), CacheError,
             r"shape: expected \(B, Hkv, T, D\), four ints")
    rejected(cache, lambda: model(_ids(2, 1, 2)[:, :0], cache), ValueError, r"ids: expected at least one token")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_appends_are_refused_and_change_nothing(kind):
    model, cache = _filled(kind)
    shape = _shape(model)
    k = torch.zeros(shape, dtype=torch.float64)
    for step, call in {"append": lambda: cache.append(0, k, k), "mask": lambda: cache.mask(0, 1),
                       "end": cache.end}.items():
        rejected(cache, call, CacheError, rf"cache: expected a pass in progress \(begin\(\) before {step}\(\)\)")
    cache.begin(shape, torch.float64, "cpu")
    rejected(cache, lambda: cache.append(1, k, k), CacheError, r"layer: expected layer 0 next")
    rejected(cache, lambda: cache.append(0, k[:, :, :, :-2], k[:, :, :, :-2]), CacheError,
             r"k, v: expected two \[B, Hkv, T, D\] tensors of the shape begin\(\) was given")
    rejected(cache, lambda: cache.append(0, k.float(), k.float()), CacheError, r"k, v: expected torch.float64")
    rejected(cache, cache.end, CacheError, r"layer: expected all 2 layers appended before end\(\), got 0")
    cache.cancel()


DEEPER = {"latent": lambda: LatentCache(3), "kivi2": lambda: KIVICache(3), "kivi4": lambda: KIVICache(3, bits=4),
          "h2o": lambda: H2OCache(3, 4, 1), "snapkv": lambda: SnapKVCache(3, 4, 2),
          "streaming": lambda: StreamingCache(3, 4, 1)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_for_another_depth_is_refused(kind):
    deeper = DEEPER[kind]()
    rejected(deeper, lambda: KINDS[kind][0](_ids(4, 0), deeper), CacheError,
             r"cache: expected a cache for 2 layers, got one for 3")


@pytest.mark.parametrize("make, match", [
    (lambda: LatentCache(2, 0), r"width: expected None or a positive row width r \+ dR, got 0"),
    (lambda: KIVICache(2, bits=3), r"bits: expected one of \(2, 4, 8\), got 3"),
    (lambda: KIVICache(2, bits=True), r"bits: expected one of \(2, 4, 8\), got True"),
    (lambda: KIVICache(2, group_size=0), r"group_size: expected a positive number of tokens per key group, got 0"),
    (lambda: KIVICache(2, residual=-1), r"residual: expected a number of latest tokens kept exact, at least 0"),
    (lambda: KIVICache(2, value_group=2.0), r"value_group: expected None or a positive number of channels"),
    (lambda: H2OCache(2, 0, 0), r"budget: expected a positive number of keys to keep per head, got 0"),
    (lambda: H2OCache(2, 4, 5), r"recent: expected an int in \[0, budget 4\]"),
    (lambda: SnapKVCache(2, 4, window=5), r"window: expected an int in \[1, budget 4\]"),
    (lambda: SnapKVCache(2, 4, window=2, kernel=4), r"kernel: expected a positive odd width"),
    (lambda: SnapKVCache(2, 4, window=2, pool="median"), r"pool: expected one of \('max', 'avg'\)"),
    (lambda: StreamingCache(2, 4, n_keep=4), r"n_keep: expected an int in \[0, budget 4\)"),
    (lambda: StreamingCache(2, 4, n_keep=-1), r"n_keep: expected an int in \[0, budget 4\)"),
    (lambda: H2OCache(0, 4, 1), r"n_layers: expected a positive number of layers, got 0"),
])
def test_bad_construction(make, match):
    with pytest.raises(CacheError, match=match):
        make()


def test_kivi_refuses_a_head_dim_its_codes_cannot_pack():
    cache = KIVICache(2, bits=2)
    rejected(cache, lambda: cache.begin((1, 1, 1, 6), torch.float64, "cpu"), CacheError,
             r"k, v: expected a head dim that is a multiple of 4 \(codes of 2 bits pack into bytes\), got 6")
    cache = KIVICache(2, bits=4, value_group=3)
    rejected(cache, lambda: cache.begin((1, 1, 1, 4), torch.float64, "cpu"), CacheError,
             r"value_group: expected a divisor of the head dim D=4, got 3")


def test_the_latent_cache_refuses_heads_another_width_or_two_tensors():
    cache = LatentCache(2, width=MLA_CFG.cached_kv[1])  # r + dR = 6 + 2
    rejected(cache, lambda: PLAIN(_ids(1, 1), cache), CacheError,
             r"k, v: expected latent rows \[B, 1, T, W=8\] \(one row per token, no heads\), got \(1, 2, 1, 4\)")
    rejected(cache, lambda: cache.begin((1, 1, 1, 9), torch.float64, "cpu"), CacheError, r"W=8\]")
    run_chunks(LATENT, _ids(4, 0), cache, [4])
    cache.begin((1, 1, 1, 8), torch.float64, "cpu")
    k = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    rejected(cache, lambda: cache.append(0, k, k.clone()), CacheError,
             r"v: expected the tensor given as k \(a latent row is key and value at once\), got another tensor")
    cache.cancel()


@pytest.mark.parametrize("kind", ["h2o", "snapkv", "streaming"])
def test_observe_refuses_queries_that_do_not_fit_the_pass(kind):
    model, cache = _filled(kind)
    q = torch.zeros(2, 4, 1, 4, dtype=torch.float64)
    rejected(cache, lambda: cache.observe(0, q, None, None), CacheError, r"cache: expected a pass in progress")
    cache.begin(_shape(model), torch.float64, "cpu")
    k = torch.zeros(_shape(model), dtype=torch.float64)
    k_all, _ = cache.append(0, k, k)
    rejected(cache, lambda: cache.observe(1, q, k_all, None), CacheError,
             r"layer: expected layer 0, the one that appended last, got 1")
    rejected(cache, lambda: cache.observe(0, q[:, :3], k_all, None), CacheError,
             r"q: expected a torch.float64 \[B=2, H, T=1, D=4\] tensor with H a multiple of Hkv=2")
    rejected(cache, lambda: cache.observe(0, q.float(), k_all, None), CacheError, r"q: expected a torch.float64")
    cache.cancel()


# -- forks own what they write ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_a_fork_after_drops_equals_a_cache_that_never_forked(kind):
    model, a = _filled(kind, 9, sizes=[7, 1, 1])  # the scored kinds have dropped, KIVI has quantised
    b = a.fork()
    tail_a, tail_b = _ids(4, 1, 2), _ids(3, 2, 2)
    out_a1 = model(tail_a[:, :2], a)
    out_b = run_chunks(model, tail_b, b, [1, 2])
    out_a = torch.cat((out_a1, run_chunks(model, tail_a[:, 2:], a, [1, 1])), dim=1)
    for cache, tail, sizes, out in ((a, tail_a, [2, 1, 1], out_a), (b, tail_b, [1, 2], out_b)):
        _, alone = _filled(kind, 9, sizes=[7, 1, 1])
        assert torch.equal(out, run_chunks(model, tail, alone, sizes))
        assert cache.position == alone.position and cache.length() == alone.length()
        assert all(torch.equal(x, y) for x, y in zip(_reads(cache), _reads(alone), strict=True))


# -- rollback and reorder ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind, limit", [("latent", 10), ("kivi2", 1), ("kivi4", 2), ("h2o", 0), ("snapkv", 3),
                                         ("streaming", 0)])
def test_rollback_is_exact_within_its_limit_and_refused_past_it(kind, limit):
    """KIVI can go back only within the residual beyond the latest R (older tokens are codes now), SnapKV only
    to the end of the compressed prompt, H2O not at all; within the limit, as if never written."""
    sizes = [7, 1, 1, 1]
    model, cache = _filled(kind, 10, sizes=sizes)
    assert cache.rollback_limit() == limit
    for bad in (limit + 1, -1, True, 1.0, None):
        rejected(cache, lambda bad=bad: cache.rollback(bad), CacheError, r"n: expected ")
    cache.rollback(0)
    if not limit:
        return
    cache.rollback(limit)
    kept = [n for i, n in enumerate(sizes) if sum(sizes[: i + 1]) <= 10 - limit]
    ref = _filled(kind, 10 - limit, sizes=kept)[1] if kept else KINDS[kind][1]()
    assert cache.position == ref.position == 10 - limit and cache.length() == ref.length()
    if kept:
        assert all(torch.equal(x, y) for x, y in zip(_reads(cache), _reads(ref), strict=True))
    nxt = _ids(10, 3, 2)[:, :limit]
    assert torch.equal(run_chunks(model, nxt, cache, [1] * limit), run_chunks(model, nxt, ref, [1] * limit))


def test_h2o_says_why_it_cannot_roll_back():
    _, cache = _filled("h2o")
    rejected(cache, lambda: cache.rollback(1), CacheError,
             r"n: expected 0 \(H2O's scores hold the attention of every query it has seen")


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_gathers_every_row(kind):
    _, cache = _filled(kind)
    before = _reads(cache)
    index = torch.tensor([1, 1, 0])
    cache.reorder(index)
    assert all(torch.equal(x.index_select(0, index), y) for x, y in zip(before, _reads(cache), strict=True))
    assert cache.layout.batch == 3
