"""Benchmarks of whole models: greedy generation with and without every cache, and the bandwidth floor.

Introduced in chapter 7. Every generation runs in lockstep with the others (step i of
each method, in rotating order, before step i + 1 of any), so a change in the
machine's load touches all methods alike.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from labcode.bench.common import TIMED, Sizes, bar, random_model
from labcode.bench.timing import Streamer, median, rotated, timed, timed_cpu
from labcode.caches import ConcatCache, GrowableCache, Request, RingCache, WindowCache
from labcode.cost import kv_cache_bytes
from labcode.flops import generation_flops
from labcode.generate import decode_step
from labcode.model import GPT, attend, rotate
from labcode.results import QAResult

METHODS = ("nocache", "cat", "window", "ring", "grow_linear", "grow_double", "naive", "explicit")


class Runner:
    """One generation method: `start(ids)` runs the prompt, `step(token)` one new token; both return logits [B, V].

    "nocache" reruns the whole sequence; every other method is a `Request` in one of the three styles.
    """

    def __init__(self, model: GPT, method: str, capacity: int) -> None:
        self.model, self.method, self.ids = model, method, None
        n = model.cfg.n_layers
        caches = {
            "cat": lambda: ConcatCache(n),
            "window": lambda: WindowCache(n, capacity),
            "ring": lambda: RingCache(n, capacity),
            "grow_linear": lambda: GrowableCache(n, 16, "linear"),
            "grow_double": lambda: GrowableCache(n, 16, "double"),
        }
        if method in caches:
            self.request = Request(model, "object", caches[method]())
        elif method != "nocache":
            self.request = Request(model, method)  # "naive" or "explicit"

    def start(self, ids: torch.Tensor) -> torch.Tensor:
        if self.method == "nocache":
            self.ids = ids
            return self.model(ids)[:, -1]
        return self.request(ids)[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        if self.method == "nocache":
            self.ids = torch.cat((self.ids, token.unsqueeze(1)), dim=1)  # (B, P + i)
            return self.model(self.ids)[:, -1]
        return self.request(token.unsqueeze(1))[:, -1]


@torch.inference_mode()
def bench_generation(model: GPT, prompt_len: int, new_tokens: int, rounds: int, methods=METHODS,
                     seed: int = 0, progress=None) -> dict:
    """Greedy generation of `new_tokens` after a random prompt, every method in lockstep.

    Call 0 is the prompt (prefill, or the first full forward); calls 1..n-1 are decode
    steps. Returns per-call median seconds, totals, tokens/s, the measured speedup of
    each cache over no cache and the FLOP-count prediction, and correctness values.
    """
    device, cfg = model.device, model.cfg
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen).to(device)
    methods = list(methods)
    _generate_lockstep(model, ids, min(3, new_tokens), methods, 0, None)  # warm-up
    times: dict[str, list[list[float]]] = {m: [[] for _ in range(new_tokens)] for m in methods}
    for r in range(rounds):
        logits, step_times = _generate_lockstep(model, ids, new_tokens, methods, r, progress)
        for m in methods:
            for i, t in enumerate(step_times[m]):
                times[m][i].append(t)
    per_step = {m: [median(ts) for ts in times[m]] for m in methods}
    total = {m: sum(per_step[m]) for m in methods}
    flops = {c: sum(generation_flops(cfg, prompt_len, new_tokens, cached=c)) for c in (False, True)}
    ref = logits["nocache"]
    return {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "positions": [prompt_len + i for i in range(new_tokens)],  # tokens in the context at each call
        "per_step_s": per_step,
        "total_s": total,
        "tokens_per_s": {m: new_tokens / total[m] for m in methods},
        "speedup": {m: total["nocache"] / total[m] for m in methods},
        "flops_nocache": flops[False],
        "flops_cached": flops[True],
        "predicted_speedup": flops[False] / flops[True],
        "ids_match": {m: bool(torch.equal(logits[m].argmax(-1), ref.argmax(-1))) for m in methods},
        "max_logit_diff": {m: float((logits[m] - ref).abs().max()) for m in methods},
    }


def _generate_lockstep(model: GPT, ids: torch.Tensor, n: int, methods: list[str], shift: int, progress):
    """Run all methods side by side, each feeding back its own greedy token; return logits [n, V], seconds per call."""
    device = model.device
    runners = {m: Runner(model, m, ids.shape[1] + n) for m in methods}
    logits = {m: [] for m in methods}
    step_times = {m: [] for m in methods}
    for i in range(n):
        for m in rotated(methods, i + shift):
            run = runners[m]
            if i == 0:
                fn = lambda run=run: logits[run.method].append(run.start(ids))  # noqa: E731
            else:
                token = logits[m][-1].argmax(dim=-1)  # (B,)
                fn = lambda run=run, token=token: logits[run.method].append(run.step(token))  # noqa: E731
            step_times[m].append(timed(fn, device))
        if progress is not None:
            progress.update(1)
    model.reset_kv_cache()
    return {m: torch.cat(v) for m, v in logits.items()}, step_times


def weight_bytes_per_step(model: GPT) -> int:
    """Bytes of weights one decode step reads: every parameter, except that the position table gives one row."""
    total = sum(p.nbytes for p in model.parameters())
    if model.pos_emb is not None:
        w = model.pos_emb.weight
        total -= w.nbytes - w[0].nbytes
    return total


def kv_bytes_per_step(model: GPT, keys: int, batch: int = 1) -> int:
    """Bytes of K and V one decode step reads when `keys` positions (the new one included) are attended to."""
    cfg = model.cfg
    return kv_cache_bytes(cfg.n_layers, batch, keys, cfg.n_kv_heads, cfg.head_dim, model.dtype.itemsize)


def _fill(cache: WindowCache, model: GPT, length: int, gen: torch.Generator) -> None:
    """Put `length` random positions in every layer of `cache`: a decode step's cost does not depend on the values."""
    cfg = model.cfg
    if length == 0:
        return
    shape = (1, cfg.n_kv_heads, length, cfg.head_dim)
    k = torch.randn(shape, generator=gen).to(model.device, model.dtype)
    cache.feed(k, k)


class ProductsOnly:
    """A cached decode step reduced to its tensor operations: no modules, no checks, no cache object logic.

    A measuring device, not a design: it writes one position into a `WindowCache`'s
    buffers and reads them back as the model does, with the model's own weights and
    `attend`, but skips every Python layer around the operations (module calls,
    the model's and the cache's validation, masks, positions). Its time is what eager
    PyTorch's kernels need for one step, so the model's distance to it is the cost of
    the course's structure, and its own distance to the floor is the kernels'.
    Callable like the model on one new position: `step(ids [B, 1], cache) -> logits [B, 1, V]`.
    """

    def __init__(self, model: GPT) -> None:
        self.model, self.cfg, self.device, self.dtype = model, model.cfg, model.device, model.dtype
        self.layers = [(b.ln_1, b.attn.q_proj, b.attn.kv_proj, b.attn.out_proj, b.ln_2, b.mlp[0], b.mlp[2])
                       for b in model.blocks]

    def __call__(self, ids: torch.Tensor, cache: WindowCache) -> torch.Tensor:
        m, cfg = self.model, self.cfg
        b, n = ids.shape[0], cache.ptr
        h, hkv, d, c = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        assert ids.shape[1] == 1 and n < cache.capacity, "one new position, without a drop"
        x = F.embedding(ids, m.tok_emb.weight)  # (B, 1, C)
        if m.pos_emb is not None:
            x = x + m.pos_emb.weight[n]
        pos = torch.tensor([n], device=ids.device)
        for layer, (ln1, wq, wkv, wo, ln2, fc, proj) in enumerate(self.layers):
            a = F.layer_norm(x, (c,), ln1.weight, ln1.bias, ln1.eps)
            q = F.linear(a, wq.weight, wq.bias).view(b, 1, h, d).transpose(1, 2)  # (B, H, 1, D)
            k, v = F.linear(a, wkv.weight, wkv.bias).view(b, 1, 2, hkv, d).permute(2, 0, 3, 1, 4)
            if cfg.rotary:
                q, k = rotate(q, pos, cfg.rope_base), rotate(k, pos, cfg.rope_base)
            cache._buffers(layer, k, cache.capacity)  # an empty cache: its buffers come with the first write
            keys, values = cache.k[layer], cache.v[layer]
            keys.narrow(2, n, 1).copy_(k)
            values.narrow(2, n, 1).copy_(v)
            y = attend(q, keys.narrow(2, 0, n + 1), values.narrow(2, 0, n + 1), None)
            x = x + F.linear(y.transpose(1, 2).reshape(b, 1, c), wo.weight, wo.bias)
            a = F.layer_norm(x, (c,), ln2.weight, ln2.bias, ln2.eps)
            x = x + F.linear(F.gelu(F.linear(a, fc.weight, fc.bias), approximate="tanh"), proj.weight, proj.bias)
        cache.ptr, cache.position = n + 1, cache.position + 1  # bypasses the protocol on purpose: no begin, no end
        return F.linear(F.layer_norm(x, (c,), m.ln_f.weight, m.ln_f.bias, m.ln_f.eps), m.tok_emb.weight)


@torch.inference_mode()
def products_only_diff(model: GPT, position: int) -> float:
    """Max |logit difference| between `ProductsOnly` and the model on the same cached step (float32 rounding)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    caches = [WindowCache(model.cfg.n_layers, model.cfg.context_length) for _ in range(2)]
    token = torch.randint(0, model.cfg.vocab_size, (1,), generator=gen).to(model.device)
    for cache in caches:
        _fill(cache, model, position, torch.Generator(device="cpu").manual_seed(0))
    lean = decode_step(ProductsOnly(model), token, caches[0])
    return float((lean - decode_step(model, token, caches[1])).abs().max())


@torch.inference_mode()
def bench_floor(model: GPT, positions: list[int], steps: int, rounds: int, streamer: Streamer,
                variants: dict[str, GPT] | None = None, warmup: int = 2, progress=None) -> dict:
    """Seconds per cached decode step at each position, next to (weights + K/V bytes) / measured bandwidth.

    `variants` (other models of the same shape, e.g. another weight layout, or callables
    such as `ProductsOnly` that step a `WindowCache` like the model) are timed
    interleaved with `model`, step by step. Bandwidth is measured by `streamer` between
    positions, in the same process; the floor uses the median of all those measurements.
    Everything is measured twice: in wall-clock time and in process CPU time (`_cpu`).
    """
    device, gen = model.device, torch.Generator(device="cpu").manual_seed(0)
    models = {"model": model, **(variants or {})}
    token = torch.zeros(1, dtype=torch.long, device=device)
    step_s = {name: defaultdict(list) for name in models}
    bandwidth = [streamer.measure()]
    for r in range(rounds):
        for p in positions:
            caches = {name: WindowCache(m.cfg.n_layers, m.cfg.context_length) for name, m in models.items()}
            for name, m in models.items():
                _fill(caches[name], m, p, gen)
                for _ in range(warmup):
                    decode_step(m, token, caches[name])
            for s in range(steps):
                for name in rotated(list(models), s + r):
                    m, c = models[name], caches[name]
                    step_s[name][p].append(timed_cpu(lambda m=m, c=c: decode_step(m, token, c), device))
            del caches
            bandwidth.append(streamer.measure())
            if progress is not None:
                progress.update(1)
    bw = {key: median([b[key] for b in bandwidth]) for key in bandwidth[0]}
    w_bytes = weight_bytes_per_step(model)
    # Steps at p + warmup .. p + warmup + steps - 1 were timed; their keys include the new one.
    kv = [kv_bytes_per_step(model, p + warmup + (steps + 1) // 2) for p in positions]
    out = {"positions": positions, "weight_bytes": w_bytes, "kv_bytes": kv, "bandwidth_bytes_per_s": bw,
           "kv_bytes_per_key": kv_bytes_per_step(model, 1),
           "bandwidth_samples": [b["best"] for b in bandwidth], "variants": {}}
    for i, suffix in ((0, ""), (1, "_cpu")):  # wall clock, then CPU time
        floor = [(w_bytes + b) / bw["best" + suffix] for b in kv]
        for name in models:
            med = [median([t[i] for t in step_s[name][p]]) for p in positions]
            res = {"step" + suffix + "_s": med, "ratio" + suffix: [t / f for t, f in zip(med, floor, strict=True)]}
            (out if name == "model" else out["variants"].setdefault(name, {})).update(res)
        out["floor" + suffix + "_s"] = floor
    # The least-disturbed view: the fastest step at each position against the fastest bandwidth sample.
    best_floor = [(w_bytes + b) / max(out["bandwidth_samples"]) for b in kv]
    fastest = [min(t[0] for t in step_s["model"][p]) for p in positions]
    out.update(step_min_s=fastest, floor_best_s=best_floor,
               ratio_best=[t / f for t, f in zip(fastest, best_floor, strict=True)])
    return out


@torch.inference_mode()
def overhead_step(model: GPT, position: int, steps: int = 15, warmup: int = 3) -> dict:
    """Median seconds of a decode step of the same model with every width shrunk (D = 4, V = 64).

    The layers, heads and calls are the same, but no tensor is larger than a few kilobytes:
    what is left is the cost of the calls themselves (Python, dispatch, the cache's checks).
    """
    cfg = model.cfg.with_(d_model=4 * model.cfg.n_heads, vocab_size=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        small = GPT(cfg).to(model.device).eval()
    cache = WindowCache(cfg.n_layers, cfg.context_length)
    _fill(cache, small, position, torch.Generator(device="cpu").manual_seed(0))
    token = torch.zeros(1, dtype=torch.long, device=model.device)
    for _ in range(warmup):
        decode_step(small, token, cache)
    times = [timed(lambda: decode_step(small, token, cache), model.device) for _ in range(steps)]
    return {"position": position, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "step_s": median(times)}


@torch.inference_mode()
def profile_decode(model: GPT, position: int, steps: int = 3) -> list[dict]:
    """Where a cached decode step's time goes: self time per aten op (per weight shape for products), largest first."""
    from torch.profiler import ProfilerActivity, profile

    cache = WindowCache(model.cfg.n_layers, model.cfg.context_length)
    _fill(cache, model, position, torch.Generator(device="cpu").manual_seed(0))
    token = torch.zeros(1, dtype=torch.long, device=model.device)
    decode_step(model, token, cache)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            decode_step(model, token, cache)
    rows: dict[tuple[str, str], dict] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        self_us = e.self_device_time_total if model.device.type == "cuda" else e.self_cpu_time_total
        # Matrix products with a weight keep their shapes (one row per weight shape); others are summed by name.
        shapes = str(e.input_shapes) if e.key in ("aten::addmm", "aten::mm") else ""
        row = rows.setdefault((e.key, shapes), {"op": e.key, "shapes": shapes, "calls_per_step": 0.0,
                                                "self_s_per_step": 0.0})
        row["calls_per_step"] += e.count / steps
        row["self_s_per_step"] += self_us / 1e6 / steps
    return sorted((r for r in rows.values() if r["self_s_per_step"] > 0), key=lambda r: -r["self_s_per_step"])


def record_generation(res: QAResult, sizes: Sizes, device: torch.device, models: dict, progress: bool) -> None:
    """Greedy generation with no cache and with every cache at each of `sizes.generation`; the models it built are
    left in `models` for the sections after it."""
    generation = {}
    for preset, prompt, new, rounds in sizes.generation:
        models[preset] = models.get(preset) or random_model(preset, device)
        with bar(rounds * new, f"generation {preset}", progress) as b:
            generation[preset] = bench_generation(models[preset], prompt, new, rounds, progress=b)
        generation[preset]["preset"] = preset
    res.value("generation", generation, TIMED)
