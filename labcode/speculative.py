"""Speculative decoding: a cheap draft guesses k tokens, the target checks them all in one cached pass.

Introduced in chapter 12 (rollback). The target's cache holds every token but the
last one (`pending`). One verify pass feeds pending and the k drafted tokens d1..dk, T = k + 1,
and its logits at row i judge d(i+1). The longest agreeing prefix d1..dj is kept, row j gives
one more token (a correction, or a bonus when all k agree), and the k - j rejected positions are
rolled back (`cache.rollback`). Greedy: the output is plain greedy decoding's, token for token.
Sampling: the accept/reject rule of Leviathan et al. (2023) and Chen et al. (2023) keeps the
target's distribution whatever the draft proposes. Drafts: prompt lookup (the tokens that followed
the latest earlier occurrence of the last n tokens) or a smaller model with its own cache, such as
the target's first layers (`first_layers`, a self-speculative draft).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from labcode.caches.base import CacheError, KVCache, check_cache
from labcode.checks import fail, is_int
from labcode.generate import _check_count, _prefill, check_prompt, chunk_length, new_token_budget
from labcode.sampling import Sampler


@dataclass
class Speculation:
    """What `speculative_generate` returns: the tokens, and how the draft fared."""

    ids: torch.Tensor  # (1, P + n): the prompt followed by n new tokens
    new_tokens: int  # n
    stop_reason: str  # as in labcode.generate.Generation
    step_logits: list[torch.Tensor] = field(default_factory=list)  # n tensors [1, V]: the target logits behind each
    drafted: list[int] = field(default_factory=list)  # tokens drafted for each verify pass
    accepted: list[int] = field(default_factory=list)  # of those, how many the target kept
    target_passes: int = 0  # forward passes of the target, the prefill included
    draft_passes: int = 0  # forward passes of a model draft (0 for prompt lookup)


def speculation_stats(out: Speculation) -> dict[str, float]:
    """Acceptance rate (kept / drafted), target passes per new token, and new tokens per verify pass."""
    if not isinstance(out, Speculation):
        fail("out", "a Speculation", type(out).__name__)
    drafted, verify = sum(out.drafted), len(out.drafted)
    return {
        "acceptance_rate": sum(out.accepted) / drafted if drafted else float("nan"),
        "target_passes_per_token": out.target_passes / out.new_tokens if out.new_tokens else float("nan"),
        "tokens_per_verify_pass": (out.new_tokens - 1) / verify if verify else float("nan"),
        "drafted": float(drafted),
        "accepted": float(sum(out.accepted)),
    }


class PromptLookupDraft:
    """Prompt lookup (n-gram) drafting: find an earlier occurrence of the last n tokens (n from `max_n` down to
    `min_n`) and propose the tokens that followed it: the latest occurrence followed by k tokens, else the
    earliest (the longest continuation there is). No model, no cache."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not (is_int(min_n) and is_int(max_n) and 1 <= min_n <= max_n):
            fail("min_n, max_n", "ints with 1 <= min_n <= max_n", (min_n, max_n))
        self.max_n, self.min_n = max_n, min_n
        self.passes = 0

    def check(self, target: nn.Module, positions: int, k: int) -> None:
        """Nothing to check: the draft reads only the tokens."""

    def propose(self, ids: torch.Tensor, k: int, sample: Sampler) -> tuple[list[int], None]:
        """Up to k tokens guessed from ids [1, N]; no distribution (the draft is certain: a point mass)."""
        seq = ids[0].tolist()
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail, found = seq[-n:], None
            for start in range(len(seq) - n - 1, -1, -1):  # the latest earlier occurrence first
                if seq[start : start + n] == tail:
                    found = seq[start + n : start + n + k]
                    if len(found) == k:
                        break
            if found:
                return found, None
        return [], None

    def keep(self, n_kept: int) -> None:
        """Nothing to roll back."""


class ModelDraft:
    """A smaller model with its own cache drafts k tokens, one decode step each (greedy, or sampled from its
    distribution q at the target's temperature); after verification its cache rolls back to what was kept."""

    def __init__(self, model: nn.Module, cache: KVCache) -> None:
        check_cache(cache, model.cfg.kv_layers, model.cfg.sliding_window)
        if cache.position:
            fail("cache", "an empty cache for the draft", f"one at position {cache.position}", CacheError)
        self.model, self.cache, self.passes = model, cache, 0

    def check(self, target: nn.Module, positions: int, k: int) -> None:
        """The draft must speak the target's vocabulary, start empty and hold every position it may roll back."""
        if self.cache.position:
            fail("draft cache", "an empty cache (a ModelDraft serves one generation: reset its cache for the next)",
                 f"one at position {self.cache.position}", CacheError)
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            fail("draft", f"a model of the target's vocabulary, {target.cfg.vocab_size}", self.model.cfg.vocab_size)
        check_keeps(self.cache, positions, "draft cache", k)
        if self.cache.max_chunk is not None and self.cache.max_chunk < 2:
            fail("draft cache", "one that takes chunks of 2 tokens (it catches up on two after a full accept)",
                 f"max_chunk {self.cache.max_chunk}", CacheError)
        if positions > self.model.cfg.context_length:
            fail("draft", f"a position table of at least {positions}", self.model.cfg.context_length)

    def propose(self, ids: torch.Tensor, k: int, sample: Sampler) -> tuple[list[int], torch.Tensor | None]:
        """k tokens after ids [1, N] and, when sampling, their distributions q [k, V] (float64)."""
        behind = ids[:, self.cache.position :]  # catch up: the prompt the first time, then pending and maybe one more
        size = chunk_length(self.cache, behind.shape[1], None)
        logits = _prefill(self.model, behind, self.cache, size)  # (1, V)
        self.passes += -(-behind.shape[1] // size)
        tokens, qs = [], []
        for i in range(k):
            if sample.temperature > 0:
                qs.append(probabilities(logits[0], sample.temperature).cpu())
            tokens.append(int(sample(logits)[0]))
            if i + 1 < k:  # the last draft is never fed: the target judges it
                logits = self.model(torch.tensor([[tokens[-1]]], device=ids.device), self.cache)[:, -1]
                self.passes += 1
        return tokens, (torch.stack(qs) if qs else None)

    def keep(self, n_kept: int) -> None:
        """Roll the draft's cache back to its first `n_kept` positions (the tokens the target confirmed)."""
        if self.cache.position > n_kept:
            self.cache.rollback(self.cache.position - n_kept)


def first_layers(model: nn.Module, n_layers: int) -> nn.Module:
    """The same model cut after its first `n_layers` blocks, then its final norm and head: a self-speculative
    draft (early exit). It shares the target's modules and weights; nothing is copied or initialised."""
    if not (is_int(n_layers) and 0 < n_layers < model.cfg.n_layers):
        fail("n_layers", f"an int in [1, {model.cfg.n_layers})", n_layers)
    draft = copy.copy(model)  # a second object of the target's class, every attribute shared
    for table in ("_modules", "_parameters", "_buffers"):  # its own tables: cutting its blocks leaves the target's
        setattr(draft, table, dict(getattr(model, table)))
    draft.cfg = model.cfg.with_(n_layers=n_layers)
    draft.blocks = nn.ModuleList(list(model.blocks)[:n_layers])
    return draft


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float64, logits [..., V]: the distribution Sampler draws from."""
    return (logits.double() / temperature).softmax(dim=-1)


def accept_draft(p: torch.Tensor, q: torch.Tensor | None, draft: list[int],
                 generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling's rule: keep draft token d_i with probability min(1, p_i(d) / q_i(d)); at the first
    rejection draw from the residual max(0, p_i - q_i), renormalised; if all are kept, draw from p_k.

    p [k + 1, V]: the target's distributions; q [k, V] the draft's (None: each draft a point mass). Returns
    (j, the next token): j drafts kept. The emitted tokens are then distributed as the target's.
    """
    for i, d in enumerate(draft):
        q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([d]), 1.0) if q is None else q[i]
        r = torch.rand((), dtype=torch.float64, generator=generator)
        if r * q_i[d] < p[i, d]:  # r < p / q, without dividing
            continue
        residual = (p[i] - q_i).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=generator))


def check_keeps(cache: KVCache, positions: int, name: str, k: int) -> None:
    """A cache that drops past `cache.keeps` positions can then roll back only its `rollback_reserve`: refuse a
    run that needs more positions than it keeps, unless that reserve covers the k drafts of a pass."""
    if cache.keeps is not None and positions > cache.keeps and cache.rollback_reserve < k:
        fail(name, f"a cache that keeps the {positions} positions this run may roll back (or a rollback reserve "
             f"of k = {k})", f"{type(cache).__name__} keeping {cache.keeps}", CacheError)


def _judge(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, sample: Sampler) -> tuple[int, int]:
    """(drafts kept, next token) from the verify pass's logits [1 + m, V]."""
    if sample.temperature == 0:
        choice = logits.argmax(dim=-1).tolist()  # what plain greedy decoding picks after each prefix
        j = 0
        while j < len(drafts) and drafts[j] == choice[j]:
            j += 1
        return j, choice[j]
    return accept_draft(probabilities(logits, sample.temperature).cpu(), q, drafts, sample.generator)


@torch.inference_mode()
def speculative_generate(target: nn.Module, ids: torch.Tensor, max_new_tokens: int, cache: KVCache,
                         draft: PromptLookupDraft | ModelDraft, k: int = 4, *, temperature: float = 0.0,
                         generator: torch.Generator | None = None) -> Speculation:
    """Generate up to `max_new_tokens` after ids [1, P] with `target` and `cache`, k drafted tokens per pass.

    Stops where `labcode.generate.generate` stops. Greedy (temperature 0) gives its tokens exactly.
    """
    sample = Sampler(temperature, None, None, generator)  # the request, checked once, before anything runs
    _check_count(max_new_tokens)
    if not (is_int(k) and k >= 1):
        fail("k", "a positive number of drafted tokens per pass", repr(k))
    if not isinstance(draft, (PromptLookupDraft, ModelDraft)):
        fail("draft", "a PromptLookupDraft or a ModelDraft", type(draft).__name__)
    if ids.dim() != 2 or ids.shape[0] != 1:
        fail("ids", "one sequence [1, P] (each row would accept a different number of drafts)",
             tuple(getattr(ids, "shape", ())))
    size = check_prompt(target, ids, cache)
    if cache.max_chunk is not None and k + 1 > cache.max_chunk:
        fail("k", f"at most {cache.max_chunk - 1} (a verify pass of k + 1 tokens must fit the cache's max_chunk)", k)
    room, p = cache.room(), ids.shape[1]
    n, reason = new_token_budget(cache.position + p, max_new_tokens, target.cfg.context_length,
                                 None if room is None else room - p)
    check_keeps(cache, cache.position + p + n - 1, "cache", k)
    draft.check(target, cache.position + p + n - 1, k)
    out = Speculation(ids=ids, new_tokens=n, stop_reason=reason)
    if n == 0:
        return out
    logits = _prefill(target, ids, cache, size)  # (1, V)
    out.target_passes = -(-p // size)
    out.step_logits.append(logits)
    out.ids = torch.cat((ids, sample(logits).unsqueeze(1)), dim=1)
    while out.ids.shape[1] - p < n:
        m = min(k, n - (out.ids.shape[1] - p) - 1)  # never draft past the last token asked for
        drafts, q = draft.propose(out.ids, m, sample) if m else ([], None)
        block = torch.tensor([[int(out.ids[0, -1]), *drafts]], device=ids.device)  # pending, then the drafts
        logits = target(block, cache)[0]  # (1 + m, V): one pass judges every draft
        j, nxt = _judge(logits, drafts, q, sample)
        cache.rollback(len(drafts) - j)  # the rejected drafts were never written, as far as anyone can tell
        out.step_logits.extend(logits[i : i + 1] for i in range(j + 1))
        out.ids = torch.cat((out.ids, torch.tensor([[*drafts[:j], nxt]], device=ids.device)), dim=1)
        draft.keep(out.ids.shape[1] - 1)
        out.drafted.append(len(drafts))
        out.accepted.append(j)
        out.target_passes += 1
    out.draft_passes = draft.passes
    return out
