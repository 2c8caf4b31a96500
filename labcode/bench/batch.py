"""Decode with a batch: time per step and tokens per second against the batch size, next to the roofline.

Introduced in chapter 7. A decode step reads every weight once for the whole batch
but the keys and values of each sequence separately, so its arithmetic intensity grows
with the batch until the K/V reads, which grow with it, dominate. The roofline says
from which batch a step is compute-bound, and how the context moves that point.
"""

from __future__ import annotations

import torch

from labcode.bench.roofline import count_ops, fill_cache, machine_of
from labcode.bench.timing import median, timed_cpu
from labcode.caches import WindowCache
from labcode.generate import decode_step
from labcode.model import GPT
from labcode.roofline import Machine, context_limit, critical_batch, decode_cost, predict, weights_critical_batch


@torch.inference_mode()
def time_decode_batch(model: GPT, batch: int, s_cached: int, steps: int = 5, warmup: int = 2) -> dict:
    """Median seconds of a cached decode step of B sequences holding S positions each (steps S .. S + steps - 1)."""
    cfg, device = model.cfg, model.device
    cache = WindowCache(cfg.n_layers, s_cached + warmup + steps + 1)
    fill_cache(cache, model, batch, s_cached)
    token = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(warmup - 1):
        decode_step(model, token, cache)
    ops = count_ops(lambda: decode_step(model, token, cache))  # the last warm-up step
    s_first = cache.position
    runs = [timed_cpu(lambda: decode_step(model, token, cache), device) for _ in range(steps)]
    return {"batch": batch, "s_mid": s_first + (steps - 1) // 2, "ops": ops,
            "step_s": median([w for w, _ in runs]), "step_cpu_s": median([c for _, c in runs])}


def predicted_curve(model_cfg, s_cached: int, batches: list[int], machine: Machine, ops: int) -> dict:
    """The roofline's step time, tokens/s and bound at each batch size, for decode at S cached."""
    preds = [predict(decode_cost(model_cfg, s_cached, b), machine, ops) for b in batches]
    return {"step_s": [p.seconds for p in preds], "tokens_per_s": [b / p.seconds for b, p in zip(batches, preds,
                                                                                                 strict=True)],
            "t_math": [p.t_math for p in preds], "t_memory": [p.t_memory for p in preds],
            "bound": [p.bound for p in preds]}


def bench_batch(model: GPT, batches: tuple[int, ...], contexts: tuple[int, ...], machine: dict, steps: int = 5,
                progress=None) -> dict:
    """For each context S: measured and predicted decode step time and tokens/s at every batch size.

    Also the two batch sizes the roofline names at that S: `critical_batch` (the whole
    step compute-bound) and `weights_critical_batch` (the products with weights alone).
    """
    cfg = model.cfg
    runs = []
    for s in contexts:
        measured = []
        for b in batches:
            measured.append(time_decode_batch(model, b, s, steps))
            if progress is not None:
                progress.update(1)
        s_mid, ops = measured[0]["s_mid"], measured[0]["ops"]
        run = {"s_cached": s, "s_mid": s_mid, "batch": list(batches), "ops": ops,
               "step_s": [m["step_s"] for m in measured], "step_cpu_s": [m["step_cpu_s"] for m in measured],
               "tokens_per_s": [b / m["step_s"] for b, m in zip(batches, measured, strict=True)],
               # how much longer a step of B sequences takes than a step of one: 1.0 while the weights' reads dominate
               "step_over_first": [m["step_s"] / measured[0]["step_s"] for m in measured],
               "step_over_first_cpu": [m["step_cpu_s"] / measured[0]["step_cpu_s"] for m in measured]}
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            mach = machine_of(machine, clock)
            pred = predicted_curve(cfg, s_mid, list(batches), mach, ops)
            run["predicted" + suffix] = pred
            run["ratio" + suffix] = [m / p for m, p in zip(run["step" + suffix + "_s"], pred["step_s"], strict=True)]
            run["critical_batch" + suffix] = critical_batch(cfg, s_mid, mach)
        runs.append(run)
    return {"preset_config": {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
                              "n_kv_heads": cfg.n_kv_heads, "context_length": cfg.context_length},
            "runs": runs, "weights_critical_batch": weights_critical_batch(cfg, machine_of(machine)),
            "context_limit": context_limit(cfg, machine_of(machine))}


def critical_batch_curve(cfg, machine: Machine, contexts: list[int], kv_heads: tuple[int, ...] = ()) -> dict:
    """`critical_batch` at each cached length S, for the model and for the same model with fewer K/V heads."""
    out = {"contexts": contexts, "n_kv_heads": {}}
    for hkv in (cfg.n_kv_heads, *kv_heads):
        c = cfg.with_(n_kv_heads=hkv)
        out["n_kv_heads"][str(hkv)] = {"critical_batch": [critical_batch(c, s, machine) for s in contexts],
                                       "context_limit": context_limit(c, machine)}
    out["weights_critical_batch"] = weights_critical_batch(cfg, machine)
    return out

