"""A paged cache in the style of vLLM: a pool of fixed-size blocks and a block table per sequence.

Introduced in chapter 9. Sequences share blocks by reference count: `fork` copies a
block table, not the blocks. A block that is about to be written while another
sequence still reads it is copied first (copy-on-write), as in the PagedAttention paper.
`free` returns blocks. A pass writes only into blocks nobody holds yet; it takes them
from the pool when it ends. As in vLLM's engine today, full blocks can also be found
again by the hash of the tokens up to their end (`cache_full_blocks`, `reuse_prefix`):
a freed block keeps its hash until the pool hands it out again, least recently freed first.
"""

from __future__ import annotations

import hashlib

import torch

from labcode.caches.base import CacheError, Chunk, KVCache, snapshot
from labcode.checks import fail, is_int


def block_slots(table: list[int], start: int, t_new: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where tokens start .. start + T - 1 live: (block ids [T], offsets in the block [T])."""
    slots = torch.arange(start, start + t_new)  # (T,) logical slots = positions
    return torch.tensor(table)[slots // block_size], slots % block_size


def block_hashes(ids: list[int], block_size: int) -> list[str]:
    """One hash per full block of `ids`, chained: block i's covers block i - 1's hash and its own tokens,
    so two sequences have equal hashes exactly as far as their full blocks hold equal tokens."""
    if not (is_int(block_size) and block_size > 0):
        fail("block_size", "a positive int", block_size, CacheError)
    if not (isinstance(ids, (list, tuple)) and all(is_int(t) for t in ids)):
        fail("ids", "a list of token ids (ints)", ids, CacheError)
    hashes, parent = [], ""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = tuple(ids[start : start + block_size])
        parent = hashlib.sha256(repr((parent, block)).encode()).hexdigest()[:16]
        hashes.append(parent)
    return hashes


class BlockPool:
    """`n_blocks` blocks of `block_size` token slots for each of `n_layers` layers, and their reference counts."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int) -> None:
        for name, val in (("n_layers", n_layers), ("n_blocks", n_blocks), ("block_size", block_size)):
            if not (is_int(val) and val > 0):
                fail(name, "a positive int", val, CacheError)
        self.n_layers, self.n_blocks, self.block_size = n_layers, n_blocks, block_size
        self.k: list[torch.Tensor | None] = [None] * n_layers  # (n_blocks, Hkv, block_size, D) each
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.refcount = [0] * n_blocks
        self.free_blocks = list(range(n_blocks - 1, -1, -1))  # taken from the end: the lowest id first
        self.copies = 0  # blocks copied on write
        self.hash_of: dict[int, str] = {}  # the prefix cache: full blocks registered by the hash of their tokens
        self.cached: dict[str, int] = {}  # and the block each hash finds

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def check_kv(self, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise CacheError if keys of Hkv heads of D, in `dtype` on `device`, do not fit the storage already made."""
        if self.k[0] is not None:
            want = (self.k[0].shape[1], self.k[0].shape[3], self.k[0].dtype, self.k[0].device)
            if (hkv, d, dtype, device) != want:
                fail("k", f"(Hkv, D, dtype, device) = {want} as in the pool", (hkv, d, dtype, device), CacheError)

    def ensure_storage(self, k: torch.Tensor) -> None:
        """Allocate every layer's blocks on first use, with the activations' dtype and device."""
        if self.k[0] is None:
            _, hkv, _, d = k.shape
            for layer in range(self.n_layers):
                self.k[layer] = k.new_zeros(self.n_blocks, hkv, self.block_size, d)
                self.v[layer] = k.new_zeros(self.n_blocks, hkv, self.block_size, d)

    def peek(self, n: int) -> list[int]:
        """The n free blocks `take` would hand out next, without taking them."""
        return self.free_blocks[::-1][:n]

    def take(self, blocks: list[int]) -> None:
        """Hand out these free blocks for new data; each one's reference count becomes 1, and a cached
        block's hash is forgotten (evicted: its tokens are about to be overwritten)."""
        for block in blocks:
            self.free_blocks.remove(block)
            self.refcount[block] = 1
            if block in self.hash_of:
                del self.cached[self.hash_of.pop(block)]

    def incref(self, block: int) -> None:
        self.refcount[block] += 1

    def touch(self, block: int) -> None:
        """Take one more reference to a cached block, out of the free list if nobody held it."""
        if self.refcount[block] == 0:
            self.free_blocks.remove(block)
        self.refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when none is left: a block without a
        hash to be reused first, a cached one behind every other free block (evicted last, oldest first)."""
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self.hash_of:
                self.free_blocks.insert(0, block)  # the list is taken from the end
            else:
                self.free_blocks.append(block)

    def register(self, block: int, block_hash: str) -> None:
        """Record a full block under the hash of the tokens up to its end (the first block with a hash keeps it)."""
        if block not in self.hash_of and block_hash not in self.cached:
            self.hash_of[block], self.cached[block_hash] = block_hash, block

    def forget(self, block: int) -> None:
        """Drop a block's prefix-cache hash: its tokens are about to change in place (a rollback cut into it)."""
        if block in self.hash_of:
            del self.cached[self.hash_of.pop(block)]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated up front, used or not)."""
        return sum(t.nbytes for t in self.k + self.v if t is not None)

    def block_nbytes(self) -> int:
        return 0 if self.k[0] is None else 2 * self.n_layers * self.k[0][0].nbytes


class PagedCache(KVCache):
    """One sequence's view of a `BlockPool`: a block table maps token slot p to (table[p // bs], p % bs)."""

    def __init__(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            fail("pool", "a BlockPool", type(pool).__name__, CacheError)
        super().__init__(pool.n_layers)
        self.pool = pool
        self.table: list[int] = []

    def _blocks_to_take(self, n: int) -> int:
        """Blocks the next n positions need from the free list: new ones, and copies of shared ones."""
        if n == 0:
            return 0
        bs = self.pool.block_size
        first, last = self.position // bs, (self.position + n - 1) // bs
        shared = sum(self.pool.refcount[b] > 1 for b in self.table[first : last + 1])
        return max(0, last + 1 - len(self.table)) + shared

    def room(self) -> int:
        """Positions the pool can still take for this sequence: the rest of its last block (if not shared,
        or if a copy of it fits) and every free block."""
        bs, free = self.pool.block_size, self.pool.n_free
        left = -self.position % bs  # free slots in the last block of the table
        if left and self.pool.refcount[self.table[-1]] > 1:  # writing there needs a copy first
            return 0 if free == 0 else left + (free - 1) * bs
        return left + free * bs

    def _check(self, chunk: Chunk) -> None:
        b, hkv, t, d = chunk.shape
        if b != 1:
            fail("batch", "1 (one sequence per PagedCache; fork for more)", b, CacheError)
        self.pool.check_kv(hkv, d, chunk.dtype, chunk.device)
        need = self._blocks_to_take(t)
        if need > self.pool.n_free:
            fail("t_new", f"a chunk that fits the {self.pool.n_free} free blocks", f"{t} tokens needing {need} blocks",
                 CacheError)

    def _open(self, chunk: Chunk) -> None:
        """The table after this pass: shared blocks it writes become copies, new blocks follow; all from the pool's
        free list, taken only when the pass ends."""
        super()._open(chunk)  # the new keys follow the cached ones, under the offset causal mask
        bs, t = self.pool.block_size, chunk.t_new
        fresh = iter(self.pool.peek(self._blocks_to_take(t)))
        table, copied = list(self.table), []  # copied: (index in the table, the shared block it replaces)
        for i in range(self.position // bs, (self.position + t - 1) // bs + 1):
            if i == len(table):
                table.append(next(fresh))
            elif self.pool.refcount[table[i]] > 1:
                copied.append((i, table[i]))
                table[i] = next(fresh)
        chunk.plan = (table, copied)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table, copied = self.chunk.plan
        self.pool.ensure_storage(k)
        store_k, store_v = self.pool.k[layer], self.pool.v[layer]
        for i, old in copied:  # copy-on-write: this layer's rows of the shared block, into the private copy
            store_k[table[i]], store_v[table[i]] = store_k[old], store_v[old]
        blocks, offsets = (x.to(k.device) for x in block_slots(table, self.position, k.shape[2], self.pool.block_size))
        store_k[blocks, :, offsets] = k[0].transpose(0, 1)  # (T, Hkv, D) into T slots
        store_v[blocks, :, offsets] = v[0].transpose(0, 1)
        return self.gather(layer, self.position + k.shape[2], table)

    def _commit(self, chunk: Chunk) -> None:
        table, copied = chunk.plan
        self.pool.take([b for b in table if b not in self.table])
        for _, old in copied:
            self.pool.decref(old)
        self.pool.copies += len(copied)
        self.table = table
        super()._commit(chunk)

    def gather(self, layer: int, n: int, table: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n keys and values [1, Hkv, n, D], read through the block table (a copy)."""
        table = self.table if table is None else table
        index = torch.tensor(table[: -(-n // self.pool.block_size)], device=self.pool.k[layer].device)
        out = []
        for store in (self.pool.k[layer], self.pool.v[layer]):
            blocks = store[index]  # (nb, Hkv, bs, D)
            out.append(blocks.transpose(0, 1).reshape(1, blocks.shape[1], -1, blocks.shape[3])[:, :, :n])
        return out[0], out[1]

    def length(self, layer: int = 0) -> int:
        return self.position

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None, None) if self.position == 0 else self.gather(layer, self.position)

    def fork(self) -> PagedCache:
        """A second sequence that continues from here: the block table is copied, the blocks are shared."""
        self._between_passes("forks are made between passes")
        other = PagedCache(self.pool)
        other.table = list(self.table)
        for block in self.table:
            self.pool.incref(block)
        other.position, other.layout = self.position, self.layout
        return other

    def _rollback(self, n: int) -> None:
        """Release the blocks no kept position needs (a shared one just loses this sequence's reference). A kept
        block cut in the middle is written again next: if nobody else holds it, it forgets its prefix-cache hash;
        if someone does, the next write copies it first, as any write into a shared block does."""
        bs, kept = self.pool.block_size, self.position - n
        keep = -(-kept // bs)
        for block in reversed(self.table[keep:]):
            self.pool.decref(block)
        self.table = self.table[:keep]
        if kept % bs and self.pool.refcount[self.table[-1]] == 1:
            self.pool.forget(self.table[-1])

    def crop(self, n_drop: int) -> None:
        """Forget the last `n_drop` positions (a rejected speculative draft): `rollback` under chapter 9's name."""
        self._check_rollback(n_drop, "n_drop")
        self.rollback(n_drop)

    def free(self) -> None:
        """Return every block to the pool, the last one first (so a cached prefix is evicted from its end);
        the cache is then empty and reusable."""
        for block in reversed(self.table):
            self.pool.decref(block)
        self.table = []
        super().reset()

    def cache_full_blocks(self, ids: list[int]) -> int:
        """Register this sequence's full blocks in the pool's prefix cache, `ids` being its tokens so far;
        returns how many of its blocks are now found by hash."""
        self._between_passes("blocks are registered between passes")
        if not (isinstance(ids, (list, tuple)) and len(ids) == self.position):
            got = f"{len(ids)} ids" if isinstance(ids, (list, tuple)) else type(ids).__name__
            fail("ids", f"the sequence's {self.position} token ids", got, CacheError)
        hashes = block_hashes(list(ids), self.pool.block_size)
        for block, block_hash in zip(self.table, hashes, strict=False):
            self.pool.register(block, block_hash)
        return sum(block in self.pool.hash_of for block in self.table)

    def reuse_prefix(self, ids: list[int]) -> int:
        """Start this empty sequence from the cached blocks of the longest run of full blocks of `ids` found in
        the pool, leaving at least the last token to compute (its logits are needed); returns positions reused."""
        self._between_passes("a prefix is reused between passes")
        if self.position or self.table:
            fail("cache", "an empty sequence (reuse_prefix starts one)", f"{self.position} positions", CacheError)
        if not (isinstance(ids, (list, tuple)) and len(ids) >= 1):
            fail("ids", "a non-empty list of token ids", ids, CacheError)
        hits = []
        for block_hash in block_hashes(list(ids[:-1]), self.pool.block_size):
            if block_hash not in self.pool.cached:
                break
            hits.append(self.pool.cached[block_hash])
        for block in hits:
            self.pool.touch(block)
        self.table, self.position = hits, len(hits) * self.pool.block_size
        return self.position

    reset = free

    def state(self) -> dict:
        """This sequence's fields and the shared pool's (reference counts, free list, storage)."""
        pool = {key: snapshot(val) for key, val in vars(self.pool).items()}
        return {**super().state(), "pool": pool}

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this sequence references (shared blocks count for every sharer)."""
        return len(self.table) * self.pool.block_nbytes()
