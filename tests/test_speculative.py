"""Speculative decoding on every cache kind that rolls back: greedy output is plain greedy decoding's, token for
token, with every verified position's logits equal to the target's (float64, 1e-12); sampled output keeps the
target's distribution (seeded chi-squared tests that a wrong acceptance rule fails)."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from helpers import EXACT, TOL64, build, make_cache, property_configs, rejected

from labcode.caches import CacheError, ConcatCache, SlidingWindowCache, WindowCache
from labcode.engines import QuantizedCache
from labcode.generate import generate, generate_nocache
from labcode.speculative import (
    ModelDraft,
    PromptLookupDraft,
    accept_draft,
    first_layers,
    probabilities,
    speculation_stats,
    speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py

CONFIGS = property_configs(context_length=40)
MODELS = [build(CONFIGS[i], i, scale=0.5) for i in (0, 2, 3)]  # 2 and 3 layers, learned and rotary positions
PROMPTS = [torch.randint(0, 11, (1, p), generator=torch.Generator().manual_seed(p)) for p in (3, 7)]


def chi2_critical(df: int, alpha: float) -> float:
    """The chi-squared quantile 1 - alpha by the Wilson-Hilferty cube-root approximation (within 2% for df >= 5
    at these levels, and slightly above the exact value, so the test errs towards passing a correct rule):
    df (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, z the standard normal quantile (Python's statistics module)."""
    z = NormalDist().inv_cdf(1 - alpha)
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of category counts [V] against probabilities [V], the categories expected fewer than 5
    times pooled into one; returns (statistic, degrees of freedom)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat((counts[~small].double(), counts[small].double().sum().view(1)))
    exp = torch.cat((expected[~small], expected[small].sum().view(1)))
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def test_the_critical_value_matches_the_table():
    assert 0 < chi2_critical(10, 1e-3) - 29.588 < 0.01 * 29.588  # above the tabulated 0.999 quantile for 10 df
    assert abs(chi2_critical(5, 1e-3) - 20.515) / 20.515 < 0.02


def drafts_for(model, kind: str):
    return PromptLookupDraft() if kind == "lookup" else ModelDraft(first_layers(model, 1), ConcatCache(1))


# -- greedy: plain greedy decoding's tokens and logits ------------------------------------------------


@pytest.mark.parametrize("kind", EXACT)
@pytest.mark.parametrize("draft", ["lookup", "layers"])
def test_greedy_speculation_is_greedy_decoding_on_every_cache(kind, draft):
    drafted = accepted = 0
    for model in MODELS:
        for ids, k in zip(PROMPTS, (2, 4), strict=True):
            ref = generate_nocache(model, ids, 16)
            out = speculative_generate(model, ids, 16, make_cache(kind, model, 40), drafts_for(model, draft), k=k)
            assert torch.equal(out.ids, ref.ids) and out.stop_reason == ref.stop_reason
            assert len(out.step_logits) == 16
            diff = max((a - b).abs().max().item() for a, b in zip(out.step_logits, ref.step_logits, strict=True))
            assert diff <= TOL64
            assert out.target_passes == 1 + len(out.drafted) < 16
            assert out.new_tokens == 1 + sum(out.accepted) + len(out.drafted)
            drafted, accepted = drafted + sum(out.drafted), accepted + sum(out.accepted)
    assert drafted > accepted > 0  # both outcomes happened: kept drafts and rolled-back ones


@pytest.fixture(scope="module")
def shipped_pair():
    """The shipped tiny model and the tinier draft trained on the same corpus, both in float64."""
    from labcode.tokenizer import CharTokenizer
    from labcode.weights.checkpoint import DRAFT_CHECKPOINT, load_checkpoint

    tok = CharTokenizer()
    target = load_checkpoint(device="cpu", dtype=torch.float64)
    draft = load_checkpoint(DRAFT_CHECKPOINT, device="cpu", dtype=torch.float64)
    return target, draft, [tok.encode_tensor(t) for t in ("The owl found a", "The sleepy fox walked to")]


def test_the_trained_draft_is_greedy_decoding_on_every_cache_and_keeps_more_than_the_first_layer(shipped_pair):
    target, draft, prompts = shipped_pair
    assert draft.cfg.n_layers < target.cfg.n_layers and draft.num_params() < target.num_params() / 4
    kept = {"trained": [0, 0], "layers": [0, 0]}  # [accepted, drafted]
    for kind in EXACT:
        for ids in prompts:
            ref = generate_nocache(target, ids, 16)
            for name in kept:
                d = ModelDraft(draft, ConcatCache(1)) if name == "trained" else drafts_for(target, "layers")
                out = speculative_generate(target, ids, 16, make_cache(kind, target), d, k=4)
                assert torch.equal(out.ids, ref.ids), (kind, name)
                pairs = zip(out.step_logits, ref.step_logits, strict=True)
                assert max((a - b).abs().max().item() for a, b in pairs) <= TOL64, (kind, name)
                kept[name][0] += sum(out.accepted)
                kept[name][1] += sum(out.drafted)
    trained, layers = (a / d for a, d in kept.values())
    assert trained > layers  # a model trained to predict the next token guesses better than an early exit


def test_greedy_speculation_on_a_quantised_cache_is_its_cached_greedy_decoding():
    model, ids = MODELS[1], PROMPTS[1]
    ref = generate(model, ids, 16, QuantizedCache(model.cfg.n_layers))
    out = speculative_generate(model, ids, 16, QuantizedCache(model.cfg.n_layers), drafts_for(model, "layers"), k=3)
    assert torch.equal(out.ids, ref.ids)
    assert max((a - b).abs().max().item() for a, b in zip(out.step_logits, ref.step_logits, strict=True)) <= TOL64


def test_the_stop_reasons_are_generate_s():
    model, ids = MODELS[0], PROMPTS[1]
    out = speculative_generate(model, ids, 100, ConcatCache(model.cfg.n_layers), PromptLookupDraft(), k=4)
    assert out.stop_reason == "context_length" and out.ids.shape[1] == 40
    assert torch.equal(out.ids, generate_nocache(model, ids, 100).ids)
    assert speculative_generate(model, ids, 0, ConcatCache(2), PromptLookupDraft()).new_tokens == 0


def test_stats_count_what_happened():
    model = MODELS[1]
    draft = drafts_for(model, "layers")
    out = speculative_generate(model, PROMPTS[0], 12, ConcatCache(model.cfg.n_layers), draft, k=3)
    stats = speculation_stats(out)
    assert stats["acceptance_rate"] == sum(out.accepted) / sum(out.drafted)
    assert stats["target_passes_per_token"] == out.target_passes / 12
    assert out.draft_passes == draft.passes > 0
    assert draft.cache.position <= out.ids.shape[1] - 1  # the draft's cache was rolled back with the target's


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    draft = PromptLookupDraft(max_n=2)
    assert draft.propose(torch.tensor([[1, 2, 3, 9, 1, 2]]), 3, None) == ([3, 9, 1], None)
    assert draft.propose(torch.tensor([[5, 1, 4, 1, 6, 1]]), 2, None) == ([6, 1], None)  # n = 1, the latest "1"
    assert draft.propose(torch.tensor([[5, 1, 4, 1, 6, 1]]), 3, None) == ([4, 1, 6], None)  # the longest there is
    assert draft.propose(torch.tensor([[1, 2, 3]]), 2, None) == ([], None)


def test_first_layers_shares_the_target_s_modules():
    model = MODELS[1]
    draft = first_layers(model, 1)
    assert draft.cfg.n_layers == 1 and draft.blocks[0] is model.blocks[0] and draft.tok_emb is model.tok_emb
    with pytest.raises(ValueError, match=r"n_layers: expected an int in \[1, 3\), got 3"):
        first_layers(model, 3)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_first_layers_is_the_cut_model_and_leaves_the_target_whole(n_layers):
    """The draft computes what a model of n_layers blocks with the target's first weights computes, with and
    without a cache, and building it changes nothing in the target."""
    model, ids = MODELS[1], PROMPTS[1]
    before = model(ids)
    draft = first_layers(model, n_layers)
    cut = type(model)(model.cfg.with_(n_layers=n_layers)).to(model.dtype).eval()
    cut.load_state_dict({k: v for k, v in model.state_dict().items() if k in cut.state_dict()})
    assert (draft(ids) - cut(ids)).abs().max().item() == 0.0
    assert (draft(ids, ConcatCache(n_layers)) - cut(ids)).abs().max().item() <= TOL64
    assert len(model.blocks) == model.cfg.n_layers == 3 and torch.equal(model(ids), before)


def test_bad_requests_are_refused_before_anything_runs():
    model, ids = MODELS[0], PROMPTS[1]
    cache = ConcatCache(model.cfg.n_layers)
    rejected(cache, lambda: speculative_generate(model, ids, 5, cache, PromptLookupDraft(), k=0), ValueError,
             r"k: expected a positive number")
    rejected(cache, lambda: speculative_generate(model, ids.repeat(2, 1), 5, cache, PromptLookupDraft()),
             ValueError, r"ids: expected one sequence")
    rejected(cache, lambda: speculative_generate(model, ids, 5, cache, "draft"), ValueError, r"draft: expected")
    window = WindowCache(model.cfg.n_layers, 10)  # 7 + 5 - 1 positions would make it drop, then refuse rollbacks
    rejected(window, lambda: speculative_generate(model, ids, 5, window, PromptLookupDraft()), CacheError,
             r"cache: expected a cache that keeps the 11 positions this run may roll back \(or a rollback reserve "
             r"of k = 4\), got WindowCache keeping 10")
    small = WindowCache(model.cfg.n_layers, 20)
    rejected(small, lambda: speculative_generate(model, ids, 5, small, PromptLookupDraft(), k=20), ValueError,
             r"k: expected at most 19")
    rejected(cache, lambda: speculative_generate(model, ids, 5, cache, PromptLookupDraft(), temperature=1.0),
             ValueError, r"generator: expected a torch.Generator")
    draft = ModelDraft(first_layers(model, 1), WindowCache(1, 8))
    rejected(cache, lambda: speculative_generate(model, ids, 5, cache, draft), CacheError, r"draft cache: expected")
    used = ModelDraft(first_layers(model, 1), ConcatCache(1))
    speculative_generate(model, ids, 5, ConcatCache(model.cfg.n_layers), used)
    rejected(cache, lambda: speculative_generate(model, ids, 5, cache, used), CacheError,
             r"draft cache: expected an empty cache \(a ModelDraft serves one generation")


# -- sampling: the target's distribution, whatever the draft ------------------------------------------


def rule_counts(p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int, rule=accept_draft,
                at: int = 0) -> torch.Tensor:
    """Counts [V] of the token the acceptance rule emits at draft position `at` (the kept draft there or the token
    drawn in its place), over the draws that kept every draft before it; each draft token drawn from q (or fixed)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1], dtype=torch.long)
    for _ in range(draws):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(q.shape[0])] if q is not None else [3]
        j, nxt = rule(p, q, drafts, gen)
        if j >= at:
            counts[drafts[at] if j > at else nxt] += 1
    return counts


@pytest.mark.parametrize("with_q", [True, False])
def test_the_acceptance_rule_emits_the_target_s_distribution(with_q):
    """A draft far from the target (q) or a point mass (prompt lookup): the first emitted token is still p_1's."""
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(3, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    q = (torch.randn(2, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1) if with_q else None
    if not with_q:
        p = p[:2]
    stat, df = chi2_statistic(rule_counts(p, q, 4000, seed=1), p[0])
    assert stat < chi2_critical(df, 1e-3), (stat, df)


def resample_from_p(p, q, drafts, gen):
    """Wrong: at a rejection, draw from the target's p instead of the residual max(0, p - q)."""
    j, _ = accept_draft(p, q, drafts, gen)
    return j, int(torch.multinomial(p[j], 1, generator=gen))


def keep_every_draft(p, q, drafts, gen):
    """Wrong: keep every draft (the draft's distribution, not the target's)."""
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


def accept_by_q_over_p(p, q, drafts, gen):
    """Wrong: the ratio upside down, min(1, q / p), with the residual as before."""
    for i, d in enumerate(drafts):
        if torch.rand((), dtype=torch.float64, generator=gen) * p[i, d] < q[i, d]:
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


@pytest.mark.parametrize("wrong", [resample_from_p, keep_every_draft, accept_by_q_over_p])
def test_a_wrong_acceptance_rule_fails_the_same_test(wrong):
    """The chi-squared test above has the power to catch a wrong rule: the same p, q, draws and seed."""
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(3, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    q = (torch.randn(2, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    stat, df = chi2_statistic(rule_counts(p, q, 4000, seed=1, rule=wrong), p[0])
    assert stat > chi2_critical(df, 1e-3), (wrong.__name__, stat, df)


def two_drafts_past_the_first():
    """p [3, V] and q [2, V] as above, with q[0] moved halfway to p[0]: min(p[0], q[0]) then sums to at least 1/2,
    so more than half the draws keep the first draft and go on to the second."""
    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(3, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    q = (torch.randn(2, 11, generator=gen, dtype=torch.float64) * 1.5).softmax(-1)
    q[0] = (q[0] + p[0]) / 2
    return p, q


def test_the_token_after_a_kept_draft_is_the_target_s_too():
    """Two drafts from q; over the draws that keep the first, the second emitted token (the kept second draft or
    the token drawn from its residual) is p[1]'s. q[0] and q[1], p[0] and p[1], q[1] and p[1] are each far apart, so
    judging the second draft by q[0], drawing its residual from p[0], or keeping it unjudged would show."""
    p, q = two_drafts_past_the_first()
    for a, b in ((q[0], q[1]), (p[0], p[1]), (q[1], p[1])):
        assert (a - b).abs().sum().item() / 2 > 0.5  # total variation distance
    counts = rule_counts(p, q, 1500, seed=1, at=1)
    assert counts.sum() > 750  # the first draft kept in more than half the draws
    stat, df = chi2_statistic(counts, p[1])
    assert stat < chi2_critical(df, 1e-3), (stat, df)


def misjudged(p, q, drafts, gen, *, q_row=None, residual_row=None, keep_later=False):
    """accept_draft's rule, right at the first draft; from the second on, optionally judged by the wrong row of q,
    with the residual built from the wrong row of p, or kept unjudged."""
    for i, d in enumerate(drafts):
        q_i = q[i if q_row is None else q_row]
        if (keep_later and i > 0) or torch.rand((), dtype=torch.float64, generator=gen) * q_i[d] < p[i, d]:
            continue
        residual = (p[i if residual_row is None else residual_row] - q_i).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


def judge_every_draft_by_q0(p, q, drafts, gen):
    """Wrong: every draft judged by q[0], the first draft's distribution, in the ratio and the residual."""
    return misjudged(p, q, drafts, gen, q_row=0)


def residual_from_p0(p, q, drafts, gen):
    """Wrong: at any rejection, the residual max(0, p[0] - q[i]), from the first position's target."""
    return misjudged(p, q, drafts, gen, residual_row=0)


def keep_the_drafts_after_the_first(p, q, drafts, gen):
    """Wrong: judge the first draft only and keep the rest (the draft's distribution there, not the target's)."""
    return misjudged(p, q, drafts, gen, keep_later=True)


@pytest.mark.parametrize("wrong", [judge_every_draft_by_q0, residual_from_p0, keep_the_drafts_after_the_first])
def test_a_rule_wrong_after_the_first_draft_fails_the_same_test(wrong):
    """The test above has the power to catch a rule that is right at the first draft and wrong after it."""
    p, q = two_drafts_past_the_first()
    stat, df = chi2_statistic(rule_counts(p, q, 1500, seed=1, rule=wrong, at=1), p[1])
    assert stat > chi2_critical(df, 1e-3), (wrong.__name__, stat, df)


def test_sampled_speculation_keeps_the_target_s_distribution():
    """The second new token of sampled speculative decoding (the first one a verify pass emits), over many seeded
    runs, against its exact marginal: sum over x1 of p(x1) p(x2 | prompt, x1), computed without a cache."""
    model, ids, t = MODELS[1], PROMPTS[0], 1.5
    with torch.no_grad():
        p1 = probabilities(model(ids)[0, -1], t)  # (V,)
        nxt = torch.cat((ids.repeat(11, 1), torch.arange(11).view(11, 1)), dim=1)  # every first token x1
        marginal = p1 @ probabilities(model(nxt)[:, -1], t)  # (V,)
    draft = first_layers(model, 1)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(11, dtype=torch.long)
    for _ in range(800):
        out = speculative_generate(model, ids, 3, ConcatCache(3), ModelDraft(draft, ConcatCache(1)), k=2,
                                   temperature=t, generator=gen)
        counts[int(out.ids[0, ids.shape[1] + 1])] += 1
    stat, df = chi2_statistic(counts, marginal)
    assert stat < chi2_critical(df, 1e-3), (stat, df)



def test_greedy_speculation_runs_past_the_window_on_a_sliding_cache_with_a_reserve():
    """A sliding-window model (W = 5) and a cache that trims to W - 1 rows plus a reserve of k: 30 tokens, far past
    the window, are greedy decoding's; without the reserve the run is refused before it starts."""
    model = build(CONFIGS[1].with_(sliding_window=5), 4, scale=0.5)
    ids = PROMPTS[1]
    ref = generate_nocache(model, ids, 30)
    drafts = [PromptLookupDraft(), ModelDraft(first_layers(model, 1), SlidingWindowCache(1, 5, reserve=3))]
    for draft in drafts:
        cache = SlidingWindowCache(model.cfg.n_layers, 5, reserve=3)
        out = speculative_generate(model, ids, 30, cache, draft, k=3)
        assert torch.equal(out.ids, ref.ids) and cache.total_dropped > 0 and sum(out.drafted) > sum(out.accepted)
        assert max((a - b).abs().max().item() for a, b in zip(out.step_logits, ref.step_logits, strict=True)) <= TOL64
    bare = SlidingWindowCache(model.cfg.n_layers, 5)
    rejected(bare, lambda: speculative_generate(model, ids, 30, bare, PromptLookupDraft(), k=3), CacheError,
             r"cache: expected a cache that keeps the 36 positions")
