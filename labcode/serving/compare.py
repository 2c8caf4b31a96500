"""The two prefix caches on the same traces: hit rate, tokens computed and recomputed, blocks used, preemptions.

Introduced in chapter 11 (serving). Token granularity against block granularity: the
radix tree is run on blocks of one token (SGLang's default page) and on the hash cache's block size,
with the same number of token slots, so the table separates the data structure from the page size.
"""

from __future__ import annotations

import torch

from labcode.checks import fail, is_int
from labcode.generate import generate_nocache
from labcode.model import GPT
from labcode.serving.scheduler import Scheduler, serve
from labcode.serving.trace import Request


def distinct_prefixes(sched: Scheduler) -> int:
    """Positions whose keys some finished request needed, counted once per distinct (salt, tokens up to there):
    the work an endless cache shared by everyone would still do."""
    seen = set()
    for seq in sched.done.values():
        for i in range(len(seq.tokens) - 1):  # the last token is never fed back
            seen.add((seq.req.salt, tuple(seq.tokens[: i + 1])))
    return len(seen)


def gaps_to_alone(model: GPT, sched: Scheduler) -> dict[str, tuple[float, bool]]:
    """Per finished request: the largest |logit difference| [V per token] between its served logits and the full
    forward over the same tokens (teacher-forced, so a flipped greedy token does not derail the comparison), and
    whether its tokens equal those it gets run alone with no cache. In float64: rounding; in float32 the batch
    changes reduction orders, and this measures by how much."""
    out = {}
    with torch.inference_mode():
        for rid, seq in sched.done.items():
            full = model(torch.tensor([seq.tokens[:-1]], device=model.device))[0]  # (N - 1, V)
            served = torch.stack(seq.logits)  # (n, V): one row per generated token
            gap = (served - full[seq.prompt_len - 1 :]).abs().max().item()
            alone = generate_nocache(model, torch.tensor([seq.tokens[: seq.prompt_len]]), seq.req.max_new)
            out[rid] = (gap, alone.ids[0].tolist() == seq.tokens)
    return out


def summary(sched: Scheduler) -> dict:
    """Counts of one served trace: hit rate = cached tokens / tokens brought at admission (again after a
    preemption); recomputed = tokens computed beyond the distinct prefixes."""
    seqs = list(sched.done.values())
    brought, hits = sum(s.prompt_tokens for s in seqs), sum(s.hit_tokens for s in seqs)
    computed = sum(s.computed for s in seqs)
    return {"requests": len(seqs), "refused": len(sched.refused), "steps": sched.step_no,
            "preemptions": sched.preemptions, "hit_rate": hits / brought if brought else 0.0, "hit_tokens": hits,
            "computed": computed, "recomputed": computed - distinct_prefixes(sched),
            "peak_blocks": sched.peak_blocks, "peak_slots": sched.peak_blocks * sched.pool.block_size}


def compare_prefix_caches(model: GPT, traces: dict[str, list[Request]], n_slots: int, block_size: int,
                          budget: int, check: bool = False) -> list[dict]:
    """Serve every trace with no prefix cache, the hash cache and the radix tree (blocks of `block_size`), and the
    radix tree on one-token blocks, each with `n_slots` token slots (checking the invariants after every step if
    `check`, as `serve` does); one row of `summary` per run, plus `trace`, `cache` and `block_size`, and the
    generated tokens per request (`outputs`)."""
    if not (is_int(n_slots) and is_int(block_size) and block_size > 0 and n_slots >= block_size):
        fail("n_slots, block_size", "ints with n_slots >= block_size > 0", (n_slots, block_size))
    rows = []
    for name, trace in traces.items():
        for cache, bs in ((None, block_size), ("hash", block_size), ("radix", block_size), ("radix", 1)):
            sched = serve(model, trace, n_slots // bs, bs, budget, cache, check=check)
            outputs = {rid: seq.out for rid, seq in sched.done.items()}
            rows.append({"trace": name, "cache": cache or "none", "block_size": bs, **summary(sched),
                         "outputs": outputs})
    return rows
