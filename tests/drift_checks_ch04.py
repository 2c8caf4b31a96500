"""Drift checks for the teaching copies and the from-scratch explicit pass in notebooks/04_explicit_pass_cache.ipynb
(see tests/test_drift.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import labcode.caches as lab
from labcode import GPT, GPTConfig
from labcode.caches.base import CacheError, snapshot, states_equal
from labcode.display import max_diff

CFG = GPTConfig(vocab_size=11, context_length=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16)
SCHEDULE = [(0, 5), (5, 1), (6, 3), (9, 1)]


def _model() -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CFG).double().eval()
    return model, torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def check_pairs_cache(ns: dict) -> None:
    """Same logits, pairs, positions and rejections as labcode's PairsCache; the input list is never written."""
    ours_cls, (m, ids) = ns["PairsCache"], _model()
    ours = theirs = None
    with torch.no_grad():
        for s, t in SCHEDULE:
            a, b = ours_cls(2, ours), lab.PairsCache(2, theirs)
            assert a.position == b.position == s and a.length(1) == b.length(1) == s
            kept = snapshot(ours)
            out_a, out_b = m.run(ids[:, s : s + t], a)[0], m.run(ids[:, s : s + t], b)[0]
            assert torch.equal(out_a, out_b) and states_equal(a.state(), b.state())
            assert states_equal(kept, ours)
            assert all(torch.equal(x, y) for x, y in zip(a.read(1), b.read(1), strict=True))
            assert a.nbytes == b.nbytes
            ours, theirs = a.pairs, b.pairs
    for bad in (ours[:1], [ours[0], None], [ours[0], (ours[1][0][0], ours[1][1][0])]):
        with pytest.raises(CacheError) as ours_err:
            ours_cls(2, bad)
        with pytest.raises(CacheError) as theirs_err:
            lab.PairsCache(2, bad)
        assert str(ours_err.value) == str(theirs_err.value)
    assert ours_cls(2).read(0) == (None, None)


def check_concat_cache(ns: dict) -> None:
    """Same logits, state (rows_copied included), forks, reads and reset as labcode's ConcatCache."""
    m, ids = _model()
    ours, theirs = ns["ConcatCache"](2), lab.ConcatCache(2)
    with torch.no_grad():
        for s, t in SCHEDULE:
            assert torch.equal(m(ids[:, s : s + t], ours), m(ids[:, s : s + t], theirs))
            assert states_equal(ours.state(), theirs.state()) and ours.nbytes == theirs.nbytes
            assert all(x.is_contiguous() for x in ours.read(0))
        fa, fb = ours.fork(), theirs.fork()
        kept = ours.state()
        assert torch.equal(m(ids[:, 10:13], fa), m(ids[:, 10:13], fb))
        assert states_equal(fa.state(), fb.state()) and states_equal(kept, ours.state())
    ours.reset()
    theirs.reset()
    assert states_equal(ours.state(), theirs.state()) and ours.read(1) == (None, None)


def _compare_with_return_cache(forward) -> None:
    """`forward(model, ids, caches)` computes what `model(ids, caches, return_cache=True)` computes, bit for bit:
    the same logits and the same pairs, from None and from every list it returned; the list it is given is never
    written; two continuations of one list are independent."""
    model, ids = _model()
    ours = theirs = None
    with torch.no_grad():
        for s, t in SCHEDULE:
            kept = snapshot(ours)
            out_a, new_a = forward(model, ids[:, s : s + t], ours)
            out_b, theirs = model(ids[:, s : s + t], theirs, return_cache=True)
            assert torch.equal(out_a, out_b) and states_equal(new_a, theirs), (s, t)
            assert states_equal(kept, ours)
            ours = new_a
        kept = snapshot(ours)
        fork_a, _ = forward(model, ids[:, 10:12], ours)  # two continuations of one list
        fork_b, _ = forward(model, ids[:, 12:14], ours)
        full_a = model(ids[:, :12])[:, 10:]
        full_b = model(torch.cat((ids[:, :10], ids[:, 12:14]), 1))[:, 10:]
        assert max_diff(fork_a, full_a) <= 1e-12 and max_diff(fork_b, full_b) <= 1e-12
        assert states_equal(kept, ours)


def check_scratch_explicit_attention(ns: dict) -> None:
    """The notebook's explicit_attention, threaded through labcode's blocks, is the course's return_cache=True."""
    attention = ns["explicit_attention"]

    def forward(model, ids, caches):
        t = ids.shape[1]
        start = 0 if caches is None else caches[0][0].shape[2]
        x = model.tok_emb(ids) + model.pos_emb(torch.arange(start, start + t))
        new = []
        for block, past in zip(model.blocks, caches or [None] * len(model.blocks), strict=True):
            y, kv = attention(block.attn, block.ln_1(x), past)
            x = x + y
            x = x + block.mlp(block.ln_2(x))
            new.append(kv)
        return F.linear(model.ln_f(x), model.tok_emb.weight), new

    _compare_with_return_cache(forward)


def check_scratch_explicit_forward(ns: dict) -> None:
    """The notebook's explicit_forward is the course's forward(ids, caches, return_cache=True)."""
    _compare_with_return_cache(ns["explicit_forward"])


CHECKS = {
    "labcode/model.py::CausalSelfAttention (return_cache=True)": check_scratch_explicit_attention,
    "labcode/model.py::GPT (return_cache=True)": check_scratch_explicit_forward,
    "labcode/caches/explicit.py::PairsCache": check_pairs_cache,
    "labcode/caches/concat.py::ConcatCache": check_concat_cache,
}
