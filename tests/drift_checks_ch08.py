"""Drift checks for the teaching copies in notebooks/08_attention_kernels.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import pytest
import torch

import labcode.attention
from labcode.masks import causal_mask


def _inputs(h, hkv, t, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, m, d, generator=g, dtype=torch.float64).to(dtype)
            for n, m in ((h, t), (hkv, s), (hkv, s))]


CASES = [  # (H, Hkv, T, S, D, dtype)
    (4, 4, 1, 9, 8, torch.float64),
    (6, 2, 3, 20, 8, torch.float64),
    (9, 3, 1, 300, 16, torch.float32),
    (4, 1, 5, 33, 8, torch.float16),
    (4, 2, 2, 40, 8, torch.bfloat16),
]


def _same_errors(ours, theirs, calls) -> None:
    for args, kwargs in calls:
        with pytest.raises(ValueError) as a:
            ours(*args, **kwargs)
        with pytest.raises(ValueError) as b:
            theirs(*args, **kwargs)
        assert str(a.value) == str(b.value)


def check_repeat_kv_attention(ns: dict) -> None:
    """Identical outputs with and without masks, in every precision, and the same errors."""
    ours, theirs = ns["repeat_kv_attention"], labcode.attention.repeat_kv_attention
    for i, (h, hkv, t, s, d, dtype) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, dtype, i)
        for mask in (None, causal_mask(t, s - t)):
            assert torch.equal(ours(q, k, v, mask), theirs(q, k, v, mask)), (i, mask is None)
    q, k, v = _inputs(4, 2, 2, 6, 8, torch.float64, 0)
    _same_errors(ours, theirs, [((q, k[:, :, :, :4], v), {}), ((q, k, v, causal_mask(2, 3)), {})])


def check_online_softmax_attention(ns: dict) -> None:
    """Identical outputs for every mask kind, block size and precision option, and the same errors."""
    ours, theirs = ns["online_softmax_attention"], labcode.attention.online_softmax_attention
    for i, (h, hkv, t, s, d, dtype) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, dtype, i)
        blank = torch.ones(t, s, dtype=torch.bool)
        blank[:, : s // 2] = False
        for block in ((1, 4, 17, 256) if s <= 40 else (4, 17, 256)):  # block 1 only where it is quick
            for kwargs in ({}, {"causal": True}, {"mask": causal_mask(t, s - t)}, {"mask": blank},
                           {"accum_dtype": dtype}):
                a = ours(q, k, v, block_size=block, **kwargs)
                b = theirs(q, k, v, block_size=block, **kwargs)
                assert a.dtype == b.dtype and torch.equal(a, b), (i, block, kwargs)
    q, k, v = _inputs(4, 2, 2, 6, 8, torch.float64, 0)
    _same_errors(ours, theirs, [((q, k, v), {"block_size": 0}), ((q, k, v, causal_mask(2, 4)), {"causal": True}),
                                ((q[0], k, v), {})])


def _splits(q, k, v, mask, size):
    s = k.shape[2]
    return [(q, k[:, :, j : j + size], v[:, :, j : j + size], None if mask is None else mask[:, j : j + size])
            for j in range(0, s, size)]


def check_attention_partial(ns: dict) -> None:
    """Identical (o, m, l) for every split, mask and precision, including a split with nothing visible."""
    ours, theirs = ns["attention_partial"], labcode.attention.attention_partial
    for i, (h, hkv, t, s, d, dtype) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, dtype, i)
        blank = torch.ones(t, s, dtype=torch.bool)
        blank[:, : s // 2] = False
        for mask in (None, causal_mask(t, s - t), blank):
            for args in _splits(q, k, v, mask, 7):
                for kwargs in ({}, {"accum_dtype": dtype}):
                    a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
                    assert len(a) == len(b) == 3, i
                    for x, y in zip(a, b, strict=True):
                        assert x.dtype == y.dtype and torch.equal(x, y), (i, kwargs)


def check_merge_partials(ns: dict) -> None:
    """Identical merges of labcode's partials, in any order, and the same error for no partials."""
    ours, theirs = ns["merge_partials"], labcode.attention.merge_partials
    for i, (h, hkv, t, s, d, dtype) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, dtype, i)
        blank = torch.ones(t, s, dtype=torch.bool)
        blank[:, : s // 2] = False
        for mask in (None, blank):
            parts = [labcode.attention.attention_partial(*args) for args in _splits(q, k, v, mask, 6)]
            for order in (parts, parts[::-1], parts[-1:]):  # the last split always sees a key
                a, b = ours(order), theirs(order)
                assert a.dtype == b.dtype and torch.equal(a, b), (i, mask is None)
    _same_errors(ours, theirs, [(([],), {})])


def check_flash_decoding_attention(ns: dict) -> None:
    """Identical outputs for every mask kind, split size and precision option, and the same errors."""
    ours, theirs = ns["flash_decoding_attention"], labcode.attention.flash_decoding_attention
    for i, (h, hkv, t, s, d, dtype) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, dtype, i)
        for split in (1, 5, 64, 256) if s <= 40 else (5, 64, 256):
            for kwargs in ({}, {"causal": True}, {"mask": causal_mask(t, s - t)}, {"accum_dtype": dtype}):
                a = ours(q, k, v, split_size=split, **kwargs)
                b = theirs(q, k, v, split_size=split, **kwargs)
                assert a.dtype == b.dtype and torch.equal(a, b), (i, split, kwargs)
    q, k, v = _inputs(4, 2, 2, 6, 8, torch.float64, 0)
    _same_errors(ours, theirs, [((q, k, v), {"split_size": 0}), ((q, k, v), {"split_size": True}),
                                ((q, k, v, causal_mask(2, 4)), {"causal": True}), ((q, k[:, :, :, :4], v), {})])


CHECKS = {
    "labcode/attention.py::repeat_kv_attention": check_repeat_kv_attention,
    "labcode/attention.py::online_softmax_attention": check_online_softmax_attention,
    "labcode/attention.py::attention_partial": check_attention_partial,
    "labcode/attention.py::merge_partials": check_merge_partials,
    "labcode/attention.py::flash_decoding_attention": check_flash_decoding_attention,
}
