"""The benchmark suite of chapter 7: `python -m labcode.bench [--quick|--full]`.

Introduced in chapter 7. The measurements, each in one process, interleaved, after
a warm-up, summarised by medians and ratios:
  1. appending one position to every layer, for every cache (`append`);
  2. append plus single-token attention, three ways (`append_attention`);
  3. greedy generation with no cache and with every cache (`generation`);
  4. cached decode steps against the memory-bandwidth floor (`floor`), operation by
     operation (`floor_ops`), and the window cache against the concatenating one;
  5. the roofline: the machine measured once, every prefill, decode and uncached call
     predicted and timed (`roofline`); decode against the batch size (`batch`);
  6. how many sequences fit in memory, checked by allocating the caches (`memory`);
  7. the decode step fused and compiled against the model's eager step and the floor, at
     every preset and the real model (`compiled`; the test sizes never compile).
Timings are recorded, never compared: the result file is `machine_dependent`, every
value's rule is `recorded`, its checks are about correctness only, and the targets
are values with a `met` flag (and the measured reason where not met), computed from
the other values by `labcode.bench.targets`.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from labcode.bench.append import KINDS as APPEND_KINDS
from labcode.bench.append import AppendSetup, bench_append, bench_append_attention
from labcode.bench.batch import bench_batch, critical_batch_curve
from labcode.bench.compiled import bench_compiled, float64_check, fresh_compile_cache
from labcode.bench.decode import (
    ProductsOnly,
    bench_floor,
    bench_generation,
    overhead_step,
    products_only_diff,
    profile_decode,
)
from labcode.bench.floor import (
    LeanDecode,
    bench_window_vs_concat,
    kv_read_variants,
    lean_diff,
    op_breakdown,
    product_variants,
    validation_cost,
)
from labcode.bench.layout import row_major_copy, store_wide_weights_by_column
from labcode.bench.memory import allocation_agrees, allocation_check, concurrency, concurrency_sweep
from labcode.bench.roofline import (
    bench_roofline,
    machine_of,
    measure_machine,
    measure_rows,
    overhead_crossover,
    points_for,
    summary,
)
from labcode.bench.targets import targets
from labcode.bench.timing import Streamer, linear_layouts, matmul_flops_per_s, op_overhead
from labcode.config import get_config
from labcode.flops import forward_flops, measure_flops
from labcode.model import GPT
from labcode.results import QAResult, recorded
from labcode.roofline import decode_cost, predict, prefill_cost, uncached_cost
from labcode.weights.checkpoint import default_device


@dataclass(frozen=True)
class Sizes:
    """How much each benchmark runs. `SIZES` holds the named modes."""

    append_layers: int = 30
    append_prefills: tuple[int, int] = (128, 4096)  # the "candle" setup and the "long" one
    append_decode: int = 200
    append_rounds: int = 3
    attention_decode: int = 200
    attention_rounds: int = 3
    # (preset, prompt length, new tokens, rounds) for each end-to-end generation benchmark
    generation: tuple[tuple[str, int, int, int], ...] = (("tiny", 16, 48, 5), ("gpt2-124m", 64, 128, 1))
    floor_preset: str = "gpt2-124m"  # the model whose decode steps are held against the bandwidth floor
    floor_positions: tuple[int, ...] = tuple(range(0, 1009, 96))
    floor_steps: int = 11
    floor_rounds: int = 2
    bandwidth_mbytes: int = 256
    profile_position: int = 512
    profile_steps: int = 3  # 0: no torch.profiler table (its first use costs seconds)
    # decode at the floor, operation by operation (labcode.bench.floor), and window against concat per step
    floor_ops_position: int = 512
    floor_ops_steps: int = 7
    kv_read_lengths: tuple[int, ...] = (128, 512, 1000)
    window_concat_positions: tuple[int, ...] = (0, 128, 256, 512, 768, 1000)
    window_concat_steps: int = 9
    window_concat_rounds: int = 2
    # the roofline (labcode.bench.roofline): the machine, the presets, and the calls timed at each
    overhead_preset: str = "gpt2-124m"  # whose shrunk decode step measures the fixed cost per operation
    overhead_min_s: float = 0.5  # seconds of shrunk decode steps timed for it
    rows_shape: tuple[int, int] = (3072, 768)  # the weight through which products of few rows are timed
    roofline_presets: tuple[str, ...] = ("gpt2-124m", "small", "tiny")
    roofline_prefill: tuple[tuple[int, int], ...] = ((16, 0), (64, 0), (256, 0), (64, 512))  # (T, S)
    roofline_decode: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0)  # where decode starts, as a fraction of the table
    roofline_uncached: tuple[int, ...] = (32, 128, 512)
    roofline_repeats: int = 5
    roofline_min_s: float = 1.0  # each point is timed in rounds until its calls add up to this
    roofline_overhead_steps: int = 3  # shrunk decode steps timed after each round: the fixed cost beside each call
    # decode against the batch size (labcode.bench.batch): (preset, batch sizes, cached lengths)
    batch_runs: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (
        ("tiny", (1, 2, 4, 8, 16, 32, 64), (16, 48)),
        ("small", (1, 2, 4, 8, 16, 32, 64), (128, 896)),
        ("gpt2-124m", (1, 2, 4, 8, 16), (128, 896)),
    )
    batch_steps: int = 5
    batch_min_s: float = 1.0  # each batch is timed in rounds of `batch_steps` steps until they add up to this
    stream_mbytes: int = 64  # at least this many MB of each weight shape in the memory-side ceilings' probe
    decode_min_rounds: int = 3  # rounds every decode point takes at least: the ceilings beside it, a median of three
    # the fused decode step, eager and compiled, against the floor (labcode.bench.compiled); positions as fractions
    # of each preset's buffers (its context, at most `compiled_capacity`); `compile` False times the eager steps only
    compiled_presets: tuple[str, ...] = ("tiny", "small", "gpt2-124m", "smollm2-135m")
    compiled_positions: tuple[float, ...] = (0.125, 0.5, 0.875)
    compiled_capacity: int = 1024
    compiled_steps: int = 7
    compiled_rounds: int = 3
    compile: bool = True
    # how many sequences fit (labcode.bench.memory)
    memory_budget_gib: float = 16.0
    memory_lengths: tuple[int, ...] = (100, 500, 1000)
    memory_block_size: int = 16


SIZES = {
    "full": Sizes(),
    "quick": Sizes(append_decode=24, append_rounds=2, attention_decode=24, attention_rounds=2,
                   generation=(("tiny", 16, 32, 3), ("gpt2-124m", 16, 12, 1)),
                   floor_positions=(0, 256, 512, 768, 1008), floor_steps=5, floor_rounds=1,
                   bandwidth_mbytes=128, profile_steps=0, floor_ops_steps=3, kv_read_lengths=(512,),
                   window_concat_positions=(0, 512, 1000), window_concat_steps=5, window_concat_rounds=1,
                   roofline_presets=("small", "tiny"), roofline_prefill=((16, 0), (128, 0)),
                   roofline_decode=(0.0, 1.0), roofline_uncached=(64,), roofline_repeats=3,
                   roofline_min_s=0.2, overhead_min_s=0.2,
                   batch_runs=(("tiny", (1, 4, 16), (16,)), ("small", (1, 4, 16), (128,))), batch_steps=3,
                   batch_min_s=0.2, stream_mbytes=32, decode_min_rounds=2,
                   compiled_presets=("tiny", "small"), compiled_steps=5, compiled_rounds=2),
    "test": Sizes(append_layers=3, append_prefills=(16, 256), append_decode=4, append_rounds=1,
                  attention_decode=4, attention_rounds=1, generation=(("micro", 4, 5, 1), ("tiny", 4, 5, 1)),
                  floor_preset="tiny", floor_positions=(0, 40), floor_steps=2, floor_rounds=1,
                  bandwidth_mbytes=8, profile_steps=0, floor_ops_position=20, floor_ops_steps=2,
                  kv_read_lengths=(32,), window_concat_positions=(0, 40), window_concat_steps=2,
                  window_concat_rounds=1, roofline_presets=("tiny",), roofline_prefill=((8, 0), (8, 16)),
                  roofline_decode=(0.0, 0.5), roofline_uncached=(16,), roofline_repeats=2,
                  roofline_min_s=0.0, roofline_overhead_steps=1, overhead_min_s=0.0,
                  batch_runs=(("tiny", (1, 2), (8,)),), batch_steps=2, batch_min_s=0.0, stream_mbytes=1,
                  decode_min_rounds=1, memory_budget_gib=0.001,
                  memory_lengths=(20,), memory_block_size=8, overhead_preset="tiny", rows_shape=(256, 64),
                  compiled_presets=("tiny",), compiled_steps=2, compiled_rounds=1, compile=False),
}


# Every value of the benchmark record is a measurement of the machine that ran it: recorded, never compared.
TIMED = recorded("benchmark measurements of the machine that ran them")


def random_model(preset: str, device: torch.device, seed: int = 0) -> GPT:
    """A model of `preset` with random weights, its wide weights stored by column (`bench.layout`), in eval mode;
    the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(get_config(preset))
    return store_wide_weights_by_column(model).to(device).eval()


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False)


def run_benchmarks(mode: str = "quick", device: torch.device | None = None, progress: bool = True) -> QAResult:
    """Run every benchmark at the sizes of `mode` ("test", "quick" or "full"); return the unwritten result."""
    sizes, device = SIZES[mode], device or default_device()
    started = section = time.perf_counter()
    sections = {}

    def lap(name: str) -> None:
        nonlocal section
        sections[name] = time.perf_counter() - section
        section = time.perf_counter()

    res = QAResult("bench", {"mode": mode, "device": str(device), **asdict(sizes)}, machine_dependent=True)
    res.value("machine", {"cpu_count": os.cpu_count(), "op_overhead_us": op_overhead(device),
                          "matmul_flops_per_s": matmul_flops_per_s(device)}, TIMED)
    measured = measure_machine(device, sizes.bandwidth_mbytes, sizes.overhead_preset, sizes.overhead_min_s)
    measured["rows"] = measure_rows(device, sizes.rows_shape, min_mbytes=sizes.bandwidth_mbytes // 4)
    res.value("roofline_machine", measured, TIMED)
    lap("machine")
    _append_benchmarks(res, sizes, device, progress)
    lap("append")
    models = {}
    generation = {}
    for preset, prompt, new, rounds in sizes.generation:
        models[preset] = models.get(preset) or random_model(preset, device)
        with _bar(rounds * new, f"generation {preset}", progress) as bar:
            generation[preset] = bench_generation(models[preset], prompt, new, rounds, progress=bar)
        generation[preset]["preset"] = preset
    res.value("generation", generation, TIMED)
    lap("generation")
    _roofline_benchmarks(res, sizes, device, measured, models, progress)
    lap("roofline")
    model = models.get(sizes.floor_preset) or random_model(sizes.floor_preset, device)
    _floor_benchmarks(res, sizes, device, model, progress)
    del models, model
    lap("floor")
    _compiled_benchmarks(res, sizes, device, progress)
    lap("compiled")
    res.value("memory", _memory(sizes), TIMED)
    lap("memory")
    _flop_checks(res)
    lap("flop_checks")
    _correctness_checks(res)
    res.value("targets", targets(res.doc["values"]), TIMED)
    res.value("section_s", sections, TIMED)
    res.value("elapsed_s", time.perf_counter() - started, TIMED)
    return res


def _roofline_benchmarks(res: QAResult, sizes: Sizes, device: torch.device, measured: dict, models: dict,
                         progress: bool) -> None:
    """The roofline's predictions against the clock at every preset, decode against the batch size."""
    points = {"prefill": sizes.roofline_prefill, "decode": sizes.roofline_decode,
              "uncached": sizes.roofline_uncached, "decode_steps": sizes.roofline_repeats}
    n_points = sum(len(points_for(get_config(p), **points)) for p in sizes.roofline_presets)
    with _bar(n_points, "roofline", progress) as bar:
        result = bench_roofline(sizes.roofline_presets, points, measured, device, models,
                                repeats=sizes.roofline_repeats, min_s=sizes.roofline_min_s,
                                overhead_steps=sizes.roofline_overhead_steps, stream_mbytes=sizes.stream_mbytes,
                                min_rounds=sizes.decode_min_rounds, progress=bar)
    res.value("roofline", result, TIMED)
    wall = machine_of(measured)
    overhead = measured["overhead"]
    extra = {"crossover": {p: overhead_crossover(get_config(p), wall, _decode_ops(result[p]))
                           for p in sizes.roofline_presets}}
    for preset, run in res.doc["values"]["generation"].items():
        if preset in result:
            extra.setdefault("generation", {})[preset] = roofline_speedup(get_config(preset), run, result[preset],
                                                                          wall)
    res.value("roofline_summary", {**summary(result), "overhead_measured_on": overhead["preset"], **extra}, TIMED)
    batch = {}
    n_runs = sum(len(b) * len(c) for _, b, c in sizes.batch_runs)
    with _bar(n_runs, "batch", progress) as bar:
        for preset, batches, contexts in sizes.batch_runs:
            model = models.get(preset) or random_model(preset, device)
            batch[preset] = bench_batch(model, batches, contexts, measured, sizes.batch_steps, sizes.batch_min_s,
                                        sizes.roofline_overhead_steps, sizes.stream_mbytes,
                                        sizes.decode_min_rounds, progress=bar)
            cfg = model.cfg
            batch[preset]["curve"] = critical_batch_curve(cfg, wall, list(range(0, cfg.context_length + 1,
                                                                              max(1, cfg.context_length // 64))),
                                                          kv_heads=tuple(h for h in (cfg.n_heads // 4, 1)
                                                                         if 0 < h < cfg.n_heads))
            del model
    res.value("batch", batch, TIMED)


def _decode_ops(run: dict) -> int:
    """Operations a batch-1 decode step dispatched in a roofline run (after the first step)."""
    ops = [p["ops"] for p in run["points"] if p["kind"] == "decode"]
    return min(ops) if ops else 0


def roofline_speedup(cfg, run: dict, roofline_run: dict, machine) -> dict:
    """The roofline's prediction of a generation benchmark's totals, with and without a cache, and the speedup.

    Each call is predicted with the operation counts the roofline run measured for its kind.
    """
    ops = {kind: [p["ops"] for p in roofline_run["points"] if p["kind"] == kind] for kind in ("prefill", "decode",
                                                                                             "uncached")}
    ops = {k: (min(v) if v else 0) for k, v in ops.items()}
    p0, n = run["prompt_len"], run["new_tokens"]
    nocache = [predict(uncached_cost(cfg, p0 + i), machine, ops["uncached"]).seconds for i in range(n)]
    cached = [predict(prefill_cost(cfg, p0), machine, ops["prefill"]).seconds] + [
        predict(decode_cost(cfg, p0 + i - 1), machine, ops["decode"]).seconds for i in range(1, n)]
    measured = run["speedup"]["window"]
    pred = sum(nocache) / sum(cached)
    return {"predicted_nocache_s": sum(nocache), "predicted_cached_s": sum(cached), "predicted_speedup": pred,
            "measured_speedup": measured, "ratio": measured / pred,
            "measured_nocache_s": run["total_s"]["nocache"], "measured_cached_s": run["total_s"]["window"]}


def _floor_benchmarks(res: QAResult, sizes: Sizes, device: torch.device, model, progress: bool) -> None:
    """Decode against the bandwidth floor: whole steps, operation by operation, and window against concat."""
    streamer = Streamer(sizes.bandwidth_mbytes, device)
    bw = streamer.measure()
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and "pos_emb" not in n})
    fused = {(model.cfg.n_heads * model.cfg.head_dim + 2 * model.cfg.n_kv_heads * model.cfg.head_dim,
              model.cfg.d_model)}
    products = product_variants(sorted(set(shapes) | fused), device, min_mbytes=sizes.bandwidth_mbytes // 2)
    layouts = {tuple(r["shape"]): r["best_addmv_layout"] for r in products}
    lean = LeanDecode(model, lean=True, layouts=layouts)
    with _bar(sizes.floor_rounds * len(sizes.floor_positions), "bandwidth floor", progress) as bar:
        floor = bench_floor(model, list(sizes.floor_positions), sizes.floor_steps, sizes.floor_rounds, streamer,
                            variants={"row-major weights": row_major_copy(model), "products only": ProductsOnly(model),
                                      "lean": lean}, progress=bar)
    floor["preset"], floor["device"] = sizes.floor_preset, device.type
    floor["products_only_max_logit_diff"] = products_only_diff(model, sizes.floor_positions[-1])
    floor["lean_max_logit_diff"] = lean_diff(model, sizes.floor_positions[-1], layouts)
    floor["overhead"] = overhead_step(model, sizes.floor_positions[len(sizes.floor_positions) // 2])
    res.value("floor", floor, TIMED)
    res.value("linear_layouts", linear_layouts(shapes, device, min_mbytes=sizes.bandwidth_mbytes // 2), TIMED)
    bandwidth = {"wall": bw["best"], "cpu": bw["best_cpu"]}
    cfg = model.cfg
    res.value("floor_ops", {
        "preset": sizes.floor_preset, "bandwidth": bandwidth, "layouts": {f"{o}x{i}": lay for (o, i), lay in
                                                                          layouts.items()},
        "model": op_breakdown(LeanDecode(model, lean=False), sizes.floor_ops_position, sizes.floor_ops_steps,
                              bandwidth),
        "lean": op_breakdown(lean, sizes.floor_ops_position, sizes.floor_ops_steps, bandwidth),
        "products": products,
        "kv_reads": kv_read_variants(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, sizes.kv_read_lengths,
                                     device, capacity=cfg.context_length),
        "validation": validation_cost(model),
    }, TIMED)
    del streamer, lean
    positions = [p for p in sizes.window_concat_positions if p + sizes.window_concat_steps + 3 < cfg.context_length]
    with _bar(sizes.window_concat_rounds * len(positions), "window vs concat", progress) as bar:
        res.value("window_vs_concat", bench_window_vs_concat(model, positions, sizes.window_concat_steps,
                                                             sizes.window_concat_rounds, bandwidth=bw["best"],
                                                             progress=bar), TIMED)
    if sizes.profile_steps:
        res.value("profile", profile_decode(model, sizes.profile_position, sizes.profile_steps), TIMED)


def compiled_model(preset: str, device: torch.device) -> GPT:
    """The model a compiled-step benchmark runs: the real model (float32) for "smollm2-135m", else `random_model`."""
    if preset == "smollm2-135m":
        from labcode.weights.smollm2 import load_smollm2

        return load_smollm2(torch.float32, device)[0].eval()
    return random_model(preset, device)


def _compiled_benchmarks(res: QAResult, sizes: Sizes, device: torch.device, progress: bool) -> None:
    """The model's eager decode step, the fused step eager and compiled, and the floor, for every preset; compiled
    with an empty compile cache (`fresh_compile_cache`)."""
    streamer = Streamer(sizes.bandwidth_mbytes, device)
    runs = {}
    n_rounds = sizes.compiled_rounds * len(sizes.compiled_positions) * len(sizes.compiled_presets)
    with fresh_compile_cache():
        with _bar(n_rounds, "compiled", progress) as bar:
            for preset in sizes.compiled_presets:
                model = compiled_model(preset, device)
                cap = min(model.cfg.context_length, sizes.compiled_capacity)
                positions = tuple(int(f * cap) for f in sizes.compiled_positions)
                runs[preset] = bench_compiled(model, preset, positions, sizes.compiled_steps, sizes.compiled_rounds,
                                              streamer, capacity=cap, compile=sizes.compile,
                                              concat=preset == sizes.floor_preset, progress=bar)
                del model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            exact = float64_check(GPT(get_config("tiny")).double().eval(), compile=sizes.compile)
    res.value("compiled", {"runs": runs, "float64": exact, "compiled": sizes.compile,
                           "compile_cache": "empty at the start of the run"}, TIMED)
    for kind, run in exact.items():
        res.check(f"fused_step_float64_{kind}", f"the fused decode step ({'compiled' if sizes.compile else 'eager'}"
                  f", {kind} cache) equals the model's full pass at tiny in float64", run["max_logit_diff"], 1e-12,
                  "<=")
    for preset, run in runs.items():
        res.check(f"fused_step_logits_{preset}", f"every fused decode step computes the model's logits at {preset} "
                  "(float32)", max(run["max_logit_diff"].values()), 1e-3, "<=")


def _memory(sizes: Sizes) -> dict:
    """How many sequences fit at GPT-2 124M shapes, and the formulas checked against allocated caches (tiny)."""
    budget = int(sizes.memory_budget_gib * 2**30)
    table = concurrency(get_config("gpt2-124m"), budget, sizes.memory_lengths, sizes.memory_block_size)
    check_cfg = get_config("tiny")
    rows = allocation_check(check_cfg, 3 * 2**16, 21, 8)
    return {"concurrency": table, "sweep": concurrency_sweep(get_config("gpt2-124m"), budget, sizes.memory_block_size),
            "allocation": {"preset": "tiny", "budget_bytes": 3 * 2**16, "length": 21, "block_size": 8, "rows": rows,
                           "agrees": allocation_agrees(rows)}}


def _append_benchmarks(res: QAResult, sizes: Sizes, device: torch.device, progress: bool) -> None:
    append = {}
    for name, prefill in zip(("candle", "long"), sizes.append_prefills, strict=True):
        setup = AppendSetup(name, prefill, sizes.append_decode, n_layers=sizes.append_layers)
        with _bar((sizes.append_rounds + 1) * setup.decode, f"append {name}", progress) as bar:
            append[name] = bench_append(setup, list(APPEND_KINDS), sizes.append_rounds, device, progress=bar)
    res.value("append", append, TIMED)
    setup = AppendSetup("candle", sizes.append_prefills[0], sizes.attention_decode, n_layers=sizes.append_layers)
    with _bar((sizes.attention_rounds + 1) * setup.decode, "append + attention", progress) as bar:
        res.value("append_attention", bench_append_attention(setup, ["cat", "slice"], sizes.attention_rounds,
                                                             device, progress=bar), TIMED)


def _flop_checks(res: QAResult) -> None:
    """The FLOP formulas against FlopCounterMode on a small random model: a full forward and a decode step."""
    from labcode.caches import ConcatCache

    model = random_model("tiny", torch.device("cpu"))
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full, _ = measure_flops(lambda: model(ids))
        cache = ConcatCache(cfg.n_layers)
        model(ids[:, :11], cache)
        step, _ = measure_flops(lambda: model(ids[:, 11:], cache))
    res.check("flops_full_forward", "FLOP formula equals FlopCounterMode: full forward, B=2, T=12",
              full, forward_flops(cfg, 12, 0, 2), "==")
    res.check("flops_decode_step", "FLOP formula equals FlopCounterMode: decode step after 11 cached",
              step, forward_flops(cfg, 1, 11, 2), "==")


def _correctness_checks(res: QAResult) -> None:
    v = res.doc["values"]
    for name, run in v["append"].items():
        res.check(f"append_{name}_contents", f"every cache holds the same keys after the {name} benchmark",
                  run["max_content_diff"], 0.0, "==")
    res.check("attention_methods_agree", "repeat-KV, GQA and SDPA attention agree (float32)",
              v["append_attention"]["max_output_diff"], 1e-5, "<=")
    for preset, run in v["generation"].items():
        worst = max(run["max_logit_diff"].values())
        res.check(f"generation_{preset}_logits", f"every cache's logits match no-cache generation at {preset} "
                  "(float32)", worst, 1e-3, "<=")
    res.check("products_only_logits", "the products-only decode step computes the model's logits (float32)",
              v["floor"]["products_only_max_logit_diff"], 1e-3, "<=")
    res.check("lean_logits", "the benchmark's lean decode step computes the model's logits (float32)",
              v["floor"]["lean_max_logit_diff"], 1e-3, "<=")
    res.check("memory_allocation", "sequences admitted, bytes held and empty slots of real caches (plain, paged, "
              "int8) equal the capacity formulas", v["memory"]["allocation"]["agrees"], True, "==")
