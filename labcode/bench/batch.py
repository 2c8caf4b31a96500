"""Decode with a batch: time per step and tokens per second against the batch size, next to the roofline.

Introduced in chapter 7. A decode step reads every weight once for the whole batch
but the keys and values of each sequence separately, so its arithmetic intensity grows
with the batch until the K/V reads, which grow with it, dominate. The roofline says
from which batch a step is compute-bound, and how the context moves that point.
"""

from __future__ import annotations

import torch

from labcode.bench.common import TIMED, Sizes, bar, random_model
from labcode.bench.roofline import (
    StreamProbe,
    annotate,
    beside_call,
    machine_of,
    middle_keys,
    overhead_probe,
    time_point,
)
from labcode.model import GPT
from labcode.results import QAResult
from labcode.roofline import Machine, context_limit, critical_batch, weights_critical_batch


def bench_batch(model: GPT, batches: tuple[int, ...], contexts: tuple[int, ...], machine: dict, steps: int = 5,
                min_s: float = 0.0, overhead_steps: int = 3, stream_mbytes: int = 64, min_rounds: int = 1,
                progress=None) -> dict:
    """For each context S: measured and predicted decode step time and tokens/s at every batch size.

    Each point is timed as `bench_roofline` times its decode points, from a fresh cache of B sequences holding S
    positions, with the fixed cost (`overhead_probe` stepping B sequences) and the ceilings (`StreamProbe` with B
    rows) measured between the rounds; it is predicted with them (`predicted`) and with one bandwidth (`plain`).
    Also the two batch sizes the roofline names at that S: `critical_batch` (the whole step compute-bound) and
    `weights_critical_batch` (the products with weights alone).
    """
    cfg = model.cfg
    probes = {b: overhead_probe(cfg, model.device, steps=overhead_steps, batch=b) for b in batches}
    streams = StreamProbe(cfg, model.device, stream_mbytes)
    balance = machine_of(machine).balance
    runs = []
    for s in contexts:
        points = []
        for b in batches:
            stream = streams.at(b, middle_keys(s, steps), balance)
            probe_ops, probe = probes[b]
            pt = time_point(model, "decode", 1, s, batch=b, repeats=steps, min_s=min_s, min_rounds=min_rounds,
                            beside=beside_call(probe, stream))
            annotate(cfg, pt, machine, stream, probe_ops)
            points.append(pt)
            del stream
            if progress is not None:
                progress.update(1)
        first = points[0]
        run = {"s_cached": s, "s_mid": first["s_mid"], "batch": list(batches), "ops": first["ops"],
               "ops_by_batch": [p["ops"] for p in points],
               "step_s": [p["step_s"] for p in points], "step_cpu_s": [p["step_cpu_s"] for p in points],
               "tokens_per_s": [b / p["step_s"] for b, p in zip(batches, points, strict=True)],
               # how much longer a step of B sequences takes than a step of one: 1.0 while the weights' reads dominate
               "step_over_first": [p["step_s"] / first["step_s"] for p in points],
               "step_over_first_cpu": [p["step_cpu_s"] / first["step_cpu_s"] for p in points]}
        for name in ("predicted", "predicted_cpu", "plain", "plain_cpu"):
            preds = [p[name] for p in points]
            run[name] = {"step_s": [q["seconds"] for q in preds],
                         "tokens_per_s": [b / q["seconds"] for b, q in zip(batches, preds, strict=True)],
                         **{k: [q[k] for q in preds] for k in ("t_math", "t_memory", "t_parts", "t_overhead", "bound")}}
        for k in ("ratio", "ratio_cpu", "ratio_plain", "ratio_plain_cpu", "ceilings", "ceilings_cpu",
                  "products_flops", "products_flops_cpu", "overhead_s_per_op", "overhead_cpu_s_per_op"):
            run[k] = [p[k] for p in points]
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            run["critical_batch" + suffix] = critical_batch(cfg, first["s_mid"], machine_of(machine, clock))
        runs.append(run)
    del streams
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


def record(res: QAResult, sizes: Sizes, device: torch.device, measured: dict, models: dict, progress: bool) -> None:
    """Decode against the batch size at each of `sizes.batch_runs`, with the critical batch against the context."""
    wall = machine_of(measured)
    batch = {}
    n_runs = sum(len(b) * len(c) for _, b, c in sizes.batch_runs)
    with bar(n_runs, "batch", progress) as shown:
        for preset, batches, contexts in sizes.batch_runs:
            model = models.get(preset) or random_model(preset, device)
            batch[preset] = bench_batch(model, batches, contexts, measured, sizes.batch_steps, sizes.batch_min_s,
                                        sizes.roofline_overhead_steps, sizes.stream_mbytes,
                                        sizes.decode_min_rounds, progress=shown)
            cfg = model.cfg
            batch[preset]["curve"] = critical_batch_curve(cfg, wall, list(range(0, cfg.context_length + 1,
                                                                              max(1, cfg.context_length // 64))),
                                                          kv_heads=tuple(h for h in (cfg.n_heads // 4, 1)
                                                                         if 0 < h < cfg.n_heads))
            del model
    res.value("batch", batch, TIMED)
