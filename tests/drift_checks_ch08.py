"""Drift checks for the teaching copies in notebooks/08_attention_kernels.ipynb (see tests/test_drift.py).

The teaching copies show the algorithm only. The labcode originals also check their arguments (tests/test_attention.py
and tests/test_flash_decoding.py test those errors) and accumulate half-precision inputs in float32, so a copy is
held to computing what its original computes on valid float64 inputs: to 1e-12, for every mask kind and block size.
"""

from __future__ import annotations

import torch

import labcode.attention
from labcode.masks import causal_mask

TOL = 1e-12
CASES = [  # (H, Hkv, T, S, D)
    (4, 4, 1, 9, 8),
    (6, 2, 3, 20, 8),
    (9, 3, 1, 300, 16),
    (4, 1, 5, 33, 8),
    (4, 2, 2, 40, 8),
]


def _inputs(h, hkv, t, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, m, d, generator=g, dtype=torch.float64) for n, m in ((h, t), (hkv, s), (hkv, s))]


def _blank(t, s):
    """A mask hiding the first half of the keys from every query: splits there see nothing."""
    blank = torch.ones(t, s, dtype=torch.bool)
    blank[:, : s // 2] = False
    return blank


def _masks(t, s):
    return [None, causal_mask(t, s - t), _blank(t, s)]


def _close(ours, theirs, what) -> None:
    assert ours.dtype == theirs.dtype == torch.float64 and ours.shape == theirs.shape, what
    assert torch.allclose(ours, theirs, atol=TOL, rtol=0), what  # -inf (an empty split's max) matches -inf


def check_repeat_kv_attention(ns: dict) -> None:
    """The same outputs with and without masks."""
    ours, theirs = ns["repeat_kv_attention"], labcode.attention.repeat_kv_attention
    for i, (h, hkv, t, s, d) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, i)
        for mask in _masks(t, s):
            _close(ours(q, k, v, mask), theirs(q, k, v, mask), (i, mask is None))


def check_online_softmax_attention(ns: dict) -> None:
    """The same outputs for every mask kind and block size, blocks of one key included."""
    ours, theirs = ns["online_softmax_attention"], labcode.attention.online_softmax_attention
    for i, (h, hkv, t, s, d) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, i)
        options = [{"causal": True}] + [{"mask": mask} for mask in _masks(t, s)]
        for block in ((1, 4, 17, 256) if s <= 40 else (4, 17, 256)):  # block 1 only where it is quick
            for kwargs in options:
                a = ours(q, k, v, block_size=block, **kwargs)
                _close(a, theirs(q, k, v, block_size=block, **kwargs), (i, block, kwargs))


def _splits(q, k, v, mask, size):
    s = k.shape[2]
    return [(q, k[:, :, j : j + size], v[:, :, j : j + size], None if mask is None else mask[:, j : j + size])
            for j in range(0, s, size)]


def check_attention_partial(ns: dict) -> None:
    """The same (o, m, l) for every split and mask, including splits with nothing visible."""
    ours, theirs = ns["attention_partial"], labcode.attention.attention_partial
    for i, (h, hkv, t, s, d) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, i)
        for mask in _masks(t, s):
            for args in _splits(q, k, v, mask, 7):
                a, b = ours(*args), theirs(*args)
                assert len(a) == len(b) == 3, i
                for x, y in zip(a, b, strict=True):
                    _close(x, y, (i, mask is None))


def check_merge_partials(ns: dict) -> None:
    """The same merges of labcode's partials, in any order, empty splits included."""
    ours, theirs = ns["merge_partials"], labcode.attention.merge_partials
    for i, (h, hkv, t, s, d) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, i)
        for mask in (None, _blank(t, s)):  # every query sees a key of the last split
            parts = [labcode.attention.attention_partial(*args) for args in _splits(q, k, v, mask, 6)]
            for order in (parts, parts[::-1], parts[-1:]):
                _close(ours(order), theirs(order), (i, mask is None))


def check_flash_decoding_attention(ns: dict) -> None:
    """The same outputs for every mask kind and split size, splits of one key included."""
    ours, theirs = ns["flash_decoding_attention"], labcode.attention.flash_decoding_attention
    for i, (h, hkv, t, s, d) in enumerate(CASES):
        q, k, v = _inputs(h, hkv, t, s, d, i)
        options = [{"causal": True}] + [{"mask": mask} for mask in _masks(t, s)]
        for split in (1, 5, 64, 256) if s <= 40 else (5, 64, 256):
            for kwargs in options:
                a = ours(q, k, v, split_size=split, **kwargs)
                _close(a, theirs(q, k, v, split_size=split, **kwargs), (i, split, kwargs))


CHECKS = {
    "labcode/attention.py::repeat_kv_attention": check_repeat_kv_attention,
    "labcode/attention.py::online_softmax_attention": check_online_softmax_attention,
    "labcode/attention.py::attention_partial": check_attention_partial,
    "labcode/attention.py::merge_partials": check_merge_partials,
    "labcode/attention.py::flash_decoding_attention": check_flash_decoding_attention,
}
