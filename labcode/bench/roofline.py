"""The roofline against the clock: measure the machine once, predict every forward call, time it, divide.

Introduced in chapter 7. Three numbers describe the machine: peak FLOP/s (a large
matrix product), streaming bandwidth (a large matrix-vector product) and the fixed
cost of one tensor operation (a decode step of a model whose every width is shrunk
until its tensors are a few kilobytes, divided by the operations it dispatches).
`labcode.roofline.predict` turns them, with the counted FLOPs, bytes and operations,
into seconds; each point here is also timed, with the wall clock and with the
process's CPU time, and the two are divided.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labcode.bench.timing import Streamer, median, timed_cpu
from labcode.caches import WindowCache
from labcode.config import GPTConfig, get_config
from labcode.generate import decode_step
from labcode.model import GPT
from labcode.roofline import Machine, StepCost, decode_cost, predict, prefill_cost, uncached_cost

KINDS = ("prefill", "decode", "uncached")


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
    """Write `length` positions of [B, Hkv, D] keys and values into every layer of `cache`, as the model would.

    The values are one random row repeated: a step's time does not depend on them, and
    a large batch is filled without drawing gigabytes of random numbers.
    """
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
    """Seconds per tensor operation of a cached decode step of `shrunk_model(cfg)`: its step time / its operations.

    The steps are timed in rounds of `steps` from the same cached length (`overhead_probe`)
    until `min_s` seconds of them are in: the median of a few hundred steps, which a moment of
    other work on the machine barely moves.
    """
    ops, probe = overhead_probe(cfg, device, position, steps)
    runs, _ = timed_rounds(probe, min_s)
    wall, cpu = median([w for w, _ in runs]), median([c for _, c in runs])
    small = shrunk_config(cfg)
    return {"d_model": small.d_model, "vocab_size": small.vocab_size, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "ops_per_step": ops, "step_s": wall, "step_cpu_s": cpu, "s_per_op": wall / ops, "cpu_s_per_op": cpu / ops,
            "steps_timed": len(runs)}


def measure_peak(device: torch.device, n: int = 1024, repeats: int = 7) -> dict:
    """FLOP/s of an n x n x n float32 matrix product (median of `repeats`), wall clock and CPU time."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    a @ b
    runs = [timed_cpu(lambda: a @ b, device) for _ in range(repeats)]
    flops = 2 * n**3
    return {"n": n, "flops_per_s": flops / median([w for w, _ in runs]),
            "cpu_flops_per_s": flops / max(median([c for _, c in runs]), 1e-9)}


def measure_machine(device: torch.device, bandwidth_mbytes: int, overhead_preset: str = "gpt2-124m",
                    overhead_min_s: float = 0.5) -> dict:
    """The roofline's three numbers for this machine, in wall-clock and CPU time, with their raw measurements."""
    peak = measure_peak(device)
    streamer = Streamer(bandwidth_mbytes, device)
    bw = streamer.measure()
    del streamer
    over = measure_overhead(get_config(overhead_preset), device, min_s=overhead_min_s)
    overlapped = device.type == "cuda"
    return {
        "wall": {"peak_flops_per_s": peak["flops_per_s"], "bandwidth_bytes_per_s": bw["best"],
                 "overhead_s_per_op": over["s_per_op"], "overlapped": overlapped},
        "cpu": {"peak_flops_per_s": peak["cpu_flops_per_s"], "bandwidth_bytes_per_s": bw["best_cpu"],
                "overhead_s_per_op": over["cpu_s_per_op"], "overlapped": overlapped},
        "peak": peak, "bandwidth": bw, "overhead": {**over, "preset": overhead_preset},
    }


def row_ceilings(rows: list[dict], clock: str, balance: float) -> tuple[tuple[int, float], ...]:
    """(R, FLOP/s) of the `measure_rows` products that were compute-bound: intensity at least the machine's balance.

    A product with fewer rows is below the balance, so its rate measures the bandwidth,
    not how fast the arithmetic of so few rows can go; it is left out.
    """
    key = "flops_per_s" if clock == "wall" else "cpu_flops_per_s"
    return tuple((r["rows"], r[key]) for r in sorted(rows, key=lambda r: r["rows"]) if r["intensity"] >= balance)


def machine_of(measured: dict, clock: str = "wall") -> Machine:
    """The `Machine` a `measure_machine` result describes, in `clock` ("wall" or "cpu").

    Where the result holds products of few rows (`measure_rows`, under "rows"), the
    compute-bound ones are the machine's `row_ceilings`.
    """
    m = measured[clock]
    balance = m["peak_flops_per_s"] / m["bandwidth_bytes_per_s"]
    return Machine(**m, row_ceilings=row_ceilings(measured.get("rows", []), clock, balance))


def machine_at(measured: dict, point: dict, clock: str = "wall") -> Machine:
    """The `Machine` a roofline point was predicted with: `machine_of(measured, clock)` with the fixed cost per
    operation measured beside the point, where it was."""
    machine = machine_of(measured, clock)
    key = "overhead_s_per_op" if clock == "wall" else "overhead_cpu_s_per_op"
    return replace(machine, overhead_s_per_op=point[key]) if key in point else machine


def wall_over_cpu(roofline: dict) -> tuple[float, int]:
    """(median of wall-clock over CPU time, number of calls) over every timed call of a `bench_roofline` result.

    About 1 when the process had its core to itself; well above 1 when other work shared the cores.
    """
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
    """(kind, T, S) of each point that fits the preset's position table.

    `prefill` holds (T, S) pairs; `decode` fractions of the table at which the cached
    length starts (the timed steps follow it); `uncached` lengths of the full forward.
    """
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


def timed_rounds(one_round, min_s: float = 0.0, max_rounds: int = 50, beside=None) -> tuple[list, list]:
    """(wall, CPU) seconds of the calls of `one_round()`, called until they add up to `min_s` seconds (once at
    least, `max_rounds` times at most), and those of `beside()`, called after every round if given."""
    runs, other = [], []
    for _ in range(max_rounds):
        runs += one_round()
        if beside is not None:
            other += beside()
        if sum(w for w, _ in runs) >= min_s:
            break
    return runs, other


def _decode_rounds(model: GPT, token: torch.Tensor, s_cached: int, repeats: int, warmup: int) -> tuple[int, object]:
    """(operations of one decode step, a function that times `repeats` steps from S in a fresh cache)."""
    cfg, device, batch = model.cfg, model.device, token.shape[0]

    def start():
        cache = WindowCache(cfg.n_layers, cfg.context_length)
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
def overhead_probe(cfg: GPTConfig, device: torch.device, position: int = 64, steps: int = 3) -> tuple[int, object]:
    """(operations of one step, a function timing `steps` decode steps) of `shrunk_model(cfg)` from `position`:
    the fixed cost per operation, measured in rounds interleaved with a timed call (`time_point(beside=...)`)."""
    model = shrunk_model(cfg, device)
    position = min(position, cfg.context_length // 2)
    steps = max(1, min(steps, cfg.context_length - position - 3))
    return _decode_rounds(model, torch.zeros(1, dtype=torch.long, device=device), position, steps, warmup=2)


@torch.inference_mode()
def time_point(model: GPT, kind: str, t_new: int, s_cached: int, batch: int = 1, repeats: int = 5,
               warmup: int = 2, min_s: float = 0.0, max_rounds: int = 50, beside=None) -> dict:
    """Median wall and CPU seconds of one forward call of `kind`, and the operations it dispatches.

    Decode times `repeats` consecutive steps from S (so the cached length grows by one each
    step; `s_mid` is the middle one); prefill and uncached calls start from the same state
    every time (a fresh cache holding S positions for prefill). Short calls are timed again,
    in rounds from the same state, until the timed calls add up to `min_s` seconds (at most
    `max_rounds` rounds): a call of a millisecond is otherwise at the mercy of one interruption.
    `beside`, a function returning (wall, CPU) seconds of some other calls, runs after every
    round, and the medians of its calls come back as `beside_s` and `beside_cpu_s`: measured
    in the same moments as the call, whatever the machine's speed did meanwhile.
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
    runs, other = timed_rounds(one_round, min_s, max_rounds, beside)
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    out = {"kind": kind, "t_new": t_new, "s_cached": s_cached, "s_mid": s_mid, "batch": batch, "ops": ops,
           "step_s": median(walls), "step_cpu_s": median(cpus), "step_min_s": min(walls), "timed": len(runs)}
    if beside is not None:
        out.update(beside_s=median([w for w, _ in other]), beside_cpu_s=median([c for _, c in other]))
    return out


def predicted(cfg: GPTConfig, point: dict, machine: Machine) -> dict:
    """The roofline's seconds for a timed point, and its terms."""
    p = predict(cost_of(cfg, point["kind"], point["t_new"], point["s_mid"], point["batch"]), machine, point["ops"])
    return {"seconds": p.seconds, "t_math": p.t_math, "t_memory": p.t_memory, "t_parts": p.t_parts,
            "t_overhead": p.t_overhead, "bound": p.bound}


def bench_roofline(presets: tuple[str, ...], points: dict, machine: dict, device: torch.device,
                   models: dict | None = None, repeats: int = 5, min_s: float = 0.0, overhead_steps: int = 3,
                   progress=None) -> dict:
    """Every point of every preset, timed and predicted; `points` holds `points_for`'s arguments.

    Decode points time `repeats` steps; prefill and uncached calls, which are longer, about
    half as many; each point in rounds until its timed calls add up to `min_s` seconds.
    Between the rounds of each point, `overhead_steps` decode steps of the shrunk model of
    `machine` (`overhead_probe`) measure the fixed cost per operation again, and the point is
    predicted with that cost (`machine_at`): a shared machine's speed changes by tens of
    percent from one second to the next, and a cost measured in the same moments as the
    call changes with it.
    Returns, per preset, a list of points with their counted cost, the measured seconds, the
    prediction with and without the overhead term, and measured / predicted in both clocks.
    """
    from labcode.bench import random_model  # the package imports this module

    out = {}
    probe_ops, probe = overhead_probe(get_config(machine["overhead"]["preset"]), device, steps=overhead_steps)
    for preset in presets:
        model = (models or {}).get(preset) or random_model(preset, device)
        cfg = model.cfg
        rows = []
        for kind, t, s in points_for(cfg, **points):
            row = time_point(model, kind, t, s, repeats=repeats if kind == "decode" else max(1, (repeats + 1) // 2),
                             min_s=min_s, beside=probe)
            cost = cost_of(cfg, kind, t, row["s_mid"])
            row.update(flops=cost.flops, bytes=cost.bytes, weight_bytes=cost.weight_bytes,
                       kv_bytes=cost.kv_read_bytes + cost.kv_write_bytes, act_bytes=cost.act_bytes,
                       intensity=cost.intensity, overhead_s_per_op=row.pop("beside_s") / probe_ops,
                       overhead_cpu_s_per_op=row.pop("beside_cpu_s") / probe_ops)
            for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
                pred = predicted(cfg, row, machine_at(machine, row, clock))
                row["predicted" + suffix] = pred
                row["ratio" + suffix] = row["step" + suffix + "_s"] / pred["seconds"]
                row["ratio_no_overhead" + suffix] = row["step" + suffix + "_s"] / pred["t_parts"]
            rows.append(row)
            if progress is not None:
                progress.update(1)
        out[preset] = {"config": {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model,
                                  "vocab_size": cfg.vocab_size, "context_length": cfg.context_length},
                       "points": rows}
        del model
    return out


def worst_factor(ratios: list[float]) -> float:
    """How far the worst ratio is from 1, as a factor >= 1 (0.5 and 2.0 are both 2x off)."""
    return max(max(r, 1 / r) for r in ratios) if ratios else float("nan")


def summary(result: dict, tolerance: float = 1.5) -> dict:
    """Per preset and kind: the worst factor, with and without the overhead term, and where the overhead dominates."""
    out = {}
    for preset, run in result.items():
        pts = run["points"]
        per_kind = {}
        for kind in KINDS:
            mine = [p for p in pts if p["kind"] == kind]
            if not mine:
                continue
            per_kind[kind] = {
                "worst_factor": worst_factor([p["ratio"] for p in mine]),
                "worst_factor_cpu": worst_factor([p["ratio_cpu"] for p in mine]),
                "worst_factor_no_overhead": worst_factor([p["ratio_no_overhead"] for p in mine]),
                "overhead_share": [p["predicted"]["t_overhead"] / p["predicted"]["seconds"] for p in mine],
                "overhead_dominates": [p["predicted"]["bound"] == "overhead" for p in mine],
            }
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
    """FLOP/s of `F.linear` with R rows through a weight [out, in]: how close products with few rows get to the peak.

    The roofline assumes a call is compute-bound at the peak as soon as its intensity
    allows; products with a few rows are not. Enough distinct weights are cycled that
    none stays in a cache.
    """
    gen = torch.Generator().manual_seed(0)
    n_out, n_in = shape
    copies = max(1, -(-min_mbytes * 2**20 // (4 * n_out * n_in)))
    ws = [torch.randn(n_out, n_in, generator=gen).to(device) for _ in range(copies)]
    out = []
    for r in rows:
        x = torch.randn(r, n_in, generator=gen).to(device)
        fn = lambda x=x: [torch.nn.functional.linear(x, w) for w in ws]  # noqa: E731
        fn()
        runs = [timed_cpu(fn, device) for _ in range(repeats)]
        flops = 2 * r * n_in * n_out * copies
        out.append({"rows": r, "flops_per_s": flops / median([w for w, _ in runs]),
                    "cpu_flops_per_s": flops / max(median([c for _, c in runs]), 1e-9),
                    "intensity": flops / (4 * (n_out * n_in + r * (n_in + n_out)) * copies)})
    return out


def overhead_crossover(cfg: GPTConfig, machine: Machine, ops: int, widths: tuple[int, ...] | None = None) -> dict:
    """The model width below which a batch-1 decode step is predicted to spend more on operations than on bytes.

    Same layers, heads and vocabulary as `cfg`, widths `d_model` from `widths` (default:
    multiples of 64 up to 2048); `ops` is the step's operation count, which the width does not change.
    """
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
