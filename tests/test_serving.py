"""The serving scheduler: every request equals running it alone, under any trace, pool, budget and prefix cache;
the prefix caches' eviction order, reference counts and salts; bad requests refused without harm to the others."""

from __future__ import annotations

import pytest
import torch
from helpers import TOL64, build, property_configs
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from labcode.caches.base import CacheError
from labcode.engines import BlockPool
from labcode.generate import generate_nocache
from labcode.serving import (
    HashPrefixCache,
    RadixPrefixCache,
    Request,
    Scheduler,
    check_invariants,
    compare_prefix_caches,
    few_shot_trace,
    gaps_to_alone,
    multi_turn_trace,
    run_paged_batch,
    salted_hashes,
    serve,
    system_prompt_trace,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py
CONTEXT = 32
MODELS = [build(cfg, seed=i, scale=0.5) for i, cfg in enumerate(property_configs(CONTEXT))]
MODEL = MODELS[1]
V = MODEL.cfg.vocab_size
SERVING = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def alone(model, seq) -> tuple[list[int], torch.Tensor]:
    """The request run by itself with no cache: (all its tokens, logits [n, V])."""
    ref = generate_nocache(model, torch.tensor([seq.tokens[: seq.prompt_len]]), seq.req.max_new)
    return ref.ids[0].tolist(), torch.cat(ref.step_logits)


def assert_each_alone(model, sched) -> None:
    for rid, seq in sched.done.items():
        tokens, logits = alone(model, seq)
        assert seq.tokens == tokens, rid
        assert (torch.stack(seq.logits) - logits).abs().max().item() <= TOL64, rid


@st.composite
def traces(draw) -> list[Request]:
    """Up to 5 requests; a prompt may start with part of an earlier one, so prefix caches find hits."""
    out = []
    for i in range(draw(st.integers(1, 5))):
        prompt = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=9))
        if out:
            donor = out[draw(st.integers(0, len(out) - 1))].prompt
            prompt = list(donor[: draw(st.integers(0, len(donor)))]) + prompt
        parent = None
        firsts = [r.rid for r in out if r.parent is None]
        if firsts and draw(st.integers(0, 4)) == 0:  # a follow-up turn: short, so the whole chat fits the context
            parent, prompt = draw(st.sampled_from(firsts)), prompt[:4]
        out.append(Request(f"r{i}", draw(st.integers(0, 4)), tuple(prompt[:14]), draw(st.integers(1, 5)),
                           draw(st.sampled_from([None, None, "t"])), parent))
    return out


@SERVING
@given(model=st.integers(0, len(MODELS) - 1), trace=traces(), block_size=st.integers(1, 4),
       spare=st.integers(0, 6), budget=st.integers(1, 12), prefix=st.sampled_from([None, "hash", "radix"]))
def test_every_request_equals_running_it_alone(model, trace, block_size, spare, budget, prefix):
    """Tokens and float64 logits of every request equal generate_nocache's, with preemption and prefix hits;
    the invariants hold after every step."""
    total = {}
    for r in trace:
        total[r.rid] = len(r.prompt) + r.max_new + (total[r.parent] if r.parent else 0)
    need = max(-(-(n - 1) // block_size) for n in total.values())
    sched = serve(MODELS[model], trace, need + spare, block_size, budget, prefix, check=True)
    assert set(sched.done) == {r.rid for r in trace} and not sched.refused
    event(f"preempted: {sched.preemptions > 0}")
    event(f"prefix hits: {sum(s.hit_tokens for s in sched.done.values()) > 0}")
    event(f"follow-up turns: {any(r.parent for r in trace)}")
    assert_each_alone(MODELS[model], sched)


def test_a_tight_pool_preempts_the_newest_and_recomputes_it():
    trace = [Request(f"r{i}", 0, tuple(range(i, i + 6)), 8) for i in range(3)]
    sched = Scheduler(MODEL, n_blocks=6, block_size=4, budget=16)
    for req in trace:
        sched.submit(req)
    first = None
    while sched.busy():
        record = sched.step()
        check_invariants(sched)
        if record["preempted"] and first is None:
            first = record
    assert sched.preemptions > 0 and first["preempted"][0] == "r2"  # the newest goes first
    assert sched.done["r0"].preemptions == 0  # the oldest is never preempted
    assert_each_alone(MODEL, sched)


def test_decodes_and_prefill_chunks_share_a_step_under_the_budget():
    trace = [Request("a", 0, (1, 2), 6), Request("b", 2, tuple(range(10)), 2)]
    sched = serve(MODEL, trace, n_blocks=16, block_size=2, budget=4, check=True)
    assert all(sum(n for _, n in rec["batch"]) <= 4 for rec in sched.log)
    mixed = [rec["batch"] for rec in sched.log if len(rec["batch"]) == 2]
    assert mixed and mixed[0] == [("a", 1), ("b", 3)]  # a's decode, then a chunk of b's prompt
    assert_each_alone(MODEL, sched)


def test_after_step_sees_every_step_and_a_broken_pool():
    """serve calls after_step once per step with the scheduler, so a QA notebook can count the steps whose
    invariants fail instead of stopping at the first; a reference count broken in a step is seen there."""
    trace = [Request("a", 0, (1, 2, 3), 4), Request("b", 1, (4, 5), 3)]
    seen, broken = [], []

    def audit(sched):
        seen.append(sched.step_no)
        if sched.step_no == 2 and sched.running:  # plant: one extra reference on a held block
            sched.pool.refcount[sched.running[0].blocks[0]] += 1
        try:
            check_invariants(sched)
        except AssertionError:
            broken.append(sched.step_no)

    sched = serve(MODEL, trace, 16, 2, 4, after_step=audit)
    assert seen == list(range(1, sched.step_no + 1))
    assert broken and broken[0] == 2


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_prefix_hits_do_not_change_a_request(prefix):
    trace = system_prompt_trace(3, 5, V, system_len=10, every=3) + few_shot_trace(4, 4, V, every=3)
    trace = [Request(r.rid, r.arrival, r.prompt[:20], 3) for r in trace]
    plain = serve(MODEL, trace, 30, 2, 8, None)
    cached = serve(MODEL, trace, 30, 2, 8, prefix, check=True)
    assert sum(s.hit_tokens for s in cached.done.values()) > 0
    assert sum(s.computed for s in cached.done.values()) < sum(s.computed for s in plain.done.values())
    for rid, seq in cached.done.items():
        assert seq.tokens == plain.done[rid].tokens
        assert (torch.stack(seq.logits) - torch.stack(plain.done[rid].logits)).abs().max().item() <= TOL64
    assert_each_alone(MODEL, cached)


def test_multi_turn_chats_continue_the_conversation():
    trace = multi_turn_trace(5, 2, 3, V, first_len=6, max_new=3)
    sched = serve(MODEL, trace, 16, 2, 6, "radix", check=True)
    first, second = sched.done["c0t0"], sched.done["c0t1"]
    assert second.tokens[: len(first.tokens)] == first.tokens and second.hit_tokens >= len(first.tokens) - 2
    assert_each_alone(MODEL, sched)


def test_the_hash_cache_evicts_least_recently_freed_first_and_tails_first():
    pool = BlockPool(1, n_blocks=6, block_size=2)
    cache = HashPrefixCache(pool)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    for tokens, blocks in ((a, [0, 1]), (b, [2, 3])):
        pool.take(blocks)
        cache.release(tokens + [0], blocks, 4, None, None)  # a leaves first, then b
    assert pool.peek(6) == [4, 5, 1, 0, 3, 2]  # never-cached blocks, then a's (tail first), then b's
    hits, _ = cache.match(a + [9], None)
    assert hits == [0, 1] and pool.refcount[:2] == [1, 1] and pool.peek(4) == [4, 5, 3, 2]
    pool.take(pool.peek(3))  # handing out b's tail block evicts its hash
    assert cache.match(b + [9], None)[0] == [2]


def test_a_salt_keeps_tenants_apart_and_closes_the_timing_side_channel():
    assert salted_hashes([1, 2, 3, 4], 2, "x")[0] != salted_hashes([1, 2, 3, 4], 2, "y")[0]
    prompt = tuple(range(9))
    for prefix in ("hash", "radix"):
        runs = {}
        for salts in (("x", "x"), ("x", "y")):
            trace = [Request("first", 0, prompt, 2, salts[0]), Request("second", 5, prompt, 2, salts[1])]
            runs[salts] = sched = serve(MODEL, trace, 12, 2, 4, prefix, check=True)
            assert_each_alone(MODEL, sched)
        same, other = runs[("x", "x")].done["second"], runs[("x", "y")].done["second"]
        assert same.hit_tokens == 8 and other.hit_tokens == 0  # the same tenant: the first's full blocks; another: none
        # the side channel: a hit answers in the step it arrives, a miss prefills 9 tokens at 4 a step
        assert (same.ttft_steps, other.ttft_steps) == (1, 3)


def test_the_radix_tree_splits_counts_references_and_evicts_the_oldest_unlocked_leaf():
    pool = BlockPool(1, n_blocks=8, block_size=1)
    tree = RadixPrefixCache(pool)

    def serve_one(tokens: list[int]) -> None:  # a request: its cached prefix, fresh blocks for the rest, then it leaves
        hits, node = tree.match(tokens, None)
        fresh = pool.peek(len(tokens) - len(hits))
        pool.take(fresh)
        tree.release(tokens, hits + fresh, len(tokens), None, node)

    def edges() -> set[tuple]:
        return {n.tokens for n in tree._nodes() if n.parent}

    serve_one([1, 2, 3, 4])
    serve_one([1, 2, 7])
    assert edges() == {(1, 2), (3, 4), (7,)}  # [1, 2] split off, two branches below it
    assert sorted(tree.held().values()) == [1] * 5 and pool.n_free == 3  # one reference each, held by the tree
    hits, node = tree.match([1, 2, 3, 4, 5], None)  # locks [1, 2] and [3, 4]
    assert len(hits) == 4 and [pool.refcount[b] for b in hits] == [2] * 4 and tree.evictable() == 1
    tree.check([(node, hits)])
    tree.evict(1)  # only the unlocked leaf [7] can go
    assert edges() == {(1, 2), (3, 4)} and pool.n_free == 4
    tree.release([1, 2, 3, 4, 5], hits, 4, None, node)
    tree.check([])
    serve_one([1, 2, 5])  # the newest leaf
    tree.evict(1)
    assert edges() == {(1, 2), (5,)}  # [3, 4] was the least recently used
    serve_one([1, 2, 3, 4])  # back, and now the newest
    tree.evict(1)
    assert edges() == {(1, 2), (3, 4)}
    tree.check([])


def test_the_invariant_checker_catches_a_lost_reference():
    sched = Scheduler(MODEL, n_blocks=8, block_size=2, budget=4)
    sched.submit(Request("a", 0, (1, 2, 3), 4))
    sched.step()
    check_invariants(sched)
    sched.pool.decref(sched.running[0].blocks[0])  # a planted bug: the block is free but still in a table
    with pytest.raises(AssertionError, match="refcount"):
        check_invariants(sched)


def test_bad_requests_are_refused_and_no_other_request_loses_a_token():
    sched = Scheduler(MODEL, n_blocks=6, block_size=2, budget=6, prefix="hash")
    good = [Request("a", 0, (1, 2, 3), 4), Request("b", 1, (4, 5), 3)]
    for req in good:
        assert sched.submit(req)
    before = (list(sched.pending), dict(sched.lengths), dict(sched.refused))
    for bad, match in ((Request("a", 0, (1,), 1), "not submitted before"),  # a duplicate id
                       (Request("e", 0, (), 2), "non-empty"),  # an empty prompt
                       (Request("v", 0, (V,), 2), "token ids"),
                       (Request("n", 0, (1,), 0), "positive"),
                       (Request("p", 0, (1,), 1, parent="nobody"), "submitted earlier")):
        with pytest.raises(ValueError, match=match):
            sched.submit(bad)
        assert (list(sched.pending), dict(sched.lengths), dict(sched.refused)) == before
    assert not sched.submit(Request("long", 0, (1,) * CONTEXT, 2))  # past the position table
    assert not sched.submit(Request("big", 0, (1,) * 12, 2))  # 13 tokens need 7 blocks of 2; the pool has 6
    assert not sched.submit(Request("child", 0, (1,), 1, parent="big"))
    assert set(sched.refused) == {"long", "big", "child"} and "context length" in sched.refused["long"]
    while sched.busy():
        sched.step()
        check_invariants(sched)
    assert set(sched.done) == {"a", "b"}
    assert_each_alone(MODEL, sched)


def test_bad_arguments_raise_before_anything_changes():
    with pytest.raises(ValueError, match="budget"):
        Scheduler(MODEL, 4, 2, 0)
    with pytest.raises(ValueError, match="prefix"):
        Scheduler(MODEL, 4, 2, 4, prefix="lru")
    pool = BlockPool(MODEL.cfg.n_layers, 4, 2)
    run_paged_batch(MODEL, pool, [[0]], [0], [[1, 2]])
    before = [t.clone() for t in pool.k + pool.v]
    with pytest.raises(CacheError, match="covering"):
        run_paged_batch(MODEL, pool, [[0]], [2], [[3]])  # slot 2 is past the row's one block
    with pytest.raises(CacheError, match="non-empty"):
        run_paged_batch(MODEL, pool, [[0]], [0], [[]])
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v, strict=True))


def test_both_prefix_caches_on_the_same_traces():
    traces = {"system": system_prompt_trace(1, 6, V, system_len=10, max_new=3),
              "chat": multi_turn_trace(2, 2, 3, V, first_len=6, max_new=3),
              "few-shot": few_shot_trace(3, 6, V, example_len=3, max_new=3)}
    rows = compare_prefix_caches(MODEL, traces, n_slots=40, block_size=4, budget=8, check=True)
    assert len(rows) == 3 * 4
    for name in traces:
        runs = [r for r in rows if r["trace"] == name]
        assert runs[0]["cache"] == "none" and runs[0]["hit_rate"] == 0.0
        assert all(r["outputs"] == runs[0]["outputs"] for r in runs)  # hits never change a token
        assert all(r["hit_rate"] > 0 and r["computed"] < runs[0]["computed"] for r in runs[1:])


def test_gaps_to_alone_measure_the_served_logits_against_the_full_forward():
    trace = system_prompt_trace(6, 4, V, system_len=6, max_new=3)
    sched = serve(MODEL, trace, 12, 2, 5, "hash")
    gaps = gaps_to_alone(MODEL, sched)
    assert set(gaps) == set(sched.done) and all(g <= TOL64 and same for g, same in gaps.values())
    seq = sched.done["s1"]
    seq.logits[-1] = seq.logits[-1] + 1e-3  # a planted error in one logit row shows
    assert gaps_to_alone(MODEL, sched)["s1"][0] >= 1e-3 * 0.99
