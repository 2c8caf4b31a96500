"""Cells and slot search in the style of llama.cpp: one buffer, several sequences, metadata per cell.

Introduced in chapter 9. Each of the `n_cells` slots records the position it holds and
which sequences own it; the data never says whose it is. A batch is a flat list of
tokens, each with its own sequence id and position (set with `plan`); the mask is
built from the metadata, so a token sees exactly its own sequence's past.
"""

from __future__ import annotations

import torch

from labcode.caches.base import KVCache, expect


def find_slots(pos: torch.Tensor, head: int, t_new: int) -> torch.Tensor | None:
    """Indices of `t_new` empty cells (pos < 0), searching from `head` and wrapping around; None if too few."""
    n = pos.shape[0]
    order = (torch.arange(n) + head) % n  # head, head + 1, ..., n - 1, 0, ..., head - 1
    free = order[pos[order] < 0]
    return free[:t_new] if free.numel() >= t_new else None


def cells_mask(pos: torch.Tensor, owners: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, n_cells]: token i (of sequence seq_ids[i], at positions[i]) sees cell j iff its sequence
    owns cell j and the cell's position is not after its own. pos [n_cells], owners [n_cells, n_seqs]."""
    same_seq = owners[:, seq_ids].T  # (T, n_cells)
    return same_seq & (pos.unsqueeze(0) <= positions.unsqueeze(1)) & (pos >= 0).unsqueeze(0)


class CellsCache(KVCache):
    """K/V cells [1, Hkv, n_cells, D] per layer, with `pos` [n_cells] and `owners` [n_cells, n_seqs] metadata."""

    def __init__(self, n_layers: int, n_cells: int, n_seqs: int = 4) -> None:
        super().__init__(n_layers)
        expect(isinstance(n_cells, int) and n_cells > 0, "n_cells", "a positive int", n_cells)
        expect(isinstance(n_seqs, int) and n_seqs > 0, "n_seqs", "a positive int", n_seqs)
        self.n_cells, self.n_seqs = n_cells, n_seqs
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.pos = torch.full((n_cells,), -1, dtype=torch.long)  # -1: empty cell
        self.owners = torch.zeros(n_cells, n_seqs, dtype=torch.bool)  # a bitset of sequences per cell
        self.head = 0  # the slot search starts here: just after the last cell written
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None  # (seq ids [T], positions [T])
        self._slots: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def seq_pos_max(self, seq: int) -> int:
        """Largest position sequence `seq` holds, or -1."""
        held = self.pos[self.owners[:, seq]]
        return int(held.max()) if held.numel() else -1

    def plan(self, seq_ids: list[int], positions: list[int] | None = None) -> None:
        """Say which sequence (and position) each of the next T tokens belongs to; changes no cell.

        Without `positions`, each sequence continues after the largest position it holds.
        """
        expect(len(seq_ids) > 0 and all(isinstance(s, int) and 0 <= s < self.n_seqs for s in seq_ids),
               "seq_ids", f"a non-empty list of ints in [0, {self.n_seqs})", seq_ids)
        start = {s: self.seq_pos_max(s) + 1 for s in set(seq_ids)}
        if positions is None:
            nxt, positions = dict(start), []
            for s in seq_ids:
                positions.append(nxt[s])
                nxt[s] += 1
        nxt = dict(start)
        expect(len(positions) == len(seq_ids), "positions", f"{len(seq_ids)} positions, one per token", positions)
        for s, p in zip(seq_ids, positions, strict=True):
            expect(isinstance(p, int) and p >= nxt[s], "positions",
                   f"for sequence {s}, increasing positions after its last one ({nxt[s] - 1})", positions)
            nxt[s] = p + 1
        self._plan = (torch.tensor(seq_ids), torch.tensor(positions))

    def query_positions(self) -> torch.Tensor:
        """Positions [T] of the planned tokens (the model reads them instead of counting)."""
        expect(self._plan is not None, "plan", "plan(seq_ids) before each forward pass", None)
        return self._plan[1]

    def find_slots(self, t_new: int) -> torch.Tensor | None:
        """Where the next `t_new` tokens would go (changes nothing)."""
        return find_slots(self.pos, self.head, t_new)

    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        super().check(batch, t_new, dtype, device)
        expect(batch == 1, "batch", "1 (tokens of all sequences go side by side on the T axis)", batch)
        expect(self._plan is not None and len(self._plan[0]) == t_new, "plan",
               f"a plan for the {t_new} tokens of this pass", None if self._plan is None else len(self._plan[0]))
        expect(self.find_slots(t_new) is not None, "t_new", f"at most {int((self.pos < 0).sum())} tokens "
               f"(free cells)", t_new)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == 0:
            self._slots = self.find_slots(k.shape[2])
            self._mask = None
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(1, k.shape[1], self.n_cells, k.shape[3])
            self.v[layer] = k.new_zeros(1, k.shape[1], self.n_cells, k.shape[3])
        slots = self._slots.to(k.device)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        n_kv = self._n_kv()
        return self.k[layer][:, :, :n_kv], self.v[layer][:, :, :n_kv]  # only up to the last used cell

    def _n_kv(self) -> int:
        used = torch.cat((torch.nonzero(self.pos >= 0).flatten(), self._slots))
        return int(used.max()) + 1

    def mask(self, layer: int, t_new: int) -> torch.Tensor:
        """[T, n_kv]: token i sees cell j iff j holds i's sequence at a position <= i's position."""
        if self._mask is None:  # the same for every layer: build once per pass
            seq, qpos = self._plan
            pos, owners = self.pos.clone(), self.owners.clone()
            pos[self._slots] = qpos
            owners[self._slots] = False
            owners[self._slots, seq] = True
            n_kv = self._n_kv()
            self._mask = cells_mask(pos[:n_kv], owners[:n_kv], seq, qpos)
        return self._mask.to(self.k[layer].device)

    def advance(self, t_new: int) -> None:
        """Commit the planned metadata to the cells just written; the next search starts after them."""
        seq, qpos = self._plan
        self.pos[self._slots] = qpos
        self.owners[self._slots] = False
        self.owners[self._slots, seq] = True
        self.head = (int(self._slots[-1]) + 1) % self.n_cells
        self._plan = self._slots = self._mask = None
        self.position = int(self.pos.max()) + 1

    def _check_range(self, seq: int, p0: int, p1: int | None) -> int:
        expect(isinstance(seq, int) and 0 <= seq < self.n_seqs, "seq", f"an int in [0, {self.n_seqs})", seq)
        expect(isinstance(p0, int) and p0 >= 0, "p0", "an int >= 0", p0)
        p1 = max(p0, int(self.pos.max()) + 1) if p1 is None else p1
        expect(isinstance(p1, int) and p1 >= p0, "p1", f"an int >= p0 = {p0}", p1)
        return p1

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Remove sequence `seq` from cells at positions [p0, p1); cells nobody owns become empty."""
        p1 = self._check_range(seq, p0, p1)
        hit = self.owners[:, seq] & (self.pos >= p0) & (self.pos < p1)
        self.owners[hit, seq] = False
        self.pos[~self.owners.any(dim=1)] = -1
        self.position = int(self.pos.max()) + 1

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Let `dst` own the cells of `src` at positions [p0, p1): a fork that copies no K/V."""
        p1 = self._check_range(src, p0, p1)
        self._check_range(dst, 0, None)
        expect(self.seq_pos_max(dst) < 0, "dst", "a sequence that holds no cells", dst)
        self.owners[self.owners[:, src] & (self.pos >= p0) & (self.pos < p1), dst] = True

    def length(self, layer: int = 0) -> int:
        return int((self.pos >= 0).sum())

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers
        self.pos.fill_(-1)
        self.owners.fill_(False)
        self.head = 0
        self._plan = self._slots = self._mask = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)
