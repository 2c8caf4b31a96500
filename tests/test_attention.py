"""Attention kernels for decode (chapter 8): exactness, masks, precision, memory, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labcode.attention import (
    MemoryTracker,
    measure_memory,
    online_softmax_attention,
    repeat_kv_attention,
    sdpa_attention,
)
from labcode.bench.timing import interleaved_samples, median, time_interleaved
from labcode.masks import causal_mask
from labcode.model import attend

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py


def qkv(b=1, h=4, hkv=2, t=1, s=64, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), groups=st.integers(1, 3), t=st.integers(1, 6),
       cached=st.integers(0, 40), d=st.sampled_from([4, 8]), block=st.integers(1, 50),
       mask_kind=st.sampled_from(["none", "causal", "random"]), seed=st.integers(0, 10_000))
def test_online_softmax_equals_matmul_softmax_in_float64(b, hkv, groups, t, cached, d, block, mask_kind, seed):
    s = cached + t
    q, k, v = qkv(b, hkv * groups, hkv, t, s, d, seed=seed)
    mask = None
    if mask_kind == "causal":
        mask = causal_mask(t, cached)
    elif mask_kind == "random":  # any pattern, as long as every query sees at least one key
        mask = torch.rand(t, s, generator=torch.Generator().manual_seed(seed)) < 0.5
        mask[:, -1] = True
    ref = repeat_kv_attention(q, k, v, mask)
    out = online_softmax_attention(q, k, v, mask, block_size=block)
    assert out.shape == ref.shape == (b, hkv * groups, t, d)
    assert (out - ref).abs().max().item() <= 1e-12
    assert (attend(q, k, v, mask) - ref).abs().max().item() <= 1e-12  # grouped, no copy: same numbers
    if mask_kind == "causal":  # the built-in offset causal mask is the same mask
        assert (online_softmax_attention(q, k, v, causal=True, block_size=block) - out).abs().max().item() == 0


def test_a_block_with_nothing_visible_changes_nothing():
    # Keys 0..9 are hidden from every query: the first block has only -inf scores.
    q, k, v = qkv(t=2, s=20)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[:, :10] = False
    ref = repeat_kv_attention(q, k, v, mask)
    out = online_softmax_attention(q, k, v, mask, block_size=5)
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= 1e-12


def test_float32_is_exact_to_rounding():
    q, k, v = qkv(h=9, hkv=3, s=2048, d=64, dtype=torch.float32, seed=3)
    truth = repeat_kv_attention(q.double(), k.double(), v.double())
    err = (online_softmax_attention(q, k, v, block_size=128).double() - truth).abs().max().item()
    assert err <= 1e-6


@pytest.mark.parametrize("dtype,eps", [(torch.float16, 2.0**-10), (torch.bfloat16, 2.0**-7)])
def test_half_precision_inputs_are_accumulated_in_float32(dtype, eps):
    q, k, v = qkv(h=9, hkv=3, s=4096, d=64, dtype=dtype, seed=4)
    out = online_softmax_attention(q, k, v, block_size=256)
    assert out.dtype == dtype
    # Same numbers as running the kernel in float32 on the upcast inputs, then rounding once.
    in_f32 = online_softmax_attention(q.float(), k.float(), v.float(), block_size=256).to(dtype)
    scale = out.float().abs().max().item()
    assert (out.float() - in_f32.float()).abs().max().item() <= eps * scale
    truth = repeat_kv_attention(q.double(), k.double(), v.double())
    err_f32_acc = (out.double() - truth).abs().max().item()
    err_half_acc = (online_softmax_attention(q, k, v, block_size=256, accum_dtype=dtype).double() - truth
                    ).abs().max().item()
    assert err_f32_acc <= eps * scale  # one rounding of the output, nothing more
    assert err_f32_acc < err_half_acc  # accumulating in half precision loses more


def test_memory_of_online_softmax_does_not_grow_with_key_length():
    peaks, largest_ref = [], []
    for s in (512, 1024, 4096):
        q, k, v = qkv(h=9, hkv=3, s=s, d=64, dtype=torch.float32)
        peaks.append(measure_memory(online_softmax_attention, q, k, v, block_size=256)["peak"])
        largest_ref.append(measure_memory(repeat_kv_attention, q, k, v)["largest"])
    assert peaks[0] == peaks[1] == peaks[2] > 0
    assert largest_ref[2] == 8 * largest_ref[0]  # the copied K/V heads grow with S
    assert peaks[2] < largest_ref[0]


def test_grouped_attention_copies_no_kv_heads():
    q, k, v = qkv(h=9, hkv=3, s=1024, d=64, dtype=torch.float32)
    grouped, repeated = measure_memory(attend, q, k, v, None), measure_memory(repeat_kv_attention, q, k, v)
    kv_copy = 3 * k.nbytes  # G = 3 copies of K (and of V) in the repeat version
    assert repeated["largest"] == kv_copy
    assert grouped["peak"] < k.nbytes  # only scores and output, smaller than one K tensor


def test_sdpa_agrees_with_the_reference():
    q, k, v = qkv(h=6, hkv=2, t=3, s=50, d=16, dtype=torch.float32, seed=5)
    mask = causal_mask(3, 47)
    assert (sdpa_attention(q, k, v, mask) - repeat_kv_attention(q, k, v, mask)).abs().max().item() <= 1e-5


def test_memory_tracker_counts_new_storage_only():
    x = torch.zeros(1000)
    with MemoryTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        del a  # freed before the next one
        b = torch.ones(500)  # 2000 bytes
        y = x.view(10, 100)  # a view: no new memory
        x.add_(1.0)  # in place: no new memory
        del b, y
    assert tracker.largest == 4000
    assert tracker.peak == 4000
    assert tracker.live == 0


def test_time_interleaved_reports_a_median_per_function():
    calls = {"a": 0, "b": 0}

    def bump(name):
        calls[name] += 1

    result = time_interleaved({"a": lambda: bump("a"), "b": lambda: bump("b")}, repeats=5, warmup=2)
    assert set(result) == {"a", "b"} and all(t >= 0 for t in result.values())
    assert calls == {"a": 7, "b": 7}
    samples = interleaved_samples({"a": lambda: bump("a"), "b": lambda: bump("b")}, repeats=4, warmup=0)
    assert [len(v) for v in samples.values()] == [4, 4] and calls == {"a": 11, "b": 11}
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved({"a": lambda: None}, repeats=0)


def test_timing_on_a_given_thread_count_restores_the_callers():
    before = torch.get_num_threads()  # 1 under the module's fixture: ask for another count
    seen = []
    interleaved_samples({"a": lambda: seen.append(torch.get_num_threads())}, repeats=2, warmup=1, threads=before + 1)
    assert seen == [before + 1] * 3 and torch.get_num_threads() == before

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        time_interleaved({"a": fails}, repeats=1, threads=before + 1)
    assert torch.get_num_threads() == before  # restored after an error too
    seen.clear()
    interleaved_samples({"a": lambda: seen.append(torch.get_num_threads())}, repeats=1, warmup=0)
    assert seen == [before]  # threads=None leaves the count alone
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads: expected a positive int or None"):
            time_interleaved({"a": lambda: None}, repeats=1, threads=bad)


def test_timing_reads_the_clock_it_is_given():
    ticks = iter(range(0, 1000, 5))  # a clock that advances 5 units per reading
    samples = interleaved_samples({"a": lambda: None, "b": lambda: None}, repeats=3, warmup=1,
                                  clock=lambda: next(ticks))
    assert samples == {"a": [5, 5, 5], "b": [5, 5, 5]}
    assert time_interleaved({"a": lambda: None}, repeats=2, warmup=0, clock=lambda: next(ticks)) == {"a": 5}


@pytest.mark.parametrize("kernel", [online_softmax_attention, repeat_kv_attention, sdpa_attention])
@pytest.mark.parametrize("change,message", [
    (lambda q, k, v, m: (q[0], k, v, m), "q: expected a rank-4"),
    (lambda q, k, v, m: (q, k[:, :, :, :4], v, m), "k, v: expected two"),
    (lambda q, k, v, m: (q, k[:, :1].expand(1, 3, -1, -1), v[:, :1].expand(1, 3, -1, -1), m), "k: expected a number"),
    (lambda q, k, v, m: (q, k, v.float(), m), "q, k, v: expected one dtype"),
    (lambda q, k, v, m: (q, k, v, m[:, :-1]), "mask: expected a bool"),
    (lambda q, k, v, m: (q, k, v, m.long()), "mask: expected a bool"),
    (lambda q, k, v, m: (q.long(), k, v, m), "q: expected a floating-point"),
])
def test_bad_input_raises_a_clear_error_and_touches_nothing(kernel, change, message):
    q, k, v = qkv(h=4, hkv=2, t=2, s=10)
    mask = causal_mask(2, 8)
    before = [x.clone() for x in (q, k, v, mask)]
    with pytest.raises(ValueError, match=message):
        kernel(*change(q, k, v, mask))
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, mask), strict=True))


def test_online_softmax_options_are_checked():
    q, k, v = qkv(t=2, s=10)
    with pytest.raises(ValueError, match="block_size: expected a positive int, got 0"):
        online_softmax_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="causal: expected either"):
        online_softmax_attention(q, k, v, causal_mask(2, 8), causal=True)
