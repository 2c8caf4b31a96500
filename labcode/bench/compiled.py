"""Whole decode steps against the floor of the bytes they read, side by side, eager and compiled.

Introduced in chapter 7. `bench_compiled` times the model's own eager step, the eager variants of `labcode.bench.floor`
at the floor's preset, and the course's fused step (`labcode.fused.FusedDecode`) eager and compiled, in the same rounds;
`record` runs it for every preset and the real model, with an empty compile cache.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

import torch

from labcode.bench.common import TIMED, Sizes, bar, random_model
from labcode.bench.floor import LeanDecode, step_bytes
from labcode.bench.layout import by_column, row_major_copy, store_wide_weights_by_column
from labcode.bench.roofline import fill_cache
from labcode.bench.timing import Streamer, median, profiled, rotated, timed_cpu
from labcode.caches import WindowCache
from labcode.config import get_config
from labcode.fused import FusedDecode
from labcode.generate import decode_step
from labcode.model import GPT
from labcode.results import QAResult


@contextmanager
def fresh_compile_cache():
    """Inductor's on-disk cache in a new, empty directory while the block runs: every compile time recorded is
    that of a first run, not of a machine that compiled the same code before."""
    keep = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="kvcv-inductor-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        try:
            yield
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            if keep is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = keep


class _ModelStep:
    """A decode step through the course's `WindowCache`, restartable at a position: the model's own, or that of `step`
    (anything `decode_step` runs like the model: a copy in other layouts, a `LeanDecode`); the prompt is the model's."""

    def __init__(self, model: GPT, capacity: int, step=None) -> None:
        self.model, self.cache = model, WindowCache(model.cfg.kv_layers, capacity)
        self.stepper = model if step is None else step

    @torch.inference_mode()  # as every call that writes the cache: its buffers are made in inference mode
    def reset(self, position: int) -> None:
        if position > self.cache.position:
            fill_cache(self.cache, self.model, 1, position - self.cache.position)
        self.cache.rollback(self.cache.position - position)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, self.cache)[:, -1]

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        return decode_step(self.stepper, ids[:, 0], self.cache)


def _start(runner, position: int) -> None:
    """Put `runner` at `position` after one untimed step there: timed steps start from the same state."""
    runner.reset(position)
    runner.step(torch.zeros(1, 1, dtype=torch.long, device=runner.model.device))
    runner.reset(position)


def fused_step(model: GPT, capacity: int, concat: bool = False) -> FusedDecode:
    """The course's fused step as the benchmark times it: its stacked weights stored by the benchmark's layout rule."""
    return FusedDecode(model, capacity, concat=concat, by_column=by_column)


def profile_step(runner, position: int, steps: int = 3) -> dict:
    """Seconds per step of each kind of operation in `runner`'s step at `position`, from torch.profiler's table:
    products with weights (the library's, or inductor's on packed weights), attention (SDPA, bmm, softmax, or the
    kernel inductor writes for it), and everything else with the Python between as `other`."""
    _start(runner, position)
    ids = torch.zeros(1, 1, dtype=torch.long, device=runner.model.device)
    averages, wall = profiled(lambda: runner.step(ids), steps, runner.model.device)
    kinds = {"products with weights": 0.0, "attention": 0.0}
    for e in averages:
        name = e.key
        if name in ("aten::addmm", "aten::mm", "aten::addmv", "aten::mv", "mkl::_mkl_linear") or (
                "_gemm_" in name and name.endswith("_kernel")):
            kinds["products with weights"] += e.self_cpu_time_total / 1e6 / steps
        elif "scaled_dot_product" in name or "flash_attention" in name or "softmax" in name or name == "aten::bmm":
            kinds["attention"] += e.self_cpu_time_total / 1e6 / steps
    kinds["other"] = max(0.0, wall - sum(kinds.values()))
    return {"position": position, "step_s": wall, "s_per_step": kinds}


def bench_compiled(model: GPT, name: str, positions: tuple[int, ...], steps: int, rounds: int, streamer,
                   capacity: int | None = None, concat: bool = True, compile: bool = True, extra: dict | None = None,
                   progress=None) -> dict:
    """The decode step of `model` several ways against the floor, its bytes over the bandwidth measured after each
    position: the model's eager step, the steps in `extra`, the fused step eager and (with `compile`) compiled with
    its weights as stored and packed, and (with `concat`) the compiled concatenating step, interleaved step by step.
    Returns medians per position on the wall clock and in CPU time (seconds, tokens/s, bytes/s, ratio to the floor),
    the compile seconds, each variant's largest logit difference from the model's full pass, and the model's step and
    the fastest one taken apart by kind of operation at the middle position."""
    cfg = model.cfg
    capacity = min(cfg.context_length, capacity or cfg.context_length)
    positions = [p for p in positions if p + steps + 2 <= capacity - 3]
    runners = {"eager model": _ModelStep(model, capacity),
               **{n: _ModelStep(model, capacity, step) for n, step in (extra or {}).items()},
               "fused eager": fused_step(model, capacity)}
    compile_s = {}  # the library's products on the weights as stored, then inductor's own on the weights packed for it
    compiled = {"compiled unpacked": (False, False), "compiled": (False, True)}  # (concatenating, packed)
    compiled.update({"compiled concat": (True, True)} if concat else {})
    for n, (cat, packed) in compiled.items() if compile else ():
        runners[n] = fused_step(model, capacity, concat=cat)
        compile_s[n] = runners[n].compiled(packed=packed)
    names = list(runners)
    diffs = _logit_diffs(model, runners, positions[-1])
    times = {n: {p: [] for p in positions} for n in names}
    bandwidth = {p: [] for p in positions}
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    for r in range(rounds):
        for i, p in enumerate(positions):
            for n in names:
                _start(runners[n], p)
            for s in range(steps):  # step by step, in an order that rotates every step
                for n in rotated(names, r + i + s):
                    times[n][p].append(timed_cpu(lambda run=runners[n]: run.step(ids), model.device))
            bandwidth[p].append(streamer.measure())
            if progress is not None:
                progress.update(1)
    weights, kv_per_key = step_bytes(model, 1)
    floor_bytes = [sum(step_bytes(model, p + 1 + (steps - 1) // 2)) for p in positions]
    out = {"preset": name, "device": model.device.type, "dtype": str(model.dtype).removeprefix("torch."),
           "config": {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
                      "n_kv_heads": cfg.n_kv_heads, "vocab_size": cfg.vocab_size, "norm": cfg.norm, "mlp": cfg.mlp},
           "capacity": capacity, "positions": positions, "steps": steps, "rounds": rounds,
           "weight_bytes": weights, "kv_bytes_per_key": kv_per_key, "floor_bytes": floor_bytes,
           "compile_s": compile_s, "max_logit_diff": diffs, "variants": {n: {} for n in names}}
    for i, clock in ((0, ""), (1, "_cpu")):  # wall clock, then CPU time
        bw = [median([b["best" + clock] for b in bandwidth[p]]) for p in positions]
        floor_s = [b / w for b, w in zip(floor_bytes, bw, strict=True)]
        out.update({f"bandwidth{clock}_bytes_per_s": bw, f"floor{clock}_s": floor_s})
        for n in names:
            step_s = [median([t[i] for t in times[n][p]]) for p in positions]
            out["variants"][n].update({f"step{clock}_s": step_s,
                                       f"over_floor{clock}": [s / f for s, f in zip(step_s, floor_s, strict=True)]})
    for v in out["variants"].values():
        v.update(tokens_per_s=[1 / s for s in v["step_s"]],
                 bytes_per_s=[b / s for b, s in zip(floor_bytes, v["step_s"], strict=True)])
    out["speedup"] = {n: [e / s for e, s in zip(out["variants"]["eager model"]["step_s"], v["step_s"], strict=True)]
                      for n, v in out["variants"].items()}
    middle = positions[len(positions) // 2]
    out["operations"] = {n: profile_step(runners[n], middle) for n in ("eager model", fastest_variant(names))}
    _, kv = step_bytes(model, middle + 1)
    for part in out["operations"].values():
        part["bytes"] = {"products with weights": weights, "attention": kv}
        part["bytes_per_s"] = {k: part["bytes"][k] / s for k, s in part["s_per_step"].items()
                               if k in part["bytes"] and s > 0}
    return out


def _history(model: GPT, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [1, length] and the model's full-pass logits of every position [length, V]: the reference."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (1, length), generator=gen).to(model.device)
    return ids, model(ids)[0]


def _off(runner, ids: torch.Tensor, ref: torch.Tensor, prompt: int) -> float:
    """The largest |logit difference| from `ref` of `runner`'s steps over ids[:, prompt:] after prefilling the rest."""
    runner.reset(0)
    runner.prefill(ids[:, :prompt])
    got = torch.stack([runner.step(ids[:, t : t + 1])[0] for t in range(prompt, ids.shape[1])])
    return float((got - ref[prompt:]).abs().max())


@torch.inference_mode()
def _logit_diffs(model: GPT, runners: dict, position: int, steps: int = 3) -> dict:
    """The largest |logit difference| of each variant from the model's full pass over `steps` steps from
    `position` on one cached history (float32 here: the exact comparison is `float64_check`)."""
    ids, ref = _history(model, position + steps, position)
    return {n: _off(r, ids, ref, position) for n, r in runners.items()}


@torch.inference_mode()
def float64_check(model: GPT, prompt: int = 5, steps: int = 6, compile: bool = True) -> dict:
    """The fused step (compiled unless `compile=False`) against the model's full pass in float64: the largest
    |logit difference| over `steps` decode steps after a `prompt`-token prefill, and the compile seconds."""
    ids, ref = _history(model, prompt + steps, 0)
    out = {}
    for concat in (False, True):
        f = fused_step(model, prompt + steps + 3, concat=concat)
        seconds = f.compiled() if compile else 0.0
        out["concat" if concat else "window"] = {"max_logit_diff": _off(f, ids, ref, prompt), "compile_s": seconds}
    return out


def fastest_variant(names) -> str:
    """The step the targets hold to the floor: the compiled one, or the fused eager one where nothing compiled."""
    return "compiled" if "compiled" in names else "fused eager"


def compiled_model(preset: str, device: torch.device) -> GPT:
    """The model a compiled-step benchmark runs: the real model (float32) for "smollm2-135m", else `random_model`;
    either way with its large wide weights stored by column (`labcode.bench.layout`)."""
    if preset == "smollm2-135m":
        from labcode.weights.smollm2 import load_smollm2

        return store_wide_weights_by_column(load_smollm2(torch.float32, device)[0].eval())
    return random_model(preset, device)


def record(res: QAResult, sizes: Sizes, device: torch.device, streamer: Streamer, progress: bool,
           layouts: dict | None = None) -> None:
    """The model's eager step and the fused step eager and compiled (from an empty compile cache) against the floor
    of `streamer`'s best read, at every preset; at `sizes.floor_preset` also its tensor operations alone and the lean
    step with `layouts`, and there and at `sizes.row_major_presets` the model with every weight row-major."""
    runs = {}
    presets = list(dict.fromkeys((*sizes.compiled_presets, sizes.floor_preset)))
    total = sizes.compiled_rounds * len(sizes.compiled_positions) * len(presets)
    with fresh_compile_cache(), bar(total, "decode steps", progress) as shown:
        for preset in presets:
            model = compiled_model(preset, device)
            cap = min(model.cfg.context_length, sizes.compiled_capacity)
            room = cap - sizes.compiled_steps - 5  # the last position whose steps fit, with the untimed one
            positions = tuple(max(1, int(f * room)) for f in sizes.compiled_positions)
            extra = {"row-major weights": row_major_copy(model)} if preset in (
                sizes.floor_preset, *sizes.row_major_presets) else {}
            if preset == sizes.floor_preset:
                extra.update({"products only": LeanDecode(model, lean=False),
                              "lean": LeanDecode(model, lean=True, layouts=layouts)})
            runs[preset] = bench_compiled(model, preset, positions, sizes.compiled_steps, sizes.compiled_rounds,
                                          streamer, capacity=cap, compile=sizes.compile,
                                          concat=preset == sizes.floor_preset, extra=extra, progress=shown)
            del model, extra
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            exact = float64_check(GPT(get_config("tiny")).double().eval(), compile=sizes.compile)
    res.value("compiled", {"runs": runs, "float64": exact, "compiled": sizes.compile,
                           "compile_cache": "empty at the start of the run"}, TIMED)
    for kind, run in exact.items():
        res.check(f"fused_step_float64_{kind}", f"the fused decode step ({'compiled' if sizes.compile else 'eager'}, "
                  f"{kind} cache) equals the model's full pass at tiny in float64", run["max_logit_diff"], 1e-12, "<=")
    for preset, run in runs.items():
        res.check(f"decode_step_logits_{preset}", f"every decode step the benchmark times at {preset} ("
                  + ", ".join(run["max_logit_diff"]) + ") computes the model's full-pass logits (float32)",
                  max(run["max_logit_diff"].values()), 1e-3, "<=")
