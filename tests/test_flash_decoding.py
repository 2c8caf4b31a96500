"""Flash-Decoding (chapter 8): splits computed independently and merged by log-sum-exp equal plain attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode.attention import (
    attention_partial,
    flash_decoding_attention,
    merge_partials,
    online_softmax_attention,
    repeat_kv_attention,
)
from labcode.masks import causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py


def qkv(b=1, h=4, hkv=2, t=1, s=64, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, m, d, generator=g, dtype=torch.float64).to(dtype)
               for n, m in ((h, t), (hkv, s), (hkv, s)))
    return q, k, v


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), groups=st.integers(1, 4), t=st.integers(1, 4),
       cached=st.integers(0, 70), d=st.sampled_from([4, 8, 16]), split=st.integers(1, 80),
       mask_kind=st.sampled_from(["none", "causal", "random"]), seed=st.integers(0, 10_000))
def test_flash_decoding_equals_the_reference_in_float64(b, hkv, groups, t, cached, d, split, mask_kind, seed):
    s = cached + t  # S is rarely a multiple of the split: the last split is usually shorter
    q, k, v = qkv(b, hkv * groups, hkv, t, s, d, seed=seed)
    mask = None
    if mask_kind == "causal":
        mask = causal_mask(t, cached)
    elif mask_kind == "random":  # any pattern in which every query sees at least one key
        mask = torch.rand(t, s, generator=torch.Generator().manual_seed(seed)) < 0.3
        mask[:, -1] = True
    out = flash_decoding_attention(q, k, v, mask, split_size=split)
    assert out.shape == (b, hkv * groups, t, d) and out.dtype == torch.float64
    assert err(out, repeat_kv_attention(q, k, v, mask)) <= 1e-12
    if mask_kind == "causal":
        assert err(flash_decoding_attention(q, k, v, causal=True, split_size=split), out) == 0.0


@pytest.mark.parametrize("s,split", [(1000, 256), (1000, 1000), (1000, 4096), (7, 1), (257, 256)])
def test_one_query_many_keys_uneven_last_split(s, split):
    q, k, v = qkv(h=12, hkv=12, s=s, d=64, seed=1)  # GPT-2 shapes: MHA, one new token
    ref = repeat_kv_attention(q, k, v)
    assert err(flash_decoding_attention(q, k, v, split_size=split), ref) <= 1e-12
    assert err(flash_decoding_attention(q, k, v, split_size=split),
               online_softmax_attention(q, k, v, block_size=split)) <= 1e-12


def test_grouped_heads_read_their_own_kv_head():
    q, k, v = qkv(h=9, hkv=3, s=300, d=16, seed=2)
    out = flash_decoding_attention(q, k, v, split_size=64)
    for head in range(9):  # query head h reads K/V head h // 3, and nothing else
        kv = slice(head // 3, head // 3 + 1)
        one = repeat_kv_attention(q[:, head : head + 1], k[:, kv], v[:, kv])
        assert err(out[:, head : head + 1], one) <= 1e-12


def test_partials_merge_to_the_whole_and_in_any_order():
    q, k, v = qkv(h=4, hkv=2, t=2, s=90, seed=3)
    whole = attention_partial(q, k, v)
    parts = [attention_partial(q, k[:, :, j : j + 40], v[:, :, j : j + 40]) for j in (0, 40, 80)]
    assert err(merge_partials(parts), whole[0]) <= 1e-12
    assert err(merge_partials(parts[::-1]), whole[0]) <= 1e-12
    # each split's max and sum are those of its own scores
    scores = (q.reshape(1, 2, 4, 8) / 8**0.5) @ k[:, :, 40:80].transpose(-2, -1)  # (B, Hkv, G*T, 40)
    m = scores.amax(-1, keepdim=True)
    assert err(parts[1][1].reshape(m.shape), m) == 0.0
    assert err(parts[1][2].reshape(m.shape), torch.exp(scores - m).sum(-1, keepdim=True)) <= 1e-12


def test_a_split_with_nothing_visible_weighs_nothing():
    q, k, v = qkv(t=2, s=30, seed=4)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[:, 10:20] = False  # the whole middle split is hidden from both queries
    o, m, ssum = attention_partial(q, k[:, :, 10:20], v[:, :, 10:20], mask[:, 10:20])
    assert torch.isneginf(m).all() and (ssum == 0).all() and (o == 0).all()
    out = flash_decoding_attention(q, k, v, mask, split_size=10)
    assert torch.isfinite(out).all() and err(out, repeat_kv_attention(q, k, v, mask)) <= 1e-12


@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0**-10), (torch.bfloat16, 2.0**-7)])
def test_half_precision_inputs_accumulate_in_float32(dtype, eps):
    q, k, v = qkv(h=12, hkv=4, s=3000, d=64, dtype=dtype, seed=5)
    o, m, ssum = attention_partial(q, k[:, :, :500], v[:, :, :500])
    assert o.dtype == m.dtype == ssum.dtype == torch.float32
    out = flash_decoding_attention(q, k, v, split_size=512)
    assert out.dtype == dtype
    scale = out.float().abs().max().item()
    in_f32 = flash_decoding_attention(q.float(), k.float(), v.float(), split_size=512).to(dtype)
    assert err(out, in_f32) <= eps * scale  # the same numbers as float32 throughout, rounded once at the end
    truth = repeat_kv_attention(q.double(), k.double(), v.double())
    half_acc = flash_decoding_attention(q, k, v, split_size=512, accum_dtype=dtype)
    assert err(out, truth) <= eps * scale
    assert err(out, truth) < err(half_acc, truth)  # accumulating in half precision loses more


def test_bad_options_raise_clear_errors():
    q, k, v = qkv(t=2, s=10)
    with pytest.raises(ValueError, match="split_size: expected a positive int, got 0"):
        flash_decoding_attention(q, k, v, split_size=0)
    with pytest.raises(ValueError, match="split_size: expected a positive int, got True"):
        flash_decoding_attention(q, k, v, split_size=True)
    with pytest.raises(ValueError, match="causal: expected either"):
        flash_decoding_attention(q, k, v, causal_mask(2, 8), causal=True)
    with pytest.raises(ValueError, match="k, v: expected two"):
        flash_decoding_attention(q, k[:, :, :, :4], v)
    with pytest.raises(ValueError, match="parts: expected at least one"):
        merge_partials([])
