"""Drift checks for the teaching copies in notebooks/13_smaller_caches.ipynb (see tests/test_drift.py).

The teaching copies show the algorithms only: latent attention's two ways for one layer, KIVI's asymmetric codes
and its two groupings, H2O's and SnapKV's selection rules. Their labcode originals also check their arguments
(tests/test_mla.py, tests/test_kivi.py and tests/test_eviction.py test those errors), so a copy is held to
computing what its original computes on valid float64 inputs: the same codes and indices exactly, the same
attention to 1e-12.
"""

from __future__ import annotations

import torch

import labcode.caches.scored as scored
import labcode.engines.kivi as kivi
from labcode import GPT, GPTConfig
from labcode.masks import causal_mask
from labcode.model import rotate

TOL = 1e-12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def check_latent_attention(ns: dict) -> None:
    """The naive and absorbed copies equal LatentAttention.naive and .absorbed, and each other, for rotary and
    learned positions, with and without a rotary key, masked and not, one query and several."""
    configs = [
        GPTConfig(vocab_size=11, context_length=32, n_layers=1, n_heads=4, d_model=32, rotary=True, kv_latent=10),
        GPTConfig(vocab_size=11, context_length=32, n_layers=1, n_heads=2, d_model=16, rotary=True, kv_latent=6,
                  latent_rope_dim=4, bias=False),
        GPTConfig(vocab_size=11, context_length=32, n_layers=1, n_heads=4, d_model=32, kv_latent=8),
    ]
    for i, cfg in enumerate(configs):
        torch.manual_seed(i)
        attn = GPT(cfg).double().eval().blocks[0].attn
        for p in attn.parameters():
            p.data.normal_(0.0, 0.3, generator=_gen(10 + i))
        for t, s in ((1, 9), (5, 5), (3, 12)):
            x = torch.randn(2, s, cfg.d_model, generator=_gen(20 + t), dtype=torch.float64)
            pos = torch.arange(s)
            rows = attn.latent(x, pos)  # (B, 1, S, r + dR)
            q = attn.q_proj(x[:, -t:]).view(2, t, attn.n_heads, -1).transpose(1, 2)
            q_c, q_rope = q.split((attn.head_dim, attn.rope_dim), dim=-1)
            if cfg.rotary:
                q_rope = rotate(q_rope, pos[-t:], cfg.rope_base)
            for mask in (None, causal_mask(t, s - t)):
                args = (q_c, q_rope, rows, mask)
                ours_n, ours_a = ns["naive"](attn, *args), ns["absorbed"](attn, *args)
                assert (ours_n - attn.naive(*args)).abs().max() <= TOL
                assert (ours_a - attn.absorbed(*args)).abs().max() <= TOL
                assert (ours_n - ours_a).abs().max() <= TOL and ours_n.abs().max() > 0.01


def check_quantize_asym(ns: dict) -> None:
    """The same codes, scales and minima for random tensors along every dim, constant groups included."""
    for seed, shape in enumerate(((2, 3, 8, 16), (1, 2, 5, 4, 8), (3, 1, 4), (4, 6))):
        x = torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)
        x[..., 0] = 0.25
        for dim in range(-1, -len(shape) - 1, -1):
            for bits in kivi.BITS:
                ours, theirs = ns["quantize_asym"](x, dim, bits), kivi.quantize_asym(x, dim, bits)
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (shape, dim, bits)


def check_quantize_keys(ns: dict) -> None:
    """The same packed codes, scales and zero points for every bit width and key group size."""
    k = torch.randn(2, 3, 24, 8, generator=_gen(5), dtype=torch.float64)
    k[..., 2] = k[..., 2] * 8 + 20  # an outlier channel
    for bits in kivi.BITS:
        for g in (1, 2, 4, 8, 12, 24):
            ours, theirs = ns["quantize_keys"](k, bits, g), kivi.quantize_keys(k, bits, g)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (bits, g)


def check_quantize_values(ns: dict) -> None:
    """The same packed codes, scales and zero points for every bit width and value group size."""
    v = torch.randn(2, 3, 7, 16, generator=_gen(6), dtype=torch.float64)
    for bits in kivi.BITS:
        for g in (4, 8, 16):
            ours, theirs = ns["quantize_values"](v, bits, g), kivi.quantize_values(v, bits, g)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (bits, g)


def check_heavy_hitters(ns: dict) -> None:
    """The same kept indices (or None) for random scores, every budget and every recent window."""
    for s in (1, 4, 9, 17):
        scores = torch.rand(2, 3, s, generator=_gen(s), dtype=torch.float64)
        for budget in range(1, s + 3):
            for recent in range(budget + 1):
                a, b = ns["heavy_hitters"](scores, budget, recent), scored.heavy_hitters(scores, budget, recent)
                assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check_snap_select(ns: dict) -> None:
    """The same kept indices for random votes, every count, kernel width and pooling."""
    for s in (3, 8, 21):
        votes = torch.rand(2, 2, s, generator=_gen(30 + s), dtype=torch.float64)
        for keep in range(1, s + 1):
            for kernel in (1, 3, 5, 7):
                for pool in scored.POOLS:
                    a, b = ns["snap_select"](votes, keep, kernel, pool), scored.snap_select(votes, keep, kernel, pool)
                    assert torch.equal(a, b), (s, keep, kernel, pool)


CHECKS = {
    "labcode/mla.py::LatentAttention": check_latent_attention,
    "labcode/engines/kivi.py::quantize_asym": check_quantize_asym,
    "labcode/engines/kivi.py::quantize_keys": check_quantize_keys,
    "labcode/engines/kivi.py::quantize_values": check_quantize_values,
    "labcode/caches/scored.py::heavy_hitters": check_heavy_hitters,
    "labcode/caches/scored.py::snap_select": check_snap_select,
}
