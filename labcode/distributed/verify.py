"""Comparing what a chapter-10 job computed with the single-process model.

Introduced in chapter 10. Each function takes the results `launch` returned for a job and reruns the
same request in this process with the whole model, through the same loop (`run_request`, or
`generate` for the disaggregated continuation): the logits must agree to rounding and the tokens
exactly. It also reports what each process held (heads, layers, cache bytes) and what crossed the
wire (bytes shipped against 2 L T Hkv D bytes per element).
"""

from __future__ import annotations

import torch

from labcode.caches.concat import ConcatCache
from labcode.distributed.jobs import new_cache, run_request
from labcode.distributed.transfer import payload_bytes
from labcode.generate import generate
from labcode.model import GPT
from labcode.roofline import element_bytes


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def verify_tp(model: GPT, ids: torch.Tensor, schedules: list[list[int]], steps: int, results: list[dict]) -> dict:
    """Every rank's logits and tokens against the single process, per request; cache bytes per rank."""
    diffs, full_diffs, tokens_equal, agree = [], [], True, True
    one_process = []
    for i, schedule in enumerate(schedules):
        ref = run_request(model, ids, schedule, steps, ConcatCache(model.cfg.n_layers))
        with torch.inference_mode():
            full = model(ref["ids"])  # (B, P + steps, V): the full forward of the same tokens
        one_process.append(ref["cache_bytes"])
        for r in results:
            got = r["requests"][i]
            diffs.append(_diff(got["logits"], ref["logits"]))
            full_diffs.append(_diff(got["logits"], full))
            tokens_equal &= bool(torch.equal(got["ids"], ref["ids"]))
            agree &= bool(torch.equal(got["logits"], results[0]["requests"][i]["logits"]))
    return {
        "world": len(results), "max_abs_logit_diff": max(diffs), "max_abs_diff_vs_full_forward": max(full_diffs),
        "tokens_equal": tokens_equal, "ranks_agree_exactly": agree,
        "q_heads": [r["q_heads"] for r in results], "kv_heads": [r["kv_heads"] for r in results],
        "replicas": results[0]["replicas"],
        "cache_bytes_per_rank": [r["requests"][-1]["cache_bytes"] for r in results],
        "cache_bytes_one_process": one_process[-1],
    }


def verify_pp(model: GPT, ids: torch.Tensor, schedules: list[list[int]], steps: int, results: list[dict]) -> dict:
    """The last stage's logits and the first stage's tokens against the single process; bytes per stage."""
    diffs, full_diffs, tokens_equal, one_process = [], [], True, []
    for i, schedule in enumerate(schedules):
        ref = run_request(model, ids, schedule, steps, ConcatCache(model.cfg.n_layers))
        with torch.inference_mode():
            full = model(ref["ids"])
        one_process.append(ref["cache_bytes"])
        logits, fed = results[-1]["requests"][i]["logits"], results[0]["requests"][i]["ids"]
        diffs.append(_diff(logits, ref["logits"]))
        full_diffs.append(_diff(logits, full))
        tokens_equal &= bool(torch.equal(fed, ref["ids"]))
    return {
        "world": len(results), "max_abs_logit_diff": max(diffs), "max_abs_diff_vs_full_forward": max(full_diffs),
        "tokens_equal": tokens_equal, "layers": [r["layers"] for r in results],
        "cache_bytes_per_rank": [r["requests"][-1]["cache_bytes"] for r in results],
        "cache_bytes_one_process": one_process[-1],
    }


def verify_disagg(model: GPT, prompt: torch.Tensor, steps: int, kind: str, results: list[dict], window: int = 8,
                  block_size: int = 4) -> dict:
    """The prefill's logits and the decode process's continuation against one process generating with a
    cache of the same kind; the bytes shipped against 2 L T Hkv D bytes per element."""
    prefill, decode = results
    ref = generate(model, prompt, steps + 1, new_cache(kind, model, window=window, block_size=block_size))
    out = {"kind": kind}
    if "refused" in decode:
        return {**out, "refused": decode["refused"], "unchanged": decode["unchanged"]}
    h = decode["header"]
    cfg, e = model.cfg, element_bytes(model.dtype)
    slots = h["length"] if h["blocks"] is None else h["blocks"] * h["block_size"]
    return {
        **out,
        "prefill_logit_diff": _diff(prefill["prefill_logits"], ref.step_logits[0]),
        "max_abs_logit_diff": _diff(decode["step_logits"], torch.stack(ref.step_logits[1:], dim=1)),
        "tokens_equal": bool(torch.equal(torch.cat((prompt, decode["ids"]), dim=1), ref.ids)),
        "blob_bytes": prefill["blob_bytes"], "payload_bytes": h["payload_bytes"],
        "header_bytes": prefill["blob_bytes"] - h["payload_bytes"],
        "rows_shipped": h["length"], "slots_shipped": slots, "position": h["position"],
        "formula_bytes": payload_bytes(cfg.n_layers, prompt.shape[0], h["length"], cfg.n_kv_heads, cfg.head_dim, e),
        "prefill_cache_bytes": prefill["cache_bytes"], "decode_cache_bytes": decode["cache_bytes"],
    }
