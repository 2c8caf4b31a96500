"""Beam search on a cache reordered every step and on shared copy-on-write paged blocks: the same beams as the
reference that recomputes every beam without a cache, scores within 1e-12 (float64); and what each costs."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, TOL64, build, make_cache, property_configs, rejected

from labcode.beam import beam_search, beam_search_nocache, beam_search_paged, beam_step
from labcode.caches import CacheError, ConcatCache, WindowCache
from labcode.engines import BlockPool, CellsCache

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py

CONFIGS = property_configs(context_length=24)
MODELS = [build(CONFIGS[i], i, scale=0.5) for i in (0, 2, 3)]  # 2 and 3 layers, learned and rotary positions
PROMPTS = [torch.randint(0, 11, (1, p), generator=torch.Generator().manual_seed(p)) for p in (1, 6)]
REORDERED = [k for k in EXACT if k not in ("paged", "cells")]  # kinds that hold the beams as batch rows


def same_beams(got, want) -> None:
    assert torch.equal(got.ids, want.ids)
    assert (got.scores - want.scores).abs().max().item() <= TOL64


@pytest.mark.parametrize("kind", REORDERED)
def test_a_reordered_cache_finds_the_reference_beams(kind):
    for model in MODELS:
        for ids, width in zip(PROMPTS, (3, 4), strict=True):
            out = beam_search(model, ids, width, 7, make_cache(kind, model, 24))
            same_beams(out, beam_search_nocache(model, ids, width, 7))
            assert len(out.bytes_reordered) == 6 and min(out.bytes_reordered) > 0


@pytest.mark.parametrize("block_size", [1, 2, 5])
def test_shared_paged_blocks_find_the_reference_beams(block_size):
    for model in MODELS:
        for ids, width in zip(PROMPTS, (3, 4), strict=True):
            pool = BlockPool(model.cfg.n_layers, n_blocks=width * -(-(ids.shape[1] + 7) // block_size),
                             block_size=block_size)
            out = beam_search_paged(model, ids, width, 7, pool)
            same_beams(out, beam_search_nocache(model, ids, width, 7))
            assert pool.n_free == pool.n_blocks and pool.refcount == [0] * pool.n_blocks  # every block returned
            assert max(out.blocks_shared) > 0  # beams did share blocks
            if block_size == 1:  # a block holds one position: every write opens a new one, nothing is copied
                assert sum(out.bytes_copied_on_write) == 0


def test_sharing_blocks_copies_less_than_reordering():
    model, ids = MODELS[1], PROMPTS[1]
    reordered = beam_search(model, ids, 4, 10, ConcatCache(model.cfg.n_layers))
    shared = beam_search_paged(model, ids, 4, 10, BlockPool(model.cfg.n_layers, n_blocks=32, block_size=4))
    same_beams(shared, reordered)
    assert 0 < sum(shared.bytes_copied_on_write) < sum(reordered.bytes_reordered)


def test_beam_step_keeps_the_best_pairs_over_all_beams():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64))
    parents, tokens, scores = beam_step(logits, torch.tensor([0.0, -0.1], dtype=torch.float64), 3)
    assert parents.tolist() == [1, 0, 0] and tokens.tolist() == [2, 0, 1]
    assert torch.allclose(scores, torch.log(torch.tensor([0.8, 0.5, 0.3], dtype=torch.float64))
                          + torch.tensor([-0.1, 0.0, 0.0], dtype=torch.float64))


def test_reorder_gathers_rows_and_a_later_pass_sees_them():
    model = MODELS[0]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cache = WindowCache(model.cfg.n_layers, 8)
    model(ids, cache)
    before = cache.read(1)[0].clone()
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.layout.batch == 3 and torch.equal(cache.read(1)[0], before[[1, 1, 0]])
    got = model(torch.tensor([[7], [8], [9]]), cache)
    want = model(torch.tensor([[4, 5, 6, 7], [4, 5, 6, 8], [1, 2, 3, 9]]))[:, -1:]
    assert (got - want).abs().max().item() <= TOL64


def test_bad_reorders_and_searches_are_refused():
    model = MODELS[0]
    cache = ConcatCache(model.cfg.n_layers)
    rejected(cache, lambda: cache.reorder(torch.tensor([0])), CacheError, r"cache: expected a cache holding rows")
    model(torch.tensor([[1, 2], [3, 4]]), cache)
    for bad in (torch.tensor([2]), torch.tensor([-1]), torch.tensor([0.0]), torch.tensor([], dtype=torch.long),
                torch.tensor([[0]]), [0]):
        rejected(cache, lambda bad=bad: cache.reorder(bad), CacheError,
                 r"index: expected a non-empty rank-1 long tensor of rows in \[0, 2\)")
    cells = CellsCache(model.cfg.n_layers, 8, default_seq=0)
    model(torch.tensor([[1, 2]]), cells)
    rejected(cells, lambda: cells.reorder(torch.tensor([0, 0])), CacheError, r"reorder: expected a cache with one row")
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"width: expected an int in \[1, 11\]"):
        beam_search_nocache(model, ids, 12, 3)
    with pytest.raises(ValueError, match=r"ids: expected one prompt"):
        beam_search(model, ids.repeat(2, 1), 2, 3, ConcatCache(model.cfg.n_layers))
    with pytest.raises(ValueError, match=r"steps: expected a positive number"):
        beam_search_nocache(model, ids, 2, 0)
    with pytest.raises(ValueError, match=r"positions: expected start \+ T <= context_length 24"):
        beam_search_nocache(model, ids, 2, 24)
    pool = BlockPool(model.cfg.n_layers, n_blocks=3, block_size=2)
    with pytest.raises(ValueError, match=r"pool: expected at least 6 free blocks"):
        beam_search_paged(model, ids, 3, 2, pool)
