"""Attention kernels for decode, and a tool to measure the memory they allocate (timers: `labcode.bench.timing`).

Introduced in chapter 8. `online_softmax_attention` is the flash-attention recurrence
written blockwise in PyTorch: one pass over the keys with a running maximum, a running
sum and a rescaled accumulator, so the [T, S] score matrix never exists.
`repeat_kv_attention` is the textbook reference that copies each key/value head for
its query heads; `labcode.model.attend` is the grouped version that copies nothing.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HALF = (torch.float16, torch.bfloat16)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Raise ValueError naming the argument if q [B, H, T, D], k, v [B, Hkv, S, D], mask [T, S] do not fit."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name}: expected a rank-4 tensor, got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    b, h, t, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k, v: expected two [B={b}, Hkv, S, D={d}] tensors, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"k: expected a number of heads dividing H={h}, got {k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (t, k.shape[2])):
        raise ValueError(f"mask: expected a bool [T={t}, S={k.shape[2]}] tensor, got {mask.dtype} {tuple(mask.shape)}")


def repeat_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: copy each K/V head for its H/Hkv query heads, then matmul, softmax, matmul -> [B, H, T, D]."""
    check_qkv(q, k, v, mask)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H, S, D): copies
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, T, D)


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                             *, causal: bool = False, block_size: int = 256,
                             accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Blockwise one-pass attention -> [B, H, T, D]. q [B, H, T, D], k, v [B, Hkv, S, D].

    `mask` [T, S] (True = visible) or `causal=True` (query i sits at position S - T + i).
    Half-precision inputs are accumulated in float32 unless `accum_dtype` says otherwise.
    """
    check_qkv(q, k, v, mask)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if causal and mask is not None:
        raise ValueError("causal: expected either causal=True or an explicit mask, got both")
    acc_dtype = accum_dtype or (torch.float32 if q.dtype in HALF else q.dtype)
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, (h // hkv) * t, d).to(acc_dtype) * (1.0 / math.sqrt(d))  # (B, Hkv, G*T, D), no copy of K
    m = torch.full((b, hkv, qg.shape[2], 1), float("-inf"), dtype=acc_dtype, device=q.device)  # running max
    ssum = torch.zeros_like(m)  # running sum of exp(score - m)
    acc = torch.zeros(b, hkv, qg.shape[2], d, dtype=acc_dtype, device=q.device)  # running weighted sum of V
    query_pos = torch.arange(s - t, s, device=q.device).unsqueeze(1)  # (T, 1) for causal
    for j in range(0, s, block_size):
        kb, vb = k[:, :, j : j + block_size].to(acc_dtype), v[:, :, j : j + block_size].to(acc_dtype)
        scores = qg @ kb.transpose(-2, -1)  # (B, Hkv, G*T, blk): the only score block alive
        visible = mask[:, j : j + block_size] if mask is not None else (
            torch.arange(j, j + kb.shape[2], device=q.device) <= query_pos if causal else None)
        if visible is not None:
            scores = scores.view(b, hkv, -1, t, kb.shape[2]).masked_fill(~visible, float("-inf")).view_as(scores)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that has seen nothing yet stays at zero
        scale_old = torch.exp(m - m_safe)  # shrink what was accumulated under the old maximum
        p = torch.exp(scores - m_safe)  # (B, Hkv, G*T, blk)
        ssum = ssum * scale_old + p.sum(dim=-1, keepdim=True)
        acc = acc * scale_old + p @ vb
        m = m_new
    return (acc / ssum).to(q.dtype).reshape(b, h, t, d)  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch's fused `scaled_dot_product_attention` with grouped K/V heads -> [B, H, T, D]."""
    check_qkv(q, k, v, mask)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class MemoryTracker(TorchDispatchMode):
    """Watches every tensor operation inside a `with` block and records the bytes of new storage.

    `largest`: the biggest single allocation; `peak`: the most bytes allocated inside the block
    and alive at one time (storage freed inside the block is subtracted when it is released).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._known: set[int] = set()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled; the default would import torch._dynamo (seconds) on first use

    def _free(self, key: int, nbytes: int) -> None:
        self._known.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0]
                  if isinstance(x, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if not isinstance(x, torch.Tensor):
                continue
            storage = x.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in inputs or key in self._known or nbytes == 0:
                continue  # a view or an in-place result: no new memory
            self._known.add(key)
            weakref.finalize(storage, self._free, key, nbytes)
            self.live += nbytes
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, nbytes)
        return out


def measure_memory(fn: Callable, *args, **kwargs) -> dict:
    """Run fn(*args, **kwargs) once and return {"largest": bytes, "peak": bytes} of what it allocated."""
    with MemoryTracker() as tracker:
        out = fn(*args, **kwargs)
    del out
    return {"largest": tracker.largest, "peak": tracker.peak}


# -- Flash-Decoding: split the keys, compute the splits independently, merge with log-sum-exp ----------------------

def attention_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None = None,
                      *, accum_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over one split of the keys: (output o, max m, sum l), [B, H, T, D], [B, H, T, 1], [B, H, T, 1].

    q [B, H, T, D]; k, v [B, Hkv, s, D] (the split); visible [T, s] or None. o is this split's
    softmax-weighted average of its values, m its largest score, l = sum exp(score - m).
    All three are in the accumulation dtype (float32 for half-precision inputs). A query that
    sees no key of the split gets m = -inf, l = 0, o = 0: it weighs nothing in the merge.
    """
    acc_dtype = accum_dtype or (torch.float32 if q.dtype in HALF else q.dtype)
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, (h // hkv) * t, d).to(acc_dtype) * (1.0 / math.sqrt(d))  # (B, Hkv, G*T, D)
    scores = qg @ k.to(acc_dtype).transpose(-2, -1)  # (B, Hkv, G*T, s)
    if visible is not None:
        scores = scores.view(b, hkv, -1, t, s).masked_fill(~visible, float("-inf")).view_as(scores)
    m = scores.amax(dim=-1, keepdim=True)  # (B, Hkv, G*T, 1)
    p = torch.exp(scores - m.masked_fill(m == float("-inf"), 0.0))  # a row with nothing visible: all zeros
    ssum = p.sum(dim=-1, keepdim=True)
    o = (p @ v.to(acc_dtype)) / ssum.masked_fill(ssum == 0, 1.0)  # (B, Hkv, G*T, D)
    return o.reshape(b, h, t, d), m.reshape(b, h, t, 1), ssum.reshape(b, h, t, 1)


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine `attention_partial` results of disjoint splits into attention over all their keys -> [B, H, T, D].

    Split j's log-sum-exp is lse_j = m_j + log l_j; with lse = logsumexp_j lse_j over the
    splits, the output is sum_j exp(lse_j - lse) o_j: each split weighs its share of the
    softmax's denominator. Exact: no approximation, only the order of the sums changes.
    """
    if not parts:
        raise ValueError("parts: expected at least one (o, m, l) triple, got none")
    o = torch.stack([p[0] for p in parts])  # (n, B, H, T, D)
    lse = torch.stack([p[1] + torch.log(p[2]) for p in parts])  # (n, B, H, T, 1); -inf for an empty split
    return (torch.softmax(lse, dim=0) * o).sum(dim=0)  # softmax over the splits = exp(lse_j - logsumexp lse)


def flash_decoding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                             *, causal: bool = False, split_size: int = 256,
                             accum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Flash-Decoding: the keys cut into splits of `split_size` (the last may be shorter), merged -> [B, H, T, D].

    q [B, H, T, D], k, v [B, Hkv, S, D]; `mask` [T, S] or `causal=True` as in
    `online_softmax_attention`. Why it matters at batch 1 with a long sequence: a decode step
    has one query per head, so a kernel that gives each (sequence, head) to one processor uses
    only B x H of them while the S keys are read one after another. The splits are
    independent (here a loop; on a GPU one thread block each), so B x H x S / split_size
    processors read K and V at once, and the merge costs a few numbers per split.
    """
    check_qkv(q, k, v, mask)
    if type(split_size) is not int or split_size <= 0:
        raise ValueError(f"split_size: expected a positive int, got {split_size!r}")
    if causal and mask is not None:
        raise ValueError("causal: expected either causal=True or an explicit mask, got both")
    t, s = q.shape[2], k.shape[2]
    if causal:
        mask = torch.arange(s, device=q.device) <= torch.arange(s - t, s, device=q.device).unsqueeze(1)  # (T, S)
    parts = [attention_partial(q, k[:, :, j : j + split_size], v[:, :, j : j + split_size],
                               None if mask is None else mask[:, j : j + split_size], accum_dtype=accum_dtype)
             for j in range(0, s, split_size)]
    return merge_partials(parts).to(q.dtype)
