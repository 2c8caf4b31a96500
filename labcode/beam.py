"""Beam search three ways: recomputed without a cache, on a cache reordered every step, on shared paged blocks.

Introduced in chapter 12 (rollback). Each step, every beam's next-token log-probabilities
are added to its score, and the W best (beam, token) pairs over all beams survive; a surviving beam's
cache must then be its parent's. Hugging Face's `reorder_cache` gathers the cache's batch rows by parent
(`KVCache.reorder`): every cached byte is written again at every step. A paged cache instead forks each
parent's block table (vLLM's beam search shares blocks by reference count) and copies a block only when
a beam writes into one that another beam still reads (copy-on-write). All three pick the same beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from labcode.caches.base import KVCache, check_cache
from labcode.checks import fail, is_int
from labcode.engines.paged import BlockPool, PagedCache
from labcode.generate import prefill


@dataclass
class Beams:
    """What a beam search returns: W beams, best first, and what keeping their caches cost."""

    ids: torch.Tensor  # (W, P + n): the prompt followed by each beam's n tokens
    scores: torch.Tensor  # (W,) float64: each beam's summed log-probability of its n tokens
    bytes_reordered: list[int] = field(default_factory=list)  # per step: cache bytes written by reordering
    blocks_shared: list[int] = field(default_factory=list)  # per step: paged blocks more than one beam holds
    bytes_copied_on_write: list[int] = field(default_factory=list)  # per step: bytes of blocks copied on write


def beam_step(logits: torch.Tensor, scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """The `width` best continuations of beams with `scores` [N] and next-token logits [N, V]: (parents [width],
    tokens [width], new scores [width]), best first; scores add float64 log-probabilities."""
    total = scores.view(-1, 1) + logits.double().log_softmax(dim=-1)  # (N, V)
    best = total.flatten().topk(width)  # sorted, best first
    v = logits.shape[-1]
    return best.indices // v, best.indices % v, best.values


def _check(model: nn.Module, ids: torch.Tensor, width: int, steps: int) -> None:
    b, p = model.check_ids(ids)
    if b != 1:
        fail("ids", "one prompt [1, P] (the beams grow from it)", tuple(ids.shape))
    if not (is_int(width) and 1 <= width <= model.cfg.vocab_size):
        fail("width", f"an int in [1, {model.cfg.vocab_size}] (the vocabulary)", repr(width))
    if not (is_int(steps) and steps >= 1):
        fail("steps", "a positive number of new tokens", repr(steps))
    model.positions(None, 0, 1, p + steps - 1)  # every fed position must fit the position table


@torch.inference_mode()
def beam_search_nocache(model: nn.Module, ids: torch.Tensor, width: int, steps: int) -> Beams:
    """The reference: every step runs the full forward on every beam, ids [W, P + t]."""
    _check(model, ids, width, steps)
    seqs, scores = ids, torch.zeros(1, dtype=torch.float64, device=ids.device)
    for _ in range(steps):
        parents, tokens, scores = beam_step(model(seqs)[:, -1], scores, width)
        seqs = torch.cat((seqs[parents], tokens.unsqueeze(1)), dim=1)
    return Beams(seqs, scores)


@torch.inference_mode()
def beam_search(model: nn.Module, ids: torch.Tensor, width: int, steps: int, cache: KVCache) -> Beams:
    """Beam search on one cache whose batch rows are the beams, reordered by parent every step (the first
    step turns the prompt's one row into W)."""
    _check(model, ids, width, steps)
    check_cache(cache, model.cfg.kv_layers, model.cfg.sliding_window)
    out = Beams(ids, torch.zeros(1, dtype=torch.float64, device=ids.device))
    logits = prefill(model, ids, cache)  # (1, V)
    for step in range(steps):
        parents, tokens, out.scores = beam_step(logits, out.scores, width)
        out.ids = torch.cat((out.ids[parents], tokens.unsqueeze(1)), dim=1)
        if step + 1 < steps:
            out.bytes_reordered.append(cache.reorder(parents))  # row b now holds beam b's parent's keys
            logits = model(tokens.unsqueeze(1), cache)[:, -1]  # (W, V)
    return out


@torch.inference_mode()
def beam_search_paged(model: nn.Module, ids: torch.Tensor, width: int, steps: int, pool: BlockPool) -> Beams:
    """Beam search with one `PagedCache` per beam in `pool`: a surviving beam forks its parent (blocks shared,
    nothing copied), the old beams are freed, and a write into a shared block copies it first. Every block
    is back in the pool at the end."""
    _check(model, ids, width, steps)
    if not isinstance(pool, BlockPool):
        fail("pool", "a BlockPool", type(pool).__name__)
    need = width * -(-(ids.shape[1] + steps) // pool.block_size)
    if pool.n_free < need:
        fail("pool", f"at least {need} free blocks ({width} beams of up to {ids.shape[1] + steps} positions)",
             pool.n_free)
    out = Beams(ids, torch.zeros(1, dtype=torch.float64, device=ids.device))
    beams = [PagedCache(pool)]
    logits = prefill(model, ids, beams[0])  # (1, V)
    for step in range(steps):
        parents, tokens, out.scores = beam_step(logits, out.scores, width)
        out.ids = torch.cat((out.ids[parents], tokens.unsqueeze(1)), dim=1)
        if step + 1 == steps:
            break
        children = [beams[i].fork() for i in parents.tolist()]  # block tables copied, blocks shared
        for beam in beams:
            beam.free()  # a parent's blocks live on in its children (or go back to the pool)
        out.blocks_shared.append(len({b for c in children for b in c.table if pool.refcount[b] > 1}))
        copies = pool.copies
        logits = torch.cat([model(t.view(1, 1), c)[:, -1] for t, c in zip(tokens, children, strict=True)])
        out.bytes_copied_on_write.append((pool.copies - copies) * pool.block_nbytes())
        beams = children
    for beam in beams:
        beam.free()
    return out
