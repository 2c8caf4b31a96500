"""Latent attention (MLA): naive equals absorbed, the cache holds the latent, and the counts of bytes and FLOPs.

A random-weight model is enough: both ways compute the same attention whatever the weights, and the
bytes depend only on the shapes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build, max_diff, run_chunks

from labcode import GPTConfig
from labcode.caches import CacheError, ConcatCache, LatentCache, PairsCache, SlidingWindowCache
from labcode.config import get_config
from labcode.cost import kv_cache_bytes
from labcode.flops import measure_flops
from labcode.mla import (
    LatentAttention,
    bytes_per_token_table,
    folded_weights,
    latent_bytes_per_token,
    latent_step_flops,
    set_mode,
    shared_step_flops,
)
from labcode.model import rotate

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
BASE = GPTConfig(vocab_size=17, context_length=32, n_layers=2, n_heads=4, d_model=32, kv_latent=10)
CONFIGS = {
    "rotary": BASE.with_(rotary=True),  # a rotary key of D/2 = 4 beside the latent
    "rotary-wide-key": BASE.with_(rotary=True, latent_rope_dim=6, bias=False),
    "learned": BASE,  # learned positions: no rotary key, the row is the latent alone
    "window": BASE.with_(rotary=True, sliding_window=5),
}
MODELS = {name: build(cfg, seed=i, scale=0.3) for i, (name, cfg) in enumerate(CONFIGS.items())}
IDS = torch.randint(0, 17, (2, 24), generator=torch.Generator().manual_seed(0))
SCHEDULES = [[24], [1] * 24, [5, 1, 7, 2, 9], [3, 3, 3, 15]]


def _both(model, fn):
    """fn() computed the naive way and the absorbed way."""
    out = fn(set_mode(model, "naive")), fn(set_mode(model, "absorbed"))
    set_mode(model, "naive")
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_naive_equals_absorbed_in_float64(name):
    model = MODELS[name]
    naive, absorbed = _both(model, lambda m: m(IDS))
    assert max_diff(naive, absorbed) <= TOL64
    assert naive.abs().max() > 0.1  # logits far from zero: the bar is not met by tiny numbers


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("sizes", SCHEDULES, ids=str)
def test_the_latent_cache_equals_the_full_forward_both_ways(name, sizes):
    model = MODELS[name]
    full = model(IDS)
    for out in _both(model, lambda m: run_chunks(m, IDS, _latent_cache(m), sizes)):
        assert max_diff(out, full) <= TOL64


def _latent_cache(model):
    """A cache for the latent rows of `model`: the latent cache, or the band's cache for a sliding window
    (any cache of the course holds the rows; the latent cache applies no band, and refuses such a model)."""
    if model.cfg.sliding_window is not None:
        return SlidingWindowCache(2, model.cfg.sliding_window, max_chunk=24)
    return LatentCache(2, model.cfg.cached_kv[1])


def test_the_latent_cache_refuses_a_sliding_window_model():
    with pytest.raises(CacheError, match=r"cache: expected a cache whose masks apply the model's sliding window"):
        MODELS["window"](IDS, LatentCache(2))


def test_the_cache_holds_the_latent_and_the_rotary_key_only():
    model, cfg = MODELS["rotary"], CONFIGS["rotary"]
    cache = LatentCache(cfg.n_layers)
    model(IDS[:, :9], cache)
    rows, same = cache.read(0)
    r, dr = cfg.kv_latent, cfg.latent_rope_dim
    assert rows is same and tuple(rows.shape) == (2, 1, 9, r + dr)
    attn = model.blocks[0].attn
    down = attn.kv_down(model.blocks[0].ln_1(model.tok_emb(IDS[:, :9])))  # (B, T, r + dR): layer 0, by hand
    c = down[..., :r] * torch.rsqrt(down[..., :r].pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * attn.kv_norm.weight
    assert max_diff(rows[:, 0, :, :r], c) <= TOL64  # the normed latent
    assert max_diff(rows[:, 0, :, r:], rotate(down[:, None, :, r:], torch.arange(9), cfg.rope_base)[:, 0]) <= TOL64
    per_token = latent_bytes_per_token(cfg.n_layers, r, dr, 8)
    assert cache.nbytes == 2 * 9 * per_token


@pytest.mark.parametrize("style", ["concat", "pairs", "naive"])
def test_every_cache_style_runs_the_latent_model_but_stores_the_row_twice(style):
    model = MODELS["rotary"]
    full = model(IDS)
    if style == "naive":
        model.reset_kv_cache()
        out = torch.cat([model(IDS[:, :5], use_cache=True), model(IDS[:, 5:], use_cache=True)], dim=1)
        model.reset_kv_cache()
    else:
        cache = ConcatCache(2) if style == "concat" else PairsCache(2)
        out = run_chunks(model, IDS, cache, [5, 19])
        latent = LatentCache(2)
        model(IDS, latent)
        assert cache.nbytes == 2 * latent.nbytes  # key and value: the same row, kept twice
    assert max_diff(out, full) <= TOL64


def test_the_folded_projections_give_the_absorbed_query_and_output():
    """W_uk folded into the query projection and W_uv into the output projection, once, compute what the
    absorbed mode computes step by step (a model without biases, whose projections fold whole)."""
    model = MODELS["rotary-wide-key"]
    attn: LatentAttention = model.blocks[0].attn
    w_q, w_o = folded_weights(attn)
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h, d, dr = attn.n_heads, attn.head_dim, attn.rope_dim
    q_c = attn.q_proj(x).view(2, 5, h, d + dr).transpose(1, 2)[..., :d]  # (B, H, T, D)
    w_uk, w_uv = attn.up_weights()
    assert max_diff(torch.einsum("btc,hcr->bhtr", x, w_q), torch.einsum("bhtd,hdr->bhtr", q_c, w_uk)) <= TOL64
    o = torch.randn(2, h, 5, attn.rank, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.einsum("bhtr,hdr->bhtd", o, w_uv).transpose(1, 2).reshape(2, 5, h * d)
    assert max_diff(torch.einsum("bhtr,hrc->btc", o, w_o), attn.out_proj(y)) <= TOL64


@pytest.mark.parametrize("cached", [0, 11])
def test_the_flop_formulas_match_the_counter(cached):
    """A decode step (or a prefill of 4 after nothing): measured FLOPs, less the feed-forward and the head,
    are the shared projections plus the mode's attention, as the formulas say."""
    model, cfg = MODELS["rotary"], CONFIGS["rotary"]
    t = 1 if cached else 4
    prefix = IDS[:, :cached]
    b, c = 2, cfg.d_model
    rest = cfg.n_layers * 2 * b * t * 2 * c * cfg.d_ff + 2 * b * t * c * cfg.vocab_size  # feed-forward and head
    for mode in ("naive", "absorbed"):
        set_mode(model, mode)
        cache = LatentCache(2)
        if cached:
            model(prefix, cache)
        total, _ = measure_flops(lambda cache=cache: model(IDS[:, cached : cached + t], cache))
        want = shared_step_flops(cfg, t, batch=2) + latent_step_flops(cfg, mode, t, cached + t, batch=2) + rest
        assert total == want, (mode, total, want)
    set_mode(model, "naive")


def test_absorbed_beats_naive_for_decode_at_length():
    cfg = get_config("smollm2-135m").with_(n_kv_heads=None, kv_latent=256, latent_rope_dim=32)
    naive, absorbed = (latent_step_flops(cfg, m, 1, 4096) for m in ("naive", "absorbed"))
    assert absorbed * 4 < naive  # the naive step up-projects all S latents, every step
    # a prefill of 512 queries shares each up-projected row among them: there the absorbed way costs more
    assert latent_step_flops(cfg, "absorbed", 512, 512) > latent_step_flops(cfg, "naive", 512, 512)


def test_bytes_per_token_at_smollm2s_width():
    cfg = get_config("smollm2-135m")  # L=30, H=9, Hkv=3, D=64
    rows = {(r["layout"], r["rank"]): r["bytes_per_token"] for r in bytes_per_token_table(cfg, [64, 256], 32, 2)}
    assert rows[("MHA", None)] == 2 * 30 * 9 * 64 * 2 == kv_cache_bytes(30, 1, 1, 9, 64, 2)
    assert rows[("GQA", None)] == 2 * 30 * 3 * 64 * 2
    assert rows[("MQA", None)] == 2 * 30 * 1 * 64 * 2
    assert rows[("MLA", 64)] == 30 * (64 + 32) * 2 and rows[("MLA", 256)] == 30 * (256 + 32) * 2
    assert rows[("MQA", None)] < rows[("MLA", 256)] < rows[("GQA", None)]  # DeepSeek's ratios (r = 4D, dR = D/2)


@pytest.mark.parametrize("changes, match", [
    ({"kv_latent": 0}, r"GPTConfig.kv_latent: expected None or a positive int"),
    ({"kv_latent": 8, "rotary": True, "latent_rope_dim": 3}, r"GPTConfig.latent_rope_dim: expected None or a "
     r"positive even int"),
    ({"kv_latent": 8, "latent_rope_dim": 4}, r"GPTConfig.latent_rope_dim: expected None or 0 \(no rotary"),
    ({"latent_rope_dim": 4}, r"GPTConfig.latent_rope_dim: expected None without kv_latent"),
    ({"kv_latent": 8, "n_kv_heads": 2}, r"GPTConfig.n_kv_heads: expected None or n_heads 4 with kv_latent"),
])
def test_bad_latent_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(n_heads=4, d_model=32, **changes)


def test_the_default_model_is_unchanged_by_the_option():
    cfg = get_config("tiny")
    assert cfg.kv_latent is None and cfg.latent_rope_dim is None and cfg.cached_kv == (4, 16)
    names = {n for n, _ in build(cfg).named_parameters()}
    assert not any("kv_down" in n or "kv_up" in n for n in names) and "blocks.0.attn.kv_proj.weight" in names
    rotary = BASE.with_(rotary=True)
    assert rotary.latent_rope_dim == 4 and rotary.with_(d_model=64).latent_rope_dim == 8  # follows D/2


def test_set_mode_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match=r"mode: expected one of \('naive', 'absorbed'\), got 'fast'"):
        set_mode(MODELS["rotary"], "fast")
    with pytest.raises(ValueError, match=r"model: expected a model with latent attention"):
        set_mode(build(get_config("micro")), "absorbed")


@pytest.mark.parametrize("mode", ["naive", "absorbed"])
def test_generate_with_the_latent_cache_is_generation_without_a_cache(mode):
    from labcode.generate import generate, generate_nocache

    model = set_mode(MODELS["rotary"], mode)
    try:
        ids = IDS[:1, :5]
        cached, plain = generate(model, ids, 12, LatentCache(2)), generate_nocache(model, ids, 12)
        assert torch.equal(cached.ids, plain.ids)
        assert max(max_diff(a, b) for a, b in zip(cached.step_logits, plain.step_logits, strict=True)) <= TOL64
    finally:
        set_mode(model, "naive")
