"""Drift checks for the teaching copies in notebooks/12_the_cache_that_goes_back.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import torch

import labcode.beam
import labcode.speculative


def check_accept_draft(ns: dict) -> None:
    """The same (kept, next token) for random targets, drafts and seeds, with a draft distribution and with
    point-mass drafts (prompt lookup), for every number of drafts."""
    ours, theirs = ns["accept_draft"], labcode.speculative.accept_draft
    g = torch.Generator().manual_seed(5)
    for _ in range(60):
        k, v = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
        p = (torch.randn(k + 1, v, generator=g, dtype=torch.float64) * 2).softmax(-1)
        q = (torch.randn(k, v, generator=g, dtype=torch.float64) * 2).softmax(-1)
        drafts = torch.randint(0, v, (k,), generator=g).tolist()
        for dist in (q, None):
            seed = int(torch.randint(0, 2**31, (1,), generator=g))
            a = ours(p, dist, drafts, torch.Generator().manual_seed(seed))
            b = theirs(p, dist, drafts, torch.Generator().manual_seed(seed))
            assert a == b, (a, b, drafts)


def check_beam_step(ns: dict) -> None:
    """The same parents, tokens and scores for random logits, scores and widths, ties included."""
    ours, theirs = ns["beam_step"], labcode.beam.beam_step
    g = torch.Generator().manual_seed(6)
    for n in (1, 2, 5):
        for v in (3, 11):
            for width in range(1, min(n * v, 8) + 1):
                logits = torch.randn(n, v, generator=g, dtype=torch.float64)
                scores = torch.randn(n, generator=g, dtype=torch.float64)
                for a, b in zip(ours(logits, scores, width), theirs(logits, scores, width), strict=True):
                    assert torch.equal(a, b), (n, v, width)
    flat = torch.zeros(2, 4, dtype=torch.float64)  # every pair ties
    assert all(torch.equal(a, b) for a, b in zip(ours(flat, torch.zeros(2), 3), theirs(flat, torch.zeros(2), 3),
                                                 strict=True))


CHECKS = {
    "labcode/speculative.py::accept_draft": check_accept_draft,
    "labcode/beam.py::beam_step": check_beam_step,
}
