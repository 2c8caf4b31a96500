"""Drift checks for the teaching copies in notebooks/03_naive_cache.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import labcode.caches.naive as naive
from labcode import GPT, GPTConfig
from labcode.caches.base import states_equal

CFG = GPTConfig(vocab_size=11, context_length=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
SCHEDULE = [(0, 5), (5, 1), (6, 3), (9, 1), (10, 6)]


def _module() -> SimpleNamespace:
    return SimpleNamespace(cache_k=None, cache_v=None, ptr_current_pos=0)


def _run_model(append, rows) -> tuple[list[torch.Tensor], dict]:
    """The naive cache on a small float64 model, with the given write and mask functions."""

    class Cache(naive.ModuleStateCache):
        def _append(self, layer, k, v):
            return append(self.attns[layer], k, v)

        def mask(self, layer, t_new):
            return rows(self.attns[layer], t_new, self.model.cfg.context_length)

    torch.manual_seed(0)
    model = GPT(CFG).double().eval()
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        outs = [model(ids[:, s : s + t], Cache(model)) for s, t in SCHEDULE]
    return outs, naive.naive_state(model)


def check_append_to_module(ns: dict) -> None:
    """Same tensors and same module state for a run of appends, and the same model logits."""
    ours, theirs = _module(), _module()
    gen = torch.Generator().manual_seed(2)
    for t in (3, 1, 1, 4):
        k, v = torch.randn(2, 2, t, 4, generator=gen), torch.randn(2, 2, t, 4, generator=gen)
        a, b = ns["append_to_module"](ours, k, v), naive.append_to_module(theirs, k, v)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert torch.equal(ours.cache_k, theirs.cache_k) and torch.equal(ours.cache_v, theirs.cache_v)
    out_a, state_a = _run_model(ns["append_to_module"], naive.mask_rows)
    out_b, state_b = _run_model(naive.append_to_module, naive.mask_rows)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True)) and states_equal(state_a, state_b)


def check_mask_rows(ns: dict) -> None:
    """Same mask rows for every pointer and chunk length, the pointer left where it was, and the same model
    logits and state (the pointers move when the pass ends, not when a mask is taken)."""
    for n in (1, 5, 16):
        for ptr in range(n):
            for t in range(1, n - ptr + 1):
                ours, theirs = _module(), _module()
                ours.cache_k = theirs.cache_k = torch.zeros(1)
                ours.ptr_current_pos = theirs.ptr_current_pos = ptr
                assert torch.equal(ns["mask_rows"](ours, t, n), naive.mask_rows(theirs, t, n)), (n, ptr, t)
                assert ours.ptr_current_pos == theirs.ptr_current_pos == ptr
    out_a, state_a = _run_model(naive.append_to_module, ns["mask_rows"])
    out_b, state_b = _run_model(naive.append_to_module, naive.mask_rows)
    assert all(torch.equal(x, y) for x, y in zip(out_a, out_b, strict=True)) and states_equal(state_a, state_b)


CHECKS = {
    "labcode/caches/naive.py::append_to_module": check_append_to_module,
    "labcode/caches/naive.py::mask_rows": check_mask_rows,
}
