"""One forward pass over many sequences whose keys live in one shared `BlockPool`.

Introduced in chapter 11 (serving). Chapter 9's ragged batch gives each row its own
offset and pads the chunks on the right; its paged cache keeps one sequence's keys in pool blocks.
A serving step needs both at once: row b holds `lengths[b]` tokens in the blocks of `tables[b]`
(allocated by the scheduler beforehand) and brings `n_new[b]` real tokens. Only real tokens are
written; padding queries read whatever finite keys sit in the padding slots, and no real query
ever sees them (chapter 9's `scattered_mask`). A view lives for one pass.
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, KVCache
from labcode.checks import fail, is_int
from labcode.engines.batch import scattered_mask
from labcode.engines.paged import BlockPool
from labcode.model import GPT


class PagedBatch(KVCache):
    """B sequences of one pool for one pass: row b has `lengths[b]` cached tokens in blocks `tables[b]`
    and brings `n_new[b]` >= 1 tokens; the tables must already cover lengths[b] + n_new[b] slots."""

    def __init__(self, pool: BlockPool, tables: list[list[int]], lengths: list[int], n_new: list[int]) -> None:
        if not isinstance(pool, BlockPool):
            fail("pool", "a BlockPool", type(pool).__name__, CacheError)
        rows = len(tables)
        if not (rows > 0 and len(lengths) == len(n_new) == rows):
            fail("tables, lengths, n_new", "three equally long non-empty lists", (rows, len(lengths), len(n_new)),
                 CacheError)
        for b in range(rows):
            ok = (is_int(lengths[b]) and lengths[b] >= 0 and is_int(n_new[b]) and n_new[b] >= 1
                  and all(is_int(x) and 0 <= x < pool.n_blocks for x in tables[b])
                  and len(tables[b]) * pool.block_size >= lengths[b] + n_new[b])
            if not ok:
                fail(f"row {b}", "blocks of the pool covering lengths + n_new slots, lengths >= 0, n_new >= 1",
                     (tables[b], lengths[b], n_new[b]), CacheError)
        super().__init__(pool.n_layers)
        self.pool, self.tables, self.lengths, self.n_new = pool, [list(t) for t in tables], list(lengths), list(n_new)

    def _check(self, chunk: Chunk) -> None:
        b, hkv, t, d = chunk.shape
        if b != len(self.tables) or t != max(self.n_new):
            fail("shape", f"B = {len(self.tables)} rows and T = {max(self.n_new)} (the longest chunk)", (b, t),
                 CacheError)
        self.pool.check_kv(hkv, d, chunk.dtype, chunk.device)

    def _slots(self, row: int, start: int, n: int) -> tuple[list[int], list[int]]:
        """(block, offset) of this row's slots start .. start + n - 1."""
        bs, table = self.pool.block_size, self.tables[row]
        return [table[p // bs] for p in range(start, start + n)], [p % bs for p in range(start, start + n)]

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: positions [B, T], the mask [B, 1, 1, T, S], where real tokens go, what each row reads."""
        t, s = chunk.t_new, max(self.lengths) + chunk.t_new
        lengths, n = torch.tensor(self.lengths).unsqueeze(1), torch.tensor(self.n_new).unsqueeze(1)  # (B, 1)
        chunk.placed = torch.minimum(lengths + torch.arange(t), lengths + n - 1)  # (B, T): padding repeats the last
        chunk.mask = scattered_mask(self.lengths, t).to(chunk.device)  # (B, 1, 1, T, S)
        write, read = ([], [], [], []), ([], [])  # (block, offset, row, column) written; (block, offset) read
        for b, (start, m) in enumerate(zip(self.lengths, self.n_new, strict=True)):
            blocks, offsets = self._slots(b, start, m)
            for part, vals in zip(write, (blocks, offsets, [b] * m, list(range(m))), strict=True):
                part.extend(vals)
            blocks, offsets = self._slots(b, 0, start + m)
            pad = s - start - m  # padding slots read block 0, slot 0: finite, and masked for real queries
            read[0].extend(blocks + [0] * pad)
            read[1].extend(offsets + [0] * pad)
        chunk.plan = ([torch.tensor(x, device=chunk.device) for x in write],
                      [torch.tensor(x, device=chunk.device).view(len(self.tables), s) for x in read])

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (blocks, offsets, rows, cols), (read_blocks, read_offsets) = self.chunk.plan
        self.pool.ensure_storage(k)
        out = []
        for new, store in ((k, self.pool.k[layer]), (v, self.pool.v[layer])):
            store[blocks, :, offsets] = new[rows, :, cols]  # (N, Hkv, D): the real tokens only
            out.append(store[read_blocks, :, read_offsets].permute(0, 2, 1, 3))  # (B, S, Hkv, D) -> (B, Hkv, S, D)
        return out[0], out[1]

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        self.lengths = [n + m for n, m in zip(self.lengths, self.n_new, strict=True)]

    def length(self, layer: int = 0) -> int:
        """The longest row's tokens."""
        return max(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct blocks the rows reference."""
        return len({x for table in self.tables for x in table}) * self.pool.block_nbytes()


def run_paged_batch(model: GPT, pool: BlockPool, tables: list[list[int]], lengths: list[int],
                    chunks: list[list[int]]) -> list[torch.Tensor]:
    """One pass of `model`: row b brings the token ids `chunks[b]` after its `lengths[b]` cached tokens in blocks
    `tables[b]`; returns each row's logits [n_b, V]."""
    if not (isinstance(chunks, list) and all(isinstance(c, list) and c for c in chunks)):
        fail("chunks", "a list of non-empty lists of token ids", chunks, CacheError)
    view = PagedBatch(pool, tables, lengths, [len(c) for c in chunks])
    t = max(len(c) for c in chunks)
    ids = torch.zeros(len(chunks), t, dtype=torch.long, device=model.device)  # (B, T), right padding with token 0
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    with torch.inference_mode():
        logits = model(ids, view)  # (B, T, V)
    return [logits[row, : len(c)] for row, c in enumerate(chunks)]
