"""Drift checks for the teaching copies in notebooks/05_window_cache.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import pytest
import torch

import labcode.caches as lab
import labcode.caches.window as window
from labcode import GPT, GPTConfig
from labcode.caches.base import CacheError, states_equal

CFG = GPTConfig(vocab_size=11, context_length=32, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)


def _model() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG).double().eval()
    return model, torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))


def _same_run(ours, theirs, schedule) -> None:
    m, ids = _model()
    with torch.no_grad():
        for s, t in schedule:
            assert torch.equal(m(ids[:, s : s + t], ours), m(ids[:, s : s + t], theirs)), (s, t)
            assert states_equal(ours.state(), theirs.state()), (s, t)


def check_shift_left(ns: dict) -> None:
    """Same buffer after every shift of every small buffer, heads and batches included."""
    gen = torch.Generator().manual_seed(3)
    for shape in ((1, 1, 6, 1), (2, 3, 7, 4)):
        w = shape[2]
        for n in range(1, w + 1):
            for drop in range(0, n + 1):
                a = torch.randn(*shape, generator=gen, dtype=torch.float64)
                b = a.clone()
                ns["shift_left"](a, drop, n)
                window.shift_left(b, drop, n)
                assert torch.equal(a, b), (shape, n, drop)


def check_window_cache(ns: dict) -> None:
    """Same logits, state, drops, masks and errors as labcode's WindowCache, before and after it fills."""
    ours, theirs = ns["WindowCache"](2, 8), lab.WindowCache(2, 8)
    assert ours.window == theirs.window == ours.max_chunk == theirs.max_chunk == 8
    _same_run(ours, theirs, [(0, 5), (5, 3), (8, 1), (9, 4), (13, 8), (21, 1), (22, 7)])
    assert ours.total_dropped == theirs.total_dropped > 0 and ours.will_drop(3) == theirs.will_drop(3)
    for t in (1, 3):  # the masks of a pass of t more tokens, begun and then cancelled
        for cache in (ours, theirs):
            cache.begin((2, 2, t, 4), torch.float64, "cpu")
        for layer in range(2):
            a, b = ours.mask(layer, t), theirs.mask(layer, t)
            assert (a is None and b is None) or torch.equal(a, b)
        for cache in (ours, theirs):
            cache.cancel()
    m, ids = _model()
    for cache in (ns["WindowCache"](2, 8), lab.WindowCache(2, 8)):
        with pytest.raises(CacheError, match=r"t_new: expected a chunk of at most 8 tokens"):
            m(ids[:, :9], cache)
    ours.reset()
    theirs.reset()
    assert states_equal(ours.state(), theirs.state())


def check_growable_cache(ns: dict) -> None:
    """Same logits, state, capacities and copy counts as labcode's GrowableCache, for both policies."""
    for policy, grow_by in (("linear", None), ("linear", 2), ("double", None)):
        ours, theirs = ns["GrowableCache"](2, 3, policy, grow_by), lab.GrowableCache(2, 3, policy, grow_by)
        _same_run(ours, theirs, [(0, 2), (2, 1), (3, 1), (4, 11), (15, 1), (16, 9)])
        assert ours.capacities == theirs.capacities and ours.grow_count == theirs.grow_count > 0
        ours.reset()
        theirs.reset()
        assert states_equal(ours.state(), theirs.state())
    # The teaching copy leaves out labcode's checks of policy and grow_by (tests/test_caches.py has them);
    # the capacity check it inherits from PreallocatedCache.
    for args in ((2, 0),):
        with pytest.raises(CacheError) as ours_err:
            ns["GrowableCache"](*args)
        with pytest.raises(CacheError) as theirs_err:
            lab.GrowableCache(*args)
        assert str(ours_err.value) == str(theirs_err.value)


CHECKS = {
    "labcode/caches/window.py::shift_left": check_shift_left,
    "labcode/caches/window.py::WindowCache": check_window_cache,
    "labcode/caches/growable.py::GrowableCache": check_growable_cache,
}
