"""KIVI-style low-bit caches: the code format, the residual kept exact, the bytes, and against int8."""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build, max_diff, run_chunks

from labcode import GPTConfig
from labcode.caches import ConcatCache
from labcode.config import get_config
from labcode.cost import kv_cache_bytes, quantized_kv_cache_bytes
from labcode.engines import KIVICache, QuantizedCache, fake_quantize, kivi_bytes
from labcode.engines.kivi import (
    dequantize_keys,
    dequantize_values,
    pack,
    quantize_keys,
    quantize_values,
    quantized_tokens,
    unpack,
)

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # both defined in conftest.py
CFG = GPTConfig(vocab_size=13, context_length=48, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, rotary=True)
MODEL = build(CFG, seed=2, scale=0.5)
IDS = torch.randint(0, 13, (2, 40), generator=torch.Generator().manual_seed(3))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_into_bytes_and_back(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 16), generator=_gen(bits), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 16 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_and_values_per_token_round_within_half_a_step(bits):
    x = torch.randn(1, 2, 8, 16, dtype=torch.float64, generator=_gen(0))
    packed, scale, zero = quantize_keys(x, bits, 4)
    assert scale.shape == (1, 2, 2, 16)  # one scale per channel and group of 4 tokens
    err = (dequantize_keys(packed, scale, zero, bits, 4) - x).abs()
    assert (err <= scale.repeat_interleave(4, dim=2) / 2 + 1e-12).all()
    packed, scale, zero = quantize_values(x, bits, 8)
    assert scale.shape == (1, 2, 8, 2)  # one scale per token and group of 8 channels
    err = (dequantize_values(packed, scale, zero, bits) - x).abs()
    assert (err <= scale.repeat_interleave(8, dim=3) / 2 + 1e-12).all()
    flat = torch.full((1, 1, 4, 4), 0.3, dtype=torch.float64)  # a constant group: exact, not divided by zero
    assert torch.equal(dequantize_keys(*quantize_keys(flat, bits, 4), bits, 4), flat)


def test_per_channel_keys_beat_per_token_keys_when_a_channel_is_an_outlier():
    """KIVI's reason for quantising keys per channel: an outlier channel, large in every token, stretches every
    per-token scale, while per channel it gets a scale of its own."""
    k = torch.randn(1, 1, 32, 16, dtype=torch.float64, generator=_gen(1))
    k[..., 3] = k[..., 3] * 2 + 40  # one channel large in every token
    per_channel = (dequantize_keys(*quantize_keys(k, 4, 32), 4, 32) - k).pow(2).mean()
    per_token = (dequantize_values(*quantize_values(k, 4, 16), 4) - k).pow(2).mean()  # KIVI's value format
    per_token_int4 = (fake_quantize(k, bits=4) - k).pow(2).mean()  # chapter 9's symmetric per-token format
    assert per_channel * 10 < min(per_token, per_token_int4)


def test_a_residual_as_long_as_the_sequence_keeps_everything_exact():
    cache = KIVICache(2, bits=2, group_size=4, residual=40)
    out = run_chunks(MODEL, IDS, cache, [9, 1, 13, 17])
    assert cache.quantized() == 0 and max_diff(out, MODEL(IDS)) <= TOL64


@pytest.mark.parametrize("sizes", [[40], [1] * 40, [7, 1, 11, 21]], ids=str)
def test_the_latest_tokens_stay_exact_and_when_a_token_is_quantised_depends_on_the_count_only(sizes):
    g, r = 4, 6
    cache, exact = KIVICache(2, bits=2, group_size=g, residual=r), ConcatCache(2)
    run_chunks(MODEL, IDS, cache, sizes)
    MODEL(IDS, exact)
    n = cache.quantized()
    assert n == quantized_tokens(40, g, r) == 32 and cache.length() == 40
    k, v = cache.read(0)
    k0, v0 = exact.read(0)  # layer 0's keys are the same whatever the cache (the embeddings, projected)
    assert max_diff(k[:, :, n:], k0[:, :, n:]) <= TOL64 and max_diff(v[:, :, n:], v0[:, :, n:]) <= TOL64
    assert 0.01 < max_diff(k[:, :, :n], k0[:, :, :n]) < 0.5 * k0.abs().max()  # the older ones are 2-bit codes
    ref = KIVICache(2, bits=2, group_size=g, residual=r)
    run_chunks(MODEL, IDS, ref, [40])  # one pass: the same tokens quantised, to the same codes
    assert all(max_diff(a, b) <= TOL64 for a, b in zip(cache.read(0), ref.read(0), strict=True))


def test_the_bytes_held_are_the_formulas():
    cache = KIVICache(2, bits=4, group_size=4, residual=5, value_group=4)
    run_chunks(MODEL, IDS[:, :23], cache, [10, 13])
    per_row = kivi_bytes(2, 2, 8, 23, bits=4, group_size=4, residual=5, value_group=4, scale_bytes=8,
                         residual_bytes=8)  # float64 scales, zero points and residual
    assert cache.nbytes == 2 * per_row
    q = quantized_tokens(23, 4, 5)
    assert q == 16 and per_row == 2 * 2 * (2 * q * 8 * 4 // 8 + 2 * 8 * (q // 4 * 8 + q * 2) + 2 * 7 * 8 * 8)


def test_bytes_per_token_at_smollm2s_shape_against_int8():
    """At SmolLM2-135M's shape and 4096 tokens, with fp16 scales and residual (KIVI's own choice): 2 bits and 4
    bits with a residual of 32 take less than chapter 9's int8 codes with float32 scales, which take less than
    float16."""
    cfg, n = get_config("smollm2-135m"), 4096
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    two, four = (kivi_bytes(*shape, n, bits=b, group_size=32, residual=32) for b in (2, 4))
    int8, fp16 = quantized_kv_cache_bytes(*shape[:1], 1, n, *shape[1:]), kv_cache_bytes(*shape[:1], 1, n, *shape[1:], 2)
    assert two < four < int8 < fp16
    assert kivi_bytes(*shape, 32, bits=2, group_size=32, residual=32) == fp16 // n * 32  # all in the residual


def test_fewer_bits_cost_more_logit_error_and_int8_sits_with_eight_bits():
    full = MODEL(IDS)
    errs = {}
    for bits in (2, 4, 8):
        errs[bits] = max_diff(run_chunks(MODEL, IDS, KIVICache(2, bits=bits, group_size=4, residual=4), [8] + [1] * 32),
                              full)
    int8 = max_diff(run_chunks(MODEL, IDS, QuantizedCache(2, bits=8), [8] + [1] * 32), full)
    assert errs[2] > errs[4] > errs[8] > 0
    assert errs[4] > int8 and int8 < 30 * errs[8]
