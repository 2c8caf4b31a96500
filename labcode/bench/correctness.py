"""The benchmark's correctness checks: the FLOP formulas against FlopCounterMode, and every timed variant against
the model (caches' contents, attention methods, logits, allocated memory).

Introduced in chapter 7. These are the record's only checks; its timings are recorded, never compared.
"""

from __future__ import annotations

import torch

from labcode.bench.common import random_model
from labcode.caches import ConcatCache
from labcode.flops import forward_flops, measure_flops
from labcode.results import QAResult


def record(res: QAResult) -> None:
    """Every check of the record, after its measurements: the FLOP formulas against FlopCounterMode on a small random
    model (a full forward and a decode step), then what the measurements computed against the model."""
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
    v = res.doc["values"]
    for name, run in v["append"].items():
        res.check(f"append_{name}_contents", f"every cache holds the same keys after the {name} benchmark",
                  run["max_content_diff"], 0.0, "==")
    res.check("attention_methods_agree", "repeat-KV, GQA and SDPA attention agree (float32)",
              v["append_attention"]["max_output_diff"], 1e-5, "<=")
    for preset, run in v["generation"].items():
        res.check(f"generation_{preset}_logits", f"every cache's logits match no-cache generation at {preset} "
                  "(float32)", max(run["max_logit_diff"].values()), 1e-3, "<=")
    res.check("memory_allocation", "sequences admitted, bytes held and empty slots of real caches (plain, paged, "
              "int8) equal the capacity formulas", v["memory"]["allocation"]["agrees"], True, "==")
