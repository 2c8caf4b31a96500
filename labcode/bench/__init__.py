"""The benchmark suite of chapter 7: `python -m labcode.bench [--quick|--full]`.

Introduced in chapter 7. Four measurements, each in one process, interleaved, after
a warm-up, summarised by medians and ratios:
  1. appending one position to every layer, for every cache (`append`);
  2. append plus single-token attention, three ways (`append_attention`);
  3. greedy generation with no cache and with every cache (`generation`);
  4. cached decode steps against the memory-bandwidth floor (`floor`).
Timings are recorded, never compared: the result file is `machine_dependent`, its
checks are about correctness only, and the targets are values with a `met` flag.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch

from labcode.bench.append import KINDS as APPEND_KINDS
from labcode.bench.append import AppendSetup, bench_append, bench_append_attention
from labcode.bench.decode import (
    ProductsOnly,
    bench_floor,
    bench_generation,
    overhead_step,
    products_only_diff,
    profile_decode,
)
from labcode.bench.layout import row_major_copy, store_wide_weights_by_column
from labcode.bench.timing import Streamer, linear_layouts, matmul_flops_per_s, op_overhead
from labcode.checkpoint import default_device
from labcode.config import get_config
from labcode.flops import forward_flops, measure_flops
from labcode.model import GPT
from labcode.results import QAResult, recorded


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
    generation: tuple[tuple[str, int, int, int], ...] = (("tiny", 16, 48, 5), ("gpt2-124m", 64, 256, 1))
    floor_preset: str = "gpt2-124m"  # the model whose decode steps are held against the bandwidth floor
    floor_positions: tuple[int, ...] = tuple(range(0, 1009, 48))
    floor_steps: int = 11
    floor_rounds: int = 2
    bandwidth_mbytes: int = 256
    profile_position: int = 512
    profile_steps: int = 3  # 0: no torch.profiler table (its first use costs seconds)


SIZES = {
    "full": Sizes(),
    "quick": Sizes(append_decode=24, append_rounds=2, attention_decode=24, attention_rounds=2,
                   generation=(("tiny", 16, 32, 3), ("gpt2-124m", 16, 12, 1)),
                   floor_positions=(0, 256, 512, 768, 1008), floor_steps=5, floor_rounds=1,
                   bandwidth_mbytes=128, profile_steps=0),
    "test": Sizes(append_layers=3, append_prefills=(16, 256), append_decode=4, append_rounds=1,
                  attention_decode=4, attention_rounds=1, generation=(("micro", 4, 5, 1), ("tiny", 4, 5, 1)),
                  floor_preset="tiny", floor_positions=(0, 40), floor_steps=2, floor_rounds=1,
                  bandwidth_mbytes=8, profile_steps=0),
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
    model = models.get(sizes.floor_preset) or random_model(sizes.floor_preset, device)
    streamer = Streamer(sizes.bandwidth_mbytes, device)
    with _bar(sizes.floor_rounds * len(sizes.floor_positions), "bandwidth floor", progress) as bar:
        floor = bench_floor(model, list(sizes.floor_positions), sizes.floor_steps, sizes.floor_rounds, streamer,
                            variants={"row-major weights": row_major_copy(model), "products only": ProductsOnly(model)},
                            progress=bar)
    floor["preset"], floor["device"] = sizes.floor_preset, device.type
    floor["products_only_max_logit_diff"] = products_only_diff(model, sizes.floor_positions[-1])
    floor["overhead"] = overhead_step(model, sizes.floor_positions[len(sizes.floor_positions) // 2])
    res.value("floor", floor, TIMED)
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and "pos_emb" not in n})
    res.value("linear_layouts", linear_layouts(shapes, device, min_mbytes=sizes.bandwidth_mbytes // 2), TIMED)
    if sizes.profile_steps:
        res.value("profile", profile_decode(model, sizes.profile_position, sizes.profile_steps), TIMED)
    del streamer, models, model
    lap("floor")
    _flop_checks(res)
    lap("flop_checks")
    _correctness_checks(res)
    res.value("targets", targets(res.doc["values"]), TIMED)
    res.value("section_s", sections, TIMED)
    res.value("elapsed_s", time.perf_counter() - started, TIMED)
    return res


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


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def speedup_at_floor(run: dict, floor: dict) -> float:
    """No-cache time over the time a cached generation would take if every decode step ran exactly at the floor.

    The cached prompt pass keeps its measured time; decode step i reads all weights and
    the keys of P + i positions at the measured bandwidth. An upper bound on what any
    cache can show on this machine in this precision.
    """
    bw, per_key = floor["bandwidth_bytes_per_s"]["best"], floor["kv_bytes_per_key"]
    steps = [(floor["weight_bytes"] + per_key * p) / bw for p in run["positions"][1:]]  # p keys, the new one included
    return _ratio(run["total_s"]["nocache"], run["per_step_s"]["window"][0] + sum(steps))


def targets(values: dict) -> list[dict]:
    """The performance targets, each with its measured value and whether it was met. Reported, never enforced."""
    ap, med = values["append"], {k: v["median_step_s"] for k, v in values["append"].items()}
    long_len = ap["long"]["setup"]["prefill"]
    short_len = ap["candle"]["setup"]["prefill"]
    out = [
        {"name": "slice_write_flat", "claim": f"slice-write append at cache length {long_len} costs at most 1.3x "
         f"its cost at {short_len}", "target": 1.3, "comparison": "<=",
         "measured": _ratio(med["long"]["slice"], med["candle"]["slice"])},
        {"name": "cat_grows", "claim": f"cat append at cache length {long_len} costs more than 1.3x its cost at "
         f"{short_len}", "target": 1.3, "comparison": ">",
         "measured": _ratio(med["long"]["cat"], med["candle"]["cat"])},
        {"name": "slice_vs_cat_long", "claim": f"slice write is at least 20x cheaper than cat at cache length "
         f"{long_len}", "target": 20.0, "comparison": ">=",
         "measured": _ratio(med["long"]["cat"], med["long"]["slice"])},
    ]
    floor = values["floor"]
    out.append({"name": "decode_near_floor", "claim": f"cached decode at {floor['preset']} within 1.3x of the "
                "memory-bandwidth floor at every measured position (wall clock)", "target": 1.3, "comparison": "<=",
                "measured": max(floor["ratio"]),
                # context: the same step with nothing but its tensor operations (ProductsOnly)
                "products_only": max(floor["variants"]["products only"]["ratio"])})
    if floor.get("device", "cpu") == "cpu":
        out.append({"name": "decode_near_floor_cpu", "claim": f"cached decode at {floor['preset']} within 1.3x of "
                    "the memory-bandwidth floor at every measured position (process CPU time)", "target": 1.3,
                    "comparison": "<=", "measured": max(floor["ratio_cpu"])})
    for preset, run in values["generation"].items():
        t = {"name": f"speedup_{preset}", "claim": f"cached generation at {preset} ({run['prompt_len']}-token "
             f"prompt, {run['new_tokens']} new) at least half as much faster as the FLOP count predicts",
             "target": 0.5, "comparison": ">=", "measured": _ratio(run["speedup"]["window"], run["predicted_speedup"])}
        if floor["preset"] == preset:  # context: the largest speedup a cache could show if decode ran at the floor
            t["speedup_at_floor"] = speedup_at_floor(run, floor)
            t["at_floor"] = _ratio(t["speedup_at_floor"], run["predicted_speedup"])
        out.append(t)
    for t in out:
        m, g = t["measured"], t["target"]
        t["met"] = bool({"<=": m <= g, ">=": m >= g, ">": m > g}[t["comparison"]])
    return out
