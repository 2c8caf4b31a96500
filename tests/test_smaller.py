"""labcode.smaller: the levers applied to a model's weights, the quality measure, the pass-key prompt, the bytes.

The levers that change the weights must change nothing outside their block (the weights are restored,
even when the block raises), be exact where they are the same function (MHA from GQA, full rank), and do
what they say (rank r, one head); the bytes are the formulas the course uses elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TOL64, build, max_diff

from labcode import GPTConfig
from labcode.caches import ConcatCache
from labcode.cost import kv_cache_bytes
from labcode.engines.kivi import kivi_bytes
from labcode.mla import latent_bytes_per_token
from labcode.smaller import (
    averaged_kv_heads,
    compare_logits,
    expand_kv_heads,
    lever_bytes,
    low_rank_kv,
    passkey_prompt,
)

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=19, context_length=32, n_layers=2, n_heads=6, n_kv_heads=2, d_model=24, rotary=True,
                norm="rmsnorm", mlp="swiglu", d_ff=32, bias=False)
MODEL = build(CFG, seed=3, scale=0.5)
IDS = torch.randint(0, 19, (1, 20), generator=torch.Generator().manual_seed(1))


def _weights(model) -> list[torch.Tensor]:
    return [b.attn.kv_proj.weight.detach().clone() for b in model.blocks]


def test_compare_logits_of_equal_logits_is_zero_and_of_different_ones_is_not():
    ref = MODEL(IDS)
    same = compare_logits(ref, ref.clone(), IDS)
    assert same["mean_kl"] == 0 and same["max_logit_diff"] == 0 and same["top1_agreement"] == 1
    assert same["loss"] == same["loss_full"]
    moved = compare_logits(ref + torch.randn_like(ref), ref, IDS)
    assert moved["mean_kl"] > 0 and moved["max_logit_diff"] > 0 and moved["top1_agreement"] < 1
    with pytest.raises(ValueError, match=r"out, ref, targets: expected logits \[1, N, V\]"):
        compare_logits(ref[:, :3], ref, IDS)


def test_compare_logits_gives_the_hand_computed_kl_agreement_and_losses():
    """Two tokens, four positions, each logit row [log a, log b] so that its softmax is (a, b) / (a + b):
    KL(ref || out) = sum p log(p / q), the losses are -log of the chosen token's probability."""
    ln = math.log
    p = [(3 / 4, 1 / 4), (1 / 4, 3 / 4), (4 / 5, 1 / 5), (1 / 3, 2 / 3)]  # ref's distributions
    q = [(2 / 3, 1 / 3), (1 / 3, 2 / 3), (1 / 5, 4 / 5), (1 / 100, 99 / 100)]  # out's: the third disagrees on top
    ref = torch.tensor([[[ln(3), 0.0], [0.0, ln(3)], [ln(4), 0.0], [0.0, ln(2)]]], dtype=torch.float64)
    out = torch.tensor([[[ln(2), 0.0], [0.0, ln(2)], [0.0, ln(4)], [0.0, ln(99)]]], dtype=torch.float64)
    targets = torch.tensor([[0, 1, 0, 1]])
    got = compare_logits(out, ref, targets)
    kl = sum(pi * ln(pi / qi) for pn, qn in zip(p, q, strict=True) for pi, qi in zip(pn, qn, strict=True)) / 4
    assert got["mean_kl"] == pytest.approx(kl, rel=1e-12, abs=0)
    reverse = sum(qi * ln(qi / pi) for pn, qn in zip(p, q, strict=True) for pi, qi in zip(pn, qn, strict=True)) / 4
    assert abs(kl - reverse) > 0.1  # the direction matters on these numbers
    assert got["top1_agreement"] == 0.75  # three of four positions agree
    assert got["max_logit_diff"] == pytest.approx(ln(99 / 2), rel=1e-12, abs=0)  # last row, second logit
    chosen = [0, 1, 0, 1]
    assert got["loss"] == pytest.approx(-sum(ln(qn[t]) for qn, t in zip(q, chosen, strict=True)) / 4, rel=1e-12)
    assert got["loss_full"] == pytest.approx(-sum(ln(pn[t]) for pn, t in zip(p, chosen, strict=True)) / 4, rel=1e-12)


def test_the_mha_model_of_a_gqa_model_is_the_same_function_with_three_times_the_cache():
    mha = expand_kv_heads(MODEL)
    assert mha.cfg.n_kv_heads == CFG.n_heads and MODEL.cfg.n_kv_heads == 2
    a, b = ConcatCache(2), ConcatCache(2)
    assert max_diff(mha(IDS, a), MODEL(IDS, b)) <= TOL64
    assert a.nbytes == 3 * b.nbytes


def test_full_rank_changes_nothing_and_rank_r_has_rank_r_and_both_are_undone():
    before, ref = _weights(MODEL), MODEL(IDS)
    with low_rank_kv(MODEL, 2 * CFG.n_kv_heads * CFG.head_dim):
        assert max_diff(MODEL(IDS), ref) <= 1e-10
    with low_rank_kv(MODEL, 3):
        assert all(torch.linalg.matrix_rank(b.attn.kv_proj.weight).item() == 3 for b in MODEL.blocks)
        assert max_diff(MODEL(IDS), ref) > 1e-3
    assert all(torch.equal(w, b) for w, b in zip(_weights(MODEL), before, strict=True))
    assert torch.equal(MODEL(IDS), ref)


def test_the_weights_come_back_when_the_block_raises():
    before = _weights(MODEL)
    with pytest.raises(RuntimeError, match="inside"), averaged_kv_heads(MODEL):
        raise RuntimeError("inside")
    assert all(torch.equal(w, b) for w, b in zip(_weights(MODEL), before, strict=True))


def test_averaged_heads_give_every_head_the_same_keys_and_values():
    with averaged_kv_heads(MODEL):
        _, pairs = MODEL(IDS, None, return_cache=True)
        for k, v in pairs:
            assert max_diff(k[:, 0], k[:, 1]) <= TOL64 and max_diff(v[:, 0], v[:, 1]) <= TOL64


@pytest.mark.parametrize("rank", [0, 17, 2.0])
def test_a_rank_outside_the_projection_is_refused(rank):
    with pytest.raises(ValueError, match=r"rank: expected an int in \[1, 2 Hkv D = 16\]"), low_rank_kv(MODEL, rank):
        pass


def test_a_projection_with_a_bias_is_refused():
    biased = build(CFG.with_(bias=True), seed=1)
    with pytest.raises(ValueError, match=r"model: expected key/value projections without bias"):
        with low_rank_kv(biased, 3):
            pass


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_pass_key_sits_at_its_depth_and_the_answer_ends_with_its_digits():
    filler = _encode("x" * 100)
    context, answer = passkey_prompt(_encode, filler, 0.25, "40213")
    text = "".join(map(chr, context))
    assert text.startswith("A pass key is hidden") and text.endswith("What is the pass key?")
    intro = len("A pass key is hidden in the text below. Remember it.\n\n")
    assert text.index("The pass key is 40213") == intro + 25 + 2  # a quarter of the filler, then two newlines
    assert "".join(map(chr, answer)) == " The pass key is 40213"
    for bad, match in ((1.5, r"depth: expected a fraction in \[0, 1\]"), (-0.1, r"depth: expected")):
        with pytest.raises(ValueError, match=match):
            passkey_prompt(_encode, filler, bad, "123")
    with pytest.raises(ValueError, match=r"key: expected a string of digits, got 'a1'"):
        passkey_prompt(_encode, filler, 0.5, "a1")
    with pytest.raises(ValueError, match=r"key: expected digits the tokenizer encodes one token each"):
        passkey_prompt(lambda s: [len(s)] * max(1, len(s) // 2), filler, 0.5, "1234")


def test_lever_bytes_are_the_course_formulas_at_sixteen_bits():
    n, h, hkv, d, t = 30, 9, 3, 64, 1024
    assert lever_bytes(n, h, hkv, d, t, "mha") == kv_cache_bytes(n, 1, 1, h, d, 2) == 69120
    assert lever_bytes(n, h, hkv, d, t, "gqa") == 23040 and lever_bytes(n, h, hkv, d, t, "mqa") == 7680
    assert lever_bytes(n, h, hkv, d, t, "latent", rank=96) == latent_bytes_per_token(n, 96, 0, 2) == 5760
    assert lever_bytes(n, h, hkv, d, t, "int8") == 2 * n * hkv * (d + 2)  # a code a channel, one scale
    assert lever_bytes(n, h, hkv, d, t, "int4", group=8) == 2 * n * hkv * (d // 2 + d // 8 * 2)
    kivi = lever_bytes(n, h, hkv, d, t, "kivi", bits=2, group=32, residual=128)
    assert kivi == kivi_bytes(n, hkv, d, t, 2, 32, 128) / t
    assert lever_bytes(n, h, hkv, d, t, "evict", budget=128) == 23040 * 128 / t
    assert lever_bytes(n, h, hkv, d, 64, "evict", budget=128) == 23040  # a budget past the context keeps all
    with pytest.raises(ValueError, match=r"lever: expected one of mha, gqa"):
        lever_bytes(n, h, hkv, d, t, "fp8")
