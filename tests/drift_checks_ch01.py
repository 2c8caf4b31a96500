"""Drift checks for the teaching copies in notebooks/01_small_gpt.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import torch

import labcode.cost
import labcode.sampling


def check_sample_next(ns: dict) -> None:
    """Same ids as labcode from equally seeded generators, for every combination of the knobs."""
    ours = ns["sample_next"]
    settings = [(0.0, None, None), (1.0, None, None), (0.5, 1, None), (0.8, 5, None), (1.0, 64, None),
                (1.2, None, 0.3), (1.0, None, 1.0), (0.9, 7, 0.7), (2.0, 3, 0.99)]
    for seed in range(12):
        logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(100 + seed)) * 2.5
        for temperature, top_k, top_p in settings:
            a = ours(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
            b = labcode.sampling.sample_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
            assert torch.equal(a, b), (seed, temperature, top_k, top_p, a, b)
    # Ties at the k-th score: both keep every tied entry.
    tied = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5]])
    for seed in range(20):
        a = ours(tied, 1.0, 2, None, torch.Generator().manual_seed(seed))
        b = labcode.sampling.sample_next(tied, 1.0, 2, None, torch.Generator().manual_seed(seed))
        assert torch.equal(a, b), seed


def check_positions_computed(ns: dict) -> None:
    """Same per-call position counts as labcode, with and without a cache, edge cases included."""
    ours = ns["positions_computed"]
    for prompt_len in (1, 2, 7, 60):
        for new_tokens in (-1, 0, 1, 2, 5, 57):
            for cached in (False, True):
                expected = labcode.cost.positions_computed(prompt_len, new_tokens, cached)
                assert ours(prompt_len, new_tokens, cached) == expected, (prompt_len, new_tokens, cached)


CHECKS = {
    "labcode/sampling.py::sample_next": check_sample_next,
    "labcode/cost.py::positions_computed": check_positions_computed,
}
