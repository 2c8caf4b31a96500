"""What the cache tests share: one factory per cache kind, the "refused and unchanged" check, and runners."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings

from labcode import GPT, GPTConfig
from labcode.caches import (
    ConcatCache,
    GrowableCache,
    KVCache,
    ModuleStateCache,
    PairsCache,
    RingCache,
    SinkCache,
    SlidingWindowCache,
    WindowCache,
)
from labcode.caches.base import states_equal
from labcode.engines import BlockPool, CellsCache, PagedCache, QuantizedCache, ScatteredCache

TOL64 = 1e-12  # float64 equivalence: the course's bar

# The property tests: 200 derandomized examples each (the same schedules on every run), no deadline.
PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def property_configs(context_length: int) -> list[GPTConfig]:
    """Tiny models that differ in what a cache could get wrong: heads, KV heads, depth, rotary positions."""
    return [
        GPTConfig(vocab_size=11, context_length=context_length, n_layers=2, n_heads=2, d_model=8),
        GPTConfig(vocab_size=11, context_length=context_length, n_layers=2, n_heads=4, n_kv_heads=2, d_model=16),
        GPTConfig(vocab_size=11, context_length=context_length, n_layers=3, n_heads=4, n_kv_heads=1, d_model=8),
        GPTConfig(vocab_size=11, context_length=context_length, n_layers=2, n_heads=2, n_kv_heads=1, d_model=8,
                  rotary=True),
    ]

# kind -> (model, room, batch) -> an empty cache for `model` that holds `room` positions of `batch` rows without
# dropping any. The window caches get exactly `room` slots (a test that wants drops gives a smaller room).
FACTORIES: dict[str, Callable[[GPT, int, int], KVCache]] = {
    "concat": lambda m, room, b: ConcatCache(m.cfg.kv_layers),
    "pairs": lambda m, room, b: PairsCache(m.cfg.kv_layers),
    "window": lambda m, room, b: WindowCache(m.cfg.kv_layers, room),
    "ring": lambda m, room, b: RingCache(m.cfg.kv_layers, room),
    "sliding": lambda m, room, b: SlidingWindowCache(m.cfg.kv_layers, room + 1),  # keeps W - 1 = room rows
    "sinks": lambda m, room, b: SinkCache(m.cfg.kv_layers, room, n_keep=2),  # the first 2 and the latest `room`
    "growable-linear": lambda m, room, b: GrowableCache(m.cfg.kv_layers, 3),
    "growable-double": lambda m, room, b: GrowableCache(m.cfg.kv_layers, 3, policy="double"),
    "naive": lambda m, room, b: (m.reset_kv_cache(), ModuleStateCache(m))[1],
    "paged": lambda m, room, b: PagedCache(BlockPool(m.cfg.kv_layers, n_blocks=-(-room // 3), block_size=3)),
    "cells": lambda m, room, b: CellsCache(m.cfg.kv_layers, room, n_seqs=2, default_seq=0),
    "scattered": lambda m, room, b: ScatteredCache(m.cfg.kv_layers, b, room),
    "quantized": lambda m, room, b: QuantizedCache(m.cfg.kv_layers, bits=8),
}
CORE = ["concat", "pairs", "window", "ring", "sliding", "sinks", "growable-linear", "growable-double"]  # chapters 4-6
ONE_ROW = {"paged", "cells"}  # kinds that hold one sequence (batch 1)
EXACT = [k for k in FACTORIES if k != "quantized"]  # every kind that computes the full forward's logits


def make_cache(kind: str, model: GPT, room: int | None = None, batch: int = 1) -> KVCache:
    """An empty cache of `kind` for `model`, with room for `room` positions (default: the position table)."""
    return FACTORIES[kind](model, room or model.cfg.context_length, batch)


def build(cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float64, scale: float | None = None) -> GPT:
    """A model in eval mode, its weights drawn under `seed` (redrawn from N(0, scale^2) if given, so that a wrong
    mask or offset shows), without touching the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg).to(dtype).eval()
        if scale is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, scale)
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run_chunks(model: GPT, ids: torch.Tensor, cache: KVCache, sizes: list[int]) -> torch.Tensor:
    """Logits [B, sum(sizes), V] of ids [B, >= sum(sizes)] fed through `cache` in chunks of the given sizes."""
    outs, start = [], 0
    for t in sizes:
        outs.append(model(ids[:, start : start + t], cache))
        start += t
    return torch.cat(outs, dim=1)


def rejected(cache: KVCache, call: Callable[[], object], exc: type[Exception], match: str) -> None:
    """`call()` raises `exc` matching `match`, and `cache.state()` is exactly unchanged."""
    before = cache.state()
    with pytest.raises(exc, match=match):
        call()
    assert states_equal(before, cache.state()), "the refused call changed the cache"
