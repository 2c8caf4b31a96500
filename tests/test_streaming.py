"""One-pass scoring of cache policies (`labcode.streaming`), on tiny models: the pass is the caches' own
answer, token by token, and bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode import GPTConfig
from labcode.caches import SinkCache, WindowCache
from labcode.streaming import policy_mask, run_policy, token_losses

pytestmark = pytest.mark.usefixtures("no_grad")
CFG = GPTConfig(vocab_size=17, context_length=40, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16, rotary=True)
MODELS = {rotary: build(CFG.with_(rotary=rotary), seed=1, scale=0.4) for rotary in (False, True)}


def one_by_one(model, ids, cache):
    return torch.cat([model(ids[:, i : i + 1], cache) for i in range(ids.shape[1])], dim=1)


def test_the_mask_keeps_the_first_and_the_latest():
    m = policy_mask(8, window=4, n_keep=1)
    assert m[7].tolist() == [True, False, False, False, False, True, True, True]  # 1 sink + latest 3
    assert torch.equal(policy_mask(5, None), torch.ones(5, 5).tril().bool())


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rotary=st.booleans(), window=st.integers(2, 9), n_keep=st.integers(0, 3), t=st.integers(1, 20),
       seed=st.integers(0, 99))
def test_one_pass_equals_the_caches_token_by_token(rotary, window, n_keep, t, seed):
    model = MODELS[rotary]
    n_keep = min(n_keep, window - 1)
    ids = torch.randint(0, CFG.vocab_size, (1, t), generator=torch.Generator().manual_seed(seed))
    cache = SinkCache(CFG.n_layers, window - n_keep, n_keep=n_keep) if n_keep else WindowCache(CFG.n_layers, window)
    logits, mass = run_policy(model, ids, window, n_keep)
    assert (logits - one_by_one(model, ids, cache)).abs().max().item() <= TOL64
    assert mass.shape == (CFG.n_layers, CFG.n_heads) and ((mass >= 0) & (mass <= 1 + 1e-12)).all()
    assert (run_policy(model, ids)[0] - model(ids)).abs().max().item() <= TOL64


@pytest.mark.parametrize("window, n_keep, first, rule, seen", [
    (None, 0, 1, "absolute", lambda i: (1, i + 1)),  # query i sees keys 0..i: 1/(i + 1) on key 0
    (None, 0, 3, "absolute", lambda i: (min(3, i + 1), i + 1)),
    (6, 0, 1, "absolute", lambda i: (int(i < 6), min(i + 1, 6))),  # key 0 leaves the window at query 6
    (6, 2, 2, "absolute", lambda i: (min(2, i + 1), min(i + 1, 6))),  # the two sinks stay in view
    (6, 2, 2, "cache", lambda i: (min(2, i + 1), min(i + 1, 6))),  # positions do not matter to zero queries
    (6, 1, 3, "absolute", lambda i: (min(3, i + 1), i + 1) if i < 6 else (1 + min(2, max(0, 7 - i)), 6)),
])
def test_the_mass_on_the_first_positions_under_uniform_attention(window, n_keep, first, rule, seen):
    """With the query projections zeroed every score is 0, so each query attends uniformly over the keys it
    sees: if query i sees n_i keys, f_i of them among the first `first`, it puts f_i / n_i on them, and the
    mass is the mean of f_i / n_i over the T queries, the same for every head of every layer. (With the
    window of 6 slots and one sink, query 6 sees keys 0 and 2..6, query 7 and after only the sink of the
    first three.)"""
    t = 12
    model = build(CFG, seed=3, scale=0.4)
    for block in model.blocks:
        block.attn.q_proj.weight.zero_()
        block.attn.q_proj.bias.zero_()
    ids = torch.randint(0, CFG.vocab_size, (1, t), generator=torch.Generator().manual_seed(2))
    mass = run_policy(model, ids, window, n_keep, rule, first)[1]
    want = sum(f / n for f, n in map(seen, range(t))) / t
    assert mass.shape == (CFG.n_layers, CFG.n_heads)
    assert (mass - want).abs().max().item() <= 1e-12


def test_positions_within_the_cache_move_only_the_kept_keys():
    model, ids = MODELS[True], torch.arange(30).remainder(CFG.vocab_size).view(1, -1)
    plain = run_policy(model, ids, 6, 0)[0]
    assert torch.equal(run_policy(model, ids, 6, 0, "cache")[0], plain)  # no kept keys: the same scores
    absolute, renumbered = run_policy(model, ids, 6, 2)[0], run_policy(model, ids, 6, 2, "cache")[0]
    assert (absolute[:, :6] - renumbered[:, :6]).abs().max().item() <= TOL64  # nothing dropped yet
    assert (absolute[:, 6:] - renumbered[:, 6:]).abs().max().item() > 1e-6  # the sinks come closer
    assert token_losses(plain, ids).shape == (29,)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=0), r"window: expected None or a positive number of cache slots, got 0"),
    (dict(window=4, n_keep=4), r"n_keep: expected 0 <= n_keep < window"),
    (dict(n_keep=1), r"n_keep: expected 0 <= n_keep < window"),
    (dict(window=4, rule="streaming"), r"rule: expected one of \('absolute', 'cache'\)"),
    (dict(first=0), r"first: expected a positive number of first positions"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_policy(MODELS[True], torch.zeros(1, 5, dtype=torch.long), **kwargs)


def test_renumbering_needs_rotary_positions_and_eval_mode():
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"rule: expected 'absolute' for a model with a position table"):
        run_policy(MODELS[False], ids, 4, 1, "cache")
    with pytest.raises(ValueError, match=r"model: expected a model in eval mode"):
        run_policy(MODELS[True].train(), ids)
    MODELS[True].eval()
