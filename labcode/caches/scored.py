"""Eviction by score: H2O and SnapKV keep, within a budget, the keys that attention used most.

Introduced in the chapter on smaller caches. Both need the attention weights, which a cache
never sees: the model hands each layer's queries to any cache that has an `observe` method,
right after that layer's `append` (`observe(layer, q, k_all, mask)`), and the cache computes
the weights itself from them (the softmax the model computes, once more). Each key/value head
keeps its own keys: the weights of its G query heads are summed.

  * H2O ("heavy hitters"): every key keeps the attention it has received, summed over every
    query since it was written; after each pass the cache keeps the `recent` latest keys and,
    of the older ones, the `budget - recent` with the largest sums.
  * SnapKV: once, after the prompt (the first pass), the last `window` prompt queries vote for
    the earlier keys; the votes are pooled along the keys (a 1-D max or average pool of width
    `kernel`, so that a neighbourhood is kept rather than lone tokens), the `budget - window`
    best are kept with the window itself, and decoding then appends as usual.

Dropping keys changes the model's answers, by design: a query can no longer see them. With a
budget at least the sequence length nothing is dropped and the output is the full forward's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labcode.caches.base import CacheError, Chunk, PerLayerCache
from labcode.checks import fail, is_int

POOLS = ("max", "avg")


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax weights of queries q [B, H, T, D] over keys k [B, Hkv, S, D] under mask [T, S]
    -> [B, Hkv, G, T, S], query head h being head h % G of group h // G (as `labcode.model.attend` groups them)."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    scores = q.view(b, hkv, h // hkv, t, d) @ k.unsqueeze(2).transpose(-2, -1) * (1.0 / math.sqrt(d))
    if mask is not None:  # (T, S), or chapter 9's (B, 1, 1, T, S): both broadcast over (B, Hkv, G, T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def heavy_hitters(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor | None:
    """Which keys H2O keeps, given their scores [B, Hkv, S]: the `recent` latest and the `budget - recent`
    older ones with the largest scores -> indices [B, Hkv, budget] in position order (None: all fit)."""
    s = scores.shape[-1]
    if s <= budget:
        return None
    latest = torch.arange(s - recent, s, device=scores.device).expand(*scores.shape[:-1], recent)
    heavy = scores[..., : s - recent].topk(budget - recent, dim=-1).indices  # (B, Hkv, budget - recent)
    return torch.cat((heavy, latest), dim=-1).sort(dim=-1).values


def pool_votes(votes: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Votes [B, Hkv, S] pooled along S by a 1-D window of odd width `kernel` ("max" or "avg", the
    average over the keys that exist) -> [B, Hkv, S]."""
    x = votes.reshape(-1, 1, votes.shape[-1])  # (B * Hkv, 1, S): one channel per head
    if pool == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    else:
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    return y.view(votes.shape)


def snap_select(votes: torch.Tensor, keep: int, kernel: int, pool: str) -> torch.Tensor:
    """The `keep` keys SnapKV keeps of the prompt before its window, from the window's votes [B, Hkv, S']
    -> indices [B, Hkv, keep] in position order."""
    return pool_votes(votes, kernel, pool).topk(keep, dim=-1).indices.sort(dim=-1).values


def gather_keys(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [B, Hkv, S'] of t [B, Hkv, S, D] or [B, Hkv, S], each head its own -> [B, Hkv, S', ...]."""
    if t.dim() == 3:
        return t.gather(2, index)
    return t.gather(2, index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))


class ScoredCache(PerLayerCache):
    """What H2O and SnapKV share: keys grown by concatenation in a pass, the queries observed, the kept set
    chosen when the pass is committed. `kept[layer]` [B, Hkv, S] holds each kept key's absolute position."""

    def __init__(self, n_layers: int, budget: int) -> None:
        super().__init__(n_layers)
        if not (is_int(budget) and budget > 0):
            fail("budget", "a positive number of keys to keep per head", repr(budget), CacheError)
        self.budget = budget
        self.kept: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, S) positions of the kept keys
        self.last_dropped = 0  # keys per head dropped by the latest pass
        self.total_dropped = 0  # keys per head dropped since the cache was new

    def _open(self, chunk: Chunk) -> None:
        super()._open(chunk)
        chunk.plan = [None] * self.n_layers  # per layer: [k_all, v_all, what the queries said]

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.k[layer], self.v[layer]
        k_all = k if old_k is None else torch.cat((old_k, k), dim=2)  # (B, Hkv, S + T, D): a new tensor
        v_all = v if old_v is None else torch.cat((old_v, v), dim=2)
        self.chunk.plan[layer] = [k_all, v_all, None]  # written into the cache only at the commit
        return k_all, v_all

    def observe(self, layer: int, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Take the queries q [B, H, T, D] of the layer that has just appended, with what `append` returned
        and the mask; refuses with CacheError, changing nothing, what does not fit the pass."""
        chunk = self._in_pass("observe")
        if layer != chunk.layer - 1:
            fail("layer", f"layer {chunk.layer - 1}, the one that appended last", layer, CacheError)
        b, hkv, t, d = chunk.shape
        if not (isinstance(q, torch.Tensor) and q.dim() == 4 and (q.shape[0], q.shape[2], q.shape[3]) == (b, t, d)
                and q.shape[1] % hkv == 0 and q.dtype == chunk.dtype):
            fail("q", f"a {chunk.dtype} [B={b}, H, T={t}, D={d}] tensor with H a multiple of Hkv={hkv}",
                 getattr(q, "shape", type(q).__name__), CacheError)
        chunk.plan[layer][2] = self._score(q, k_all, mask)

    def _score(self, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def _choose(self, layer: int, chunk: Chunk, said: torch.Tensor | None, s: int) -> torch.Tensor | None:
        """Indices [B, Hkv, S'] of the keys to keep after the pass (None: keep all S)."""
        raise NotImplementedError

    def _commit(self, chunk: Chunk) -> None:
        dropped = 0
        for layer, (k_all, v_all, said) in enumerate(chunk.plan):
            b, hkv, s, _ = k_all.shape
            new = torch.arange(chunk.start, chunk.start + chunk.t_new, device=k_all.device).expand(b, hkv, -1)
            kept = new if self.kept[layer] is None else torch.cat((self.kept[layer], new), dim=2)
            index = self._choose(layer, chunk, said, s)
            if index is not None:
                k_all, v_all, kept = gather_keys(k_all, index), gather_keys(v_all, index), gather_keys(kept, index)
                dropped = s - index.shape[-1]
            self.k[layer], self.v[layer], self.kept[layer] = k_all, v_all, kept
        self.last_dropped = dropped
        self.total_dropped += dropped
        super()._commit(chunk)

    def _rollback(self, n: int) -> None:
        """The last n rows of every layer go (each kind says, by its limit, when they are its last positions)."""
        keep = self.length() - n
        self.k, self.v = [t[:, :, :keep] for t in self.k], [t[:, :, :keep] for t in self.v]
        self.kept = [t[:, :, :keep] for t in self.kept]

    def _reorder(self, index: torch.Tensor) -> int:
        moved = super()._reorder(index)
        self.kept = [t.index_select(0, index.to(t.device)) for t in self.kept]
        return moved

    def reset(self) -> None:
        super().reset()
        self.kept = [None] * self.n_layers
        self.last_dropped = self.total_dropped = 0


class H2OCache(ScoredCache):
    """Keeps the `recent` latest keys and the `budget - recent` older ones with the most attention received.

    `scores[layer]` [B, Hkv, S] is each kept key's attention, summed over every query that saw it and
    over the G query heads of its group. Between passes a head holds at most `budget` keys; within a
    pass, the T new ones on top. A pass fed without queries (`feed`) scores its keys 0.
    """

    def __init__(self, n_layers: int, budget: int, recent: int) -> None:
        super().__init__(n_layers, budget)
        if not (is_int(recent) and 0 <= recent <= budget):
            fail("recent", f"an int in [0, budget {budget}] (the latest keys always kept)", repr(recent), CacheError)
        self.recent = recent
        self.scores: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, S)

    def _score(self, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return attention_weights(q, k_all, mask).sum(dim=(2, 3))  # (B, Hkv, S_total): summed over G and T

    def _choose(self, layer: int, chunk: Chunk, said: torch.Tensor | None, s: int) -> torch.Tensor | None:
        b, hkv, t = chunk.shape[0], chunk.shape[1], chunk.t_new
        old = self.scores[layer]
        zeros = torch.zeros(b, hkv, t, dtype=chunk.dtype, device=chunk.device)  # the new keys, before any query
        scores = zeros if old is None else torch.cat((old, zeros), dim=2)
        if said is not None:
            scores = scores + said
        index = heavy_hitters(scores, self.budget, self.recent)
        self.scores[layer] = scores if index is None else scores.gather(2, index)
        return index

    def _check_rollback(self, n: int, argument: str) -> None:
        self._between_passes("roll back between passes")
        if not (is_int(n) and n == 0):
            fail(argument, "0 (H2O's scores hold the attention of every query it has seen, which a rollback "
                 "cannot take back)", repr(n), CacheError)

    def rollback_limit(self) -> int:
        """0: the scores of the kept keys include the attention of the queries a rollback would remove."""
        return 0

    def _reorder(self, index: torch.Tensor) -> int:
        moved = super()._reorder(index)
        self.scores = [t.index_select(0, index.to(t.device)) for t in self.scores]
        return moved

    def reset(self) -> None:
        super().reset()
        self.scores = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage and of the scores H2O needs (the positions in `kept` are for the reader)."""
        return super().nbytes + sum(t.nbytes for t in self.scores if t is not None)


class SnapKVCache(ScoredCache):
    """After the prompt (the first pass), keeps per head `budget - window` prompt keys voted for by the last
    `window` prompt queries (votes pooled over `kernel` neighbours) and the window; then appends as usual.

    Prefill the prompt in one pass: only the first pass is compressed. Without queries (`feed`) it keeps all.
    """

    def __init__(self, n_layers: int, budget: int, window: int = 8, kernel: int = 5, pool: str = "max") -> None:
        super().__init__(n_layers, budget)
        if not (is_int(window) and 0 < window <= budget):
            fail("window", f"an int in [1, budget {budget}] (the last prompt queries that vote)", repr(window),
                 CacheError)
        if not (is_int(kernel) and kernel > 0 and kernel % 2):
            fail("kernel", "a positive odd width of the pooling window", repr(kernel), CacheError)
        if pool not in POOLS:
            fail("pool", f"one of {POOLS}", repr(pool), CacheError)
        self.window, self.kernel, self.pool = window, kernel, pool
        self.compressed = False  # the prompt has been through (compressed, or short enough to keep)
        self.prompt = 0  # positions up to here were compressed away in part: no rollback reaches into them

    def _score(self, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        s, w = k_all.shape[2], self.window
        if self.compressed or s <= self.budget:
            return None  # decoding, or a prompt that fits: nothing to choose
        rows = None if mask is None else mask[..., -w:, :]  # the window's rows of the mask
        votes = attention_weights(q[:, :, -w:], k_all, rows).sum(dim=(2, 3))  # (B, Hkv, S)
        return snap_select(votes[..., : s - w], self.budget - w, self.kernel, self.pool)

    def _choose(self, layer: int, chunk: Chunk, said: torch.Tensor | None, s: int) -> torch.Tensor | None:
        if said is None:
            return None
        window = torch.arange(s - self.window, s, device=said.device).expand(*said.shape[:-1], self.window)
        return torch.cat((said, window), dim=-1)

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        if not self.compressed:
            self.compressed = True
            self.prompt = self.position if self.last_dropped else 0

    def reset(self) -> None:
        super().reset()
        self.compressed, self.prompt = False, 0

    def rollback_limit(self) -> int:
        """The positions written after the compressed prompt (all of them if nothing was dropped)."""
        return self.position - self.prompt

    def _rollback(self, n: int) -> None:
        super()._rollback(n)
        if self.position == n:
            self.compressed = False  # back to an empty cache: the next pass is a prompt again


class StreamingCache(ScoredCache):
    """StreamingLLM applied after each pass, as eviction libraries apply it: keeps the first `n_keep` positions
    (the sinks) and the latest `budget - n_keep`; no scores. With `n_keep = 0`, a plain window of `budget`.

    Unlike `SinkCache`, a pass may be longer than the budget: its queries see every key of the pass and the
    cache keeps the budget afterwards (a prompt prefilled whole, then compressed), the rule the scored caches
    follow, so that all of them are compared at equal budgets.
    """

    def __init__(self, n_layers: int, budget: int, n_keep: int = 0) -> None:
        super().__init__(n_layers, budget)
        if not (is_int(n_keep) and 0 <= n_keep < budget):
            fail("n_keep", f"an int in [0, budget {budget}) (the first positions always kept)", repr(n_keep),
                 CacheError)
        self.n_keep = n_keep
        self.evicted_at = 0  # the position after the latest pass that dropped keys

    def _score(self, q: torch.Tensor, k_all: torch.Tensor, mask: torch.Tensor | None) -> None:
        return None  # the positions decide: nothing to score

    def _choose(self, layer: int, chunk: Chunk, said: torch.Tensor | None, s: int) -> torch.Tensor | None:
        if s <= self.budget:
            return None
        b, hkv = chunk.shape[0], chunk.shape[1]
        rows = torch.cat((torch.arange(self.n_keep), torch.arange(s - (self.budget - self.n_keep), s)))
        return rows.to(chunk.device).expand(b, hkv, -1)

    def rollback_limit(self) -> int:
        """The positions written since the cache last dropped a key (all of them if it never did)."""
        return self.position - self.evicted_at

    def _commit(self, chunk: Chunk) -> None:
        super()._commit(chunk)
        if self.last_dropped:
            self.evicted_at = self.position

    def reset(self) -> None:
        super().reset()
        self.evicted_at = 0
