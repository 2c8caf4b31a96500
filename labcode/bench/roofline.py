"""The roofline against the clock: measure the machine once, predict every forward call, time it, divide.

Introduced in chapter 7. Three numbers describe the machine: peak FLOP/s (a large matrix
product), streaming bandwidth (a large matrix-vector product) and the fixed cost of one
tensor operation (a decode step of the model shrunk to tensors of a few kilobytes, over the
operations it dispatches). `labcode.roofline.predict` turns them, with the counted FLOPs,
bytes and operations, into seconds. Beside each timed call the fixed cost and the ceilings
of its products (`StreamProbe`) are measured again, and the call is predicted with them too.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labcode.bench.common import TIMED, Sizes, bar, random_model
from labcode.bench.timing import Streamer, median, op_overhead, timed_cpu
from labcode.caches import WindowCache
from labcode.config import GPTConfig, get_config
from labcode.generate import decode_step
from labcode.model import GPT, attend
from labcode.results import QAResult
from labcode.roofline import Machine, StepCost, decode_cost, predict, prefill_cost, uncached_cost, weight_shapes

KINDS = ("prefill", "decode", "uncached")
TOLERANCE = 1.5  # how far the roofline's predictions may be off, as a factor either way (its targets)


class OpCounter(TorchDispatchMode):
    """Counts the tensor operations PyTorch dispatches inside a `with` block (views and in-place ones included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled; the default would import torch._dynamo (seconds) on first use

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_ops(fn) -> int:
    """Tensor operations one call of `fn()` dispatches."""
    with OpCounter() as counter:
        fn()
    return counter.total


def fill_cache(cache, model: GPT, batch: int, length: int) -> None:
    """Write `length` positions of [B, Hkv, D] keys and values into every layer of `cache`, as the model would: one
    random row repeated (a step's time does not depend on the values, and a large batch fills without gigabytes
    of random numbers)."""
    if length == 0:
        return
    cfg = model.cfg
    row = torch.randn(1, cfg.n_kv_heads, 1, cfg.head_dim, generator=torch.Generator().manual_seed(length))
    kv = row.to(model.device, model.dtype).expand(batch, -1, length, -1)  # (B, Hkv, length, D), a view
    cache.feed(kv, kv)


def shrunk_config(cfg: GPTConfig) -> GPTConfig:
    """The same layers and heads with head dim 4 and a 64-token vocabulary: every call, almost no data."""
    return cfg.with_(d_model=4 * cfg.n_heads, vocab_size=64)


def shrunk_model(cfg: GPTConfig, device: torch.device) -> GPT:
    """A model of `shrunk_config(cfg)`, seeded."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(shrunk_config(cfg)).to(device).eval()


@torch.inference_mode()
def measure_overhead(cfg: GPTConfig, device: torch.device, position: int = 64, steps: int = 11,
                     min_s: float = 0.5) -> dict:
    """Seconds per tensor operation of a cached decode step of `shrunk_model(cfg)`: its step time / its operations,
    the median of rounds of `steps` steps (`overhead_probe`) until `min_s` seconds of them are in."""
    ops, probe = overhead_probe(cfg, device, position, steps)
    runs, _ = timed_rounds(probe, min_s)
    wall, cpu = median([w for w, _ in runs]), median([c for _, c in runs])
    small = shrunk_config(cfg)
    return {"d_model": small.d_model, "vocab_size": small.vocab_size, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "ops_per_step": ops, "step_s": wall, "step_cpu_s": cpu, "s_per_op": wall / ops, "cpu_s_per_op": cpu / ops,
            "steps_timed": len(runs)}


def flop_rates(fn, flops: int, device: torch.device, repeats: int) -> dict:
    """FLOP/s of `flops` FLOPs in one call of `fn()`, wall clock and CPU time (medians of `repeats`, after one)."""
    fn()
    runs = [timed_cpu(fn, device) for _ in range(repeats)]
    return {"flops_per_s": flops / median([w for w, _ in runs]),
            "cpu_flops_per_s": flops / max(median([c for _, c in runs]), 1e-9)}


def measure_peak(device: torch.device, n: int = 1024, repeats: int = 7) -> dict:
    """FLOP/s of an n x n x n float32 matrix product, wall clock and CPU time."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    return {"n": n, **flop_rates(lambda: a @ b, 2 * n**3, device, repeats)}


def measure_machine(device: torch.device, streamer: Streamer, overhead_preset: str = "gpt2-124m",
                    overhead_min_s: float = 0.5) -> dict:
    """The roofline's three numbers for this machine, in wall-clock and CPU time, with their raw measurements."""
    peak = measure_peak(device)
    bw = streamer.measure()
    over = measure_overhead(get_config(overhead_preset), device, min_s=overhead_min_s)
    overlapped = device.type == "cuda"
    return {
        "wall": {"peak_flops_per_s": peak["flops_per_s"], "bandwidth_bytes_per_s": bw["best"],
                 "overhead_s_per_op": over["s_per_op"], "overlapped": overlapped},
        "cpu": {"peak_flops_per_s": peak["cpu_flops_per_s"], "bandwidth_bytes_per_s": bw["best_cpu"],
                "overhead_s_per_op": over["cpu_s_per_op"], "overlapped": overlapped},
        "peak": peak, "bandwidth": bw, "overhead": {**over, "preset": overhead_preset},
    }


def machine_of(measured: dict, clock: str = "wall") -> Machine:
    """The `Machine` a `measure_machine` result describes, in `clock` ("wall" or "cpu"). Its `row_ceilings` are the
    products of few rows it holds (`measure_rows`, under "rows") at an intensity of at least the machine's balance:
    below it, a product's rate measures the bandwidth, not its arithmetic."""
    m, key = measured[clock], "flops_per_s" if clock == "wall" else "cpu_flops_per_s"
    balance = m["peak_flops_per_s"] / m["bandwidth_bytes_per_s"]
    rows = sorted(measured.get("rows", []), key=lambda r: r["rows"])
    return Machine(**m, row_ceilings=tuple((r["rows"], r[key]) for r in rows if r["intensity"] >= balance))


def machine_at(measured: dict, point: dict, clock: str = "wall") -> Machine:
    """The `Machine` a roofline point was predicted with: `machine_of(measured, clock)` with the fixed cost per
    operation measured beside the point, where it was."""
    machine = machine_of(measured, clock)
    key = "overhead_s_per_op" if clock == "wall" else "overhead_cpu_s_per_op"
    return replace(machine, overhead_s_per_op=point[key]) if key in point else machine


def wall_over_cpu(roofline: dict) -> tuple[float, int]:
    """(median of wall-clock over CPU time, number of calls) over every timed call of a `bench_roofline` result:
    about 1 when the process had its core to itself."""
    ratios = [pt["step_s"] / pt["step_cpu_s"] for run in roofline.values() for pt in run["points"]
              if pt.get("step_cpu_s")]
    if not ratios:
        raise ValueError("roofline: expected timed calls with a CPU time, got none")
    return median(ratios), len(ratios)


def clock_note(roofline: dict, shared_above: float = 1.1) -> str:
    """One sentence for a page: was the machine shared during the run (`wall_over_cpu` above `shared_above`)?"""
    ratio, n = wall_over_cpu(roofline)
    if ratio > shared_above:
        return (f"In this run the wall clock measured the timed calls at {ratio:.1f} times their CPU time (median "
                f"over {n} calls): other work shared the cores, so the absolute wall-clock times are inflated, and "
                "the comparisons that matter are ratios of calls timed side by side.")
    return (f"In this run the two clocks agree to within {shared_above - 1:.0%} (median over {n} timed calls): the "
            "process had its core to itself.")


def points_for(cfg: GPTConfig, prefill: tuple[tuple[int, int], ...], decode: tuple[float, ...],
               uncached: tuple[int, ...], decode_steps: int) -> list[tuple[str, int, int]]:
    """(kind, T, S) of each point that fits the preset's position table: `prefill` (T, S) pairs, `decode` fractions
    of the table where the cached length starts, `uncached` lengths of the full forward."""
    n = cfg.context_length
    pts = [("prefill", t, s) for t, s in prefill if s + t <= n]
    pts += [("decode", 1, min(round(f * n), n - decode_steps - 3)) for f in decode]
    pts += [("uncached", t, 0) for t in uncached if t <= n]
    return list(dict.fromkeys(pts))  # in order, without repeats


def cost_of(cfg: GPTConfig, kind: str, t_new: int, s_cached: int, batch: int = 1) -> StepCost:
    if kind == "prefill":
        return prefill_cost(cfg, t_new, s_cached, batch)
    if kind == "decode":
        return decode_cost(cfg, s_cached, batch)
    return uncached_cost(cfg, t_new, batch)


def timed_rounds(one_round, min_s: float = 0.0, max_rounds: int = 50, beside=None,
                 min_rounds: int = 1) -> tuple[list, dict]:
    """(wall, CPU) seconds of the calls of `one_round()`, called until they add up to `min_s` seconds (at least
    `min_rounds`, at most `max_rounds` times), and {name: [(wall, CPU)]} of `beside()`'s, called after each round."""
    runs, other = [], {}
    for n in range(1, max_rounds + 1):
        runs += one_round()
        if beside is not None:
            for name, timed_calls in beside().items():
                other.setdefault(name, []).extend(timed_calls)
        if n >= min_rounds and sum(w for w, _ in runs) >= min_s:
            break
    return runs, other


class StreamRound(NamedTuple):
    """What `StreamProbe.at` measures beside a call: bytes of each memory-bound part, FLOPs of each compute-bound
    one (and the call's own through that shape), operations of each part, and one timed round."""

    nbytes: dict
    ops: dict
    one_round: Callable[[], dict]
    flops: dict = {}
    call_flops: dict = {}


def middle_keys(s_cached: int, repeats: int, warmup: int = 2) -> int:
    """The keys the middle timed step of a decode point attends to (`time_point`'s s_mid, + 1)."""
    return s_cached + warmup + (repeats - 1) // 2 + 1


def beside_call(probe, stream: StreamRound):
    """`time_point`'s `beside`: the fixed-cost probe's steps and a round of the memory-side ceilings."""
    return lambda: {"overhead": probe(), **stream.one_round()}


class StreamProbe:
    """The ceilings of a model's call, measured beside it: what each shape of its weights streams at (or computes
    at, where products of the call's rows are compute-bound) and what a decode step's keys and values stream at.

    Each weight shape of at least `min_matrix_kbytes` (a smaller product measures its dispatch) gets enough
    distinct matrices in the benchmark's layout, `min_mbytes` in all, that none is still in a cache when read
    again; the keys and values are the step's own, read through `labcode.model.attend`. `ceilings` and
    `compute_ceiling` turn the rounds into bytes/s and FLOP/s, less the fixed cost of their operations."""

    def __init__(self, cfg: GPTConfig, device: torch.device, min_mbytes: int = 64,
                 min_matrix_kbytes: int = 512) -> None:
        from labcode.bench.layout import by_column

        gen = torch.Generator().manual_seed(1)
        self.cfg, self.device = cfg, device
        self.weights, self.counts = {}, {}
        for o, i, k in weight_shapes(cfg):
            if 4 * o * i < min_matrix_kbytes * 1024:
                continue
            one = torch.randn(o, i, generator=gen).to(device)
            one = one.t().contiguous().t() if by_column(o, i) else one
            copies = max(1, -(-min_mbytes * 2**20 // one.nbytes))
            self.weights[(o, i)] = [one] + [one.clone(memory_format=torch.preserve_format) for _ in range(copies - 1)]
            self.counts[(o, i)] = k
        self.bias = {(o, i): torch.zeros(o, device=device) if cfg.bias else None for o, i in self.weights}

    def at(self, rows: int, kv_keys: int | None = None, balance: float = math.inf) -> StreamRound:
        """The products of `rows` rows through each shape of weight, memory-bound (bytes) where their intensity is
        below `balance` and compute-bound (FLOPs) from it on, and, for `kv_keys`, decode attention over that many
        keys for `rows` sequences; a round returns {name: [(wall, CPU) seconds]}."""
        cfg, device, e = self.cfg, self.device, 4
        calls, nbytes, flops, call_flops = {}, {}, {}, {}
        for (o, i), ws in self.weights.items():
            x, b, name = torch.randn(rows, i, device=device), self.bias[(o, i)], shape_name(o, i)
            calls[name] = lambda x=x, b=b, ws=ws: [F.linear(x, w, b) for w in ws]
            if 2 * rows * o * i / (e * (o * i + rows * (o + i))) >= balance:
                flops[name], call_flops[name] = 2 * rows * o * i * len(ws), 2 * rows * o * i * self.counts[(o, i)]
            else:
                nbytes[name] = sum(w.nbytes for w in ws)
        if kv_keys:
            shape = (rows, cfg.n_kv_heads, kv_keys, cfg.head_dim)
            row = torch.randn(1, cfg.n_kv_heads, 1, cfg.head_dim, device=device)  # repeated, as `fill_cache` does
            kv = [(row.expand(shape).contiguous(), row.expand(shape).contiguous()) for _ in range(cfg.n_layers)]
            q = torch.randn(rows, cfg.n_heads, 1, cfg.head_dim, device=device)
            calls["K/V"] = lambda: [attend(q, k, v, None) for k, v in kv]
            cost = decode_cost(cfg, kv_keys - 1, rows)
            nbytes["K/V"] = cost.kv_read_bytes + cost.act_attention_bytes
        ops = {name: count_ops(fn) for name, fn in calls.items()}
        for fn in calls.values():
            fn()  # warm-up

        def one_round() -> dict:
            return {name: [timed_cpu(fn, device)] for name, fn in calls.items()}

        return StreamRound(nbytes, ops, one_round, flops, call_flops)


def shape_name(n_out: int, n_in: int) -> str:
    return f"{n_out}x{n_in}"


def ceilings(nbytes: dict, ops: dict, seconds: dict, s_per_op: float, bandwidth: float, clock: int = 0) -> dict:
    """{name: bytes/s} of a `StreamProbe` round's parts: bytes over (median seconds less ops x the fixed cost), of
    the (wall, CPU) medians `seconds` picked by `clock`. A part whose bytes take less time at `bandwidth` than its
    fixed cost, or whose fixed cost was over half its time, measures the dispatch: it sets no ceiling."""
    out = {}
    for name, n in nbytes.items():
        t, fixed = seconds[name][clock], ops[name] * s_per_op
        if n / bandwidth >= fixed and t - fixed > 0.5 * t:
            out[name] = n / (t - fixed)
    return out


def compute_ceiling(stream: StreamRound, seconds: dict, s_per_op: float, clock: int = 0) -> float | None:
    """FLOP/s of a `StreamProbe` round's compute-bound products, less the fixed cost of their operations: each
    shape's rate, weighted by the FLOPs the call itself does through that shape; None where none was
    compute-bound, or where the fixed cost was more than half of every such part's time (it measured the dispatch).
    """
    work = time = 0.0
    for name, f in stream.flops.items():
        t = seconds[name][clock]
        if t - stream.ops[name] * s_per_op > 0.5 * t:
            work += stream.call_flops[name]
            time += stream.call_flops[name] * (t - stream.ops[name] * s_per_op) / f
    return work / time if time else None


def stream_machine(machine: Machine, rates: dict, rows: int, products_flops: float | None = None) -> Machine:
    """`machine` with the memory-side ceilings `rates` ({shape name or "K/V": bytes/s}) measured at `rows` rows, and
    the products' compute-side ceiling `products_flops` measured with them (None: `machine.peak_for`)."""
    streams = tuple((*map(int, k.split("x")), rows, b) for k, b in rates.items() if k != "K/V")
    return replace(machine, stream_ceilings=streams, kv_bandwidth_bytes_per_s=rates.get("K/V"),
                   products_flops_per_s=products_flops)


def _decode_rounds(model: GPT, token: torch.Tensor, s_cached: int, repeats: int, warmup: int,
                   capacity: int | None = None) -> tuple[int, object]:
    """(operations of one decode step, a function timing `repeats` steps from S in a fresh cache of `capacity`)."""
    cfg, device, batch = model.cfg, model.device, token.shape[0]

    def start():
        cache = WindowCache(cfg.n_layers, capacity or cfg.context_length)
        fill_cache(cache, model, batch, s_cached)
        for _ in range(warmup - 1):
            decode_step(model, token, cache)
        return cache

    first = start()
    ops = count_ops(lambda: decode_step(model, token, first))  # a step like the timed ones

    def one_round() -> list[tuple[float, float]]:
        cache = start()
        decode_step(model, token, cache)  # the last warm-up
        return [timed_cpu(lambda: decode_step(model, token, cache), device) for _ in range(repeats)]

    return ops, one_round


@torch.inference_mode()
def overhead_probe(cfg: GPTConfig, device: torch.device, position: int = 64, steps: int = 3,
                   batch: int = 1) -> tuple[int, object]:
    """(operations of one step, a function timing `steps` decode steps) of `shrunk_model(cfg)` for `batch` sequences
    from `position`: the fixed cost per operation at that batch, measured beside a timed call (`time_point`)."""
    model = shrunk_model(cfg, device)
    position = min(position, cfg.context_length // 2)
    steps = max(1, min(steps, cfg.context_length - position - 3))
    token = torch.zeros(batch, dtype=torch.long, device=device)
    return _decode_rounds(model, token, position, steps, warmup=2, capacity=position + steps + 3)


@torch.inference_mode()
def time_point(model: GPT, kind: str, t_new: int, s_cached: int, batch: int = 1, repeats: int = 5,
               warmup: int = 2, min_s: float = 0.0, max_rounds: int = 50, beside=None, min_rounds: int = 1) -> dict:
    """Median wall and CPU seconds of one forward call of `kind`, and the operations it dispatches.

    Decode times `repeats` consecutive steps from S (`s_mid` is the middle one); prefill and uncached calls start from
    the same state each time; in rounds until they add up to `min_s` seconds. `beside()` ({name: [(wall, CPU)]} of
    other calls) runs after every round; their medians come back as `beside`, measured in the same moments.
    """
    cfg, device = model.cfg, model.device
    gen = torch.Generator().manual_seed(t_new + 7 * s_cached)
    ids = torch.randint(0, cfg.vocab_size, (batch, t_new), generator=gen).to(device)
    if kind == "decode":
        ops, one_round = _decode_rounds(model, ids[:, 0], s_cached, repeats, warmup)
        s_mid = s_cached + warmup + (repeats - 1) // 2
    else:
        if kind == "prefill":
            def call():
                cache = WindowCache(cfg.n_layers, s_cached + t_new)
                fill_cache(cache, model, batch, s_cached)
                return lambda: model(ids, cache)
        else:
            def call():
                return lambda: model(ids)

        ops = count_ops(call())
        for _ in range(warmup - 1):
            call()()

        def one_round():
            return [timed_cpu(call(), device) for _ in range(repeats)]

        s_mid = s_cached
    runs, other = timed_rounds(one_round, min_s, max_rounds, beside, min_rounds)
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    out = {"kind": kind, "t_new": t_new, "s_cached": s_cached, "s_mid": s_mid, "batch": batch, "ops": ops,
           "step_s": median(walls), "step_cpu_s": median(cpus), "step_min_s": min(walls), "timed": len(runs)}
    if beside is not None:
        out["beside"] = {k: (median([w for w, _ in v]), median([c for _, c in v])) for k, v in other.items()}
    return out


def predicted(cfg: GPTConfig, point: dict, machine: Machine) -> dict:
    """The roofline's seconds for a timed point, and its terms."""
    p = predict(cost_of(cfg, point["kind"], point["t_new"], point["s_mid"], point["batch"]), machine, point["ops"])
    return {"seconds": p.seconds, "t_math": p.t_math, "t_memory": p.t_memory, "t_parts": p.t_parts,
            "t_overhead": p.t_overhead, "bound": p.bound}


def bench_roofline(presets: tuple[str, ...], points: dict, machine: dict, device: torch.device,
                   models: dict | None = None, repeats: int = 5, min_s: float = 0.0, overhead_steps: int = 3,
                   stream_mbytes: int = 64, min_rounds: int = 1, progress=None) -> dict:
    """Every point of every preset, timed and predicted; `points` holds `points_for`'s arguments.

    Decode points time `repeats` steps (at least `min_rounds` rounds), prefill and uncached calls about half as
    many, in rounds until they add up to `min_s` seconds. Between the rounds the fixed cost (`overhead_probe`)
    and the ceilings (`StreamProbe`) are measured again: a shared machine's speed changes from one second to the
    next, and what is measured in the same moments changes with it. Returns, per preset, the points with their
    counted cost, measured seconds, predictions (`annotate`) and measured / predicted in both clocks.
    """

    out = {}
    balance = machine_of(machine).balance
    for preset in presets:
        model = (models or {}).get(preset) or random_model(preset, device)
        cfg = model.cfg
        probe_ops, probe = overhead_probe(cfg, device, steps=overhead_steps)
        streams = StreamProbe(cfg, device, stream_mbytes)
        rows = []
        for kind, t, s in points_for(cfg, **points):
            stream = streams.at(1, middle_keys(s, repeats), balance) if kind == "decode" else streams.at(t, None,
                                                                                                      balance)
            row = time_point(model, kind, t, s, repeats=repeats if kind == "decode" else max(1, (repeats + 1) // 2),
                             min_s=min_s, beside=beside_call(probe, stream),
                             min_rounds=min_rounds if kind == "decode" else 1)
            cost = cost_of(cfg, kind, t, row["s_mid"])
            row.update(flops=cost.flops, bytes=cost.bytes, weight_bytes=cost.weight_bytes,
                       kv_bytes=cost.kv_read_bytes + cost.kv_write_bytes, act_bytes=cost.act_bytes,
                       intensity=cost.intensity)
            annotate(cfg, row, machine, stream, probe_ops)
            rows.append(row)
            if progress is not None:
                progress.update(1)
        out[preset] = {"config": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model,
                                  "vocab_size": cfg.vocab_size, "context_length": cfg.context_length},
                       "points": rows}
        del model, streams
    return out


def annotate(cfg: GPTConfig, row: dict, machine: dict, stream: StreamRound, probe_ops: int) -> None:
    """Add to a timed point (`time_point` with `beside`) the fixed cost per operation and the ceilings measured
    beside it (`ceilings`, bytes/s; `products_flops`, FLOP/s or None), its predictions (`predicted` with them,
    `plain` with the machine's numbers of the start) and measured / predicted, in both clocks."""
    beside = row.pop("beside")
    row["overhead_s_per_op"], row["overhead_cpu_s_per_op"] = (x / probe_ops for x in beside.pop("overhead"))
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        plain = machine_at(machine, row, clock)
        rates = ceilings(stream.nbytes, stream.ops, beside, plain.overhead_s_per_op, plain.bandwidth_bytes_per_s,
                         clock == "cpu")
        flops = compute_ceiling(stream, beside, plain.overhead_s_per_op, clock == "cpu")
        row["ceilings" + suffix], row["products_flops" + suffix] = rates, flops
        rows = row["batch"] * row["t_new"]
        for name, ratio, mach in (("plain", "ratio_plain", plain),
                                  ("predicted", "ratio", stream_machine(plain, rates, rows, flops))):
            row[name + suffix] = predicted(cfg, row, mach)
            row[ratio + suffix] = row["step" + suffix + "_s"] / row[name + suffix]["seconds"]
        row["ratio_no_overhead" + suffix] = row["step" + suffix + "_s"] / row["predicted" + suffix]["t_parts"]


def worst_factor(ratios: list[float]) -> float:
    """How far the worst ratio is from 1, as a factor >= 1 (0.5 and 2.0 are both 2x off)."""
    return max(max(r, 1 / r) for r in ratios) if ratios else float("nan")


def summary(result: dict, tolerance: float = TOLERANCE) -> dict:
    """Per preset and kind: the worst factor, with and without the overhead term, and where the overhead dominates."""
    out = {}
    for preset, run in result.items():
        pts = run["points"]
        by_kind = {kind: [p for p in pts if p["kind"] == kind] for kind in KINDS}
        per_kind = {kind: {
            "worst_factor": worst_factor([p["ratio"] for p in mine]),
            "worst_factor_cpu": worst_factor([p["ratio_cpu"] for p in mine]),
            "worst_factor_no_overhead": worst_factor([p["ratio_no_overhead"] for p in mine]),
            "overhead_share": [p["predicted"]["t_overhead"] / p["predicted"]["seconds"] for p in mine],
            "overhead_dominates": [p["predicted"]["bound"] == "overhead" for p in mine],
        } for kind, mine in by_kind.items() if mine}
        out[preset] = {
            "kinds": per_kind,
            "worst_factor": worst_factor([p["ratio"] for p in pts]),
            "worst_factor_cpu": worst_factor([p["ratio_cpu"] for p in pts]),
            "within": all(max(p["ratio"], 1 / p["ratio"]) <= tolerance for p in pts),
            "overhead_dominated_points": sum(p["predicted"]["bound"] == "overhead" for p in pts),
            "points": len(pts),
        }
    return out


def measure_rows(device: torch.device, shape: tuple[int, int] = (3072, 768), rows: tuple[int, ...] = (1, 4, 16, 64,
                 256, 1024), min_mbytes: int = 64, repeats: int = 3) -> list[dict]:
    """FLOP/s of `F.linear` with R rows through distinct weights [out, in] (none still in a cache when read): how
    close products with few rows get to the peak their intensity allows."""
    gen = torch.Generator().manual_seed(0)
    n_out, n_in = shape
    copies = max(1, -(-min_mbytes * 2**20 // (4 * n_out * n_in)))
    ws = [torch.randn(n_out, n_in, generator=gen).to(device) for _ in range(copies)]
    out = []
    for r in rows:
        x = torch.randn(r, n_in, generator=gen).to(device)
        flops = 2 * r * n_in * n_out * copies
        out.append({"rows": r, **flop_rates(lambda x=x: [F.linear(x, w) for w in ws], flops, device, repeats),
                    "intensity": flops / (4 * (n_out * n_in + r * (n_in + n_out)) * copies)})
    return out


def overhead_crossover(cfg: GPTConfig, machine: Machine, ops: int, widths: tuple[int, ...] | None = None) -> dict:
    """The model width below which a batch-1 decode step of `ops` operations is predicted to spend more on them than
    on bytes: `cfg`'s layers, heads and vocabulary at each of `widths` (default: multiples of 64 up to 2048)."""
    widths = widths or tuple(range(64, 2049, 64))
    rows = []
    for c in widths:
        if c % cfg.n_heads:
            continue
        p = predict(decode_cost(cfg.with_(d_model=c), 0), machine, ops)
        rows.append({"d_model": c, "t_parts": p.t_parts, "t_overhead": p.t_overhead})
    above = [r["d_model"] for r in rows if r["t_parts"] >= r["t_overhead"]]
    return {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "vocab_size": cfg.vocab_size, "ops": ops,
            "widths": rows, "crossover_d_model": min(above) if above else None}


def record_machine(res: QAResult, sizes: Sizes, device: torch.device, streamer: Streamer) -> dict:
    """The machine: the fixed cost of small operations, the peak, the bandwidth and the ceilings of products of few
    rows; returns the measurements the roofline predicts with."""
    res.value("machine", {"cpu_count": os.cpu_count(), "op_overhead_us": op_overhead(device)}, TIMED)
    measured = measure_machine(device, streamer, sizes.overhead_preset, sizes.overhead_min_s)
    measured["rows"] = measure_rows(device, sizes.rows_shape, min_mbytes=sizes.bandwidth_mbytes // 4)
    res.value("roofline_machine", measured, TIMED)
    return measured


def record(res: QAResult, sizes: Sizes, device: torch.device, measured: dict, models: dict, progress: bool) -> None:
    """The roofline's predictions against the clock at every preset, and its summary."""
    points = {"prefill": sizes.roofline_prefill, "decode": sizes.roofline_decode,
              "uncached": sizes.roofline_uncached, "decode_steps": sizes.roofline_repeats}
    n_points = sum(len(points_for(get_config(p), **points)) for p in sizes.roofline_presets)
    with bar(n_points, "roofline", progress) as shown:
        result = bench_roofline(sizes.roofline_presets, points, measured, device, models,
                                repeats=sizes.roofline_repeats, min_s=sizes.roofline_min_s,
                                overhead_steps=sizes.roofline_overhead_steps, stream_mbytes=sizes.stream_mbytes,
                                min_rounds=sizes.decode_min_rounds, progress=shown)
    res.value("roofline", result, TIMED)
    wall = machine_of(measured)
    extra = {"crossover": {p: overhead_crossover(get_config(p), wall, _ops(result[p])) for p in sizes.roofline_presets}}
    speedups = {preset: roofline_speedup(get_config(preset), run, result[preset], wall)
                for preset, run in res.doc["values"]["generation"].items() if preset in result}
    if speedups:
        extra["generation"] = speedups
    res.value("roofline_summary", {**summary(result), "overhead_measured_on": measured["overhead"]["preset"], **extra},
              TIMED)


def _ops(run: dict, kind: str = "decode") -> int:
    """Operations a batch-1 call of `kind` dispatched in a roofline run (the fewest of its points)."""
    return min([p["ops"] for p in run["points"] if p["kind"] == kind], default=0)


def roofline_speedup(cfg, run: dict, roofline_run: dict, machine) -> dict:
    """The roofline's prediction of a generation benchmark's totals, with and without a cache, and the speedup, each
    call with the operations the roofline run counted for its kind."""
    ops = {kind: _ops(roofline_run, kind) for kind in KINDS}
    p0, n = run["prompt_len"], run["new_tokens"]
    nocache = [predict(uncached_cost(cfg, p0 + i), machine, ops["uncached"]).seconds for i in range(n)]
    cached = [predict(prefill_cost(cfg, p0), machine, ops["prefill"]).seconds] + [
        predict(decode_cost(cfg, p0 + i - 1), machine, ops["decode"]).seconds for i in range(1, n)]
    measured = run["speedup"]["window"]
    pred = sum(nocache) / sum(cached)
    return {"predicted_nocache_s": sum(nocache), "predicted_cached_s": sum(cached), "predicted_speedup": pred,
            "measured_speedup": measured, "ratio": measured / pred,
            "measured_nocache_s": run["total_s"]["nocache"], "measured_cached_s": run["total_s"]["window"]}
