"""The one interface every cache policy implements.

Introduced in chapter 3. The model asks a cache for the keys and values to read
(`append`), the mask over them (`mask`) and the absolute position of the next
token (`position`). A cache knows nothing of the model.
"""

from __future__ import annotations

import torch

from labcode.masks import causal_mask


class CacheError(ValueError):
    """A call the cache rejects; raised before any state changes."""


def expect(ok: bool, argument: str, expected: str, got: object) -> None:
    """Raise CacheError naming the argument, the expectation and the value when `ok` is false."""
    if not ok:
        raise CacheError(f"{argument}: expected {expected}, got {got}")


def is_count(x: object) -> bool:
    """True for a Python int that is not a bool (bools are ints, but never a size)."""
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Devices are the same when the types agree and the indices do (a missing index matches any)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def snapshot(value: object) -> object:
    """A deep copy of lists, tuples, dicts and tensors (cloned), for "state unchanged" checks."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
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
    """Per-layer key/value storage for one batch of requests.

    Subclasses implement `_append` and `length` and, if their storage is not
    chronological, `mask`. The model calls, in order: `check` (once), `append` and
    `mask` (per layer), `advance` (once).
    """

    max_chunk: int | None = None  # the largest chunk one call accepts (None: any)

    def __init__(self, n_layers: int) -> None:
        expect(is_count(n_layers) and n_layers > 0, "n_layers", "a positive number of layers", repr(n_layers))
        self.n_layers = n_layers
        self.position = 0  # absolute position of the next token: tokens seen so far
        self.batch: int | None = None  # B, dtype, device, Hkv and D are fixed by the first append
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.kv_heads: int | None = None
        self.head_dim: int | None = None

    # -- validation: everything is checked before anything is written --------
    def check(self, batch: int, t_new: int, dtype: torch.dtype, device: torch.device) -> None:
        """Raise CacheError if a chunk of `t_new` tokens cannot be appended; change nothing.

        Runs for every layer of every call, so the messages are only built on failure.
        """
        if not (is_count(t_new) and t_new > 0):
            expect(False, "t_new", "at least one new token", t_new)
        if self.max_chunk is not None and t_new > self.max_chunk:
            expect(False, "t_new",
                   f"a chunk of at most {self.max_chunk} tokens (the window; prefill longer prompts in chunks)",
                   t_new)
        if self.batch is not None:
            if batch != self.batch:
                expect(False, "batch", f"the cache's batch size {self.batch} (reset it for a new batch)", batch)
            if dtype != self.dtype:
                expect(False, "dtype", f"the cache's dtype {self.dtype}", dtype)
            if device != self.device and not same_device(device, self.device):
                expect(False, "device", f"the cache's device {self.device}", device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] for `layer`; return all keys and values to attend to."""
        if not (is_count(layer) and 0 <= layer < self.n_layers):
            expect(False, "layer", f"0 <= layer < {self.n_layers}", layer)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            expect(False, "k, v", "two tensors", (type(k).__name__, type(v).__name__))
        shape = k.shape
        if not (len(shape) == 4 and shape == v.shape):
            expect(False, "k, v", "two [B, Hkv, T, D] tensors of one shape", (tuple(shape), tuple(v.shape)))
        if not (k.dtype == v.dtype and k.device == v.device):
            expect(False, "k, v", "one dtype and one device", (k.dtype, v.dtype, k.device, v.device))
        KVCache.check(self, shape[0], shape[2], k.dtype, k.device)  # the per-chunk rules, for every layer
        if self.kv_heads is None:
            self._remember(k)
        elif shape[1] != self.kv_heads or shape[3] != self.head_dim:
            expect(False, "k, v", f"Hkv={self.kv_heads} heads of D={self.head_dim}, as cached", tuple(shape))
        return self._append(layer, k, v)

    def _remember(self, k: torch.Tensor) -> None:
        """Fix B, Hkv, D, dtype and device at the first append."""
        self.batch, self.kv_heads, _, self.head_dim = k.shape
        self.dtype, self.device = k.dtype, k.device

    def _append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def mask(self, layer: int, t_new: int) -> torch.Tensor | None:
        """Boolean [T, S_total] mask over what `append` returned (None: all visible)."""
        s_total = self.length(layer)
        if t_new == 1:
            return None  # one query after its own key: every stored key is in its past
        return causal_mask(t_new, s_total - t_new, device=self.device)

    def advance(self, t_new: int) -> None:
        """Move the position counter once all layers have appended `t_new` tokens."""
        self.position += t_new

    def length(self, layer: int = 0) -> int:
        """Number of keys stored for `layer`."""
        raise NotImplementedError

    def read(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K, V [B, Hkv, S, D] of `layer`, oldest position first (None, None if empty)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything, as if new."""
        self.position = 0
        self.batch = self.dtype = self.device = self.kv_heads = self.head_dim = None

    def state(self) -> dict:
        """A snapshot of everything observable (tensors cloned), for "state unchanged" checks."""
        return {key: snapshot(val) for key, val in vars(self).items()}

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held."""
        raise NotImplementedError
