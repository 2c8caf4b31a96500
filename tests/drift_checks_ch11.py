"""Drift checks for the teaching copies in notebooks/11_serving_many_requests.ipynb (see tests/test_drift.py)."""

from __future__ import annotations

from helpers import build, property_configs

import labcode.serving
from labcode.serving import Request, Scheduler, random_trace

MODEL = build(property_configs(32)[1], seed=1, scale=0.5)


def _verdict(check, sched) -> str:
    try:
        check(sched)
        return "ok"
    except AssertionError as e:
        return str(e)


def _plants(sched) -> list:
    """Ways to break a scheduler's books, each undone after use: (break, undo)."""
    pool = sched.pool
    out = [(lambda: pool.refcount.__setitem__(0, pool.refcount[0] + 1),
            lambda: pool.refcount.__setitem__(0, pool.refcount[0] - 1))]
    if pool.free_blocks:
        extra = pool.free_blocks[0]
        out.append((lambda: pool.free_blocks.append(extra), lambda: pool.free_blocks.pop()))
    if sched.running and sched.running[0].blocks:
        seq = sched.running[0]
        out.append((lambda: seq.blocks.append(seq.blocks[0]), lambda: seq.blocks.pop()))
        out.append((lambda: setattr(seq, "n_cached", seq.n_cached + sched.pool.block_size * 2),
                    lambda: setattr(seq, "n_cached", seq.n_cached - sched.pool.block_size * 2)))
    if sched.done:
        finished = next(iter(sched.done.values()))
        out.append((lambda: finished.blocks.append(0), lambda: finished.blocks.pop()))
    return out


def check_check_invariants(ns: dict) -> None:
    """The same verdict (and message) as labcode's on every step of traces served with each prefix cache
    and tight pools, and on states with a planted bug."""
    ours, theirs = ns["check_invariants"], labcode.serving.check_invariants
    planted = 0
    for seed in range(3):
        trace = random_trace(seed, 6, MODEL.cfg.vocab_size, prompt_len=(2, 9), max_new=(1, 5), last_arrival=3)
        for prefix in (None, "hash", "radix"):
            sched = Scheduler(MODEL, 8, 2, 6, prefix)
            for req in trace:
                sched.submit(req)
            while sched.busy():
                sched.step()
                assert _verdict(ours, sched) == _verdict(theirs, sched) == "ok"
                for do, undo in _plants(sched):
                    do()
                    a, b = _verdict(ours, sched), _verdict(theirs, sched)
                    undo()
                    assert a == b, (a, b)
                    planted += a != "ok"
            assert _verdict(ours, sched) == "ok"
    assert planted > 0
    sched = Scheduler(MODEL, 4, 2, 4)
    sched.submit(Request("a", 0, (1, 2, 3), 2))
    assert _verdict(ours, sched) == _verdict(theirs, sched) == "ok"  # nothing has run yet


CHECKS = {"labcode/serving/scheduler.py::check_invariants": check_check_invariants}
