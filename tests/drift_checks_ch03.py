"""Drift checks for the teaching copies and the from-scratch naive cache in notebooks/03_naive_cache.ipynb
(see tests/test_drift.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

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


class _Scratch:
    """The from-scratch GPT's forward(ids, use_cache) and reset_kv_cache around `model`'s embeddings and
    final norm, with the given blocks (from the notebook, or built around its attention modules)."""

    def __init__(self, model: GPT, blocks: list) -> None:
        self.model, self.blocks, self.current_pos = model, blocks, 0

    def __call__(self, ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        t = ids.shape[1]
        start = self.current_pos if use_cache else 0
        if use_cache:
            self.current_pos += t
        x = self.model.tok_emb(ids) + self.model.pos_emb(torch.arange(start, start + t))
        for block in self.blocks:
            x = block(x, use_cache)
        return F.linear(self.model.ln_f(x), self.model.tok_emb.weight)

    def reset_kv_cache(self) -> None:
        for block in self.blocks:
            block.attn.reset_cache()
        self.current_pos = 0


class _AroundAttention:
    """A labcode block's norms and MLP around a from-scratch attention module."""

    def __init__(self, block, attn) -> None:
        self.block, self.attn = block, attn

    def __call__(self, x: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        x = x + self.attn(self.block.ln_1(x), use_cache)
        return x + self.block.mlp(self.block.ln_2(x))


def _compare_with_use_cache(ours, model: GPT) -> None:
    """`ours` (a from-scratch model, or a driver around from-scratch parts) computes what `model` computes with
    use_cache=True, bit for bit, with the same naive state after every call; without the switch it runs the
    full pass and leaves the state alone; `reset_kv_cache` clears what the course's reset clears."""
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for request in range(2):  # a second request after a reset starts from nothing again
            ours.reset_kv_cache()
            model.reset_kv_cache()
            assert states_equal(naive.naive_state(ours), naive.naive_state(model))
            for s, t in SCHEDULE:
                assert torch.equal(ours(ids[:, s : s + t], use_cache=True), model(ids[:, s : s + t], use_cache=True))
                assert states_equal(naive.naive_state(ours), naive.naive_state(model)), (request, s, t)
            kept = naive.naive_state(ours)
            assert torch.equal(ours(ids[:, :7]), model(ids[:, :7]))
            assert states_equal(kept, naive.naive_state(ours))


def _course_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).double().eval()


def check_scratch_attention(ns: dict) -> None:
    """The notebook's NaiveAttention, one per layer around labcode's blocks, is the course's use_cache=True."""
    model = _course_model()
    attns = [ns["NaiveAttention"](CFG).double() for _ in model.blocks]
    for attn, block in zip(attns, model.blocks, strict=True):
        attn.load_state_dict(block.attn.state_dict())
    blocks = [_AroundAttention(b, a) for b, a in zip(model.blocks, attns, strict=True)]
    _compare_with_use_cache(_Scratch(model, blocks), model)


def check_scratch_block(ns: dict) -> None:
    """The notebook's NaiveBlock, with labcode's embeddings and head around it, is the course's use_cache=True."""
    model = _course_model()
    blocks = [ns["NaiveBlock"](CFG).double() for _ in model.blocks]
    for ours, theirs in zip(blocks, model.blocks, strict=True):
        ours.load_state_dict(theirs.state_dict())
    _compare_with_use_cache(_Scratch(model, blocks), model)


def check_scratch_gpt(ns: dict) -> None:
    """The notebook's NaiveGPT, loaded with the course model's weights, is the course's use_cache=True."""
    model = _course_model()
    ours = ns["NaiveGPT"](CFG).double().eval()
    ours.load_state_dict(model.state_dict())
    _compare_with_use_cache(ours, model)


CHECKS = {
    "labcode/caches/naive.py::append_to_module": check_append_to_module,
    "labcode/caches/naive.py::mask_rows": check_mask_rows,
    "labcode/model.py::CausalSelfAttention (use_cache=True)": check_scratch_attention,
    "labcode/model.py::Block (use_cache=True)": check_scratch_block,
    "labcode/model.py::GPT (use_cache=True)": check_scratch_gpt,
}
