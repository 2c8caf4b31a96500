"""Generation loops: the no-cache reference, and prefill / decode step / generate for any cache.

Introduced in chapter 1 (reference) and chapter 3 (cached). The reference runs the
full forward on the whole sequence at every step and stays forever as the oracle
every cache is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labcode.sampling import sample_next


@dataclass
class Generation:
    """What a generation loop returns."""

    ids: torch.Tensor  # (B, P + n): the prompt, unchanged, followed by n new tokens
    new_tokens: int  # n
    stop_reason: str  # "max_new_tokens" or "context_length"
    step_logits: list[torch.Tensor] = field(default_factory=list)  # n tensors [B, V], one per new token
    positions_computed: list[int] = field(default_factory=list)  # positions run through the model per step


def new_token_budget(prompt_len: int, max_new_tokens: int, context_length: int) -> tuple[int, str]:
    """How many tokens fit, and why the loop will stop: the position table is a hard limit.

    `prompt_len` counts every position already used, cached ones included.
    """
    room = max(0, context_length - prompt_len)
    if max_new_tokens <= room:
        return max_new_tokens, "max_new_tokens"
    return room, "context_length"


def _check_request(model, ids: torch.Tensor, max_new_tokens: int, start: int, temperature: float,
                   top_k: int | None, top_p: float | None, generator: torch.Generator | None) -> None:
    """Every argument is checked before the first forward, so a bad one leaves the cache untouched."""
    model.check_ids(ids, start)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an integer >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:  # also rejects NaN
        raise ValueError(f"temperature: expected >= 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k: expected a positive integer or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected 0 < top_p <= 1 or None, got {top_p}")
    if temperature > 0 and generator is None:
        raise ValueError("generator: sampling needs a torch.Generator (no global seeding), got None")


@torch.inference_mode()
def generate_nocache(model, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                     top_k: int | None = None, top_p: float | None = None,
                     generator: torch.Generator | None = None) -> Generation:
    """Reference loop: every step runs the full forward on the whole sequence so far."""
    _check_request(model, ids, max_new_tokens, 0, temperature, top_k, top_p, generator)
    n, reason = new_token_budget(ids.shape[1], max_new_tokens, model.cfg.context_length)
    out = Generation(ids=ids, new_tokens=n, stop_reason=reason)
    for _ in range(n):
        logits = model(out.ids)[:, -1]  # (B, V): only the last row is used
        out.positions_computed.append(out.ids.shape[1])
        out.step_logits.append(logits)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        out.ids = torch.cat((out.ids, nxt.unsqueeze(1)), dim=1)
    return out


def chunk_length(cache, prompt_len: int, chunk_size: int | None) -> int:
    """The chunk length prefill uses: `chunk_size`, else the cache's `max_chunk`, else the whole prompt."""
    limit = getattr(cache, "max_chunk", None)
    if chunk_size is None:
        return prompt_len if limit is None else min(prompt_len, limit)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
    if limit is not None and chunk_size > limit:
        raise ValueError(f"chunk_size: expected at most the cache's max_chunk {limit} (its window), got {chunk_size}")
    return chunk_size


def prefill(model, ids: torch.Tensor, cache, chunk_size: int | None = None) -> torch.Tensor:
    """Run the prompt ids [B, P] into `cache`, in chunks if asked (or if the cache needs it).

    Everything is checked before the first chunk runs, so a rejected prompt leaves the
    cache untouched. Returns the logits [B, V] of the last prompt position.
    """
    model.check_ids(ids, cache.position)  # the whole prompt must fit the position table
    size = chunk_length(cache, ids.shape[1], chunk_size)
    cache.check(ids.shape[0], size, model.dtype, model.device)  # batch, dtype, device, chunk limit
    logits = None
    for start in range(0, ids.shape[1], size):
        logits = model(ids[:, start : start + size], cache)[:, -1]  # (B, V)
    return logits


def decode_step(model, token: torch.Tensor, cache) -> torch.Tensor:
    """Run one new token per row, token [B], and return the next logits [B, V]."""
    if not isinstance(token, torch.Tensor) or token.dim() != 1:
        raise ValueError(f"token: expected a rank-1 tensor [B] of ids, got {getattr(token, 'shape', type(token))}")
    return model(token.unsqueeze(1), cache)[:, -1]


@torch.inference_mode()
def generate(model, ids: torch.Tensor, max_new_tokens: int, cache, *, chunk_size: int | None = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> Generation:
    """Prefill the prompt, then one decode step per new token; stops at the position-table capacity.

    At most context_length - (cache.position + P) new tokens: the last one is never fed back.
    """
    _check_request(model, ids, max_new_tokens, cache.position, temperature, top_k, top_p, generator)
    chunk_length(cache, ids.shape[1], chunk_size)  # reject a bad chunk size even when nothing will run
    n, reason = new_token_budget(cache.position + ids.shape[1], max_new_tokens, model.cfg.context_length)
    out = Generation(ids=ids, new_tokens=n, stop_reason=reason)
    if n == 0:
        return out
    logits = prefill(model, ids, cache, chunk_size)
    out.positions_computed.append(ids.shape[1])
    for step in range(n):
        out.step_logits.append(logits)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        out.ids = torch.cat((out.ids, nxt.unsqueeze(1)), dim=1)
        if step + 1 < n:  # the last token is never fed back: nothing would read its K/V
            logits = decode_step(model, nxt, cache)
            out.positions_computed.append(1)
    return out
