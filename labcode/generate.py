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
    """How many tokens fit, and why the loop will stop: the position table is a hard limit."""
    room = max(0, context_length - prompt_len)
    if max_new_tokens <= room:
        return max_new_tokens, "max_new_tokens"
    return room, "context_length"


def _check_prompt(model, ids: torch.Tensor, max_new_tokens: int) -> None:
    model.check_ids(ids, 0)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")


@torch.inference_mode()
def generate_nocache(model, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                     top_k: int | None = None, top_p: float | None = None,
                     generator: torch.Generator | None = None) -> Generation:
    """Reference loop: every step runs the full forward on the whole sequence so far."""
    _check_prompt(model, ids, max_new_tokens)
    n, reason = new_token_budget(ids.shape[1], max_new_tokens, model.cfg.context_length)
    out = Generation(ids=ids, new_tokens=n, stop_reason=reason)
    for _ in range(n):
        logits = model(out.ids)[:, -1]  # (B, V): only the last row is used
        out.positions_computed.append(out.ids.shape[1])
        out.step_logits.append(logits)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        out.ids = torch.cat((out.ids, nxt.unsqueeze(1)), dim=1)
    return out


def prefill(model, ids: torch.Tensor, cache, chunk_size: int | None = None) -> torch.Tensor:
    """Run the prompt ids [B, P] into `cache`, in chunks if asked (or if the cache needs it).

    Returns the logits [B, V] of the last prompt position.
    """
    limit = getattr(cache, "max_chunk", None)
    size = chunk_size or limit or ids.shape[1]
    if limit is not None:
        size = min(size, limit)
    logits = None
    for start in range(0, ids.shape[1], size):
        logits = model(ids[:, start : start + size], cache)[:, -1]
    return logits


def decode_step(model, token: torch.Tensor, cache) -> torch.Tensor:
    """Run one new token per row, token [B], and return the next logits [B, V]."""
    return model(token.unsqueeze(1), cache)[:, -1]


@torch.inference_mode()
def generate(model, ids: torch.Tensor, max_new_tokens: int, cache, *, chunk_size: int | None = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> Generation:
    """Prefill the prompt, then one decode step per new token; stops at the position-table capacity."""
    _check_prompt(model, ids, max_new_tokens)
    n, reason = new_token_budget(ids.shape[1], max_new_tokens, model.cfg.context_length)
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
