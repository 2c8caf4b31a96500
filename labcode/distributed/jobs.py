"""What each process of a chapter-10 job runs: tensor-parallel, pipeline and disaggregated generation.

Introduced in chapter 10. Each job is a function `job(rank, world, ...)` that `launch` runs in every
process of a group (module-level functions, so that a fork server or spawn can import them). Each returns
plain data (tensors, ints, strings) that the caller compares with the single-process model, which
runs the very same request loop, `run_request`, with the whole model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from labcode.caches.base import CacheError, KVCache, states_equal
from labcode.caches.concat import ConcatCache
from labcode.caches.window import WindowCache
from labcode.checks import fail, is_int
from labcode.distributed.pipeline import PipelineStage
from labcode.distributed.tensor_parallel import shard_model
from labcode.distributed.transfer import TransferError, pack, recv_bytes, send_bytes, unpack
from labcode.engines.paged import BlockPool, PagedCache
from labcode.generate import generate, prefill
from labcode.model import GPT


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of logits [B, V] -> [B]."""
    return logits.argmax(dim=-1)


def run_request(model, ids: torch.Tensor, schedule: list[int], steps: int, cache: KVCache,
                choose: Callable[[torch.Tensor], torch.Tensor] = argmax) -> dict:
    """Prefill ids [B, P] in chunks of the sizes in `schedule`, then run `steps` greedy decode steps.

    Returns the logits [B, P + steps, V] of every position run, the ids fed [B, P + steps] (the prompt,
    then each token chosen from the previous logits by `choose`), and the cache's bytes at the end.
    """
    if sum(schedule) != ids.shape[1] or min(schedule) < 1:
        fail("schedule", f"positive chunk sizes summing to P = {ids.shape[1]}", schedule)
    rows, start, fed = [], 0, ids
    with torch.inference_mode():
        for size in schedule:
            rows.append(model(ids[:, start:start + size], cache))  # (B, size, V)
            start += size
        for _ in range(steps):
            token = choose(rows[-1][:, -1])  # (B,): from the logits of the last position run
            fed = torch.cat((fed, token[:, None]), dim=1)
            rows.append(model(token[:, None], cache))
    return {"logits": torch.cat(rows, dim=1), "ids": fed, "cache_bytes": cache.nbytes}


def new_cache(kind: str, model: GPT, n_layers: int | None = None, window: int = 8, block_size: int = 4) -> KVCache:
    """An empty cache of `kind` ("contiguous", "window" or "paged") for `n_layers` layers of `model`.

    The paged cache gets a pool with room for the whole position table.
    """
    n = model.cfg.n_layers if n_layers is None else n_layers
    if kind == "contiguous":
        return ConcatCache(n)
    if kind == "window":
        return WindowCache(n, window)
    if kind == "paged":
        return PagedCache(BlockPool(n, n_blocks=-(-model.cfg.context_length // block_size), block_size=block_size))
    fail("kind", "'contiguous', 'window' or 'paged'", repr(kind))


# -- tensor parallelism -------------------------------------------------------------------------------

def _agreed_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Rank 0's greedy token, given to every rank (as an engine's driver samples once for all)."""
    token = argmax(logits).contiguous()
    dist.broadcast(token, 0)
    return token


def tp_job(rank: int, world: int, model: GPT, ids: torch.Tensor, schedules: list[list[int]], steps: int) -> dict:
    """Each rank runs its shard of `model` (`shard_model`) on one request per chunk schedule."""
    local = shard_model(model, rank, world)
    requests = [run_request(local, ids, schedule, steps, ConcatCache(model.cfg.n_layers), choose=_agreed_argmax)
                for schedule in schedules]
    s = local.shard
    return {"requests": requests, "q_heads": list(s.q_heads), "kv_heads": list(s.kv_heads), "replicas": s.replicas}


# -- pipeline parallelism -----------------------------------------------------------------------------

def pp_job(rank: int, world: int, model: GPT, ids: torch.Tensor, schedules: list[list[int]], steps: int) -> dict:
    """Each rank runs one pipeline stage on one request per chunk schedule; the last stage picks each
    greedy token and sends it back to the first, which feeds it in."""
    if world < 2:
        fail("world", "at least 2 stages", world)
    stage = PipelineStage(model, rank, world)
    requests = []
    for schedule in schedules:
        cache = ConcatCache(len(stage.layers))  # this stage's layers only
        rows, fed, start = [], ids, 0
        with torch.inference_mode():
            for size in schedule:
                out = stage.step(ids[:, start:start + size] if stage.first else None, cache)
                rows.append(out)
                start += size
            for _ in range(steps):
                token = torch.empty(ids.shape[0], dtype=torch.int64)
                if stage.last:
                    token = argmax(rows[-1][:, -1])
                    dist.send(token, 0)  # the next token goes back to the stage that embeds it
                elif stage.first:
                    dist.recv(token, world - 1)
                if stage.first:
                    fed = torch.cat((fed, token[:, None]), dim=1)
                rows.append(stage.step(token[:, None] if stage.first else None, cache))
        requests.append({"logits": torch.cat(rows, dim=1) if stage.last else None,
                         "ids": fed if stage.first else None, "cache_bytes": cache.nbytes})
    return {"requests": requests, "layers": list(stage.layers)}


# -- disaggregated prefill and decode -------------------------------------------------------------------

def spoil(blob: bytes, damage: tuple[str, int] | None) -> bytes:
    """A transfer damaged in transit: ("flip", i) inverts byte i, ("truncate", n) loses the last n bytes."""
    if damage is None:
        return blob
    how, where = damage
    if how == "flip":
        out = bytearray(blob)
        out[where] ^= 0xFF
        return bytes(out)
    if how == "truncate" and is_int(where) and 0 < where < len(blob):
        return blob[:-where]
    fail("damage", "None, ('flip', index) or ('truncate', n bytes)", repr(damage))


def disagg_job(rank: int, world: int, model: GPT, prompt: torch.Tensor, steps: int, kind: str,
               receiver_kind: str | None = None, window: int = 8, block_size: int = 4,
               damage: tuple[str, int] | None = None) -> dict:
    """Rank 0 prefills `prompt` into a cache of `kind`, picks the first token and ships both to rank 1,
    which continues with `steps` decode steps in a cache of `receiver_kind` (default: the same kind).
    A transfer rank 1 refuses is reported, with whether its cache stayed unchanged, not raised."""
    if world != 2:
        fail("world", "2 processes (one prefills, one decodes)", world)
    if rank == 0:
        cache = new_cache(kind, model, window=window, block_size=block_size)
        with torch.inference_mode():
            last = prefill(model, prompt, cache)  # (B, V): chunked when the cache needs it (a window)
        first = argmax(last)
        blob = pack(cache, model)
        send_bytes(spoil(blob, damage), 1)
        dist.send(first, 1)
        return {"prefill_logits": last, "first": first, "blob_bytes": len(blob), "cache_bytes": cache.nbytes}
    cache = new_cache(receiver_kind or kind, model, window=window, block_size=block_size)
    blob = recv_bytes(0)
    first = torch.empty(prompt.shape[0], dtype=torch.int64)
    dist.recv(first, 0)
    before = cache.state()
    try:
        fields = unpack(blob, model, cache)
    except (TransferError, CacheError) as e:
        return {"refused": f"{type(e).__name__}: {e}", "unchanged": states_equal(before, cache.state())}
    out = generate(model, first[:, None], steps, cache)  # feeds the first token, then decodes
    return {"header": fields, "received_bytes": len(blob), "step_logits": torch.stack(out.step_logits, dim=1),
            "ids": out.ids, "position": cache.position, "cache_bytes": cache.nbytes}


# -- small jobs that show what the launcher does ----------------------------------------------------------

def hello_job(rank: int, world: int) -> dict:
    """Each rank contributes rank + 1 to an all-reduce: every rank gets 1 + 2 + ... + N."""
    total = torch.tensor([rank + 1.0], dtype=torch.float64)
    dist.all_reduce(total)
    return {"rank": rank, "world": world, "sum": total.item()}


def failing_job(rank: int, world: int, bad_rank: int) -> None:
    """Rank `bad_rank` raises while the others wait for it in a collective: the launcher must stop them all."""
    if rank == bad_rank:
        raise ValueError(f"rank {rank}: expected to fail, got here")
    dist.barrier()


def stalled_job(rank: int, world: int, seconds: float) -> None:
    """Every rank sleeps: a job that runs past its deadline."""
    time.sleep(seconds)
