"""Choosing the next token from logits: greedy, or seeded sampling.

Introduced in chapter 1. Randomness comes only from the `torch.Generator` passed
in, never from global seeding, so two runs with equal generators agree.
"""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next ids [B] from last-position logits [B, V]. temperature 0 means greedy (argmax)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected rank 2 [B, V], got shape {tuple(logits.shape)}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k: expected a positive integer or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected 0 < top_p <= 1 or None, got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    if generator is None:
        raise ValueError("generator: expected a torch.Generator for sampling (no global seeding), got None")
    scores = logits.double() / temperature  # float64 so that every dtype samples from the same numbers
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = scores.softmax(dim=-1).to(torch.float64).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
