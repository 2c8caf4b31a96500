"""Tensor parallelism: every layer's heads split across N processes, and each process's cache with them.

Introduced in chapter 10. Process r of N owns H/N query heads and the key/value heads they read, in
every layer: it computes only their queries, keys and values, caches only those keys and values, and
multiplies its heads' outputs by its own columns of the output projection. The N partial sums add up
to the full projection, so one all-reduce per attention gives every process the same output. The
MLP is split the same way (Megatron-LM's pattern): each process owns 4C/N hidden units, and a second
all-reduce sums their contributions.

Grouped-query attention keeps each group whole: a process owns Hkv/N key/value heads and the query
heads that read them. When Hkv < N there are not enough key/value heads to go round: each process
keeps one, shared by N/Hkv processes (each holding a different part of its query group), so every
key/value head is cached N/Hkv times. vLLM does the same (`QKVParallelLinear`: `num_kv_head_replicas`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labcode.caches.base import KVCache
from labcode.checks import fail, is_int
from labcode.cost import kv_cache_bytes
from labcode.masks import causal_mask
from labcode.model import GPT, CausalSelfAttention, attend, rotate


@dataclass(frozen=True)
class HeadShard:
    """The heads process `rank` of `world` owns in every layer."""

    rank: int
    world: int
    q_heads: range  # query heads it computes
    kv_heads: range  # key/value heads it computes and caches
    replicas: int  # processes that hold each of its key/value heads (1: none shared)


def head_shard(n_heads: int, n_kv_heads: int, world: int, rank: int) -> HeadShard:
    """Query heads r*H/N .. (r+1)*H/N - 1 and the key/value heads they read, for process `rank` of `world`.

    Needs N to divide H, and either N to divide Hkv (each process owns Hkv/N key/value heads) or Hkv
    to divide N (each owns one, replicated on N/Hkv processes).
    """
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("world", world)):
        if not (is_int(value) and value > 0):
            fail(name, "a positive int", repr(value))
    if n_heads % n_kv_heads:
        fail("n_kv_heads", f"a divisor of n_heads {n_heads}", n_kv_heads)
    if not (is_int(rank) and 0 <= rank < world):
        fail("rank", f"an int in [0, {world})", repr(rank))
    if n_heads % world:
        fail("world", f"a divisor of n_heads {n_heads} (each process owns whole query heads)", world)
    if n_kv_heads % world and world % n_kv_heads:
        fail("world", f"a divisor or a multiple of n_kv_heads {n_kv_heads} (key/value heads split or replicated)",
             world)
    per_q = n_heads // world
    q_heads = range(rank * per_q, (rank + 1) * per_q)
    if n_kv_heads >= world:
        per_kv = n_kv_heads // world
        return HeadShard(rank, world, q_heads, range(rank * per_kv, (rank + 1) * per_kv), 1)
    replicas = world // n_kv_heads  # consecutive ranks share one key/value head
    head = rank // replicas
    return HeadShard(rank, world, q_heads, range(head, head + 1), replicas)


def tp_cache_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int, bytes_per_element: int,
                   world: int) -> int:
    """Cache bytes each of `world` processes holds: Hkv/N key/value heads in every layer, or one when Hkv < N."""
    if not (is_int(world) and world > 0 and is_int(n_kv_heads) and n_kv_heads > 0):
        fail("world, n_kv_heads", "positive ints", (world, n_kv_heads))
    if n_kv_heads % world and world % n_kv_heads:
        fail("world", f"a divisor or a multiple of n_kv_heads {n_kv_heads}", world)
    return kv_cache_bytes(n_layers, batch, tokens, max(n_kv_heads // world, 1), head_dim, bytes_per_element)


def split_attention(attn: CausalSelfAttention, shard: HeadShard) -> dict[str, torch.Tensor | None]:
    """The rows and columns of one attention layer's weights that process `shard.rank` needs.

    q: rows of its query heads; kv: rows of its key heads, then of its value heads (the fused
    projection's output is [K heads | V heads]); out: the output projection's columns that
    multiply its heads, and its bias on rank 0 only (the all-reduce would add it N times).
    """
    d, hkv = attn.head_dim, attn.n_kv_heads
    q_rows = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    k_rows = torch.arange(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    kv_rows = torch.cat((k_rows, k_rows + hkv * d))  # the value rows sit Hkv*D below the key rows
    return {
        "q_weight": attn.q_proj.weight[q_rows], "q_bias": attn.q_proj.bias[q_rows],
        "kv_weight": attn.kv_proj.weight[kv_rows], "kv_bias": attn.kv_proj.bias[kv_rows],
        "out_weight": attn.out_proj.weight[:, q_rows],
        "out_bias": attn.out_proj.bias if shard.rank == 0 else None,
    }


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                      device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class ShardedAttention(nn.Module):
    """One process's share of a `CausalSelfAttention`: its heads, its cache, an all-reduce of the output."""

    def __init__(self, attn: CausalSelfAttention, shard: HeadShard, group=None) -> None:
        super().__init__()
        self.cfg, self.shard, self.group = attn.cfg, shard, group
        self.n_heads, self.n_kv_heads, self.head_dim = len(shard.q_heads), len(shard.kv_heads), attn.head_dim
        w = split_attention(attn, shard)
        self.q_proj = _linear(w["q_weight"], w["q_bias"])
        self.kv_proj = _linear(w["kv_weight"], w["kv_bias"])
        self.out_proj = _linear(w["out_weight"], w["out_bias"])

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, C): every process holds the whole input
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, h, d).transpose(1, 2)  # (B, H/N, T, D): this process's query heads
        k, v = self.kv_proj(x).view(b, t, 2, hkv, d).permute(2, 0, 3, 1, 4)  # (B, Hkv/N, T, D) each
        if self.cfg.rotary:
            q, k = rotate(q, positions, self.cfg.rope_base), rotate(k, positions, self.cfg.rope_base)
        if cache is None:
            mask = causal_mask(t, device=x.device) if t > 1 else None
        else:
            k, v = cache.append(layer, k, v)  # this process's shard of the cache: its heads only
            mask = cache.mask(layer, t)
        y = attend(q, k, v, mask)  # (B, H/N, T, D)
        partial = self.out_proj(y.transpose(1, 2).reshape(b, t, h * d))  # (B, T, C): this shard's share
        dist.all_reduce(partial, group=self.group)  # the N shares add up to the full projection
        return partial


class ShardedMLP(nn.Module):
    """One process's share of the MLP: 4C/N hidden units, an all-reduce of the output (bias on rank 0)."""

    def __init__(self, mlp: nn.Sequential, rank: int, world: int, group=None) -> None:
        super().__init__()
        fc, act, proj = mlp[0], mlp[1], mlp[2]
        hidden = fc.out_features
        if hidden % world:
            fail("world", f"a divisor of the MLP width {hidden}", world)
        rows = slice(rank * hidden // world, (rank + 1) * hidden // world)
        self.fc = _linear(fc.weight[rows], fc.bias[rows])
        self.act = act
        self.proj = _linear(proj.weight[:, rows], proj.bias if rank == 0 else None)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.proj(self.act(self.fc(x)))  # (B, T, C): this shard's hidden units only
        dist.all_reduce(partial, group=self.group)
        return partial


def shard_model(model: GPT, rank: int, world: int, group=None) -> GPT:
    """The model process `rank` of `world` runs: every attention and MLP replaced by its shard.

    Embeddings, LayerNorms and the head stay whole on every process (they are small and cheap). The
    copy's config says Hkv/N key/value heads (one when replicated), so `GPT.run` opens its cache with
    this process's heads only, and any cache class of the course holds the shard unchanged. A real
    engine never builds the whole model first: it loads only its rows from the checkpoint.
    """
    if not isinstance(model, GPT):
        fail("model", "a labcode GPT", type(model).__name__)
    cfg = model.cfg
    shard = head_shard(cfg.n_heads, cfg.n_kv_heads, world, rank)
    local = copy.deepcopy(model)
    for block in local.blocks:
        block.attn = ShardedAttention(block.attn, shard, group)
        block.mlp = ShardedMLP(block.mlp, rank, world, group)
    local.cfg = cfg.with_(n_kv_heads=len(shard.kv_heads))  # H/(Hkv/N) is a whole number: a valid config
    local.shard = shard
    return local.eval()
