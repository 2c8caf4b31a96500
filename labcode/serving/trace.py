"""Requests and the seeded traces they arrive on.

Introduced in chapter 11 (serving). A trace is a list of `Request`s: each arrives at a
step, brings a prompt and asks for a number of greedy tokens. A follow-up turn of a chat names its
`parent`: it arrives once the parent has finished, and its prompt is the parent's prompt and reply
followed by its own tokens. The generators draw from `random.Random(seed)`, so a seed is a trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One request: id `rid`, arrival step, prompt ids [P], tokens wanted, tenant salt, and the turn it follows."""

    rid: str
    arrival: int
    prompt: tuple[int, ...]
    max_new: int
    salt: str | None = None  # requests share cached blocks only with requests of the same salt
    parent: str | None = None  # a chat's next turn: its prompt follows the parent's prompt and reply


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def random_trace(seed: int, n_requests: int, vocab_size: int, prompt_len: tuple[int, int] = (1, 8),
                 max_new: tuple[int, int] = (1, 4), last_arrival: int = 4, share: float = 0.5) -> list[Request]:
    """`n_requests` requests with lengths drawn from the ranges (inclusive); with probability `share` a prompt
    starts with a prefix of an earlier one, so that prefix caches find something."""
    rng, out = random.Random(seed), []
    for i in range(n_requests):
        prompt = _ids(rng, rng.randint(*prompt_len), vocab_size)
        if out and rng.random() < share:
            donor = rng.choice(out).prompt
            prompt = (donor[: rng.randint(1, len(donor))] + prompt)[: prompt_len[1]]
        out.append(Request(f"r{i}", rng.randint(0, last_arrival), prompt, rng.randint(*max_new)))
    return sorted(out, key=lambda r: r.arrival)


def system_prompt_trace(seed: int, n_requests: int, vocab_size: int, system_len: int = 12,
                        user_len: tuple[int, int] = (2, 6), max_new: int = 4, every: int = 1,
                        salts: tuple[str | None, ...] = (None,)) -> list[Request]:
    """Every request is one shared system prompt and a user message of its own; one arrives every `every` steps,
    tenants (salts) taking turns."""
    rng = random.Random(seed)
    system = _ids(rng, system_len, vocab_size)
    return [Request(f"s{i}", i * every, system + _ids(rng, rng.randint(*user_len), vocab_size), max_new,
                    salts[i % len(salts)]) for i in range(n_requests)]


def multi_turn_trace(seed: int, n_chats: int, turns: int, vocab_size: int, first_len: int = 8,
                     turn_len: tuple[int, int] = (2, 4), max_new: int = 4, every: int = 2) -> list[Request]:
    """`n_chats` chats of `turns` turns: each turn after the first continues the whole conversation so far."""
    rng, out = random.Random(seed), []
    for c in range(n_chats):
        parent = None
        for t in range(turns):
            prompt = _ids(rng, first_len if t == 0 else rng.randint(*turn_len), vocab_size)
            out.append(Request(f"c{c}t{t}", c * every, prompt, max_new, None, parent))
            parent = f"c{c}t{t}"
    return out


def few_shot_trace(seed: int, n_requests: int, vocab_size: int, n_examples: int = 4, example_len: int = 5,
                   question_len: tuple[int, int] = (2, 4), max_new: int = 3, every: int = 1) -> list[Request]:
    """Few-shot prompts: the first k of a fixed list of examples (k drawn per request), then a question, so prompts
    share prefixes of many lengths that need not end on a block boundary."""
    rng = random.Random(seed)
    examples = [_ids(rng, example_len, vocab_size) for _ in range(n_examples)]
    out = []
    for i in range(n_requests):
        shots = sum(examples[: rng.randint(1, n_examples)], ())
        out.append(Request(f"f{i}", i * every, shots + _ids(rng, rng.randint(*question_len), vocab_size), max_new))
    return out
