"""Pipeline parallelism: the layers split into N consecutive stages, one process each, and the cache with them.

Introduced in chapter 10. Stage r runs its own run of layers and caches their keys and values only;
the first stage also embeds the tokens, the last also computes the logits. A forward pass starts on
the first stage; each stage sends its output activations [B, T, C] to the next with `send` and the
next waits for them with `recv`. Nothing else crosses: a stage's cache never leaves its process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labcode.caches.base import KVCache, check_cache
from labcode.checks import fail, is_int
from labcode.model import GPT


def stage_layers(n_layers: int, world: int, rank: int) -> range:
    """The layers stage `rank` of `world` runs: consecutive runs, the first L mod N stages one layer longer."""
    if not (is_int(world) and world > 0):
        fail("world", "a positive number of stages", repr(world))
    if not (is_int(n_layers) and n_layers >= world):
        fail("n_layers", f"at least one layer per stage ({world} stages)", repr(n_layers))
    if not (is_int(rank) and 0 <= rank < world):
        fail("rank", f"an int in [0, {world})", repr(rank))
    base, extra = divmod(n_layers, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class PipelineStage:
    """Process `rank` of `world` in a pipeline over `model`: its layers, and the tokens' or logits' end."""

    def __init__(self, model: GPT, rank: int, world: int) -> None:
        if not isinstance(model, GPT):
            fail("model", "a labcode GPT", type(model).__name__)
        self.model, self.rank, self.world = model, rank, world
        self.layers = stage_layers(model.cfg.n_layers, world, rank)
        self.blocks = [model.blocks[i] for i in self.layers]  # the only layers this process runs
        self.first, self.last = rank == 0, rank == world - 1

    def step(self, ids: torch.Tensor | None, cache: KVCache) -> torch.Tensor | None:
        """One forward pass through this stage. The first stage takes ids [B, T]; the others receive the
        activations [B, T, C] from the previous stage. Returns the logits [B, T, V] on the last stage;
        the others send their activations on and return None."""
        m, cfg = self.model, self.model.cfg
        check_cache(cache, len(self.blocks))  # a cache for this stage's layers only
        if self.first:
            b, t = m.check_ids(ids)
        else:
            shape = torch.empty(2, dtype=torch.int64)
            dist.recv(shape, self.rank - 1)  # blocks until the previous stage has run this pass
            b, t = shape.tolist()
            x = torch.empty(b, t, cfg.d_model, dtype=m.dtype)
            dist.recv(x, self.rank - 1)
        placed = cache.begin((b, cfg.n_kv_heads, t, cfg.head_dim), m.dtype, m.device)
        try:
            positions = m.positions(placed, cache.position, b, t)  # every stage's cache is at the same position
            if self.first:
                x = m.tok_emb(ids)
                if m.pos_emb is not None:
                    x = x + m.pos_emb(positions)
            for local, block in enumerate(self.blocks):  # layer numbers in this stage's cache: 0, 1, ...
                x = block(x, local, positions, cache)
            logits = F.linear(m.ln_f(x), m.tok_emb.weight) if self.last else None  # tied head
        except BaseException:
            cache.cancel()
            raise
        cache.end()
        if not self.last:
            dist.send(torch.tensor([b, t], dtype=torch.int64), self.rank + 1)
            dist.send(x.contiguous(), self.rank + 1)  # (B, T, C): all that crosses between stages
        return logits
