"""Choosing the next token from logits: greedy, or seeded sampling.

Introduced in chapter 1. Randomness comes only from the `torch.Generator` passed
in, never from global seeding, so two runs with equal generators agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labcode.checks import fail, is_int


@dataclass(frozen=True)
class Sampler:
    """How to pick the next token; checked once, when made. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            fail("temperature", ">= 0", self.temperature)
        if self.top_k is not None and not (is_int(self.top_k) and self.top_k > 0):
            fail("top_k", "a positive integer or None", self.top_k)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail("top_p", "0 < top_p <= 1 or None", self.top_p)
        if self.temperature > 0 and self.generator is None:
            fail("generator", "a torch.Generator for sampling (no global seeding)", None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Next ids [B] from last-position logits [B, V]."""
        if logits.dim() != 2:
            fail("logits", "rank 2 [B, V]", f"shape {tuple(logits.shape)}")
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        scores = logits.double() / self.temperature  # float64 so that every dtype samples from the same numbers
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs > self.top_p  # keep the shortest prefix whose mass exceeds top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = scores.softmax(dim=-1).to(torch.float64).cpu()
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).to(logits.device)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next ids [B] from last-position logits [B, V]. temperature 0 means greedy (argmax)."""
    return Sampler(temperature, top_k, top_p, generator)(logits)
