"""Continuous batching over a paged pool: chunked prefill mixed with decode, admission, preemption by recompute.

Introduced in chapter 11 (serving). Each `step` spends a token budget: first one token
(or the next prefill chunk) for every running request, oldest first, then the first chunk of each
waiting request while blocks and budget last. A running request that needs a block when none is
free (and none can be evicted) preempts the newest running request: its blocks go back to the pool
and it waits at the head of the queue, to be recomputed from its prompt and the tokens it already
produced. Greedy decoding; one `run_paged_batch` pass per step through the one model.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from labcode.checks import fail, is_int
from labcode.engines.paged import BlockPool
from labcode.model import GPT
from labcode.serving.paged_batch import run_paged_batch
from labcode.serving.prefix import HashPrefixCache, RadixPrefixCache
from labcode.serving.trace import Request

PREFIX_CACHES = {"hash": HashPrefixCache, "radix": RadixPrefixCache}


@dataclass(eq=False)
class Seq:
    """A request being served: its tokens (prompt, then generated), its blocks and how many tokens they hold."""

    req: Request
    tokens: list[int]  # the whole prompt (a follow-up turn's includes the conversation so far), then the reply
    prompt_len: int
    blocks: list[int] = field(default_factory=list)  # its block table
    n_cached: int = 0  # tokens whose keys and values are in its blocks
    handle: object = None  # what the prefix cache returns from match (the radix node it locked)
    logits: list[torch.Tensor] = field(default_factory=list)  # [V] for each generated token
    preemptions: int = 0
    prompt_tokens: int = 0  # tokens it brought at each admission (again after a preemption)
    hit_tokens: int = 0  # of which the prefix cache already held
    computed: int = 0  # tokens it ran through the model
    arrived: int | None = None  # the step it joined the queue (a follow-up turn: once its parent finished)
    first_step: int | None = None  # the step that produced its first token
    finish_step: int | None = None

    @property
    def out(self) -> list[int]:
        """The generated tokens so far [n]."""
        return self.tokens[self.prompt_len :]

    @property
    def ttft_steps(self) -> int | None:
        """Steps from joining the queue to the first token, counted inclusively (1: the step it arrived)."""
        return None if self.first_step is None else self.first_step - self.arrived + 1


class Scheduler:
    """Requests `pending` (not yet arrived), `waiting`, `running` (admitted, oldest first), `done` and `refused`,
    over a pool of `n_blocks` blocks of `block_size` slots; each step computes at most `budget` tokens."""

    def __init__(self, model: GPT, n_blocks: int, block_size: int, budget: int, prefix: str | None = None) -> None:
        if not (is_int(budget) and budget > 0):
            fail("budget", "a positive number of tokens per step", budget)
        if prefix not in (None, *PREFIX_CACHES):
            fail("prefix", f"None or one of {sorted(PREFIX_CACHES)}", prefix)
        self.model, self.budget = model, budget
        self.pool = BlockPool(model.cfg.n_layers, n_blocks, block_size)
        self.prefix = None if prefix is None else PREFIX_CACHES[prefix](self.pool)
        self.step_no, self.preemptions, self.peak_blocks = 0, 0, 0
        self.pending: list[Request] = []
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.done: dict[str, Seq] = {}
        self.refused: dict[str, str] = {}  # request id -> why
        self.lengths: dict[str, int] = {}  # accepted request id -> its final token count
        self.log: list[dict] = []  # per step: what ran, what was preempted

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens slots."""
        return -(-n_tokens // self.pool.block_size)

    def submit(self, req: Request) -> bool:
        """Accept `req` (True), or record why it cannot be served (False: longer than the position table, or more
        blocks than the pool has). Malformed requests and duplicate ids raise ValueError, changing nothing."""
        self._check_request(req)
        total = len(req.prompt) + req.max_new + (self.lengths.get(req.parent, 0))
        why = None
        if req.parent in self.refused:
            why = f"its parent {req.parent} was refused"
        elif total > self.model.cfg.context_length:
            why = f"{total} tokens in all, past the context length {self.model.cfg.context_length}"
        elif self.blocks_for(total - 1) > self.pool.n_blocks:
            why = f"{self.blocks_for(total - 1)} blocks needed, the pool has {self.pool.n_blocks}"
        if why is not None:
            self.refused[req.rid] = why
            return False
        self.lengths[req.rid] = total
        self.pending.append(req)
        return True

    def _check_request(self, req: Request) -> None:
        if not isinstance(req, Request):
            fail("request", "a Request", type(req).__name__)
        if not isinstance(req.rid, str) or req.rid in self.lengths or req.rid in self.refused:
            fail("request.rid", "a string id not submitted before", req.rid)
        v = self.model.cfg.vocab_size
        if not (isinstance(req.prompt, tuple) and req.prompt and all(is_int(t) and 0 <= t < v for t in req.prompt)):
            fail("request.prompt", f"a non-empty tuple of token ids in [0, {v})", req.prompt)
        if not (is_int(req.max_new) and req.max_new > 0):
            fail("request.max_new", "a positive number of tokens", req.max_new)
        if not (is_int(req.arrival) and req.arrival >= 0):
            fail("request.arrival", "a step >= 0", req.arrival)
        if not (req.salt is None or isinstance(req.salt, str)):
            fail("request.salt", "None or a string", req.salt)
        if not (req.parent is None or req.parent in self.lengths or req.parent in self.refused):
            fail("request.parent", "None or the id of a request submitted earlier", req.parent)

    def busy(self) -> bool:
        """True while a request is pending, waiting or running."""
        return bool(self.pending or self.waiting or self.running)

    def step(self) -> dict:
        """One iteration: arrivals, running requests first (oldest first), then admissions, then one model pass.
        Returns its record: step, batch [(id, tokens computed)], preempted [ids], seconds (the pass's wall time)."""
        self._arrive()
        budget, batch, preempted = self.budget, [], []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an older request in this step
                continue
            n = min(len(seq.tokens) - seq.n_cached, budget)
            if self._grow(seq, n, preempted):
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and not preempted:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break
            batch.append((self.running[-1], n))
            budget -= n
        seconds = self._run(batch) if batch else 0.0  # wall time of the pass: recorded, never asserted
        record = {"step": self.step_no, "batch": [(s.req.rid, n) for s, n in batch], "preempted": preempted,
                  "seconds": seconds}
        self.log.append(record)
        self.step_no += 1
        return record

    def _arrive(self) -> None:
        for req in sorted(self.pending, key=lambda r: r.arrival):
            if req.arrival <= self.step_no and (req.parent is None or req.parent in self.done):
                before = self.done[req.parent].tokens if req.parent else []
                seq = Seq(req, before + list(req.prompt), len(before) + len(req.prompt), arrived=self.step_no)
                self.waiting.append(seq)
                self.pending.remove(req)

    def _free(self) -> int:
        """Blocks the pool can hand out now, counting those the prefix cache would evict."""
        return self.pool.n_free + (self.prefix.evictable() if self.prefix else 0)

    def _take(self, seq: Seq, need: int) -> None:
        if need > self.pool.n_free:
            self.prefix.evict(need - self.pool.n_free)
        blocks = self.pool.peek(need)
        self.pool.take(blocks)
        seq.blocks += blocks

    def _grow(self, seq: Seq, n: int, preempted: list[str]) -> bool:
        """Give a running request blocks for n more tokens, preempting the newest until they fit (False if that
        was the request itself)."""
        need = self.blocks_for(seq.n_cached + n) - len(seq.blocks)
        while need > self._free():
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.req.rid)
            if victim is seq:
                return False
        self._take(seq, need)
        return True

    def _admit(self, seq: Seq, budget: int) -> int:
        """Start the first waiting request from its cached prefix if its next chunk fits; return that chunk's size."""
        if self.prefix:
            seq.blocks, seq.handle = self.prefix.match(seq.tokens, seq.req.salt)
            seq.n_cached = len(seq.blocks) * self.pool.block_size
        n = min(len(seq.tokens) - seq.n_cached, budget)
        need = self.blocks_for(seq.n_cached + n) - len(seq.blocks)
        if need > self._free():
            self._drop(seq)
            return 0
        self._take(seq, need)
        self.waiting.popleft()
        self.running.append(seq)
        seq.prompt_tokens += len(seq.tokens)
        seq.hit_tokens += seq.n_cached
        return n

    def _drop(self, seq: Seq) -> None:
        """Give back every block of `seq` (to the prefix cache, if any); it keeps its tokens."""
        if self.prefix:
            self.prefix.release(seq.tokens, seq.blocks, seq.n_cached, seq.req.salt, seq.handle)
        else:
            for block in reversed(seq.blocks):
                self.pool.decref(block)
        seq.blocks, seq.n_cached, seq.handle = [], 0, None

    def _preempt(self, seq: Seq) -> None:
        self._drop(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        seq.preemptions += 1
        self.preemptions += 1

    def _run(self, batch: list[tuple[Seq, int]]) -> float:
        """One model pass for the batch; a request whose chunk reached its last token gets its next token.
        Returns the pass's wall time in seconds."""
        self.peak_blocks = max(self.peak_blocks, len({b for s, _ in batch for b in s.blocks}))
        chunks = [s.tokens[s.n_cached : s.n_cached + n] for s, n in batch]
        start = time.perf_counter()
        logits = run_paged_batch(self.model, self.pool, [s.blocks for s, _ in batch], [s.n_cached for s, _ in batch],
                                 chunks)
        seconds = time.perf_counter() - start
        for (seq, n), rows in zip(batch, logits, strict=True):
            seq.n_cached += n
            seq.computed += n
            if self.prefix:
                seq.blocks, seq.handle = self.prefix.store(seq.tokens, seq.blocks, seq.n_cached, seq.req.salt,
                                                           seq.handle)
            if seq.n_cached < len(seq.tokens):
                continue  # a prefill chunk before the last: no token yet
            seq.logits.append(rows[-1])
            seq.tokens.append(int(rows[-1].argmax()))
            seq.first_step = self.step_no if seq.first_step is None else seq.first_step
            if len(seq.tokens) == self.lengths[seq.req.rid]:
                self._drop(seq)
                self.running.remove(seq)
                self.done[seq.req.rid] = seq
                seq.finish_step = self.step_no
        return seconds


def check_invariants(sched: Scheduler) -> None:
    """Raise AssertionError unless every block is free or held, each reference count equals its holders (block
    tables and the prefix cache), no request holds a free block, and each table covers exactly its cached tokens."""
    pool = sched.pool
    holders = Counter(b for s in sched.running for b in s.blocks)
    holders += sched.prefix.held() if sched.prefix else Counter()
    free = set(pool.free_blocks)
    if len(free) != len(pool.free_blocks):
        fail("free list", "no block twice", pool.free_blocks, AssertionError)
    for b in range(pool.n_blocks):
        if pool.refcount[b] != holders[b] or (b in free) != (holders[b] == 0):
            fail(f"block {b}", f"refcount = holders = {holders[b]}, free only when unheld",
                 (pool.refcount[b], b in free), AssertionError)
    for seq in sched.running:
        if len(set(seq.blocks)) != len(seq.blocks) or len(seq.blocks) != sched.blocks_for(seq.n_cached):
            fail(f"request {seq.req.rid}", "distinct blocks covering exactly its cached tokens",
                 (seq.blocks, seq.n_cached), AssertionError)
    for seq in [*sched.waiting, *sched.done.values()]:
        if seq.blocks or seq.n_cached or seq.handle is not None:
            fail(f"request {seq.req.rid}", "no blocks while waiting or done", seq.blocks, AssertionError)
    if sched.prefix:
        sched.prefix.check([(s.handle, s.blocks) for s in sched.running])


def serve(model: GPT, trace: list[Request], n_blocks: int, block_size: int, budget: int, prefix: str | None = None,
          check: bool = False, max_steps: int = 10_000,
          after_step: Callable[[Scheduler], None] | None = None) -> Scheduler:
    """Submit the whole trace, then step until every accepted request is done (checking invariants after each
    step if `check`, and calling `after_step` with the scheduler after each step if given); returns the
    scheduler, whose `done`, `refused`, `log` and counters say what happened."""
    sched = Scheduler(model, n_blocks, block_size, budget, prefix)
    for req in trace:
        sched.submit(req)
    while sched.busy():
        if sched.step_no >= max_steps:
            fail("max_steps", "enough steps to serve the trace", max_steps, RuntimeError)
        sched.step()
        if check:
            check_invariants(sched)
        if after_step is not None:
            after_step(sched)
    return sched
