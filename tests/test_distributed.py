"""Chapter 10: the cache sharded by heads and by layers, and shipped between processes, on torch.distributed.

The process tests start real process groups (gloo on loopback) and compare each with the single-process
model in float64 to 1e-12 over a one-chunk prefill, a chunked prefill and decode steps. The transfer
format is tested in this process: round trips for each cache kind, and every refusal leaves the
receiving cache exactly as it was. Pure functions (shards, stages, byte counts, the cost table) are
checked on known inputs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOL64, build, rejected

from labcode import GPTConfig
from labcode.caches import CacheError, ConcatCache, GrowableCache, WindowCache
from labcode.distributed import (
    LaunchError,
    TransferError,
    costs,
    free_port,
    head_shard,
    jobs,
    launch,
    pack,
    payload_bytes,
    stage_layers,
    tp_cache_bytes,
    unpack,
    verify,
)
from labcode.distributed.tensor_parallel import split_attention
from labcode.distributed.transfer import MAGIC, PREFIX, fingerprint, frame, read_frame
from labcode.engines import BlockPool, PagedCache, QuantizedCache
from labcode.generate import generate, prefill
from labcode.weights.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # defined in conftest.py

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = [[12], [5, 4, 3]]  # a one-chunk prefill and a chunked one, then decode steps
STEPS = 5


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint(device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def gqa():
    """Four layers (two per pipeline stage), rotary positions, two key/value heads for four query heads."""
    return build(GPTConfig(vocab_size=64, context_length=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32,
                           rotary=True), seed=3)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))


# -- pure functions --------------------------------------------------------------------------------------

@pytest.mark.parametrize("h,hkv,world", [(4, 4, 2), (4, 4, 4), (4, 2, 2), (4, 2, 4), (4, 1, 2), (8, 2, 8), (8, 4, 2)])
def test_head_shards_cover_every_head_and_keep_groups_whole(h, hkv, world):
    shards = [head_shard(h, hkv, world, r) for r in range(world)]
    assert sorted(q for s in shards for q in s.q_heads) == list(range(h))  # each query head on one process
    group = h // hkv
    for s in shards:
        assert {q // group for q in s.q_heads} <= set(s.kv_heads), s  # a query head's K/V head is on its process
        assert len(s.kv_heads) == max(hkv // world, 1)
        assert s.replicas == max(world // hkv, 1)
    held = [kv for s in shards for kv in s.kv_heads]
    assert sorted(set(held)) == list(range(hkv)) and len(held) == max(hkv, world)  # replicated when Hkv < N


@pytest.mark.parametrize("args,match", [((4, 4, 3, 0), "world: expected a divisor of n_heads 4"),
                                        ((12, 4, 6, 0), "world: expected a divisor or a multiple of n_kv_heads 4"),
                                        ((4, 4, 2, 2), "rank: expected an int in"),
                                        ((4, 3, 2, 0), "n_kv_heads: expected a divisor of n_heads")])
def test_head_shard_refuses_splits_that_do_not_fit(args, match):
    with pytest.raises(ValueError, match=match):
        head_shard(*args)


def test_split_attention_rows_and_columns_reassemble_the_layer(gqa):
    attn = gqa.blocks[0].attn
    parts = [split_attention(attn, head_shard(4, 2, 4, r)) for r in range(4)]
    d = attn.head_dim
    assert torch.equal(torch.cat([p["q_weight"] for p in parts]), attn.q_proj.weight)
    assert torch.equal(torch.cat([p["out_weight"] for p in parts], dim=1), attn.out_proj.weight)
    assert [p["out_bias"] is not None for p in parts] == [True, False, False, False]  # added once, by rank 0
    k_rows = parts[3]["kv_weight"][:d]  # rank 3 holds K/V head 1 (replicated on ranks 2 and 3)
    assert torch.equal(k_rows, attn.kv_proj.weight[d:2 * d])
    assert torch.equal(parts[3]["kv_weight"][d:], attn.kv_proj.weight[3 * d:4 * d])  # its V rows, Hkv*D below
    assert torch.equal(parts[2]["kv_weight"], parts[3]["kv_weight"])


def test_tp_cache_bytes_on_known_inputs():
    assert tp_cache_bytes(2, 1, 10, 4, 16, 8, 1) == 2 * 2 * 10 * 4 * 16 * 8
    assert tp_cache_bytes(2, 1, 10, 4, 16, 8, 2) == 2 * 2 * 10 * 2 * 16 * 8  # half the heads
    assert tp_cache_bytes(2, 1, 10, 4, 16, 8, 8) == 2 * 2 * 10 * 1 * 16 * 8  # one head, replicated twice
    with pytest.raises(ValueError, match="world: expected a divisor or a multiple of n_kv_heads 4"):
        tp_cache_bytes(2, 1, 10, 4, 16, 8, 3)


def test_stage_layers_split_consecutively():
    assert [list(stage_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, 4, r)) for r in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="n_layers: expected at least one layer per stage"):
        stage_layers(2, 3, 0)


def test_free_port_is_a_bindable_loopback_port():
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_cost_formulas_on_known_inputs():
    qwen7 = costs.MODELS["Qwen2.5-7B"]
    per_layer = 3584 * 3584 * 2 + 2 * 3584 * 4 * 128 + 3 * 3584 * 18944
    assert qwen7.layer_params() == 28 * per_layer
    assert qwen7.matmul_params() == 28 * per_layer + 3584 * 152064
    assert qwen7.params() == 28 * per_layer + 2 * 3584 * 152064  # untied: embedding and head
    qwen72 = costs.MODELS["Qwen2.5-72B"]
    assert 72.5e9 < qwen72.params() < 72.8e9  # 72.7 B published, with norms and biases
    assert costs.MODELS["LLaMA-2-7B-32K"].kv_bytes(32768) == 16 * 2**30  # 2 L T Hkv D x 2 bytes = 16 GiB
    # Mooncake's README: 40 GB of cache for 128k tokens of a 70B model with 80 layers and 8 K/V heads of 128.
    assert costs.MODELS["Qwen2.5-72B"].kv_bytes(131072) == 40 * 2**30
    assert costs.ship_seconds(25 * 10**9 // 8, 25) == pytest.approx(1.0)
    cost = costs.prefill_cost(qwen7, 4)
    assert cost.flops_linear == 2 * 4 * qwen7.layer_params() + 2 * 3584 * 152064  # head: last token only
    assert cost.flops_attention == 4 * 28 * 28 * 128 * (4 * 5 // 2)  # causal: T(T+1)/2 pairs
    for row in costs.cost_table(32768):
        shape = costs.MODELS[row["model"]]
        at_crossover = costs.ship_seconds(row["kv_bytes"], row["crossover_gbit"])
        assert at_crossover == pytest.approx(row["recompute_s"])
        assert row["recompute_s"] >= costs.prefill_cost(shape, 32768).flops / costs.H100.peak_flops_per_s
    with pytest.raises(ValueError, match="gbit_per_s: expected a positive rate"):
        costs.ship_seconds(10, 0)


# -- the transfer format, in this process -------------------------------------------------------------------

KINDS = {  # kind -> (a fresh cache for the tiny model, prompt length, how many rows it holds after the prompt)
    "contiguous": (lambda m: ConcatCache(2), 12, 12),
    "growable": (lambda m: GrowableCache(2, 4), 12, 12),
    "window": (lambda m: WindowCache(2, 8), 12, 8),  # drops the 4 oldest positions
    "paged": (lambda m: PagedCache(BlockPool(2, n_blocks=16, block_size=5)), 12, 12),
}


def filled(kind, model, ids):
    cache = KINDS[kind][0](model)
    with torch.inference_mode():
        last = prefill(model, ids[:, :KINDS[kind][1]], cache)
    return cache, last


@pytest.mark.parametrize("kind", list(KINDS))
def test_transfer_round_trip_then_the_same_continuation(kind, tiny, ids):
    sent, last = filled(kind, tiny, ids)
    blob = pack(sent, tiny)
    received = KINDS[kind][0](tiny)
    fields = unpack(blob, tiny, received)
    assert (received.position, received.length()) == (sent.position, sent.length()) == (12, KINDS[kind][2])
    for layer in range(2):
        assert all(torch.equal(a, b) for a, b in zip(received.read(layer), sent.read(layer), strict=True))
    slots = fields["blocks"] * fields["block_size"] if kind == "paged" else KINDS[kind][2]
    assert fields["payload_bytes"] == payload_bytes(2, 1, slots, 4, 16, 8) == len(read_frame(blob)[1])
    token = last.argmax(-1)
    a = generate(tiny, token[:, None], 6, sent)
    b = generate(tiny, token[:, None], 6, received)
    assert torch.equal(a.ids, b.ids)
    assert max((x - y).abs().max().item() for x, y in zip(a.step_logits, b.step_logits, strict=True)) <= TOL64


def test_transfer_between_kinds_and_the_paged_blocks_shipped(tiny, ids):
    sent, _ = filled("paged", tiny, ids)
    blob = pack(sent, tiny)
    fields, payload = read_frame(blob)
    assert (fields["blocks"], fields["block_size"], fields["length"]) == (3, 5, 12)  # 15 slots shipped for 12
    received = ConcatCache(2)
    unpack(blob, tiny, received)
    assert torch.equal(received.read(1)[0], sent.read(1)[0])


def test_fingerprint_ignores_the_dtype_and_sees_the_weights(tiny):
    assert fingerprint(tiny) == fingerprint(load_checkpoint(device="cpu"))  # float32 weights cast exactly
    other = build(tiny.cfg, seed=5)
    assert fingerprint(other) != fingerprint(tiny)


def flip(blob: bytes, i: int) -> bytes:
    out = bytearray(blob)
    out[i] ^= 0xFF
    return bytes(out)


REFUSALS = {  # name -> (make the bad blob from a good one and the two models, error, message)
    "payload corrupted": (lambda b, m32, other: flip(b, -5), TransferError, "checksum: expected sha256"),
    "header corrupted": (lambda b, m32, other: flip(b, PREFIX.size + 3), TransferError, "header: expected"),
    "position rewritten": (lambda b, m32, other: b.replace(b'"position":12', b'"position":13'), TransferError,
                           "checksum"),
    "truncated payload": (lambda b, m32, other: b[:-100], TransferError, "a truncated transfer"),
    "truncated header": (lambda b, m32, other: b[:PREFIX.size + 20], TransferError, "a truncated transfer"),
    "not a transfer": (lambda b, m32, other: b"HTTP" + b[4:], TransferError, "blob: expected a KV transfer"),
    "newer format": (lambda b, m32, other: MAGIC + b"\x00\x02" + b[6:], TransferError,
                     "version: expected transfer format 1, got 2"),
    "dtype mismatch": (lambda b, m32, other: pack(filled("contiguous", m32, IDS)[0], m32), TransferError,
                       "dtype: expected torch.float64"),
    "wrong model": (lambda b, m32, other: pack(filled("contiguous", other, IDS)[0], other), TransferError,
                    "model: expected a cache made by this model"),
}
IDS = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(REFUSALS))
@pytest.mark.parametrize("receiver", ["contiguous", "paged"])
def test_every_bad_transfer_is_refused_and_the_receiver_unchanged(name, receiver, tiny):
    make, error, match = REFUSALS[name]
    good = pack(filled("contiguous", tiny, IDS)[0], tiny)
    bad = make(good, load_checkpoint(device="cpu"), build(tiny.cfg, seed=5))
    into = KINDS[receiver][0](tiny)
    rejected(into, lambda: unpack(bad, tiny, into), error, match)
    unpack(good, tiny, into)  # and the same cache still takes the good transfer
    assert into.position == 12


def test_receivers_that_cannot_continue_are_refused_unchanged(tiny, ids):
    window_blob = pack(filled("window", tiny, ids)[0], tiny)  # 8 rows for 12 positions: 4 dropped
    for into, match in [(ConcatCache(2), "into: expected a WindowCache"),
                        (WindowCache(2, 4), "t_new: expected a chunk of at most 4 tokens")]:
        rejected(into, lambda into=into: unpack(window_blob, tiny, into), (TransferError, CacheError), match)
    busy = ConcatCache(2)
    with torch.inference_mode():
        tiny(ids[:, :3], busy)
    rejected(busy, lambda: unpack(window_blob, tiny, busy), TransferError, "into: expected an empty cache")
    pool = BlockPool(2, n_blocks=2, block_size=5)  # 10 slots for 12 positions
    small = PagedCache(pool)
    rejected(small, lambda: unpack(pack(filled("contiguous", tiny, ids)[0], tiny), tiny, small), TransferError,
             "into: expected room for the 12 positions shipped, got room for 10")
    with pytest.raises(TransferError, match="cache: expected a contiguous"):
        pack(QuantizedCache(2, bits=8), tiny)
    with pytest.raises(TransferError, match="cache: expected a cache holding at least one position"):
        pack(ConcatCache(2), tiny)


def test_frame_checksum_covers_header_and_payload():
    fields = {"a": 1}
    blob = frame(fields, b"xyz")
    assert blob.startswith(MAGIC)
    header_len = PREFIX.unpack_from(blob)[2]
    assert json.loads(blob[PREFIX.size:PREFIX.size + header_len])["a"] == 1


# -- process groups -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("which,world", [("tiny", 2), ("gqa", 2), ("gqa", 4)])
def test_tensor_parallel_equals_one_process(which, world, request, ids):
    model = request.getfixturevalue(which)
    results = launch(jobs.tp_job, world, model, ids, SCHEDULES, STEPS)
    out = verify.verify_tp(model, ids, SCHEDULES, STEPS, results)
    assert out["max_abs_logit_diff"] <= TOL64 and out["max_abs_diff_vs_full_forward"] <= TOL64, out
    assert out["tokens_equal"] and out["ranks_agree_exactly"]
    hkv = model.cfg.n_kv_heads
    assert out["replicas"] == max(world // hkv, 1)
    per_rank = out["cache_bytes_one_process"] * max(hkv // world, 1) // hkv  # 1/N, or 1/Hkv when replicated
    assert out["cache_bytes_per_rank"] == [per_rank] * world


def test_pipeline_equals_one_process_with_half_the_cache_each(gqa, ids):
    results = launch(jobs.pp_job, 2, gqa, ids, SCHEDULES, STEPS)
    out = verify.verify_pp(gqa, ids, SCHEDULES, STEPS, results)
    assert out["max_abs_logit_diff"] <= TOL64 and out["tokens_equal"], out
    assert out["layers"] == [[0, 1], [2, 3]]
    assert out["cache_bytes_per_rank"] == [out["cache_bytes_one_process"] // 2] * 2


@pytest.mark.parametrize("kind", ["contiguous", "window", "paged"])
def test_disaggregated_continuation_equals_one_process(kind, tiny, ids):
    results = launch(jobs.disagg_job, 2, tiny, ids, STEPS, kind)
    out = verify.verify_disagg(tiny, ids, STEPS, kind, results)
    assert out["prefill_logit_diff"] <= TOL64 and out["max_abs_logit_diff"] <= TOL64 and out["tokens_equal"], out
    assert out["position"] == 12 and out["rows_shipped"] == {"window": 8}.get(kind, 12)
    assert out["formula_bytes"] == 2 * 2 * out["rows_shipped"] * 4 * 16 * 8
    if kind == "paged":  # whole blocks: 3 blocks of 4 slots hold exactly the 12 positions
        assert out["payload_bytes"] == 2 * 2 * out["slots_shipped"] * 4 * 16 * 8
    else:
        assert out["payload_bytes"] == out["formula_bytes"]


def test_a_transfer_damaged_in_transit_is_refused_by_the_decode_process(tiny, ids):
    results = launch(jobs.disagg_job, 2, tiny, ids, STEPS, "contiguous", damage=("flip", -7))
    assert results[1]["refused"].startswith("TransferError: checksum: expected sha256")
    assert results[1]["unchanged"] is True


def test_the_launcher_stops_every_rank_when_one_fails():
    with pytest.raises(LaunchError, match=r"rank 1 raised ValueError: rank 1: expected to fail"):
        launch(jobs.failing_job, 3, 1, timeout=30)
    assert multiprocessing.active_children() == []


def test_the_launcher_stops_a_job_past_its_deadline():
    with pytest.raises(LaunchError, match=r"timeout: expected the job to finish within 1.5 s, got ranks \[0, 1\]"):
        launch(jobs.stalled_job, 2, 60, timeout=1.5)
    assert multiprocessing.active_children() == []


def _launch_hello(start, out: str) -> None:
    """One launcher process: wait for the others, launch a 2-rank job, write its sums."""
    start.wait(timeout=60)
    try:
        sums = [r["sum"] for r in launch(jobs.hello_job, 2, timeout=60)]
    except BaseException as e:  # noqa: BLE001 - reported through the file, read by the test
        sums = repr(e)
    Path(out).write_text(json.dumps(sums))
    os._exit(0)


def test_jobs_launched_at_once_get_their_own_ports(tmp_path):
    # Three launchers in three fresh interpreters (as parallel test workers are), released together: each
    # job's store binds its own port, so no rank joins another job's group. Threads of one process would
    # not do (a forked rank copies only the thread that forked it, with any lock another thread held), nor
    # forked copies of this one, which would share its fork server.
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    outs = [tmp_path / f"job{i}.json" for i in range(3)]
    procs = [context.Process(target=_launch_hello, args=(start, str(out))) for out in outs]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [json.loads(out.read_text()) for out in outs] == [[3.0, 3.0]] * 3


def test_launch_refuses_bad_arguments():
    with pytest.raises(ValueError, match="nprocs: expected a positive number of processes, got 0"):
        launch(jobs.hello_job, 0)
    with pytest.raises(ValueError, match="timeout: expected a positive number of seconds"):
        launch(jobs.hello_job, 2, timeout=0)


def _cli_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def test_command_line_starts_its_own_processes():
    out = subprocess.run([sys.executable, "-m", "labcode.distributed", "tp", "--nproc", "2", "--steps", "3"],
                         capture_output=True, text=True, cwd=ROOT, env=_cli_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["passed"] and summary["world"] == 2 and summary["max_abs_logit_diff"] <= TOL64


def _torchrun_rank(rank: int, env: dict, out: str) -> None:
    """One process as torchrun starts it: the group described in its environment, then the entry point."""
    import contextlib

    from labcode.distributed.__main__ import main

    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        code = main(["hello"])
    os._exit(code)


def test_command_line_joins_a_group_described_as_torchrun_does(tmp_path):
    # torchrun would start two fresh interpreters; forked copies of this one run the same entry point
    # (main) in the same environment without paying torch's import twice more.
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    context = multiprocessing.get_context("fork")
    outs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [context.Process(target=_torchrun_rank, args=(r, env, str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert json.loads(outs[0].read_text().strip().splitlines()[-1]) == {"job": "hello", "sums": [3.0, 3.0],
                                                                        "passed": True}
    assert outs[1].read_text().strip() == ""  # only rank 0 reports


def test_messages_shown_on_pages_hide_the_digests_only():
    from labcode.distributed.transfer import without_digests

    message = "checksum: expected sha256 0123456789ab... (the sender's), got fedcba987654... (a corrupted transfer)"
    assert without_digests(message) == ("checksum: expected sha256 <sha256>... (the sender's), got <sha256>... "
                                        "(a corrupted transfer)")
    assert without_digests("blob: expected 43008 payload bytes") == "blob: expected 43008 payload bytes"
