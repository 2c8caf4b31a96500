"""A paged cache in the style of vLLM: a pool of fixed-size blocks and a block table per sequence.

Introduced in chapter 9. Sequences share blocks by reference count: `fork` copies a
block table, not the blocks. A block that is about to be written while another
sequence still reads it is copied first (copy-on-write). `free` returns blocks.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect, snapshot
from labcode.masks import causal_mask


def block_slots(table: list[int], start: int, t_new: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where tokens start .. start + T - 1 live: (block ids [T], offsets in the block [T])."""
    slots = torch.arange(start, start + t_new)  # (T,) logical slots = positions
    return torch.tensor(table)[slots // block_size], slots % block_size


class BlockPool:
    """`n_blocks` blocks of `block_size` token slots for each of `n_layers` layers, and their reference counts."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int) -> None:
        for name, val in (("n_layers", n_layers), ("n_blocks", n_blocks), ("block_size", block_size)):
            expect(isinstance(val, int) and val > 0, name, "a positive int", val)
        self.n_layers, self.n_blocks, self.block_size = n_layers, n_blocks, block_size
        self.k: list[torch.Tensor | None] = [None] * n_layers  # (n_blocks, Hkv, block_size, D) each
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.refcount = [0] * n_blocks
        self.free_blocks = list(range(n_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self.copies = 0  # blocks copied on write

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def check_kv(self, k: torch.Tensor) -> None:
        """Raise CacheError if k [1, Hkv, T, D] does not fit the storage already allocated."""
        if self.k[0] is not None:
            want = (self.k[0].shape[1], self.k[0].shape[3], self.k[0].dtype, self.k[0].device)
            got = (k.shape[1], k.shape[3], k.dtype, k.device)
            expect(want == got, "k", f"(Hkv, D, dtype, device) = {want} as in the pool", got)

    def ensure_storage(self, k: torch.Tensor) -> None:
        """Allocate every layer's blocks on first use, with the activations' dtype and device."""
        if self.k[0] is None:
            _, hkv, _, d = k.shape
            for layer in range(self.n_layers):
                self.k[layer] = k.new_zeros(self.n_blocks, hkv, self.block_size, d)
                self.v[layer] = k.new_zeros(self.n_blocks, hkv, self.block_size, d)

    def allocate(self) -> int:
        """Take a free block; its reference count becomes 1."""
        expect(self.n_free > 0, "pool", "a free block", "none left")
        block = self.free_blocks.pop()
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none is left."""
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free_blocks.append(block)

    def copy_on_write(self, block: int) -> int:
        """A private copy of a shared block (all layers); the caller's reference moves to the copy."""
        new = self.allocate()
        for layer in range(self.n_layers):
            self.k[layer][new] = self.k[layer][block]
            self.v[layer][new] = self.v[layer][block]
        self.decref(block)
        self.copies += 1
        return new

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front, used or not)."""
        return sum(t.nbytes for t in self.k + self.v if t is not None)

    def block_nbytes(self) -> int:
        return 0 if self.k[0] is None else 2 * self.n_layers * self.k[0][0].nbytes


class PagedCache(KVCache):
    """One sequence's view of a `BlockPool`: a block table maps token slot p to (table[p // bs], p % bs)."""

    def __init__(self, pool: BlockPool) -> None:
        expect(isinstance(pool, BlockPool), "pool", "a BlockPool", type(pool).__name__)
        super().__init__(pool.n_layers)
        self.pool = pool
        self.table: list[int] = []

    def _blocks_to_take(self, t_new: int) -> int:
        """Blocks a chunk of `t_new` tokens needs from the free list: new ones, and copies of shared ones."""
        bs = self.pool.block_size
        first, last = self.position // bs, (self.position + t_new - 1) // bs
        shared = sum(self.pool.refcount[b] > 1 for b in self.table[first : last + 1])
        return max(0, last + 1 - len(self.table)) + shared

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        super().check(batch, t_new, dtype, device)
        expect(batch == 1, "batch", "1 (one sequence per PagedCache; fork for more)", batch)
        need = self._blocks_to_take(t_new)
        expect(need <= self.pool.n_free, "t_new", f"a chunk that fits the {self.pool.n_free} free blocks",
               f"{t_new} tokens needing {need} blocks")

    def _prepare(self, t_new: int) -> None:
        """Before the first write of a pass: copy shared blocks that will be written, add new blocks."""
        bs = self.pool.block_size
        for i in range(self.position // bs, (self.position + t_new - 1) // bs + 1):
            if i < len(self.table):
                if self.pool.refcount[self.table[i]] > 1:
                    self.table[i] = self.pool.copy_on_write(self.table[i])
            else:
                self.table.append(self.pool.allocate())

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(k, torch.Tensor) and k.dim() == 4:  # what only the pool knows, checked before any change
            expect(k.shape[0] == 1, "batch", "1 (one sequence per PagedCache; fork for more)", k.shape[0])
            self.pool.check_kv(k)
        return super().append(layer, k, v)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, bs = k.shape[2], self.pool.block_size
        if layer == 0:
            self.pool.ensure_storage(k)
            self._prepare(t)
        blocks, offsets = (x.to(k.device) for x in block_slots(self.table, self.position, t, bs))
        self.pool.k[layer][blocks, :, offsets] = k[0].transpose(0, 1)  # (T, Hkv, D) into T slots
        self.pool.v[layer][blocks, :, offsets] = v[0].transpose(0, 1)
        return self.gather(layer, self.position + t)

    def gather(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values [1, Hkv, n, D], read through the block table (a copy)."""
        table = torch.tensor(self.table[: -(-n // self.pool.block_size)], device=self.pool.k[layer].device)
        out = []
        for store in (self.pool.k[layer], self.pool.v[layer]):
            blocks = store[table]  # (nb, Hkv, bs, D)
            out.append(blocks.transpose(0, 1).reshape(1, blocks.shape[1], -1, blocks.shape[3])[:, :, :n])
        return out[0], out[1]

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        return None if t_new == 1 else causal_mask(t_new, self.position, device=self.pool.k[layer].device)

    def length(self, layer: int = 0) -> int:
        return self.position

    def fork(self) -> PagedCache:
        """A second sequence that continues from here: the block table is copied, the blocks are shared."""
        other = PagedCache(self.pool)
        other.table = list(self.table)
        for block in self.table:
            self.pool.incref(block)
        other.position, other.batch, other.dtype, other.device = self.position, self.batch, self.dtype, self.device
        return other

    def crop(self, n_drop: int) -> None:
        """Forget the last `n_drop` positions (a rejected speculative draft); unneeded blocks are released."""
        expect(isinstance(n_drop, int) and 0 <= n_drop <= self.position, "n_drop",
               f"an int in [0, {self.position}]", n_drop)
        self.position -= n_drop
        keep = -(-self.position // self.pool.block_size)
        for block in self.table[keep:]:
            self.pool.decref(block)
        self.table = self.table[:keep]

    def free(self) -> None:
        """Return every block to the pool; the cache is then empty and reusable."""
        for block in self.table:
            self.pool.decref(block)
        self.table = []
        super().reset()

    reset = free

    def state(self) -> dict:
        """This sequence's fields and the shared pool's (reference counts, free list, storage)."""
        pool = {key: snapshot(val) for key, val in vars(self.pool).items()}
        return {**super().state(), "pool": pool}

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references (shared blocks count for every sharer)."""
        return len(self.table) * self.pool.block_nbytes()
