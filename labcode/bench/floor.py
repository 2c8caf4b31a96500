"""Decode at the floor: where a cached decode step's time goes, operation by operation, and what eager PyTorch allows.

Introduced in chapter 7's appendix on CPU micro-benchmarks. A decode step at batch 1 reads every weight and every
cached key and value once: its floor is those bytes over the streaming bandwidth. `LeanDecode` is the model's step
with the options eager PyTorch offers; a `StepTimer` gives each kind of operation's seconds. Also here: window
against concat per step, and the cost of the cache's validation (whole steps: `labcode.bench.compiled`).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from labcode.bench.common import TIMED, Sizes, bar
from labcode.bench.layout import weight_shapes
from labcode.bench.roofline import fill_cache
from labcode.bench.timing import Streamer, median, per_call, profiled, rotated, rotating_medians, timed_cpu
from labcode.caches import ConcatCache, WindowCache
from labcode.config import get_config
from labcode.generate import decode_step
from labcode.model import GPT, attend
from labcode.results import QAResult
from labcode.rope import rotate

CATEGORIES = ("q/k/v projections", "output projection", "MLP up", "MLP down", "head", "attention", "cache write",
              "other")
ATTENTION_PARTS = ("K read (scores)", "softmax", "V read (weights @ V)")


class StepTimer:
    """Wall-clock and process CPU seconds per named kind of operation, summed over the calls made through it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __call__(self, name: str, fn, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        self.cpu_seconds[name] += time.process_time() - c0
        self.seconds[name] += time.perf_counter() - t0
        self.calls[name] += 1
        return out


def _untimed(name: str, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def stored(w: torch.Tensor, layout: str) -> torch.Tensor:
    """The same [out, in] values stored row by row ("row") or column by column ("col")."""
    return w.contiguous() if layout == "row" else w.t().contiguous().t()


class LeanDecode:
    """A cached decode step of `model` reduced to its tensor operations, with eager PyTorch's speed options.

    `lean=False` runs exactly the model's operations on its own tensors and nothing around them (no modules, checks,
    masks or cache protocol): the benchmark's "products only". `lean=True` fuses the Q/K/V weight, stores each weight
    in `layouts[(out, in)]` ("row" or "col"), multiplies one row with `addmv` into reused outputs and reads the keys
    as K @ q (`fused_qkv`, `matvec`, `k_first`: one option each). `step(ids [B, 1], cache) -> logits [B, 1, V]`
    writes a `WindowCache`'s buffers as the model does; a `StepTimer` as `timer` times each kind of operation.
    """

    def __init__(self, model: GPT, lean: bool = True, layouts: dict[tuple[int, int], str] | None = None, *,
                 fused_qkv: bool | None = None, matvec: bool | None = None, k_first: bool | None = None) -> None:
        self.model, self.cfg, self.device, self.dtype, self.lean = model, model.cfg, model.device, model.dtype, lean
        # each option alone, for ablations; by default all on (lean) or all off (the model's own operations)
        self.fused_qkv = lean if fused_qkv is None else fused_qkv
        self.matvec = lean if matvec is None else matvec
        self.k_first = lean if k_first is None else k_first
        self.timer = None
        layouts = layouts or {}

        def lay(w: torch.Tensor) -> torch.Tensor:
            return stored(w.detach(), layouts.get(tuple(w.shape), "row")) if lean else w.detach()

        self.layers = []
        for b in model.blocks:
            a, (fc, proj) = b.attn, (b.mlp[0], b.mlp[2])
            if self.fused_qkv:
                qkv = (lay(torch.cat((a.q_proj.weight, a.kv_proj.weight))), torch.cat((a.q_proj.bias, a.kv_proj.bias)))
                linears = {"qkv": qkv}
            else:
                linears = {"q": (a.q_proj.weight, a.q_proj.bias), "kv": (a.kv_proj.weight, a.kv_proj.bias)}
            linears.update(out=(lay(a.out_proj.weight), a.out_proj.bias), fc=(lay(fc.weight), fc.bias),
                           proj=(lay(proj.weight), proj.bias))
            self.layers.append(((b.ln_1.weight, b.ln_1.bias), (b.ln_2.weight, b.ln_2.bias), linears))
        self.head = lay(model.tok_emb.weight)  # (V, C): the tied output head
        self.buffers: dict[tuple, torch.Tensor] = {}

    def _linear(self, name: str, key: tuple, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
        """x [B, in] @ w^T + bias -> [B, out]; one row goes through `addmv` into a reused buffer."""
        op = self.timer or _untimed
        if not self.matvec or x.shape[0] != 1:
            return op(name, F.linear, x, w, bias)
        out = self.buffers.get(key)
        if out is None:
            out = self.buffers[key] = x.new_empty(w.shape[0])
        if bias is None:
            return op(name, torch.mv, w, x[0], out=out).unsqueeze(0)
        return op(name, torch.addmv, bias, w, x[0], out=out).unsqueeze(0)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: WindowCache) -> torch.Tensor:
        m, cfg, op = self.model, self.cfg, self.timer or _untimed
        b, n = ids.shape[0], cache.ptr
        h, hkv, d, c = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        g = h // hkv
        assert ids.shape[1] == 1 and n < cache.capacity, "one new position, without a drop"
        x = op("other", F.embedding, ids[:, 0], m.tok_emb.weight)  # (B, C)
        if m.pos_emb is not None:
            x = op("other", torch.add, x, m.pos_emb.weight[n])
        for layer, ((ln1_w, ln1_b), (ln2_w, ln2_b), lin) in enumerate(self.layers):
            a = op("other", F.layer_norm, x, (c,), ln1_w, ln1_b, 1e-5)
            if self.fused_qkv:
                qkv = self._linear("q/k/v projections", (layer, "qkv"), a, *lin["qkv"])  # (B, HD + 2 Hkv D)
                q, kv = qkv[:, : h * d], qkv[:, h * d :]
            else:
                q = self._linear("q/k/v projections", (layer, "q"), a, *lin["q"])
                kv = self._linear("q/k/v projections", (layer, "kv"), a, *lin["kv"])
            cache._buffers(layer, kv.new_empty(b, hkv, 1, d), cache.capacity)  # made on first use
            k_new, v_new = kv.reshape(b, 2, hkv, 1, d).unbind(1)  # (B, Hkv, 1, D) each
            if cfg.rotary:
                pos = torch.tensor([n], device=ids.device)
                q = op("other", rotate, q.reshape(b, h, 1, d), pos, cfg.rope_base).reshape(b, h * d)
                k_new = op("other", rotate, k_new, pos, cfg.rope_base)
            keys, values = cache.k[layer], cache.v[layer]
            op("cache write", keys.narrow(2, n, 1).copy_, k_new)
            op("cache write", values.narrow(2, n, 1).copy_, v_new)
            k_all, v_all = keys.narrow(2, 0, n + 1), values.narrow(2, 0, n + 1)  # (B, Hkv, n + 1, D): views
            if self.k_first:
                y = self._attend(q, k_all, v_all, b, hkv, g, d, n + 1)
            else:
                y = op("attention", attend, q.view(b, 1, h, d).transpose(1, 2), k_all, v_all, None)
            y = y.reshape(b, c)
            x = op("other", torch.add, x, self._linear("output projection", (layer, "out"), y, *lin["out"]))
            a = op("other", F.layer_norm, x, (c,), ln2_w, ln2_b, 1e-5)
            u = op("other", F.gelu, self._linear("MLP up", (layer, "fc"), a, *lin["fc"]), approximate="tanh")
            x = op("other", torch.add, x, self._linear("MLP down", (layer, "proj"), u, *lin["proj"]))
        cache.ptr, cache.position = n + 1, cache.position + 1  # bypasses the protocol on purpose: no begin, no end
        x = op("other", F.layer_norm, x, (c,), m.ln_f.weight, m.ln_f.bias, 1e-5)
        logits = op("head", F.linear, x, self.head) if not self.matvec or b != 1 else op(
            "head", torch.mv, self.head, x[0]).unsqueeze(0)
        return logits.unsqueeze(1)  # (B, 1, V)

    def _attend(self, q, k_all, v_all, b: int, hkv: int, g: int, d: int, s: int) -> torch.Tensor:
        """Scores as K @ q (each key row read once, contiguously), softmax over the keys, weights^T @ V -> (B, H, D)."""
        op = self.timer or _untimed
        qg = (q.reshape(b * hkv, g, d) * (1.0 / math.sqrt(d))).transpose(1, 2)  # (B*Hkv, D, G)
        scores = op("K read (scores)", torch.bmm, k_all.reshape(b * hkv, s, d), qg)  # (B*Hkv, S, G)
        weights = op("softmax", torch.softmax, scores, dim=1)
        return op("V read (weights @ V)", torch.bmm, weights.transpose(1, 2), v_all.reshape(b * hkv, s, d))


def category_bytes(cfg, keys: int, batch: int = 1, element: int = 4) -> dict[str, int]:
    """Bytes each kind of operation must read (weights, or K and V) in one decode step attending to `keys` positions."""
    c, hd, kvd, n = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_layers
    kv = n * batch * keys * kvd * element
    return {
        "q/k/v projections": n * (c + 1) * (hd + 2 * kvd) * element,
        "output projection": n * (hd + 1) * c * element,
        "MLP up": n * (c + 1) * 4 * c * element,
        "MLP down": n * (4 * c + 1) * c * element,
        "head": cfg.vocab_size * c * element,
        "attention": 2 * kv, "K read (scores)": kv, "V read (weights @ V)": kv,
        "cache write": 2 * n * batch * kvd * element,
    }


@torch.inference_mode()
def op_breakdown(step: LeanDecode, position: int, steps: int, bandwidth: dict[str, float]) -> dict:
    """Median seconds per decode step of each kind of operation, its bytes, and the bandwidth it achieves, in wall-clock
    and CPU time (`_cpu`; `bandwidth` holds the streaming bandwidth in each). `excess_s` is the time above what the
    bytes take at that bandwidth: where the step loses its distance to the floor."""
    cfg = step.cfg
    cache = WindowCache(cfg.n_layers, cfg.context_length)
    fill_cache(cache, step.model, 1, position)
    token = torch.zeros(1, dtype=torch.long, device=step.device)
    decode_step(step, token, cache)  # warm-up
    runs = []
    for _ in range(steps):
        step.timer = StepTimer()
        total = timed_cpu(lambda: decode_step(step, token, cache), step.device)
        runs.append((step.timer, total))
    step.timer = None
    keys = position + 1 + steps // 2  # about what the timed steps attend to
    nbytes = category_bytes(cfg, keys)
    floor_bytes = sum(nbytes[k] for k in ("q/k/v projections", "output projection", "MLP up", "MLP down", "head",
                                          "attention"))
    names = sorted({k for t, _ in runs for k in t.seconds}, key=(CATEGORIES + ATTENTION_PARTS).index)
    out = {"position": position, "keys": keys, "floor_bytes": floor_bytes}
    for i, (clock, suffix) in enumerate((("wall", ""), ("cpu", "_cpu"))):
        rows = {}
        for name in names:
            sec = median([(t.seconds if i == 0 else t.cpu_seconds).get(name, 0.0) for t, _ in runs])
            row = {"s_per_step": sec, "calls_per_step": runs[0][0].calls.get(name, 0)}
            if name in nbytes:
                row.update(bytes=nbytes[name], bytes_per_s=nbytes[name] / sec,
                           excess_s=sec - nbytes[name] / bandwidth[clock])
            rows[name] = row
        if "K read (scores)" in rows:  # the lean step's attention, summed from its parts
            sec, n = (sum(rows[p][k] for p in ATTENTION_PARTS) for k in ("s_per_step", "calls_per_step"))
            rows["attention"] = {"s_per_step": sec, "calls_per_step": n, "bytes": nbytes["attention"],
                                 "bytes_per_s": nbytes["attention"] / sec,
                                 "excess_s": sec - nbytes["attention"] / bandwidth[clock]}
            rows = {k: rows[k] for k in sorted(rows, key=(CATEGORIES + ATTENTION_PARTS).index)}
        step_s = median([total[i] for _, total in runs])
        out.update({"step" + suffix + "_s": step_s, "floor" + suffix + "_s": floor_bytes / bandwidth[clock],
                    "ratio" + suffix: step_s * bandwidth[clock] / floor_bytes,
                    "operations" + suffix: rows,
                    "untimed" + suffix + "_s": step_s - sum(r["s_per_step"] for k, r in rows.items()
                                                           if k not in ATTENTION_PARTS)})
    return out


def product_variants(shapes: Sequence[tuple[int, int]], device: torch.device, min_mbytes: int = 64,
                     repeats: int = 5) -> list[dict]:
    """Bytes per second of one row times a weight [out, in], six ways: `F.linear` and `addmv` (with and without a
    reused output), on the weight stored row by row and column by column; each shape cycles through enough distinct
    matrices (`min_mbytes` in all) that none is still in a cache when read again, as in a large model's step."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for n_out, n_in in shapes:
        copies = max(1, -(-min_mbytes * 2**20 // (4 * n_out * n_in)))
        rows = [torch.randn(n_out, n_in, generator=gen).to(device) for _ in range(copies)]
        bias = torch.randn(n_out, generator=gen).to(device)
        x = torch.randn(1, n_in, generator=gen).to(device)
        buf = torch.empty(n_out, device=device)
        ways = {}
        for layout in ("row", "col"):
            ws = [stored(w, layout) for w in rows]
            ways[f"F.linear, {layout}"] = lambda ws=ws, x=x, b=bias: [F.linear(x, w, b) for w in ws]
            ways[f"addmv, {layout}"] = lambda ws=ws, x=x[0], b=bias: [torch.addmv(b, w, x) for w in ws]
            ways[f"addmv out=, {layout}"] = lambda ws=ws, x=x[0], b=bias, o=buf: [torch.addmv(b, w, x, out=o)
                                                                                 for w in ws]
        nbytes = sum(w.nbytes for w in rows)
        speeds = {name: nbytes / s for name, s in rotating_medians(ways, repeats, device).items()}
        best = max(speeds, key=speeds.get)
        out.append({"shape": [n_out, n_in], "bytes_per_s": speeds, "best": best,
                    "best_addmv_layout": max(("row", "col"), key=lambda lay: speeds[f"addmv out=, {lay}"])})
        del rows, ways
    return out


def kv_read_variants(n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, lengths: Sequence[int],
                     device: torch.device, capacity: int = 1024, repeats: int = 5) -> list[dict]:
    """Bytes per second of attention's reads of the cached K (and V) for one query, in `n_layers` buffers of
    [Hkv, capacity, D] like a decode step: `q @ K^T` as `attend` does, `K @ q` (each key row read contiguously), the
    same on a copy without the unused slots, weights @ V, and `sum(K)` (a read with no product) for reference."""
    gen = torch.Generator().manual_seed(0)
    g = n_heads // n_kv_heads
    ks = [torch.randn(n_kv_heads, capacity, head_dim, generator=gen).to(device) for _ in range(n_layers)]
    q = torch.randn(n_kv_heads, g, head_dim, generator=gen).to(device)
    out = []
    for s in lengths:
        views = [k.narrow(1, 0, s) for k in ks]  # (Hkv, S, D), like the cache's narrow views
        copies = [v.contiguous() for v in views]
        w = torch.randn(n_kv_heads, g, s, generator=gen).softmax(-1).to(device)
        ways = {
            "q @ K^T (as attend)": lambda ks=views: [torch.bmm(q, k.transpose(1, 2)) for k in ks],
            "K @ q": lambda ks=views: [torch.bmm(k, q.transpose(1, 2)) for k in ks],
            "q @ K^T, contiguous K": lambda ks=copies: [torch.bmm(q, k.transpose(1, 2)) for k in ks],
            "weights @ V (as attend)": lambda vs=views, w=w: [torch.bmm(w, v) for v in vs],
            "sum(K) (streaming)": lambda ks=views: [k.sum() for k in ks],
        }
        nbytes = sum(v.numel() for v in views) * 4
        out.append({"keys": s, "bytes": nbytes,
                    "bytes_per_s": {name: nbytes / t for name, t in rotating_medians(ways, repeats, device).items()}})
    return out


@torch.inference_mode()
def bench_window_vs_concat(model: GPT, positions: Sequence[int], steps: int, rounds: int = 1, warmup: int = 2,
                           bandwidth: float | None = None, progress=None) -> dict:
    """Seconds per decode step with a `WindowCache` and with a `ConcatCache` holding the same positions, interleaved.
    The concatenating cache copies every cached key and value at every step, the window writes one row: their
    difference should grow with the context, by the copy's bytes over `bandwidth` (`cat_extra_predicted_s`)."""
    cfg, device = model.cfg, model.device
    token = torch.zeros(1, dtype=torch.long, device=device)
    times: dict[str, dict[int, list[float]]] = {"window": defaultdict(list), "cat": defaultdict(list)}
    for r in range(rounds):
        for p in positions:
            caches = {"window": WindowCache(cfg.n_layers, cfg.context_length), "cat": ConcatCache(cfg.n_layers)}
            for cache in caches.values():
                fill_cache(cache, model, 1, p)
                for _ in range(warmup):
                    decode_step(model, token, cache)
            for s in range(steps):
                for name in rotated(list(caches), s + r):
                    times[name][p].append(timed_cpu(lambda c=caches[name]: decode_step(model, token, c), device))
            del caches
            if progress is not None:
                progress.update(1)
    out = {"positions": list(positions), "keys": [p + warmup + (steps + 1) // 2 for p in positions]}
    for i, suffix in ((0, ""), (1, "_cpu")):
        for name in times:
            out[f"{name}{suffix}_s"] = [median([t[i] for t in times[name][p]]) for p in positions]
            out[f"{name}{suffix}_q"] = [_quartiles([t[i] for t in times[name][p]]) for p in positions]
        out["cat_over_window" + suffix] = [a / b for a, b in zip(out[f"cat{suffix}_s"], out[f"window{suffix}_s"],
                                                                 strict=True)]
    # what the extra copy should cost: reading and writing every cached K and V of every layer
    out["cat_copy_bytes"] = [2 * 2 * cfg.n_layers * k * cfg.n_kv_heads * cfg.head_dim * 4 for k in out["keys"]]
    if bandwidth:
        out["cat_extra_predicted_s"] = [b / bandwidth for b in out["cat_copy_bytes"]]
        out["cat_extra_s"] = [c - w for c, w in zip(out["cat_s"], out["window_s"], strict=True)]
    return out


def _quartiles(values: list[float]) -> list[float]:
    s = sorted(values)
    return [s[len(s) // 4], s[(3 * len(s)) // 4]] if s else [math.nan, math.nan]


@torch.inference_mode()
def validation_cost(model: GPT, position: int = 16) -> dict:
    """Microseconds of the checks a decode step runs, each timed alone: the cache's pass check (once per pass,
    in `begin`; before the contract of chapter 3's `KVCache` it ran in every layer's `append` too) and the
    model's id check."""
    cfg, device = model.cfg, model.device
    cache = WindowCache(cfg.n_layers, cfg.context_length)
    fill_cache(cache, model, 1, position)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    shape = (1, cfg.n_kv_heads, 1, cfg.head_dim)
    check_us = per_call(lambda: cache.check(shape, model.dtype, device), device) * 1e6
    ids_us = per_call(lambda: model.check_ids(ids), device) * 1e6
    return {"cache_check_us": check_us, "check_ids_us": ids_us, "checks_per_step_now": 1,
            "per_step_now_us": check_us + ids_us, "per_step_once_us": check_us + ids_us}


def step_bytes(model: GPT, keys: int, batch: int = 1) -> tuple[int, int]:
    """(weight bytes, K/V bytes) a decode step must read: every weight once (one row of a position table), and
    the K and V of `keys` positions, the new one included, per sequence."""
    cfg = model.cfg
    weights = sum(p.nbytes for n, p in model.named_parameters() if "pos_emb" not in n)
    if model.pos_emb is not None:
        weights += model.pos_emb.weight[0].nbytes
    kv = 2 * cfg.kv_layers * batch * keys * cfg.n_kv_heads * cfg.head_dim * model.dtype.itemsize
    return weights, kv


@torch.inference_mode()
def profile_decode(model: GPT, position: int, steps: int = 3) -> list[dict]:
    """Where a cached decode step's time goes: self time per aten op (per weight shape for products), largest first."""
    cache = WindowCache(model.cfg.n_layers, model.cfg.context_length)
    fill_cache(cache, model, 1, position)
    token = torch.zeros(1, dtype=torch.long, device=model.device)
    decode_step(model, token, cache)
    rows: dict[tuple[str, str], dict] = {}
    for e in profiled(lambda: decode_step(model, token, cache), steps, model.device, shapes=True)[0]:
        self_us = e.self_device_time_total if model.device.type == "cuda" else e.self_cpu_time_total
        # Matrix products with a weight keep their shapes (one row per weight shape); others are summed by name.
        shapes = str(e.input_shapes) if e.key in ("aten::addmm", "aten::mm") else ""
        row = rows.setdefault((e.key, shapes), {"op": e.key, "shapes": shapes, "calls_per_step": 0.0,
                                                "self_s_per_step": 0.0})
        row["calls_per_step"] += e.count / steps
        row["self_s_per_step"] += self_us / 1e6 / steps
    return sorted((r for r in rows.values() if r["self_s_per_step"] > 0), key=lambda r: -r["self_s_per_step"])


def record(res: QAResult, sizes: Sizes, device: torch.device, model, streamer: Streamer, progress: bool) -> dict:
    """Decode against the bandwidth floor operation by operation, and window against concat; return the layout
    each weight shape's product streams fastest in (the lean step's, timed whole in `compiled`). The layouts are
    timed for every shape of weight of the floor's model and of every model whose whole steps are timed; the floor's
    bandwidth is `streamer`'s best read."""
    bw = streamer.measure()
    shapes = set().union(*(weight_shapes(get_config(p)) for p in {sizes.floor_preset, *sizes.compiled_presets}))
    products = product_variants(sorted(shapes), device, min_mbytes=sizes.bandwidth_mbytes // 2)
    layouts = {tuple(r["shape"]): r["best_addmv_layout"] for r in products}
    lean = LeanDecode(model, lean=True, layouts=layouts)
    bandwidth = {"wall": bw["best"], "cpu": bw["best_cpu"]}
    cfg = model.cfg
    res.value("floor_ops", {
        "preset": sizes.floor_preset, "bandwidth": bandwidth, "layouts": {f"{o}x{i}": lay for (o, i), lay in
                                                                          layouts.items()},
        # "model": the step reduced to the model's tensor operations (compiled's "products only"), not the
        # model's own step, which has no timer inside
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
    with bar(sizes.window_concat_rounds * len(positions), "window vs concat", progress) as shown:
        res.value("window_vs_concat", bench_window_vs_concat(model, positions, sizes.window_concat_steps,
                                                             sizes.window_concat_rounds, bandwidth=bw["best"],
                                                             progress=shown), TIMED)
    if sizes.profile_steps:
        res.value("profile", profile_decode(model, sizes.profile_position, sizes.profile_steps), TIMED)
    return layouts
