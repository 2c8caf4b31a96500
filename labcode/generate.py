"""Generation loops: the no-cache reference, and prefill / decode step / generate for any cache.

Introduced in chapter 1 (reference) and chapter 3 (cached). The reference runs the
full forward on the whole sequence at every step and stays forever as the oracle
every cache is checked against. A request is checked once, before anything runs;
each forward pass is then checked once by the model and its cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labcode.caches.base import CacheError, check_cache
from labcode.checks import fail, is_int
from labcode.sampling import Sampler


@dataclass
class Generation:
    """What a generation loop returns."""

    ids: torch.Tensor  # (B, P + n): the prompt, unchanged, followed by n new tokens
    new_tokens: int  # n
    stop_reason: str  # "max_new_tokens", "context_length" (the position table) or "cache_full" (the cache's room)
    step_logits: list[torch.Tensor] = field(default_factory=list)  # n tensors [B, V], one per new token
    positions_computed: list[int] = field(default_factory=list)  # positions run through the model per step


def new_token_budget(prompt_len: int, max_new_tokens: int, context_length: int,
                     cache_room: int | None = None) -> tuple[int, str]:
    """How many tokens fit, and why the loop will stop: the position table is a hard limit, and so is a
    cache's own room (`cache_room`: positions it can take after the prompt; None: no limit of its own).

    `prompt_len` counts every position already used, cached ones included. The last new token is
    never fed back, so n tokens need n - 1 positions of room.
    """
    limits = [(max_new_tokens, "max_new_tokens"), (max(0, context_length - prompt_len), "context_length")]
    if cache_room is not None:
        limits.append((cache_room + 1, "cache_full"))
    return min(limits, key=lambda limit: limit[0])  # the first of the tightest limits names the reason


def check_prompt(model, ids: torch.Tensor, cache, chunk_size: int | None = None) -> int:
    """Everything a prompt ids [B, P] needs from `cache`, checked before the first chunk runs; returns the chunk size.

    The prompt must fit the position table and the cache's room, and its first chunk must be
    one the cache accepts (batch, dtype, device, chunk limit, plan): later chunks then are too.
    """
    check_cache(cache, model.cfg.kv_layers, model.cfg.sliding_window)
    b, p = model.check_ids(ids)
    model.positions(None, cache.position, b, p)  # the whole prompt must fit the position table
    room = cache.room()
    if room is not None and p > room:
        fail("ids", f"a prompt of at most {room} tokens (the room left in the cache)", p, CacheError)
    size = chunk_length(cache, p, chunk_size)
    hkv, d = model.cfg.cached_kv  # what each layer appends: K/V heads, or one latent row (latent attention)
    cache.check((b, hkv, size, d), model.dtype, model.device)
    return size


def chunk_length(cache, prompt_len: int, chunk_size: int | None) -> int:
    """The chunk length prefill uses: `chunk_size`, else the cache's `max_chunk`, else the whole prompt."""
    limit = cache.max_chunk
    if chunk_size is None:
        return prompt_len if limit is None else min(prompt_len, limit)
    if not (is_int(chunk_size) and chunk_size > 0):
        fail("chunk_size", "a positive integer or None", repr(chunk_size))
    if limit is not None and chunk_size > limit:
        fail("chunk_size", f"at most the cache's max_chunk {limit} ({cache.max_chunk_reason})", chunk_size)
    return chunk_size


def prefill(model, ids: torch.Tensor, cache, chunk_size: int | None = None) -> torch.Tensor:
    """Run the prompt ids [B, P] into `cache`, in chunks if asked (or if the cache needs it).

    Everything is checked before the first chunk runs, so a refused prompt leaves the
    cache untouched. Returns the logits [B, V] of the last prompt position.
    """
    return _prefill(model, ids, cache, check_prompt(model, ids, cache, chunk_size))


def _prefill(model, ids: torch.Tensor, cache, size: int) -> torch.Tensor:
    for start in range(0, ids.shape[1], size):
        logits = model(ids[:, start : start + size], cache)[:, -1]  # (B, V)
    return logits


def decode_step(model, token: torch.Tensor, cache) -> torch.Tensor:
    """Run one new token per row, token [B], and return the next logits [B, V]."""
    check_cache(cache, model.cfg.kv_layers, model.cfg.sliding_window)
    if not isinstance(token, torch.Tensor) or token.dim() != 1:
        fail("token", "a rank-1 tensor [B] of ids", getattr(token, "shape", type(token)))
    return _decode(model, token, cache)


def _decode(model, token: torch.Tensor, cache) -> torch.Tensor:
    return model(token.unsqueeze(1), cache)[:, -1]  # (B, V)


def _check_count(max_new_tokens: int) -> None:
    if not (is_int(max_new_tokens) and max_new_tokens >= 0):
        fail("max_new_tokens", "an integer >= 0", repr(max_new_tokens))


@torch.inference_mode()
def generate_nocache(model, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                     top_k: int | None = None, top_p: float | None = None,
                     generator: torch.Generator | None = None) -> Generation:
    """Reference loop: every step runs the full forward on the whole sequence so far."""
    sample = Sampler(temperature, top_k, top_p, generator)
    _check_count(max_new_tokens)
    b, p = model.check_ids(ids)
    model.positions(None, 0, b, p)
    n, reason = new_token_budget(p, max_new_tokens, model.cfg.context_length)
    out = Generation(ids=ids, new_tokens=n, stop_reason=reason)
    for _ in range(n):
        logits = model(out.ids)[:, -1]  # (B, V): only the last row is used
        out.positions_computed.append(out.ids.shape[1])
        out.step_logits.append(logits)
        out.ids = torch.cat((out.ids, sample(logits).unsqueeze(1)), dim=1)
    return out


@torch.inference_mode()
def generate(model, ids: torch.Tensor, max_new_tokens: int, cache, *, chunk_size: int | None = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> Generation:
    """Prefill the prompt, then one decode step per new token; stops at the position table or the cache's room.

    At most context_length - (cache.position + P) new tokens: the last one is never fed back.
    """
    sample = Sampler(temperature, top_k, top_p, generator)  # the request, checked once, before anything runs
    _check_count(max_new_tokens)
    size = check_prompt(model, ids, cache, chunk_size)
    if cache.planned is not None:
        fail("cache", "no pending plan (a plan covers one pass, and generate runs many)", "a plan", CacheError)
    room = cache.room()
    p = ids.shape[1]
    n, reason = new_token_budget(cache.position + p, max_new_tokens, model.cfg.context_length,
                                 None if room is None else room - p)
    out = Generation(ids=ids, new_tokens=n, stop_reason=reason)
    if n == 0:
        return out
    logits = _prefill(model, ids, cache, size)
    out.positions_computed.append(p)
    for step in range(n):
        out.step_logits.append(logits)
        nxt = sample(logits)  # (B,)
        out.ids = torch.cat((out.ids, nxt.unsqueeze(1)), dim=1)
        if step + 1 < n:  # the last token is never fed back: nothing would read its K/V
            logits = _decode(model, nxt, cache)
            out.positions_computed.append(1)
    return out
