"""Cells and slot search in the style of llama.cpp: one buffer, several sequences, metadata per cell.

Introduced in chapter 9. Each of the `n_cells` slots records the position it holds and
which sequences own it; the data never says whose it is. A batch is a flat list of
tokens, each with its own sequence id and position (set with `plan`); the mask is
built from the metadata, so a token sees exactly its own sequence's past. The search
for free cells, the head it starts from and the sequence operations (`seq_rm`, `seq_cp`,
`seq_add`) follow llama.cpp's `llama_kv_cache` (src/llama-kv-cache.cpp).
"""

from __future__ import annotations

import torch

from labcode.caches.base import CacheError, Chunk, PerLayerCache
from labcode.checks import fail, is_int


def find_slots(pos: torch.Tensor, head: int, t_new: int) -> torch.Tensor | None:
    """Indices of `t_new` empty cells (pos < 0), searching from `head` and wrapping around; None if too few.

    Far ahead of the cells in use (more than used + 2 T), the search starts at cell 0 instead.
    """
    n = pos.shape[0]
    if head > int((pos >= 0).sum()) + 2 * t_new:  # enough free cells behind the head: fill from the start
        head = 0
    order = (torch.arange(n) + head) % n  # head, head + 1, ..., n - 1, 0, ..., head - 1
    free = order[pos[order] < 0]
    return free[:t_new] if free.numel() >= t_new else None


def cells_mask(pos: torch.Tensor, owners: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, n_cells]: token i (of sequence seq_ids[i], at positions[i]) sees cell j iff its sequence
    owns cell j and the cell's position is not after its own. pos [n_cells], owners [n_cells, n_seqs]."""
    same_seq = owners[:, seq_ids].T  # (T, n_cells)
    return same_seq & (pos.unsqueeze(0) <= positions.unsqueeze(1)) & (pos >= 0).unsqueeze(0)


class CellsCache(PerLayerCache):
    """K/V cells [1, Hkv, n_cells, D] per layer, with `pos` [n_cells] and `owners` [n_cells, n_seqs] metadata.

    Each pass needs a plan (`plan(seq_ids)`): which sequence each of its tokens belongs to.
    A cache made with `default_seq` runs passes without a plan as that one sequence, which is
    how `prefill` and `generate` use it.
    """

    def __init__(self, n_layers: int, n_cells: int, n_seqs: int = 4, default_seq: int | None = None) -> None:
        super().__init__(n_layers)  # self.k, self.v: one (1, Hkv, n_cells, D) buffer per layer, made on first use
        if not (is_int(n_cells) and n_cells > 0):
            fail("n_cells", "a positive int", n_cells, CacheError)
        if not (is_int(n_seqs) and n_seqs > 0):
            fail("n_seqs", "a positive int", n_seqs, CacheError)
        if not (default_seq is None or (is_int(default_seq) and 0 <= default_seq < n_seqs)):
            fail("default_seq", f"None or an int in [0, {n_seqs})", default_seq, CacheError)
        self.n_cells, self.n_seqs, self.default_seq = n_cells, n_seqs, default_seq
        self.pos = torch.full((n_cells,), -1, dtype=torch.long)  # -1: empty cell
        self.owners = torch.zeros(n_cells, n_seqs, dtype=torch.bool)  # a bitset of sequences per cell
        self.head = 0  # the slot search starts here: just after the last cell written
        self.planned: tuple[torch.Tensor, torch.Tensor] | None = None  # the next pass's (seq ids [T], positions [T])

    def seq_pos_max(self, seq: int) -> int:
        """Largest position sequence `seq` holds, or -1."""
        held = self.pos[self.owners[:, seq]]
        return int(held.max()) if held.numel() else -1

    def plan(self, seq_ids: list[int], positions: list[int] | None = None) -> None:
        """Say which sequence (and position) each of the next pass's T tokens belongs to; changes no cell.

        Without `positions`, each sequence continues after the largest position it holds.
        """
        if not (len(seq_ids) > 0 and all(is_int(s) and 0 <= s < self.n_seqs for s in seq_ids)):
            fail("seq_ids", f"a non-empty list of ints in [0, {self.n_seqs})", seq_ids, CacheError)
        start = {s: self.seq_pos_max(s) + 1 for s in set(seq_ids)}
        if positions is None:
            nxt, positions = dict(start), []
            for s in seq_ids:
                positions.append(nxt[s])
                nxt[s] += 1
        nxt = dict(start)
        if len(positions) != len(seq_ids):
            fail("positions", f"{len(seq_ids)} positions, one per token", positions, CacheError)
        for s, p in zip(seq_ids, positions, strict=True):
            if not (is_int(p) and p >= nxt[s]):
                fail("positions", f"for sequence {s}, increasing positions after its last one ({nxt[s] - 1})",
                     positions, CacheError)
            nxt[s] = p + 1
        self.planned = (torch.tensor(seq_ids), torch.tensor(positions))

    def _pass_plan(self, t_new: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plan of a pass of `t_new` tokens: the one made with `plan`, else `default_seq` continuing."""
        if self.planned is not None or self.default_seq is None:
            return self.planned
        first = self.seq_pos_max(self.default_seq) + 1
        return torch.full((t_new,), self.default_seq), torch.arange(first, first + t_new)

    def find_slots(self, t_new: int) -> torch.Tensor | None:
        """Where the next `t_new` tokens would go (changes nothing)."""
        return find_slots(self.pos, self.head, t_new)

    def room(self) -> int:
        """Empty cells: each new token takes one."""
        return int((self.pos < 0).sum())

    def _check(self, chunk: Chunk) -> None:
        b, _, t, _ = chunk.shape
        if b != 1:
            fail("batch", "1 (tokens of all sequences go side by side on the T axis)", b, CacheError)
        plan = self._pass_plan(t)
        if plan is None:
            fail("plan", "plan(seq_ids) before each forward pass", None, CacheError)
        if len(plan[0]) != t:
            fail("plan", f"a plan for the {t} tokens of this pass", len(plan[0]), CacheError)
        if self.room() < t:
            fail("t_new", f"at most {self.room()} tokens (free cells)", t, CacheError)

    def _open(self, chunk: Chunk) -> None:
        """Once per pass: the cells the slot search finds, the metadata after the pass, and the mask."""
        seq, qpos = self._pass_plan(chunk.t_new)
        slots = self.find_slots(chunk.t_new)
        pos, owners = self.pos.clone(), self.owners.clone()  # the metadata once the pass is committed
        pos[slots], owners[slots] = qpos, False
        owners[slots, seq] = True
        n_kv = int(torch.nonzero(pos >= 0).max()) + 1  # attention reads every cell up to the last one in use
        chunk.placed, chunk.slots, chunk.plan = qpos, slots, (pos, owners, n_kv)
        chunk.mask = cells_mask(pos[:n_kv], owners[:n_kv], seq, qpos).to(chunk.device)  # (T, n_kv)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._buffers(layer, k, self.n_cells)
        slots, n_kv = self.chunk.slots.to(k.device), self.chunk.plan[2]
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer][:, :, :n_kv], self.v[layer][:, :, :n_kv]  # only up to the last used cell

    def _commit(self, chunk: Chunk) -> None:
        """The planned metadata becomes the cells'; the next search starts after the cells just written."""
        super()._commit(chunk)
        self.pos, self.owners, _ = chunk.plan
        self.head = (int(chunk.slots[-1]) + 1) % self.n_cells
        self.planned = None
        self.position = int(self.pos.max()) + 1

    def _check_range(self, seq: int, p0: int, p1: int | None) -> int:
        if not (is_int(seq) and 0 <= seq < self.n_seqs):
            fail("seq", f"an int in [0, {self.n_seqs})", seq, CacheError)
        if not (is_int(p0) and p0 >= 0):
            fail("p0", "an int >= 0", p0, CacheError)
        p1 = max(p0, int(self.pos.max()) + 1) if p1 is None else p1
        if not (is_int(p1) and p1 >= p0):
            fail("p1", f"an int >= p0 = {p0}", p1, CacheError)
        return p1

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Remove sequence `seq` from cells at positions [p0, p1); cells nobody owns become empty, and the
        head moves back to the first of them if it is behind the head."""
        p1 = self._check_range(seq, p0, p1)
        hit = self.owners[:, seq] & (self.pos >= p0) & (self.pos < p1)
        self.owners[hit, seq] = False
        self._release(hit & ~self.owners.any(dim=1))

    def seq_add(self, seq: int, p0: int, p1: int | None, delta: int) -> None:
        """Add `delta` to the positions in [p0, p1) of the cells `seq` owns (their other owners see it too);
        a cell moved below position 0 is freed. Metadata only: no key or value changes. As llama.cpp's
        `seq_add` does, the next search starts at the first cell freed, or at cell 0."""
        p1 = self._check_range(seq, p0, p1)
        if not is_int(delta):
            fail("delta", "an int", delta, CacheError)
        if delta == 0:
            return
        hit = self.owners[:, seq] & (self.pos >= p0) & (self.pos < p1)
        self.pos[hit] += delta
        gone = hit & (self.pos < 0)
        self.owners[gone] = False
        freed = torch.nonzero(gone).flatten()
        self.head = int(freed[0]) if freed.numel() else 0
        self._release(gone)

    def _release(self, cells: torch.Tensor) -> None:
        """Empty the cells marked in the bool mask `cells` [n_cells]; the next search starts at the first one
        freed if that is behind the head."""
        self.pos[cells] = -1
        freed = torch.nonzero(cells).flatten()
        if freed.numel() and int(freed[0]) < self.head:
            self.head = int(freed[0])
        self.position = int(self.pos.max()) + 1

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Let `dst` own the cells of `src` at positions [p0, p1): a fork that copies no K/V."""
        p1 = self._check_range(src, p0, p1)
        self._check_range(dst, 0, None)
        if self.seq_pos_max(dst) >= 0:
            fail("dst", "a sequence that holds no cells", dst, CacheError)
        self.owners[self.owners[:, src] & (self.pos >= p0) & (self.pos < p1), dst] = True

    def _reorder(self, index: torch.Tensor) -> int:
        fail("reorder", "a cache with one row per sequence (cells hold every sequence in one row: use seq_cp)",
             "CellsCache", CacheError)

    def rollback_limit(self, seq: int | None = None) -> int:
        """The most positions `rollback` can remove from sequence `seq` (default: `default_seq`; without one,
        the positions of the whole cache)."""
        seq = self.default_seq if seq is None else seq
        return self.position if seq is None else self.seq_pos_max(seq) + 1

    def rollback(self, n: int, seq: int | None = None) -> None:
        """Remove sequence `seq`'s last n positions (default: `default_seq`), as `seq_rm` does: cells another
        sequence still owns stay. Introduced in chapter 12 (rollback)."""
        self._between_passes("roll back between passes")
        seq = self.default_seq if seq is None else seq
        if not (is_int(seq) and 0 <= seq < self.n_seqs):
            fail("seq", f"an int in [0, {self.n_seqs}) (the cache has no default_seq)", seq, CacheError)
        if self.planned is not None:
            fail("plan", "no pending plan (it was made for the positions before the rollback)", "a plan", CacheError)
        end = self.seq_pos_max(seq) + 1
        if not (is_int(n) and 0 <= n <= end):
            fail("n", f"an int in [0, {end}]", repr(n), CacheError)
        if n:
            self.seq_rm(seq, end - n, end)

    def length(self, layer: int = 0) -> int:
        return int((self.pos >= 0).sum())

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The keys and values of the used cells in order of position (one sequence: its keys in time order)."""
        if self.k[layer] is None:
            return None, None
        order = torch.argsort(self.pos)[int((self.pos < 0).sum()):].to(self.k[layer].device)  # empty cells first
        return self.k[layer].index_select(2, order), self.v[layer].index_select(2, order)

    def reset(self) -> None:
        super().reset()
        self.pos = torch.full((self.n_cells,), -1, dtype=torch.long)
        self.owners = torch.zeros(self.n_cells, self.n_seqs, dtype=torch.bool)
        self.head = 0
        self.planned = None
