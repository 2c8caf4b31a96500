"""The one contract every cache keeps, and the defaults that let the model have one path.

Introduced in chapter 3. A forward pass with a cache is three steps, always in this order:

    placed = cache.begin((B, Hkv, T, D), dtype, device)  # once: check everything, write nothing
    for layer in range(L):
        k_all, v_all = cache.append(layer, k, v)         # store this layer's T new keys and values
        mask = cache.mask(layer, T)                      # [T, S_total] of what each new query may see
    cache.end()                                          # once: commit (position moves on by T)

`begin` returns None (the new tokens sit at position, position + 1, ...) or the positions the
cache places them at itself (chapter 9). Every refusal happens in `begin`, before anything is
written, so a refused pass changes nothing; a pass that fails after `begin` is closed with
`cancel()`, which commits nothing. A fork owns everything it will write. A cache knows nothing
of the model. Between passes, `rollback(n)` removes the last n committed positions as if they had
never been written (refused, changing nothing, past `rollback_limit()`: a window that dropped
positions cannot bring them back), and `reorder(index)` gathers batch rows (beam search); both
come from chapter 12 (rollback).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from labcode.checks import fail, is_int
from labcode.masks import causal_mask, sliding_window_mask


class CacheError(ValueError):
    """A call the cache refuses; raised before any state changes."""


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Devices are the same when the types agree and the indices do (a missing index matches any)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@dataclass(frozen=True)
class Layout:
    """What a cache's first pass fixes: B rows of Hkv key/value heads of width D, one dtype, one device."""

    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(k: torch.Tensor) -> Layout:
        """The layout of stored keys k [B, Hkv, S, D]."""
        return Layout(k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device)


@dataclass
class Chunk:
    """The pass in progress, from `begin` to `end`: T new tokens for each of B rows.

    `begin` fills it once; each layer's `append` and `mask` read it; `end` commits it.
    """

    shape: tuple[int, int, int, int]  # (B, Hkv, T, D) of the k and v every layer appends
    dtype: torch.dtype
    device: torch.device
    start: int  # cache.position when the pass began
    layer: int = 0  # the next layer to append: each layer appends once per pass, in order
    placed: torch.Tensor | None = None  # positions [T] or [B, T] when the cache places tokens itself
    past: int = 0  # cached keys ahead of the T new ones in what `append` returns
    mask: torch.Tensor | None = None  # what every layer's queries may see (None: every returned key)
    dropped: int = 0  # cached positions this pass drops (window caches)
    slots: torch.Tensor | None = None  # where the T tokens are written, when not after the cached ones
    plan: object = None  # anything else a cache decided for this pass in `_open`

    @property
    def t_new(self) -> int:
        return self.shape[2]

    @property
    def layout(self) -> Layout:
        b, hkv, _, d = self.shape
        return Layout(b, hkv, d, self.dtype, self.device)


def snapshot(value: object) -> object:
    """A deep copy of lists, tuples, dicts, passes and tensors (cloned), for "state unchanged" checks."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, Chunk):
        return {"chunk": snapshot(vars(value))}
    return value


def states_equal(a: object, b: object) -> bool:
    """Exact equality of two snapshots: same structure, tensors equal in dtype, shape, device and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device
                and (a.device.type == "meta" or bool(torch.equal(a, b))))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(states_equal(a[k], b[k]) for k in a))
    return type(a) is type(b) and a == b


class KVCache:
    """Key/value storage for one batch of requests, behind the contract of this module's docstring.

    A subclass stores keys in `_append(layer, k, v)` and says how many it holds in `length`;
    it may refuse what it cannot take in `_check(chunk)`, prepare each pass once in
    `_open(chunk)` and make it permanent in `_commit(chunk)`. Everything else has a default.
    """

    max_chunk: int | None = None  # the largest T one pass accepts (None: any)
    max_chunk_reason: str = "the window"  # why, as the refusal says it
    attention_window: int | None = None  # W of the band its masks apply (None: every cached key is visible)
    position: int = 0  # absolute position of the next token: the tokens committed so far
    layout: Layout | None = None  # B, Hkv, D, dtype and device, fixed by the first pass
    planned: object = None  # a plan for the next pass, for caches that place tokens themselves (chapter 9)

    def __init__(self, n_layers: int) -> None:
        if not (is_int(n_layers) and n_layers > 0):
            fail("n_layers", "a positive number of layers", repr(n_layers), CacheError)
        self.n_layers = n_layers
        self.chunk: Chunk | None = None  # the pass in progress, between begin and end

    # -- the contract ----------------------------------------------------------------
    def begin(self, shape: tuple[int, int, int, int], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor | None:
        """Open a pass in which every layer appends k, v of `shape` (B, Hkv, T, D).

        Returns the new tokens' positions [T] or [B, T] if this cache places them itself
        (chapter 9), else None: they follow `position`. Refuses with CacheError, changing nothing.
        """
        chunk = self._chunk(shape, dtype, device)
        self._refuse(chunk)
        self._open(chunk)
        self.chunk = chunk
        return chunk.placed

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `layer`'s new k, v [B, Hkv, T, D]; return all it may attend to, [B, Hkv, S_total, D].

        Only per-layer facts are checked here: `begin` checked everything else, once.
        """
        chunk = self._in_pass("append")
        if not (is_int(layer) and 0 <= layer < self.n_layers):
            fail("layer", f"0 <= layer < {self.n_layers}", layer, CacheError)
        if layer != chunk.layer:
            fail("layer", f"layer {chunk.layer} next (each layer appends once per pass, in order)", layer, CacheError)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            fail("k, v", "two tensors", (type(k).__name__, type(v).__name__), CacheError)
        if not (k.shape == v.shape == chunk.shape):
            fail("k, v", f"two [B, Hkv, T, D] tensors of the shape begin() was given, {chunk.shape}",
                 (tuple(k.shape), tuple(v.shape)), CacheError)
        if not (k.dtype == v.dtype == chunk.dtype and k.device == v.device and same_device(k.device, chunk.device)):
            fail("k, v", f"{chunk.dtype} on {chunk.device}, as begin() was given", (k.dtype, k.device), CacheError)
        out = self._append(layer, k, v)
        chunk.layer += 1
        return out

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        """Boolean [T, S_total] mask over what `append` returned (True: visible), or None when all is visible.

        The default is the one `_open` built for the whole pass: the offset causal mask.
        """
        return self._in_pass("mask").mask

    def end(self) -> None:
        """Close the pass once every layer has appended, and make it permanent."""
        chunk = self._in_pass("end")
        if chunk.layer != self.n_layers:
            fail("layer", f"all {self.n_layers} layers appended before end()", f"{chunk.layer}", CacheError)
        self._commit(chunk)
        self.chunk = None

    def cancel(self) -> None:
        """Close a pass that failed between begin and end, committing nothing of it.

        Position, counters, tables and plans stay as they were. A cache that writes in place
        (window, ring) may keep rows of the failed pass in its buffers: reset such a cache.
        """
        self.chunk = None

    # -- what a cache kind says about itself (defaults) --------------------------------
    def _check(self, chunk: Chunk) -> None:
        """Refuse with CacheError what this kind cannot take; change nothing. Default: nothing more."""

    def _open(self, chunk: Chunk) -> None:
        """Prepare the pass once, writing nothing: by default the T new keys follow the `length()`
        held ones, under the offset causal mask."""
        chunk.past = self.length()
        chunk.mask = None if chunk.t_new == 1 else causal_mask(chunk.t_new, chunk.past, device=chunk.device)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _commit(self, chunk: Chunk) -> None:
        """Make the pass permanent: position moves on by T, and the first pass fixes the layout."""
        self.position = chunk.start + chunk.t_new
        if self.layout is None:
            self.layout = chunk.layout

    def length(self, layer: int = 0) -> int:
        """Number of keys stored for `layer`."""
        raise NotImplementedError

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stored K, V [B, Hkv, S, D] of `layer`, oldest position first (None, None if empty)."""
        raise NotImplementedError

    def room(self) -> int | None:
        """How many more positions this cache can take (None: no limit of its own)."""
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held."""
        raise NotImplementedError

    # -- going back (chapter 12, rollback) ---------------------------------
    keeps: int | None = None  # positions held before the cache starts dropping (None: it never drops)
    rollback_reserve: int = 0  # positions a cache that drops can still roll back after dropping

    def rollback_limit(self) -> int:
        """The largest n `rollback(n)` accepts now: every committed position, unless the cache dropped
        some (a window): then the positions before the kept ones are gone, and none can be rolled back."""
        if self.keeps is not None and self.position > self.keeps:
            return 0
        return self.position

    def rollback(self, n: int) -> None:
        """Remove the last n committed positions, as if they had never been written (a rejected draft).

        Checked first, between passes: n an int in [0, rollback_limit()]; a refusal changes nothing.
        Introduced in chapter 12 (rollback).
        """
        self._check_rollback(n, "n")
        if n:
            self._rollback(n)
            self.position -= n

    def _check_rollback(self, n: int, argument: str) -> None:
        self._between_passes("roll back between passes")
        limit = self.rollback_limit()
        if not (is_int(n) and 0 <= n <= limit):
            why = "" if self.keeps is None or limit == self.position else (
                f" (it keeps {self.keeps} positions and dropped older ones, which a rollback would need back)")
            fail(argument, f"an int in [0, {limit}]{why}", repr(n), CacheError)

    def _rollback(self, n: int) -> None:
        """Forget the storage of the last n positions (0 < n <= rollback_limit()); `rollback` moves position."""
        fail("rollback", "a cache kind that can roll back", type(self).__name__, CacheError)

    def reorder(self, index: torch.Tensor) -> int:
        """Row b becomes old row index[b] in every layer (beam search: each beam continues its parent); index [B']
        may repeat rows and change B. Returns the bytes written. Introduced in chapter 12 (rollback)."""
        self._check_reorder(index)
        moved = self._reorder(index)
        self.layout = replace(self.layout, batch=index.shape[0])
        return moved

    def _check_reorder(self, index: torch.Tensor) -> None:
        self._between_passes("reorder between passes")
        if self.layout is None:
            fail("cache", "a cache holding rows to reorder", "an empty one", CacheError)
        b = self.layout.batch
        if not (isinstance(index, torch.Tensor) and index.dim() == 1 and index.numel() > 0
                and index.dtype == torch.long and int(index.min()) >= 0 and int(index.max()) < b):
            fail("index", f"a non-empty rank-1 long tensor of rows in [0, {b})", index, CacheError)

    def _reorder(self, index: torch.Tensor) -> int:
        fail("reorder", "a cache kind whose rows can be reordered", type(self).__name__, CacheError)

    # -- built on the contract ---------------------------------------------------------
    def check(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str) -> None:
        """Raise CacheError if `begin` would refuse this pass; change nothing."""
        self._refuse(self._chunk(shape, dtype, device))

    def feed(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One whole pass without a model: the same k, v [B, Hkv, T, D] appended to every layer.

        Returns what the last layer's `append` returned.
        """
        self.begin(tuple(k.shape), k.dtype, k.device)
        try:
            for layer in range(self.n_layers):
                out = self.append(layer, k, v)
        except BaseException:
            self.cancel()
            raise
        self.end()
        return out

    def fork(self) -> KVCache:
        """A copy that owns everything it will write: later passes on one never change what the other reads.

        The default copies every list, dict and tensor; a cache may share what it never writes in place.
        """
        self._between_passes("forks are made between passes")
        other = object.__new__(type(self))
        other.__dict__.update({key: snapshot(val) for key, val in vars(self).items()})
        return other

    def reset(self) -> None:
        """Forget everything, as if new."""
        self.position, self.layout, self.chunk = 0, None, None

    def state(self) -> dict:
        """A snapshot of everything observable (tensors cloned), for "state unchanged" checks."""
        return {key: snapshot(val) for key, val in vars(self).items()}

    # -- the base rules, checked once per pass -------------------------------------------
    def _chunk(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str) -> Chunk:
        self._between_passes("end() or cancel() it first")
        shape = tuple(shape)
        if not (len(shape) == 4 and all(is_int(n) for n in shape)):
            fail("shape", "(B, Hkv, T, D), four ints", shape, CacheError)
        if shape[2] < 1:
            fail("t_new", "at least one new token", shape[2], CacheError)
        if min(shape) < 1:
            fail("shape", "(B, Hkv, T, D), all positive", shape, CacheError)
        return Chunk(shape, dtype, torch.device(device), self.position)

    def _refuse(self, chunk: Chunk) -> None:
        """The rules every cache keeps, then this kind's own (`_check`)."""
        b, hkv, t, d = chunk.shape
        if self.max_chunk is not None and t > self.max_chunk:
            fail("t_new", f"a chunk of at most {self.max_chunk} tokens ({self.max_chunk_reason}; prefill longer "
                 "prompts in chunks)", t, CacheError)
        fixed = self.layout
        if fixed is not None:
            if b != fixed.batch:
                fail("batch", f"the cache's batch size {fixed.batch} (reset it for a new batch)", b, CacheError)
            if chunk.dtype != fixed.dtype:
                fail("dtype", f"the cache's dtype {fixed.dtype}", chunk.dtype, CacheError)
            if not same_device(chunk.device, fixed.device):
                fail("device", f"the cache's device {fixed.device}", chunk.device, CacheError)
            if (hkv, d) != (fixed.kv_heads, fixed.head_dim):
                fail("k, v", f"Hkv={fixed.kv_heads} heads of D={fixed.head_dim}, as cached", chunk.shape, CacheError)
        self._check(chunk)

    def _between_passes(self, why: str) -> None:
        if self.chunk is not None:
            fail("cache", f"no pass in progress ({why})",
                 f"a pass begun at position {self.chunk.start}", CacheError)

    def _in_pass(self, what: str) -> Chunk:
        if self.chunk is None:
            fail("cache", f"a pass in progress (begin() before {what}())", "none", CacheError)
        return self.chunk


class PerLayerCache(KVCache):
    """A cache that keeps each layer's keys and values as tensors `k[layer]`, `v[layer]` (None until written)."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(n_layers)
        self.k: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, S, D) each
        self.v: list[torch.Tensor | None] = [None] * n_layers

    def _buffers(self, layer: int, like: torch.Tensor, slots: int) -> None:
        """Make `layer`'s zero buffers [B, Hkv, slots, D], in the dtype and on the device of `like`, once."""
        if self.k[layer] is None:
            b, hkv, _, d = like.shape
            self.k[layer] = like.new_zeros(b, hkv, slots, d)
            self.v[layer] = like.new_zeros(b, hkv, slots, d)

    def length(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[2]

    def _reorder(self, index: torch.Tensor) -> int:
        """New buffers gathered row by row (whole buffers, free slots included, as a static cache's are)."""
        moved = 0
        for buffers in (self.k, self.v):
            for layer, t in enumerate(buffers):
                if t is not None:
                    buffers[layer] = t.index_select(0, index.to(t.device))
                    moved += buffers[layer].nbytes
        return moved

    def read(self, layer: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.k[layer], self.v[layer]

    def reset(self) -> None:
        super().reset()
        self.k = [None] * self.n_layers
        self.v = [None] * self.n_layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)


class NoCache(KVCache):
    """The full forward as a pass through a cache that keeps nothing: every pass starts at position 0.

    With a `window` W (a sliding-window model, chapter 5) the mask is banded: each query sees its last W keys.
    """

    def __init__(self, n_layers: int, window: int | None = None) -> None:
        super().__init__(n_layers)
        if not (window is None or (is_int(window) and window > 0)):
            fail("window", "None or a positive number of keys", repr(window), CacheError)
        self.attention_window = window

    def _open(self, chunk: Chunk) -> None:
        super()._open(chunk)
        if self.attention_window is not None and chunk.t_new > 1:
            chunk.mask = sliding_window_mask(chunk.t_new, 0, self.attention_window, device=chunk.device)

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # attend to the T new keys only

    def _commit(self, chunk: Chunk) -> None:
        pass  # nothing kept, so the next pass starts at position 0 again

    def length(self, layer: int = 0) -> int:
        return 0

    def read(self, layer: int = 0) -> tuple[None, None]:
        return None, None

    @property
    def nbytes(self) -> int:
        return 0


def check_cache(cache: object, n_layers: int, window: int | None = None) -> None:
    """Raise CacheError unless `cache` is a KVCache object for `n_layers` layers that, for a sliding-window
    model (`window` W), applies that band: a cache that ignored it would silently compute another model."""
    if not isinstance(cache, KVCache):
        fail("cache", "a KVCache object (labcode.caches; wrap (K, V) pairs in PairsCache)",
             None if cache is None else type(cache).__name__, CacheError)
    if cache.n_layers != n_layers:
        fail("cache", f"a cache for {n_layers} layers", f"one for {cache.n_layers}", CacheError)
    if window is not None and cache.attention_window != window:
        fail("cache", f"a cache whose masks apply the model's sliding window of {window} (SlidingWindowCache, "
             f"or a WindowCache or RingCache of {window})",
             f"{type(cache).__name__} with attention_window {cache.attention_window}", CacheError)
