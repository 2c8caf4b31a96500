"""Drift checks for the teaching copies in notebooks/09_how_engines_manage_the_cache.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

import pytest
import torch

import labcode.engines
from labcode.caches import CacheError


def _same_errors(ours, theirs, calls) -> None:
    for args in calls:
        with pytest.raises(CacheError) as a:
            ours(*args)
        with pytest.raises(CacheError) as b:
            theirs(*args)
        assert str(a.value) == str(b.value)


def check_block_slots(ns: dict) -> None:
    """The same blocks and offsets for every start, length and block size on small tables."""
    ours, theirs = ns["block_slots"], labcode.engines.block_slots
    for bs in (1, 2, 3, 5):
        table = [7, 3, 9, 0, 4, 2][: 11 // bs + 1]
        for start in range(len(table) * bs):
            for t in range(1, len(table) * bs - start + 1):
                a, b = ours(table, start, t, bs), theirs(table, start, t, bs)
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (bs, start, t)


def check_block_hashes(ns: dict) -> None:
    """The same hashes for random token lists and every block size, and the same errors."""
    ours, theirs = ns["block_hashes"], labcode.engines.block_hashes
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        ids = torch.randint(0, 64, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        for bs in (1, 2, 3, 4, 7):
            assert ours(ids, bs) == theirs(ids, bs), (ids, bs)
    _same_errors(ours, theirs, [([1, 2], 0), ([1, 2], -1), ([1, 2.5], 2), ("ab", 2)])


def check_find_slots(ns: dict) -> None:
    """The same cells (or None) for random occupancy, every head and every request size."""
    ours, theirs = ns["find_slots"], labcode.engines.find_slots
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(1, 12, (1,), generator=g))
        pos = torch.where(torch.rand(n, generator=g) < 0.5, torch.arange(n), torch.full((n,), -1))
        for head in range(n):
            for t in range(1, n + 2):
                a, b = ours(pos, head, t), theirs(pos, head, t)
                assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check_cells_mask(ns: dict) -> None:
    """The same mask for random metadata and random tokens."""
    ours, theirs = ns["cells_mask"], labcode.engines.cells_mask
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        n, seqs, t = (int(x) for x in torch.randint(1, 9, (3,), generator=g))
        pos = torch.randint(-1, 8, (n,), generator=g)
        owners = torch.rand(n, seqs, generator=g) < 0.5
        seq_ids, positions = torch.randint(0, seqs, (t,), generator=g), torch.randint(0, 8, (t,), generator=g)
        assert torch.equal(ours(pos, owners, seq_ids, positions), theirs(pos, owners, seq_ids, positions))


def check_scattered_mask(ns: dict) -> None:
    """The same [B, 1, 1, T, S] mask for many row lengths and chunk sizes."""
    ours, theirs = ns["scattered_mask"], labcode.engines.scattered_mask
    for lengths in ([0], [5], [3, 0, 5], [2, 2], [7, 1, 4, 0], [0, 0, 0]):
        for t in (1, 2, 3, 6):
            a, b = ours(lengths, t), theirs(lengths, t)
            assert a.shape == b.shape and torch.equal(a, b), (lengths, t)


def check_quantize(ns: dict) -> None:
    """The same codes and scales for every bit width and group size, zeros included, and the same errors."""
    ours, theirs = ns["quantize"], labcode.engines.quantize
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 16, generator=g, dtype=torch.float64) * 5
    x[0, 0] = 0.0
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for bits in range(2, 9):
            for group in (None, 1, 4, 16):
                a, b = ours(x.to(dtype), bits, group), theirs(x.to(dtype), bits, group)
                assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), (dtype, bits, group)
    _same_errors(ours, theirs, [(x, 9, None), (x, 8, 3), (x, 1, None)])


def check_hadamard(ns: dict) -> None:
    """The same matrix for every power of two up to 128 and in several dtypes, and the same errors."""
    ours, theirs = ns["hadamard"], labcode.engines.hadamard
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        for dtype in (torch.float64, torch.float32):
            assert torch.equal(ours(n, dtype), theirs(n, dtype)), (n, dtype)
    _same_errors(ours, theirs, [(12,), (0,), (-4,)])


CHECKS = {
    "labcode/engines/paged.py::block_slots": check_block_slots,
    "labcode/engines/paged.py::block_hashes": check_block_hashes,
    "labcode/engines/cells.py::find_slots": check_find_slots,
    "labcode/engines/cells.py::cells_mask": check_cells_mask,
    "labcode/engines/batch.py::scattered_mask": check_scattered_mask,
    "labcode/engines/quant.py::quantize": check_quantize,
    "labcode/engines/quant.py::hadamard": check_hadamard,
}
