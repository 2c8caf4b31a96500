"""The benchmark record's performance targets, as data: each with its measured value, verdict and, where missed, why.

Introduced in chapter 7. A target is a row of `TARGETS`: its name, claim and reason are templates over facts that a
small function reads from the record's values (one set per preset where a target is held per preset), so a committed
record's targets can be recomputed without running anything. Reported, never enforced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from labcode.bench.compiled import fastest_variant
from labcode.bench.floor import CATEGORIES
from labcode.bench.roofline import TOLERANCE, worst_factor
from labcode.bench.timing import median

COMPARE = {"<=": lambda m, t: m <= t, ">=": lambda m, t: m >= t, ">": lambda m, t: m > t}
COMPILED_PRESETS = ("gpt2-124m", "smollm2-135m")  # where the compiled step is held to its targets


@dataclass(frozen=True)
class Target:
    """One performance target: `name`, `claim` and `reason` are `str.format` templates over the facts that
    `facts(values, target)` reads from the record (a list, one per preset held to it; empty where the record has
    nothing to judge); `measured` names the fact compared with `target`, and `shown` the facts recorded beside it."""

    name: str
    claim: str
    comparison: str
    target: float
    measured: str
    reason: str
    facts: Callable[[dict, float], list[dict]]
    shown: tuple[str, ...] = ()

    def judge(self, facts: dict) -> dict:
        """The record's entry for one set of facts: claim, value, verdict and, where not met, the reason."""
        fill = {**facts, "target": self.target}
        m = float(facts[self.measured])
        out = {"name": self.name.format(**fill), "claim": self.claim.format(**fill), "target": self.target,
               "comparison": self.comparison, "measured": m, **{k: facts[k] for k in self.shown if k in facts}}
        out["met"] = bool(COMPARE[self.comparison](m, self.target))
        if not out["met"]:
            out["reason"] = self.reason.format(**fill) or "no measured reason recorded"
        return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _append(values: dict, target: float) -> list[dict]:
    """The append benchmark's medians in µs per step, at the short ("candle") and the long cache."""
    ap = values["append"]
    short, long = ({n: s * 1e6 for n, s in ap[k]["median_step_s"].items()} for k in ("candle", "long"))
    return [{"short_len": ap["candle"]["setup"]["prefill"], "long_len": ap["long"]["setup"]["prefill"],
             "narrow_us": values["machine"]["op_overhead_us"]["one-row narrow().copy_()"],
             "n_tensors": 2 * ap["candle"]["setup"]["n_layers"],
             **{f"{n}_{where}_us": m[n] for where, m in (("short", short), ("long", long))
                for n in ("bare_slice", "slice", "cat")},
             "slice_growth": _ratio(long["slice"], short["slice"]), "cat_growth": _ratio(long["cat"], short["cat"]),
             "cat_over_slice_long": _ratio(long["cat"], long["slice"])}]


def streams(ops: dict, clock: str = "") -> str:
    """The decode step's operations (`floor.op_breakdown`) farthest above their floor time, and the rate of each."""
    rows = ops["operations" + clock]
    bw = ops["floor_bytes"] / ops["floor" + clock + "_s"]
    worst = sorted(((k, r) for k, r in rows.items() if "excess_s" in r and k in CATEGORIES),
                   key=lambda kr: -kr[1]["excess_s"])[:3]
    parts = [f"{k} {r['bytes_per_s'] / 1e9:.3g} GB/s (+{r['excess_s'] * 1e3:.2g} ms)" for k, r in worst]
    other = rows.get("other", {}).get("s_per_step", 0.0) + ops["untimed" + clock + "_s"]
    return (f"against {bw / 1e9:.3g} GB/s streaming: " + ", ".join(parts)
            + f"; operations without weights or K/V and the Python between them {other * 1e3:.2g} ms")


def _floor(values: dict, target: float, step: str = "model", clock: str = "") -> list[dict]:
    """The worst ratio to the floor of the model's own step (or the lean one) at the floor's preset, and the streams
    of the per-operation record `step`: "model" holds the step reduced to the model's tensor operations (the
    "products only" variant), which can be timed operation by operation; the model's own step cannot."""
    preset, ops = values["floor_ops"]["preset"], values["floor_ops"][step]
    run = values["compiled"]["runs"][preset]
    if clock and run["device"] != "cpu":
        return []  # process CPU time says nothing of a GPU's work
    worst = {n: max(v["over_floor" + clock]) for n, v in run["variants"].items()}
    return [{"preset": preset, "worst": worst["eager model" if step == "model" else "lean"],
             "position": ops["position"], "streams": streams(ops, clock), "products_only": worst["products only"],
             "lean": worst["lean"]}]


def _window(values: dict, target: float) -> list[dict]:
    """Concat's decode step over the window's, length by length, and where the two are apart beyond the noise."""
    wc = values["window_vs_concat"]
    rows = list(zip(wc["keys"], wc["cat_over_window"], wc["window_q"], wc["cat_q"], strict=True))
    slower = [f"{k} keys ({r:.3f})" for k, r, q_w, q_c in rows if r < 1 and q_w[0] <= q_c[1]]
    why = (f"where the window is slower, the two steps' interquartile ranges overlap at {', '.join(slower)}: equal "
           "within the noise" if slower else "the window step is slower beyond the spread of the measurements")
    return [{"preset": values["floor_ops"]["preset"], "keys": wc["keys"][-1], "worst": min(wc["cat_over_window"]),
             "pulls_ahead_at": next((k for k, r, q_w, q_c in rows if r > 1 and q_w[1] < q_c[0]), None), "why": why}]


def _why_off(values: dict, point: dict) -> str:
    """Why a roofline point missed its prediction, by what bounds it: the rate of products of that many rows
    (compute), the cost of its operations (overhead), or where the decode step's stream rates are (memory)."""
    bound, machine = point["predicted"]["bound"], values["roofline_machine"]
    if bound == "compute" and point.get("products_flops"):
        return (f"; beside it, products of {point['t_new'] * point['batch']} rows through its weights ran at "
                f"{point['products_flops'] / 1e9:.3g} GFLOP/s, "
                f"{point['products_flops'] / machine['wall']['peak_flops_per_s']:.0%} of the measured peak")
    if bound == "compute" and machine.get("rows"):
        near = min(machine["rows"], key=lambda r: abs(math.log(r["rows"] / max(point["t_new"] * point["batch"], 1))))
        return (f"; products with {near['rows']} rows run at {near['flops_per_s'] / 1e9:.3g} GFLOP/s, "
                f"{near['flops_per_s'] / machine['wall']['peak_flops_per_s']:.0%} of the measured peak")
    if bound == "overhead":
        return "; " + _per_op(point["step_s"], point["predicted"]["t_parts"], point["ops"], point["overhead_s_per_op"])
    if bound == "memory" and values.get("floor_ops"):
        return ("; the decode step's operations stream below one large matrix-vector product (their rates: the "
                "reason of decode_near_floor)")
    return ""


def _per_op(step_s: float, t_parts: float, ops: int, s_per_op: float) -> str:
    """What an overhead-bound call's operations cost each beyond its bytes and FLOPs, against the fixed cost."""
    return (f"its {ops} operations took {(step_s - t_parts) / ops * 1e6:.3g} µs each beyond the predicted time of its "
            f"bytes and FLOPs, against {s_per_op * 1e6:.3g} µs per operation measured beside it")


def _roofline(values: dict, target: float) -> list[dict]:
    """The roofline's worst prediction of the record's calls, per kind and preset, and the worst call."""
    summ, presets = values["roofline_summary"], list(values["roofline"])
    pts = [(preset, p) for preset, run in values["roofline"].items() for p in run["points"]]
    preset, worst = max(pts, key=lambda x: worst_factor([x[1]["ratio"]]))
    no_overhead = [p["ratio_no_overhead"] for _, p in pts if p["predicted"]["bound"] != "overhead"]
    dominated = [f"{p} ({summ[p]['overhead_dominated_points']} of {summ[p]['points']} points)" for p in presets
                 if summ[p]["overhead_dominated_points"]]
    return [{"first": presets[0], "last": presets[-1], "worst": max(summ[p]["worst_factor"] for p in presets),
             "one_bandwidth": worst_factor([p["ratio_plain"] for _, p in pts]),
             "measured_cpu": max(summ[p]["worst_factor_cpu"] for p in presets),
             "without_overhead_where_it_does_not_dominate": worst_factor(no_overhead),
             "overhead_dominates": ", ".join(dominated) or "nowhere",
             "worst_by_kind": {p: {k: v["worst_factor"] for k, v in summ[p]["kinds"].items()} for p in presets},
             "overhead_crossover_d_model": {p: summ["crossover"][p]["crossover_d_model"] for p in presets},
             "point": f"{worst['kind']} of T={worst['t_new']} after S={worst['s_cached']} at {preset}",
             "ratio": worst["ratio"], "bound": worst["predicted"]["bound"], "why": _why_off(values, worst)}]


def _batch(values: dict, target: float) -> list[dict]:
    """Every decode step of the batch sweep against its prediction, and those outside the tolerance."""
    points = [{"preset": preset, "s": run["s_cached"], "b": b, "bound": run["predicted"]["bound"][i],
               "t_parts": run["predicted"]["t_parts"][i], "ops": run["ops_by_batch"][i], "step_s": run["step_s"][i],
               "products_flops": run.get("products_flops", [None] * len(run["batch"]))[i],
               **{k: run[k][i] for k in ("ratio", "ratio_cpu", "ratio_plain", "ceilings", "overhead_s_per_op")}}
              for preset, res in values["batch"].items() for run in res["runs"] for i, b in enumerate(run["batch"])]

    def beside(p: dict) -> str:
        weights = [v for k, v in p["ceilings"].items() if k != "K/V"]
        parts = [f"weights {min(weights) / 1e9:.2g}-{max(weights) / 1e9:.2g} GB/s"] if weights else []
        if p["products_flops"]:
            parts.append(f"compute-bound products {p['products_flops'] / 1e9:.3g} GFLOP/s")
        parts = parts or ["weights at the bandwidth"]
        if "K/V" in p["ceilings"]:
            parts.append(f"K/V {p['ceilings']['K/V'] / 1e9:.2g} GB/s")
        if p["bound"] == "overhead":
            return ", ".join(parts) + "; " + _per_op(p["step_s"], p["t_parts"], p["ops"], p["overhead_s_per_op"])
        return ", ".join(parts) + f", {p['overhead_s_per_op'] * 1e6:.2g} µs per operation"

    outside = [p for p in points if worst_factor([p["ratio"]]) > target]
    return [{"presets": ", ".join(values["batch"]), "worst": worst_factor([p["ratio"] for p in points]),
             "measured_cpu": worst_factor([p["ratio_cpu"] for p in points]), "points": len(points),
             "one_bandwidth": worst_factor([p["ratio_plain"] for p in points]), "outside": len(outside),
             "steps": "; ".join(f"{p['preset']} B = {p['b']} at S = {p['s']}: {p['ratio']:.3g}x ({p['bound']}-bound; "
                                f"beside it {beside(p)})" for p in outside)}]


def speedup_at_floor(run: dict, steps: dict) -> float:
    """No-cache time over the time a cached generation would take if every decode step ran exactly at the floor:
    the prompt pass as measured, then all weights and the keys so far at the bandwidth of `steps` (a run of
    `compiled.bench_compiled`). An upper bound on what any cache can show on this machine in this precision."""
    bw, per_key = median(steps["bandwidth_bytes_per_s"]), steps["kv_bytes_per_key"]
    floors = [(steps["weight_bytes"] + per_key * p) / bw for p in run["positions"][1:]]  # p keys, the new one included
    return _ratio(run["total_s"]["nocache"], run["per_step_s"]["window"][0] + sum(floors))


def _speedup(values: dict, target: float) -> list[dict]:
    """Per generated preset the roofline timed: the cache's measured speedup, the predicted one and the floor's."""
    out = []
    for preset, g in values["roofline_summary"].get("generation", {}).items():
        run, steps = values["generation"][preset], values["compiled"]["runs"].get(preset)
        out.append({"preset": preset, "prompt_len": run["prompt_len"], "new_tokens": run["new_tokens"],
                    "off": worst_factor([g["ratio"]]), "measured_speedup": g["measured_speedup"],
                    "predicted_speedup": g["predicted_speedup"], "flop_count_speedup": run["predicted_speedup"],
                    "nocache_off": g["measured_nocache_s"] / g["predicted_nocache_s"],
                    "cached_off": g["measured_cached_s"] / g["predicted_cached_s"],
                    **({"speedup_at_floor": speedup_at_floor(run, steps)} if steps else {})})
    return out


def _compiled(values: dict, target: float) -> list[dict]:
    """Per preset held to the compiled targets: the fast step against the floor and against the eager step, and
    what each kind of operation took (profiled at the middle position)."""
    runs = (values.get("compiled") or {}).get("runs", {})
    out = []
    for preset in [p for p in COMPILED_PRESETS if p in runs] or list(runs)[-1:]:
        r = runs[preset]
        fast = fastest_variant(r["variants"])
        eager, ops = min(r["variants"]["eager model"]["over_floor"]), r["operations"][fast]
        ms = {n: {k: v * 1e3 for k, v in r["operations"][n]["s_per_step"].items()} for n in ("eager model", fast)}
        rates = [f"{k} {ops['bytes_per_s'][k] / 1e9:.3g} GB/s ({ms[fast][k]:.3g} ms)"
                 for k in ("products with weights", "attention") if k in ops["bytes_per_s"]]
        gains = [f"{g:.3g}x at {p}" for p, g in zip(r["positions"], r["speedup"][fast], strict=True)]
        out.append({"preset": preset, "fast": fast, "over_floor": max(r["variants"][fast]["over_floor"]),
                    "speedup": min(r["speedup"][fast]), "position": ops["position"],
                    "bw_gbs": sum(r["bandwidth_bytes_per_s"]) / len(r["bandwidth_bytes_per_s"]) / 1e9,
                    "streams": ", ".join(rates), "gains": ", ".join(gains), "eager_best": eager,
                    "room": f", so {target:g}x its speed would beat the floor" if eager < target else "",
                    "products_eager_ms": ms["eager model"]["products with weights"],
                    "products_fast_ms": ms[fast]["products with weights"],
                    "other_eager_ms": ms["eager model"]["other"], "other_fast_ms": ms[fast]["other"]})
    return out


def _compiled_window(values: dict, target: float) -> list[dict]:
    """The compiled concatenating step over the compiled window step, where the record compiled both."""
    out = []
    for preset, r in (values.get("compiled") or {}).get("runs", {}).items():
        if "compiled concat" in r["variants"]:
            ratio = [c / w for c, w in zip(r["variants"]["compiled concat"]["step_s"],
                                           r["variants"]["compiled"]["step_s"], strict=True)]
            where = ", ".join(f"{p} cached ({x:.3f})" for p, x in zip(r["positions"], ratio, strict=True))
            out.append({"preset": preset, "worst": min(ratio), "by_position": ratio,
                        "weight_mb": r["weight_bytes"] / 1e6, "where": where})
    return out


APPEND_CALLS = ("a one-row narrow().copy_() costs {narrow_us:.3g} µs per call whatever the length, {n_tensors} calls "
                "per step; the bare per-layer write takes {bare_slice_short_us:.3g} µs from {short_len} and "
                "{bare_slice_long_us:.3g} µs from {long_len}, the course's WindowCache {slice_short_us:.3g} and "
                "{slice_long_us:.3g} µs")
FLOOR_CLAIM = "within {target:g}x of the memory-bandwidth floor at every measured position"
BREAKDOWN = ("operation by operation at position {position}, in the step reduced to the model's tensor operations "
             "(products only: no modules, checks or masks), {streams}")  # the record's floor_ops["model"]

TARGETS = (
    Target("slice_write_flat", "slice-write append, in steps from a cache of {long_len} positions, costs at most "
           "{target:g}x its cost in steps from {short_len}", "<=", 1.3, "slice_growth", APPEND_CALLS, _append),
    Target("cat_grows", "cat append, in steps from a cache of {long_len} positions, costs more than {target:g}x its "
           "cost in steps from {short_len}", ">", 1.3, "cat_growth", "cat: {cat_short_us:.3g} µs per step from "
           "{short_len}, {cat_long_us:.3g} µs from {long_len}; " + APPEND_CALLS, _append),
    Target("slice_vs_cat_long", "slice write is at least {target:g}x cheaper than cat in steps from a cache of "
           "{long_len} positions", ">=", 20.0, "cat_over_slice_long", "cat: {cat_long_us:.3g} µs per step from "
           "{long_len}; " + APPEND_CALLS, _append),
    Target("decode_near_floor", "cached decode at {preset} " + FLOOR_CLAIM + " (wall clock)", "<=", 1.3, "worst",
           BREAKDOWN, _floor,
           ("products_only", "lean")),
    Target("decode_near_floor_lean", "the benchmark's lean decode step at {preset} (fused Q/K/V, each weight in its "
           "fastest layout, addmv into reused outputs, K @ q) " + FLOOR_CLAIM + " (wall clock)", "<=", 1.3, "worst",
           "at position {position}, {streams}", lambda v, t: _floor(v, t, "lean")),
    Target("decode_near_floor_cpu", "cached decode at {preset} " + FLOOR_CLAIM + " (process CPU time)", "<=", 1.3,
           "worst", BREAKDOWN, lambda v, t: _floor(v, t, clock="_cpu")),
    Target("window_not_slower", "decode with the window cache at least as fast as with the concatenating cache at "
           "every length up to {keys} keys ({preset}, wall clock)", ">=", 1.0, "worst", "{why}", _window,
           ("pulls_ahead_at",)),
    Target("roofline_prediction", "every measured prefill, decode and uncached call from {first} down to {last} "
           "within {target:g}x of max(FLOPs / peak, bytes / bandwidth) per kind of operation (compute-bound products "
           "with weights at the rate products of the call's rows reached beside it; a decode step's weights and keys "
           "and values at the streaming rates measured beside it) + operations x the fixed cost measured beside the "
           "call (wall clock)", "<=", TOLERANCE, "worst",
           "worst: {point}, measured {ratio:.3g}x the prediction ({bound}-bound){why}", _roofline,
           ("one_bandwidth", "measured_cpu", "without_overhead_where_it_does_not_dominate", "overhead_dominates",
            "worst_by_kind", "overhead_crossover_d_model")),
    Target("batch_prediction", "every decode step of the batch sweep ({presets}) within {target:g}x of the roofline "
           "with each weight shape and the keys and values at the streaming rate measured beside it (compute-bound "
           "products at the rate they reached beside it), + operations x the fixed cost (wall clock)", "<=",
           TOLERANCE, "worst", "{steps}", _batch, ("measured_cpu", "one_bandwidth", "points", "outside")),
    Target("speedup_{preset}", "cached generation at {preset} ({prompt_len}-token prompt, {new_tokens} new) as much "
           "faster than no cache as the roofline predicts, within {target:g}x", "<=", TOLERANCE, "off",
           "measured {measured_speedup:.3g}x against {predicted_speedup:.3g}x predicted: no cache took "
           "{nocache_off:.3g}x its prediction, the cache {cached_off:.3g}x", _speedup,
           ("measured_speedup", "predicted_speedup", "flop_count_speedup", "speedup_at_floor")),
    Target("compiled_near_floor_{preset}", "the {fast} decode step at {preset} " + FLOOR_CLAIM + " (wall clock)",
           "<=", 1.3, "over_floor", "at position {position}, against {bw_gbs:.3g} GB/s streaming, the {fast} step's "
           "operations stream at: {streams}; everything else {other_fast_ms:.3g} ms", _compiled),
    Target("compiled_speedup_{preset}", "the {fast} decode step at {preset} at least {target:g}x the tokens per "
           "second of the model's own eager step at every measured position", ">=", 1.5, "speedup",
           "{fast} over eager: {gains}; the eager step runs at {eager_best:.3g}x the floor at best{room}; at position "
           "{position} the products with weights take {products_eager_ms:.3g} ms eager and {products_fast_ms:.3g} ms "
           "{fast}, everything else {other_eager_ms:.3g} and {other_fast_ms:.3g} ms", _compiled),
    Target("compiled_window_not_slower", "the compiled step with the preallocated window at {preset} at least as "
           "fast as the compiled concatenating step at every measured position", ">=", 1.0, "worst",
           "concat over window at {where}: the copy a concatenating step makes is a small part of a step that reads "
           "{weight_mb:.0f} MB of weights", _compiled_window, ("by_position",)),
)


def targets(values: dict, only: tuple[str, ...] | None = None) -> list[dict]:
    """The record's entry for every target of `TARGETS` (or those named in `only`) and every set of facts the
    record has for it: the measured value, whether it was met and, if not, the measured reason."""
    return [t.judge(f) for t in TARGETS if only is None or t.name in only for f in t.facts(values, t.target)]
