"""Cross-layer attention (`GPTConfig.kv_share`): layers that attend to another layer's cache.

The exactness needs no training: whatever the weights, a model whose borrowing layers read their
owner's keys and values through any cache of the course gives the logits of its full forward. The
shipped variants (`labcode/data/tiny_cla.pt`, `tiny_gqa.pt`) are checked for what chapter 13 reads
from them.
"""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, ONE_ROW, TOL64, build, make_cache, max_diff, rejected, run_chunks

from labcode import GPTConfig
from labcode.caches import CacheError, ConcatCache, WindowCache
from labcode.model import GPT
from labcode.weights.checkpoint import CLA_CHECKPOINT, DEFAULT_CHECKPOINT, GQA_CHECKPOINT, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
BASE = GPTConfig(vocab_size=17, context_length=32, n_layers=5, n_heads=4, d_model=32)
CONFIGS = {
    "share-2": BASE.with_(kv_share=2),  # owners 0, 2, 4: the last owner has no borrower
    "share-3-rotary": BASE.with_(kv_share=3, rotary=True, n_kv_heads=2),  # owners 0, 3, grouped heads
    "share-all": BASE.with_(kv_share=5),  # one cache for the whole model (YOCO's limit)
    "share-2-window": BASE.with_(kv_share=2, sliding_window=6),
}
MODELS = {name: build(cfg, seed=i, scale=0.3) for i, (name, cfg) in enumerate(CONFIGS.items())}
IDS = torch.randint(0, 17, (2, 24), generator=torch.Generator().manual_seed(0))
SCHEDULES = [[24], [1] * 24, [5, 1, 7, 2, 9]]


@pytest.mark.parametrize("name", CONFIGS)
def test_owners_and_borrowers(name):
    cfg, model = CONFIGS[name], MODELS[name]
    owners = [i for i, b in enumerate(model.blocks) if b.attn.kv_proj is not None]
    assert owners == list(range(0, cfg.n_layers, cfg.kv_share)) and len(owners) == cfg.kv_layers
    plain = GPT(cfg.with_(kv_share=1))
    kv = 2 * cfg.n_kv_heads * cfg.head_dim * (cfg.d_model + 1)  # one layer's K/V projection, with its bias
    assert plain.num_params() - model.num_params() == (cfg.n_layers - cfg.kv_layers) * kv


@pytest.mark.parametrize("name", [n for n in CONFIGS if "window" not in n])
@pytest.mark.parametrize("kind", [k for k in EXACT if k not in ONE_ROW | {"sliding", "sinks"}])
@pytest.mark.parametrize("sizes", SCHEDULES, ids=str)
def test_every_exact_cache_gives_the_full_forward(name, kind, sizes):
    model = MODELS[name]
    full = model(IDS)
    assert full.abs().max() > 0.1  # logits far from zero: the bar is not met by tiny numbers
    assert max_diff(run_chunks(model, IDS, make_cache(kind, model, batch=2), sizes), full) <= TOL64


@pytest.mark.parametrize("kind", ["paged", "cells"])
def test_the_one_sequence_caches_give_the_full_forward(kind):
    model = MODELS["share-3-rotary"]
    full = model(IDS[:1])
    assert max_diff(run_chunks(model, IDS[:1], make_cache(kind, model), [5, 1, 7, 2, 9]), full) <= TOL64


def test_a_sliding_window_model_shares_its_band():
    model = MODELS["share-2-window"]
    full = model(IDS)
    cache = make_cache("sliding", model, room=5)  # W - 1 = 5 rows kept: what the band needs
    assert max_diff(run_chunks(model, IDS, cache, [5, 1, 6, 2, 6, 4]), full) <= TOL64
    assert cache.total_dropped > 0


def test_the_cache_holds_the_owners_only():
    cfg, model = CONFIGS["share-2"], MODELS["share-2"]
    shared, plain = ConcatCache(cfg.kv_layers), ConcatCache(cfg.n_layers)
    model(IDS, shared)
    build(cfg.with_(kv_share=1))(IDS, plain)
    assert shared.nbytes * cfg.n_layers == plain.nbytes * cfg.kv_layers


def test_a_borrower_reads_its_owners_keys():
    """Change the owner's value projection: the borrower's output moves with it, through the cache."""
    cfg = CONFIGS["share-2"]
    a, b = build(cfg, seed=3, scale=0.3), build(cfg, seed=3, scale=0.3)
    with torch.no_grad():
        b.blocks[2].attn.kv_proj.weight[cfg.n_kv_heads * cfg.head_dim :] *= 2  # layer 2's values only
    hidden_a, hidden_b = (m.run(IDS, ConcatCache(cfg.kv_layers), keep_hidden=True)[1] for m in (a, b))
    assert max_diff(hidden_a[1], hidden_b[1]) == 0  # layers 0 and 1 never see layer 2
    assert max_diff(hidden_a[2], hidden_b[2]) > 1e-3 and max_diff(hidden_a[3], hidden_b[3]) > 1e-3


def test_a_cache_for_every_layer_is_refused_and_unchanged():
    model = MODELS["share-2"]
    cache = WindowCache(BASE.n_layers, 32)
    rejected(cache, lambda: model(IDS, cache), CacheError, r"expected a cache for 3 layers, got one for 5")


def test_the_naive_cache_lives_in_the_owners():
    model = MODELS["share-2"]
    model.reset_kv_cache()
    full = model(IDS)
    out = torch.cat([model(IDS[:, a:b], use_cache=True) for a, b in ((0, 9), (9, 10), (10, 24))], dim=1)
    assert max_diff(out, full) <= TOL64
    held = [blk.attn.cache_k is not None for blk in model.blocks]
    assert held == [True, False, True, False, True]
    model.reset_kv_cache()


def test_a_borrowing_layer_alone_says_what_it_needs():
    block = MODELS["share-2"].blocks[1]
    x = torch.randn(1, 3, BASE.d_model, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"shared: expected the keys and values of layer 0, which layer 1"):
        block(x, 1, torch.arange(3))


@pytest.mark.parametrize(("changes", "match"), [
    ({"kv_share": 0}, r"GPTConfig.kv_share: expected an int in \[1, n_layers 5\]"),
    ({"kv_share": 6}, r"GPTConfig.kv_share: expected an int in \[1, n_layers 5\]"),
    ({"kv_share": 2.0}, r"GPTConfig.kv_share"),
    ({"kv_share": 2, "kv_latent": 8}, r"and 1 with kv_latent"),
])
def test_bad_sharing_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.with_(**changes)


def test_the_shipped_variants_halve_the_cache_and_keep_the_rest():
    tiny = load_checkpoint(DEFAULT_CHECKPOINT, device="cpu")
    cla, gqa = (load_checkpoint(p, device="cpu") for p in (CLA_CHECKPOINT, GQA_CHECKPOINT))
    assert cla.cfg == tiny.cfg.with_(kv_share=2) and gqa.cfg == tiny.cfg.with_(n_kv_heads=2)
    per_token = {m: m.cfg.kv_layers * m.cfg.n_kv_heads for m in (tiny, cla, gqa)}
    assert per_token[cla] == per_token[gqa] == per_token[tiny] // 2
